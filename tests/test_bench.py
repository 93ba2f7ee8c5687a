"""Tests of the benches: `bench`'s command line and table (the bench itself
is not run), and `sample_bench` end to end on a tiny model."""

import json
import os
import subprocess
import sys
import tempfile

from unittest import mock

from absl.testing import absltest

from tools import bench
from tools import demo_model
from tools import sample_bench
import helpers

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
  """{method: {column: cell}} of the markdown table."""
  lines = [l for l in table.splitlines() if l.startswith('|')]
  header = [c.strip() for c in lines[0].strip('|').split('|')]
  rows = {}
  for line in lines[2:]:
    cells = dict(zip(header, (c.strip() for c in line.strip('|').split('|'))))
    rows[cells['method']] = cells
  return rows


class FlagsTest(absltest.TestCase):

  def test_every_flag_has_help_and_default(self):
    parser = bench._parser()  # pylint: disable=protected-access
    # Help text as printed, with line wrapping undone.
    text = ' '.join(parser.format_help().split())
    actions = parser._actions  # pylint: disable=protected-access
    flags = [a for a in actions if a.dest != 'help']
    self.assertLen(flags, 11)
    for action in flags:
      self.assertTrue(action.help, action.dest)
      self.assertIn(f'(default: {action.default})', text, action.dest)
    self.assertIn('(default: 4x3,2x6)', text)
    self.assertIn('(default: False)', text)

  def test_help_command(self):
    result = subprocess.run(
        [sys.executable, '-m', 'tools.bench', '--help'],
        capture_output=True, text=True, check=False,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    self.assertEqual(result.returncode, 0, result.stderr)
    text = ' '.join(result.stdout.split())
    for flag in ('--configs', '--batch_sizes', '--lengths', '--repeats',
                 '--speculative_vocab', '--out', '--demo_out', '--quick'):
      self.assertIn(flag, text)
    self.assertEqual(text.count('(default: '), 11)
    # The module docstring keeps its layout.
    self.assertIn('\n  speed_short   speed_decode', result.stdout)


class MarkdownTest(absltest.TestCase):

  def test_quick_mode_has_no_nan(self):
    # --quick runs greedy and SPEED only: no G-layer baseline to compare with.
    table = bench._markdown(  # pylint: disable=protected-access
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
    # pylint: disable-next=protected-access
    table = bench._markdown([_result(methods)], META)
    rows = _table_rows(table)
    self.assertEqual({m: r['decode vs G-layer'] for m, r in rows.items()},
                     {'greedy': '0.50x', 'speed': '0.60x',
                      'greedy_g': '1.00x'})


class BenchRunTest(absltest.TestCase):

  def test_quick_bench_on_a_tiny_model(self):
    # The recording model and the "Base" models are tiny (random 2x3 with the
    # demo's vocabulary; a width-32 stand-in for Base width): the bench's own
    # path runs as a user runs it, from recording to bench.json.
    source = helpers.tiny_model(vocab_size=demo_model.VOCAB_SIZE)
    out = tempfile.mkdtemp()
    tiny = lambda g, r, dtype: helpers.tiny_config(  # pylint: disable=g-long-lambda
        num_unique_layers=g, num_repeats=r, dtype=dtype,
        vocab_size=demo_model.VOCAB_SIZE)
    with mock.patch.object(bench, 'demo_schedule_source',
                           return_value=source), \
         mock.patch.object(bench, 'base_config', tiny):
      self.assertEqual(bench.main(['--quick', '--repeats', '2', '--out',
                                   out]), 0)
    with open(os.path.join(out, 'bench.json')) as f:
      (result,) = json.load(f)['results']
    self.assertEqual((result['config'], result['batch']), ('4x3', 1))
    rows = result['methods']
    self.assertEqual(set(rows), {'greedy', 'speed'})
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
    # The replay takes exactly the recorded loop steps.
    self.assertAlmostEqual(rows['speed']['steps_per_token'],
                           result['replay']['steps_per_token'])
    self.assertEqual(rows['greedy']['steps_per_token'], 1.0)
    with open(os.path.join(out, 'bench.md')) as f:
      table = f.read()
    self.assertIn('| 4x3 | 1 | short | speed |', table)
    self.assertIn('GB/s median', table)


class SampleBenchTest(absltest.TestCase):

  def test_runs_on_a_tiny_model(self):
    # A random 2x3 model with the demo's vocabulary stands in for the trained
    # demo model (training takes minutes; test_demo trains one); one setting
    # and a replay at width 16 keep it to four compiles.
    source = helpers.tiny_model(vocab_size=demo_model.VOCAB_SIZE)
    out = tempfile.mkdtemp()
    with mock.patch.object(bench, 'demo_schedule_source',
                           return_value=source), \
         mock.patch.object(sample_bench, 'SETTINGS',
                           sample_bench.SETTINGS[-1:]):
      sample_bench.main(['--config', '2x3', '--prompts', '2', '--width', '16',
                         '--vocab_size', '64', '--repeats', '1', '--out', out])
    with open(os.path.join(out, 'sample_bench.json')) as f:
      (row,) = json.load(f)['rows']
    self.assertEqual(row['setting'], 'T=1.0, top-p 0.9')
    self.assertTrue(row['identical'])
    self.assertGreaterEqual(row['steps_per_token'], 1.0)
    self.assertGreater(row['demo']['speedup'], 0.0)
    self.assertTrue(row['replay']['consistent'])
    self.assertEqual(row['replay']['width'], 16)
    self.assertGreater(row['replay']['speedup'], 0.0)

  def test_table(self):
    row = {'setting': 'T=0.7', 'steps_per_token': 1.25,
           'flip_rate': {'flip_rate/stage_2': 0.1, 'flip_rate/stage_3': 0.05},
           'identical': True, 'demo': {'speedup': 0.9},
           'replay': {'sequential_ms_per_token': 100.0,
                      'speed_ms_per_token': 50.0, 'speedup': 2.0}}
    table = sample_bench._markdown(  # pylint: disable=protected-access
        {'demo_model': '2x3', 'config': '4x3', 'width': 768,
         'vocab_size': 32128,
         'dtype': 'float32', 'kernel': True, 'prompts': 8,
         'rows': [row, {**row, 'setting': 'greedy', 'replay': None}]})
    self.assertIn('| T=0.7 | 1.25 | 10.0%, 5.0% | True | 0.90x | 100.0 | '
                  '50.0 | 2.00x |', table)
    self.assertIn('| greedy | 1.25 | 10.0%, 5.0% | True | 0.90x | – | – | – |',
                  table)
    self.assertIn('4x3 at width 768, vocabulary 32128 (float32, kernel on)',
                  table)


if __name__ == '__main__':
  absltest.main()
