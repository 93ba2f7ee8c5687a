"""Tests of the benches: `bench`'s command line, table and progress lines,
and `bench` and `sample_bench` end to end on tiny models."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

from unittest import mock

from absl.testing import absltest
import numpy as np

from tools import bench
from tools import bench_measure
from tools import bench_report
from tools import common
from tools import demo_model
from tools import replay
from tools import sample_bench
from tools import trained_exits
import helpers

REPO_ROOT = str(helpers.REPO)
META = {'machine': 'test machine, 2 cores', 'jax': '0.0', 'backend': 'cpu',
        'bandwidth_gb_s': 10.0}


def _row(tokens_per_second, speed=False, **extra):
  """A `bench_case` method row with round numbers."""
  return {
      'seconds': 1.0, 'tokens': 100, 'tokens_per_second': tokens_per_second,
      'ms_per_token_per_sequence': 10.0, 'prefill_seconds': 0.2,
      'decode_seconds': 0.8, 'decode_tokens_per_second': 125.0,
      'decode_ms_per_token_per_sequence': 8.0, 'replay_consistent': True,
      'loop_steps': 100, 'steps_per_token': 1.1 if speed else 1.0,
      'rows_free_ideal_speedup': 3 / 1.1 if speed else None,
      'weight_bytes_per_token': 1e6, 'bytes_per_token': 2e6,
      'bandwidth_bound_fraction': 0.5,
      'vs_greedy_same_model': tokens_per_second / 50.0,
      'decode_vs_greedy_same_model': tokens_per_second / 40.0,
      'bytes_ideal_speedup': 1.0, **extra}


def _result(methods):
  return {'config': '4x3', 'batch': 1, 'length': 'short',
          'replay': {'flushes': 2, 'tokens': 100, 'steps_per_token': 1.1,
                     'flip_rate': {'flip_rate/stage_2': 0.02}},
          'methods': methods}


def _table_rows(table):
  """{method: {column: cell}} of the markdown table of every method."""
  lines = table.splitlines()
  lines = lines[next(i for i, l in enumerate(lines)
                     if l.startswith('|') and '| method |' in l):]
  lines = lines[:next((i for i, l in enumerate(lines)
                       if not l.startswith('|')), len(lines))]
  header = [c.strip() for c in lines[0].strip('|').split('|')]
  rows = {}
  for line in lines[2:]:
    cells = dict(zip(header, (c.strip() for c in line.strip('|').split('|'))))
    rows[cells['method']] = cells
  return rows


def _tiny_base(g, r, dtype, encoder_layers=0):
  """A width-32 stand-in for `bench_measure.base_config`'s Base width."""
  return helpers.tiny_config(
      num_unique_layers=g, num_repeats=r, dtype=dtype,
      vocab_size=demo_model.VOCAB_SIZE, num_encoder_layers=encoder_layers,
      logits_via_embedding=not encoder_layers)


class FlagsTest(absltest.TestCase):

  def test_every_flag_has_help_and_default(self):
    parser = bench.parser()
    # Help text as printed, with line wrapping undone.
    text = ' '.join(parser.format_help().split())
    actions = parser._actions  # pylint: disable=protected-access
    flags = [a for a in actions if a.dest != 'help']
    self.assertLen(flags, 20)
    for action in flags:
      self.assertTrue(action.help, action.dest)
      self.assertIn(f'(default: {action.default})', text, action.dest)
    self.assertIn('(default: 4x3)', text)
    self.assertIn('(default: trained)', text)
    self.assertIn('(default: False)', text)

  def test_help_command(self):
    # As the README runs it: from the repository root.
    result = subprocess.run(
        [sys.executable, '-m', 'tools.bench', '--help'],
        capture_output=True, text=True, check=False, cwd=REPO_ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    self.assertEqual(result.returncode, 0, result.stderr)
    text = ' '.join(result.stdout.split())
    for flag in ('--configs', '--batch_sizes', '--lengths', '--repeats',
                 '--speculative_vocab', '--out', '--demo_out', '--quick',
                 '--quiet'):
      self.assertIn(flag, text)
    self.assertEqual(text.count('(default: '), 20)
    # The module docstring keeps its layout.
    self.assertIn('\n  speed_short   speed_decode', result.stdout)


class MarkdownTest(absltest.TestCase):

  def test_quick_mode_has_no_nan(self):
    # --quick runs greedy and SPEED only: no G-layer baseline to compare with.
    table = bench_report.markdown(
        [_result({'greedy': _row(50.0), 'speed': _row(60.0, speed=True)})],
        META)
    self.assertNotIn('nan', table.lower())
    rows = _table_rows(table)
    self.assertEqual(set(rows), {'greedy', 'speed'})
    self.assertEqual(rows['speed']['decode vs G-layer'], '–')
    self.assertEqual(rows['greedy']['decode vs G-layer'], '–')
    self.assertEqual(rows['speed']['vs greedy'], '1.20x')
    self.assertEqual(rows['speed']['decode vs greedy'], '1.50x')
    self.assertEqual(rows['speed']['decode ms/token/seq'], '8.0')
    self.assertEqual(rows['speed']['rows-free ideal'], '2.73x')
    self.assertEqual(rows['greedy']['rows-free ideal'], '–')

  def test_full_mode_compares_with_g_layer_model(self):
    methods = {'greedy': _row(50.0, decode_vs_unshared_g_layers=0.5),
               'speed': _row(60.0, speed=True,
                             decode_vs_unshared_g_layers=0.6),
               'greedy_g': _row(100.0, decode_vs_unshared_g_layers=1.0)}
    table = bench_report.markdown([_result(methods)], META)
    rows = _table_rows(table)
    self.assertEqual({m: r['decode vs G-layer'] for m, r in rows.items()},
                     {'greedy': '0.50x', 'speed': '0.60x',
                      'greedy_g': '1.00x'})


class BenchRunTest(absltest.TestCase):

  def test_quick_mode_times_greedy_and_speed(self):
    args = bench.parser().parse_args(['--quick'])
    self.assertEqual(set(bench_measure.method_configs(4, 3, args)),
                     {'greedy', 'speed'})
    # Beyond the CPU's max_speculative_rows the pipeline is timed too.
    self.assertEqual(set(bench_measure.method_configs(4, 3, args, batch=8)),
                     {'greedy', 'speed', 'speed_pipeline'})
    self.assertEqual(bench_measure.replayed_method('speed_short_pipeline'),
                     'speed_short')
    self.assertEqual(bench_measure.replayed_method('greedy_12l_xla'),
                     'greedy')
    self.assertIsNone(bench_measure.max_speculative_rows('speed_pipeline'))
    self.assertEqual(bench_measure.max_speculative_rows('speed'), 'auto')

  def test_full_bench_on_a_tiny_model(self):
    # The recording model and the "Base" models are tiny (a random 2x3
    # stands in for the committed trained model, a width-32 model for Base
    # width): the bench's own path runs as a user runs it, from recording
    # the trained model's schedules to bench.json, with every method of a
    # batch (8 x R = 24 rows) where SPEED decodes sequentially by default.
    module, params = helpers.tiny_model(vocab_size=demo_model.VOCAB_SIZE)
    models_dir = tempfile.mkdtemp()
    manifest = {'shared': '2x3', 'models': {'2x3': {
        'sha256': '0123456789abcdef', 'test_bleu': 12.5,
        'config': {'emb_dim': 32}}}}
    with open(os.path.join(models_dir, 'manifest.json'), 'w') as f:
      json.dump(manifest, f)
    committed = mock.Mock(manifest=manifest)
    committed.vocab.decode = lambda ids: ' '.join(map(str, ids))
    rng = np.random.RandomState(0)
    prompts = rng.randint(2, demo_model.VOCAB_SIZE, (16, 6)).astype(np.int32)
    held_out = (prompts, np.full(16, 6, np.int32),
                ['%d' % i for i in range(16)], 12)
    out = tempfile.mkdtemp()
    stderr = io.StringIO()
    with mock.patch.object(trained_exits, 'source', return_value=(
        trained_exits.Source(committed, module, params))), \
         mock.patch.object(trained_exits, 'held_out', return_value=held_out), \
         mock.patch.object(bench_measure, 'base_config', _tiny_base), \
         contextlib.redirect_stderr(stderr):
      self.assertEqual(bench.main(
          ['--configs', '4x3', '--batch_sizes', '8', '--lengths', 'short',
           '--repeats', '2', '--speculative_vocab', '40', '--branches', '1',
           '--out', out, '--models_dir', models_dir]), 0)
    # Progress on stderr: the row group, each compile and timed pass, the
    # time left.
    progress = stderr.getvalue()
    self.assertIn('row group 1/1: 4x3 batch 8 short', progress)
    self.assertIn('4x3 batch 8 short: compiling speed_pipeline', progress)
    self.assertIn('4x3 batch 8 short: round 2/2: greedy_12l', progress)
    self.assertIn('left, ', progress)
    with open(os.path.join(out, 'bench.json')) as f:
      (result,) = json.load(f)['results']
    self.assertEqual((result['config'], result['batch']), ('4x3', 8))
    rows = result['methods']
    expected = {'greedy', 'speed', 'speed_pipeline', 'speed_short',
                'speed_short_pipeline', 'greedy_g', 'greedy_12l',
                'speed_b1_pipeline'}
    self.assertContainsSubset(expected, set(rows))
    self.assertContainsSubset(set(rows), expected | {'t5x_sample'})
    self.assertLen(result['bandwidth_probes_gb_s'], 2)  # one per round
    self.assertGreater(min(result['bandwidth_probes_gb_s']), 0.1)
    for row in rows.values():
      self.assertTrue(row['replay_consistent'])
      self.assertEqual(row['tokens'], result['replay']['tokens'])
      # Timed apart, prefill and decoding add up to the end-to-end time
      # (each a median over the repeats, so up to their spread).
      self.assertGreater(row['prefill_seconds'], 0.0)
      self.assertGreater(row['decode_seconds'], 0.0)
      self.assertLessEqual(row['decode_seconds'], row['seconds'])
      self.assertAlmostEqual(row['decode_tokens_per_second'],
                             row['tokens'] / row['decode_seconds'])
      self.assertGreater(row['decode_vs_best_greedy'], 0.0)
    # The pipelined replays take exactly the recorded loop steps; SPEED as
    # users get it here decodes one full-depth step per token.
    for method in ('speed_pipeline', 'speed_short_pipeline'):
      self.assertTrue(rows[method]['pipelined'])
      self.assertAlmostEqual(rows[method]['steps_per_token'],
                             result['replay']['steps_per_token'])
    # One candidate branch replays its own recording: 8 x (3 + 1) rows, and
    # never more steps than without it.
    branched = rows['speed_b1_pipeline']
    self.assertEqual((branched['branches'], branched['rows_per_step']),
                     (1, 32))
    self.assertLessEqual(branched['steps_per_token'],
                         rows['speed_pipeline']['steps_per_token'])
    self.assertEqual(branched['flushes'] + branched['branch_hits'] > 0,
                     rows['speed_pipeline']['flushes'] > 0)
    for method in ('greedy', 'speed', 'speed_short'):
      self.assertFalse(rows[method]['pipelined'])
      self.assertEqual(rows[method]['steps_per_token'], 1.0)
    self.assertEqual(result['exits'], 'trained')
    self.assertEqual(result['replay']['learned']['model'],
                     'the committed 2x3 trained on gettext en->fr (test BLEU '
                     '12.5, width 32)')
    self.assertIn(result['best_greedy']['decode'],
                  ('greedy', 't5x_sample'))
    for row in rows.values():  # SPEED as users get it against the best
      self.assertGreater(row['vs_best_greedy'], 0.0)
    with open(os.path.join(out, 'bench.md')) as f:
      table = f.read()
    self.assertIn('| 4x3 | trained | 8 | short | speed_pipeline |', table)
    self.assertIn('| 4x3 | trained | 8 | short | speed | 1.00 |',
                  table)  # headline
    self.assertIn('| 4x3 | trained | 8 | short | speed_b1_pipeline |', table)
    self.assertIn('GB/s median', table)
    self.assertIn('on these 16 prompts it scores BLEU', table)


  def test_saved_records_replay_without_the_demo_model(self):
    # A first run records the schedules into --records; a second replays
    # them with neither the demo model nor its task's prompts reachable (as
    # on a machine without seqio), and takes the same steps.
    source = helpers.tiny_model(vocab_size=demo_model.VOCAB_SIZE)
    tiny = _tiny_base
    records = os.path.join(tempfile.mkdtemp(), 'records.json')
    runs = []
    for recorded in (False, True):
      out = tempfile.mkdtemp()
      unreachable = mock.Mock(side_effect=AssertionError('not replayed'))
      with mock.patch.object(replay, 'demo_schedule_source',
                             unreachable if recorded else
                             mock.Mock(return_value=source)), \
           mock.patch.object(demo_model, 'held_out',
                             unreachable if recorded else demo_model.held_out), \
           mock.patch.object(bench_measure, 'base_config', tiny):
        self.assertEqual(bench.main(
            ['--quick', '--repeats', '1', '--quiet', '--exits', 'demo',
             '--records', records, '--out', out]), 0)
      with open(os.path.join(out, 'bench.json')) as f:
        runs.append(json.load(f)['results'][0])
    with open(records) as f:
      self.assertEqual(list(json.load(f)), [
          f'R3_batch1_short_steps{demo_model.REPLAY_STEPS}'])
    first, second = runs
    self.assertEqual(first['replay'], second['replay'])
    for method in ('greedy', 'speed'):
      self.assertTrue(second['methods'][method]['replay_consistent'])
      self.assertEqual(first['methods'][method]['loop_steps'],
                       second['methods'][method]['loop_steps'])
    # Encoder-decoder rows replay the same schedules: each prompt encoded,
    # the decoder from BOS, the same tokens, steps and flushes.
    out = tempfile.mkdtemp()
    with mock.patch.object(bench_measure, 'base_config', tiny):
      self.assertEqual(bench.main(
          ['--quick', '--repeats', '1', '--quiet', '--records', records,
           '--exits', 'demo', '--encoder_layers', '2', '--out', out]), 0)
    with open(os.path.join(out, 'bench.json')) as f:
      data = json.load(f)
    (encdec,) = data['results']
    self.assertEqual(data['meta']['encoder_layers'], 2)
    self.assertEqual(encdec['config'], 'enc2+4x3')
    self.assertEqual(encdec['replay'], first['replay'])
    for method in ('greedy', 'speed'):
      row = encdec['methods'][method]
      self.assertTrue(row['replay_consistent'])
      self.assertEqual(row['tokens'], first['methods'][method]['tokens'])
    self.assertEqual(encdec['methods']['speed']['steps_per_token'],
                     first['methods']['speed']['steps_per_token'])
    with open(os.path.join(out, 'bench.md')) as f:
      self.assertNotIn('Targets', f.read())
    # int8 weights replay the same schedules: the same steps and tokens,
    # and about a quarter of float32's bytes per step; CTranslate2 times the
    # unshared equivalents beside them, f32 and int8.
    out = tempfile.mkdtemp()
    with mock.patch.object(bench_measure, 'base_config', tiny):
      self.assertEqual(bench.main(
          ['--quick', '--repeats', '1', '--quiet', '--records', records,
           '--exits', 'demo', '--weights', 'int8', '--ctranslate2',
           '--out', out]), 0)
    with open(os.path.join(out, 'bench.json')) as f:
      data = json.load(f)
    self.assertEqual(data['meta']['weights'], 'int8')
    (int8,) = data['results']
    self.assertGreater(
        int8['methods']['speed']['decode_vs_best_float_greedy'], 0.0)
    for method in ('greedy', 'speed', 'greedy_float'):
      row = int8['methods'][method]
      self.assertTrue(row['replay_consistent'])
      self.assertEqual(row['loop_steps'],
                       first['methods'][method.removesuffix('_float')][
                           'loop_steps'])
    self.assertEqual(
        [(r['model'], r['compute_type']) for r in data['ctranslate2']],
        [('12 layers (4x3 unrolled)', 'float32'),
         ('12 layers (4x3 unrolled)', 'int8'), ('4 layers', 'float32'),
         ('4 layers', 'int8')])
    self.assertTrue(all(r['ms_per_token'] > 0 for r in data['ctranslate2']))
    with open(os.path.join(out, 'bench.md')) as f:
      table = f.read()
    self.assertIn('float32 activations, int8 weights', table)
    self.assertIn('4x3 batch 1 short speed ', table)
    self.assertIn('| 4x3 | CTranslate2 | 4 layers | int8 |', table)
    self.assertIn('| 4x3 | t5x_speed | speed | int8 |', table)
    base = bench_measure.base_config(4, 3, 'float32')
    f32 = bench_measure.layer_and_classifier_bytes(base)
    q8 = bench_measure.layer_and_classifier_bytes(base, 'int8')
    self.assertAlmostEqual(q8['layer'] / f32['layer'], 0.25, delta=0.002)
    self.assertAlmostEqual(q8['classifier'] / f32['classifier'], 0.25,
                           delta=0.002)

  def test_budget_on_a_tiny_model(self):
    # The latency budget of a tiny model (random 2x3 exits recorded once):
    # each method's parts add up to its measured time per token, SPEED's
    # steps split into tokens, fill and flushes, and the per-call overhead
    # of a call that runs no loop step is below that of the full call.
    source = helpers.tiny_model(vocab_size=demo_model.VOCAB_SIZE)
    out = tempfile.mkdtemp()
    with mock.patch.object(replay, 'demo_schedule_source',
                           mock.Mock(return_value=source)), \
         mock.patch.object(bench_measure, 'base_config', _tiny_base):
      self.assertEqual(bench.main(
          ['--budget', '--exits', 'demo', '--lengths', 'short', '--repeats',
           '1', '--branches', '1', '--quiet', '--out', out]), 0)
    with open(os.path.join(out, 'budget.json')) as f:
      (budget,) = json.load(f)['budgets']
    with open(os.path.join(out, 'bench.json')) as f:
      (result,) = json.load(f)['results']
    self.assertEqual(set(budget['methods']),
                     {'SPEED', 'SPEED, 1 branch', 'best greedy',
                      'G-layer greedy'})
    for label, b in budget['methods'].items():
      row = result['methods'][b['method']]
      self.assertLess(row['call_overhead_seconds'] * 16,
                      row['decode_seconds'], label)
      self.assertAlmostEqual(sum(b['parts'].values()), b['total_ms'])
      self.assertGreater(b['step_ms'], 0.0)
    speed = budget['methods']['SPEED']
    self.assertEqual(speed['method'], 'speed')
    self.assertAlmostEqual(speed['parts']['fill'],
                           speed['step_ms'] * 2 * 16 / result['replay']['tokens'])
    self.assertIn('no flushes', budget['levers'])
    with open(os.path.join(out, 'budget.md')) as f:
      self.assertIn('| short | SPEED (speed) |', f.read())
    self.assertTrue(os.path.exists(os.path.join(out, 'budget.png')))

  def test_imports_without_seqio_or_tensorflow(self):
    # Replaying saved records is how the bench runs where seqio and
    # TensorFlow are not installed (a GPU machine).
    blocked = ('seqio', 'tensorflow', 'tensorflow_datasets', 't5x', 'gin')
    code = ('import sys\n'
            f'for name in {blocked!r}: sys.modules[name] = None\n'
            'import tools.bench, tools.replay\n'
            'print(sorted(set(tools.replay.METHODS)))\n')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True,
                            text=True, check=False, cwd=REPO_ROOT,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("'speed'", result.stdout)


class ProgressTest(absltest.TestCase):

  def test_lines_with_time_left(self):
    stream = io.StringIO()
    progress = common.Progress('bench', total=4, stream=stream)
    progress.log('compiling')
    progress._start -= 30.0  # pylint: disable=protected-access
    progress.advance()
    progress.log('round 1/3: greedy')
    first, second = stream.getvalue().splitlines()
    self.assertEqual(first, '[bench 0:00, 0% done] compiling')
    # One unit of four took 30 s: three more take about 90 s.
    self.assertRegex(second, r'^\[bench 0:30, ~1:3\d left, 25% done\] '
                     r'round 1/3: greedy$')

  def test_quiet_writes_nothing(self):
    stream = io.StringIO()
    progress = common.Progress('fuzz', total=2, quiet=True, stream=stream)
    progress.advance()
    progress.log('group 1/2')
    self.assertEqual(stream.getvalue(), '')
    self.assertEqual(progress.done, 1.0)


class SampleBenchTest(absltest.TestCase):

  def test_runs_on_a_tiny_model(self):
    # A random 2x3 model with the demo's vocabulary stands in for the trained
    # demo model (training takes minutes; test_demo trains one); greedy and
    # one sampling setting, and a replay at width 16, keep it to eight
    # compiles.
    source = helpers.tiny_model(vocab_size=demo_model.VOCAB_SIZE)
    out = tempfile.mkdtemp()
    stderr = io.StringIO()
    with mock.patch.object(replay, 'demo_schedule_source',
                           return_value=source), \
         mock.patch.object(sample_bench, 'SETTINGS',
                           sample_bench.SETTINGS[:1] +
                           sample_bench.SETTINGS[-1:]), \
         contextlib.redirect_stderr(stderr):
      sample_bench.main(['--config', '2x3', '--prompts', '2', '--width', '16',
                         '--vocab_size', '64', '--repeats', '1', '--out', out,
                         '--quiet'])
    self.assertNotIn('[sample_bench', stderr.getvalue())  # --quiet
    with open(os.path.join(out, 'sample_bench.json')) as f:
      results = json.load(f)
    greedy, row = results['rows']
    # The sampler alone: one row and R = 3 rows, kernel and XLA.
    self.assertEqual([(e['setting'], e['rows'])
                      for e in results['sampler_alone']],
                     [(sample_bench.MAIN_SETTING, 1),
                      (sample_bench.MAIN_SETTING, 3)])
    self.assertTrue(all(e['kernel_ms'] > 0 and e['xla_ms'] > 0
                        for e in results['sampler_alone']))
    self.assertEqual(greedy['setting'], 'greedy')
    self.assertTrue(greedy['identical'])
    # A random model spells no number: what it learned is recorded as such.
    self.assertEqual(greedy['exact_match'], 0.0)
    self.assertIn('cores', results['machine'])
    self.assertTrue(greedy['replay']['consistent'])
    self.assertEqual(row['setting'], sample_bench.MAIN_SETTING)
    self.assertTrue(row['identical'])
    self.assertGreaterEqual(row['steps_per_token'], 1.0)
    self.assertGreater(row['demo']['speedup'], 0.0)
    self.assertTrue(row['replay']['consistent'])
    self.assertEqual(row['replay']['width'], 16)
    self.assertGreater(row['replay']['speedup'], 0.0)

  def test_table(self):
    row = {'setting': 'T=0.7', 'exact_match': 0.5, 'steps_per_token': 1.25,
           'flip_rate': {'flip_rate/stage_2': 0.1, 'flip_rate/stage_3': 0.05},
           'identical': True, 'demo': {'speedup': 0.9},
           'replay': {'sequential_ms_per_token': 100.0,
                      'speed_ms_per_token': 50.0, 'speedup': 2.0}}
    machine = {'machine': 'AMD EPYC, 2 cores', 'jax': '0.10.2',
               'kernel_isa': 'avx2'}
    table = sample_bench.markdown(
        {**machine, 'demo_model': '2x3', 'config': '4x3', 'width': 768,
         'vocab_size': 32128,
         'dtype': 'float32', 'kernel': True, 'prompts': 8,
         'rows': [row, {**row, 'setting': 'greedy', 'replay': None}]})
    self.assertIn('Machine: AMD EPYC, 2 cores; JAX 0.10.2; kernel avx2.',
                  table)
    self.assertIn('| T=0.7 | 50% | 1.25 | 10.0%, 5.0% | True | 0.90x | 100.0 '
                  '| 50.0 | 2.00x |', table)
    self.assertIn('| greedy | 50% | 1.25 | 10.0%, 5.0% | True | 0.90x | – | – '
                  '| – |', table)
    self.assertIn('4x3 at width 768, vocabulary 32128 (float32, kernel on)',
                  table)
    self.assertNotIn('| target |', table)
    main = {**row, 'setting': sample_bench.MAIN_SETTING,
            'replay': {**row['replay'], 'speedup': 1.69}}
    table = sample_bench.markdown(
        {**machine, 'demo_model': '2x3', 'config': '4x3', 'width': 768,
         'vocab_size': 32128, 'dtype': 'float32', 'kernel': True,
         'prompts': 8, 'rows': [main]})
    # The measured row only: targets live in the issues, not in the table.
    self.assertIn('| T=0.7, top-p 0.9 | 50% | 1.25 | 10.0%, 5.0% | True | 0.90x | '
                  '100.0 | 50.0 | 1.69x |', table)
    self.assertNotIn('| target |', table)


if __name__ == '__main__':
  absltest.main()
