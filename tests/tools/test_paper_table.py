"""`make paper-table` at a toy size: the whole pipeline runs and reports."""

import dataclasses
import json
import os
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from t5x_speed import network
from tools import agreement_sweep
from tools import common
from tools import demo_real
from tools import gettext_data
from tools import paper_table
from tools import paper_table_data
from tools import paper_table_records
from tools import paper_table_report
from tools import paper_table_train
from tools import train_throughput
from tools import trainer
import helpers


class PaperTableTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The gettext set at the tiny vocabulary, built once for every test.
    cls.out = tempfile.mkdtemp()
    cls.vocab_size = paper_table.TINY.vocab_size
    cls.data_dir = paper_table_data.prepare_data(cls.out, cls.vocab_size, None,
                                                 lambda _: None)

  def test_runs_of_the_table(self):
    settings = paper_table.TableSettings(configs=('2L', '6L', '2x3'),
                                         sweep_configs=('2x3',),
                                         seeds=(0, 1), exit_agreements=(0.5,))
    self.assertEqual(paper_table.runs_of(settings), [
        ('2L', 0, 0.0), ('6L', 0, 0.0), ('2x3', 0, 0.0), ('2x3', 1, 0.0),
        ('2x3', 0, 0.5), ('2x3', 1, 0.5)])
    sweep = paper_table.TableSettings(configs=('3x2', '2x3'), seeds=(4,),
                                      sweep_configs=('3x2',),
                                      exit_agreements=(0.1, 1.0))
    self.assertEqual(paper_table.runs_of(sweep), [
        ('3x2', 4, 0.0), ('2x3', 4, 0.0), ('3x2', 4, 0.1), ('3x2', 4, 1.0)])
    no_agreement = paper_table.TableSettings(configs=('3x2',), seeds=(4,),
                                             sweep_configs=('3x2',),
                                             exit_agreements=(0.0,))
    self.assertEqual(paper_table.runs_of(no_agreement), [('3x2', 4, 0.0)])

  def test_decoded_row_helpers(self):
    # tools.common's examples: text before EOS, tokens produced with EOS;
    # the table's plateau.
    helpers.assert_doctests(common, paper_table, min_examples=2)
    points = [{'step': s, 'loss': [l]} for s, l in [(5, 2.0), (10, 1.5)]]
    self.assertFalse(paper_table.plateau(points, 10)['reached'])   # 25%
    self.assertIsNone(paper_table.plateau(points[1:], 10))  # no earlier point
    self.assertIsNone(paper_table.plateau(points[:1], 10))  # unfinished
    self.assertEqual(common.produced_count([[1, 0], [0, 0, 0]]), 4)

  def test_bad_flags_and_data_dir(self):
    with self.assertRaises(SystemExit):
      paper_table.main(['--configs', '2L,5x5', '--out_dir', '/tmp/unused'])
    with self.assertRaises(SystemExit):
      paper_table.main(['--configs', '2L,2x3', '--sweep_configs', '3x2',
                        '--out_dir', '/tmp/unused'])
    with self.assertRaisesRegex(FileNotFoundError, 'has no train.tsv'):
      paper_table_data.prepare_data('/tmp/unused', self.vocab_size,
                                    tempfile.mkdtemp(), print)

  def test_language_pair_follows_the_flag_or_the_data(self):
    self.assertEqual(gettext_data.read_languages(self.data_dir), ('en', 'fr'))
    self.assertEqual(paper_table_data.data_languages(None, None), ('en', 'fr'))
    self.assertEqual(paper_table_data.data_languages(self.data_dir, None),
                     ('en', 'fr'))
    self.assertEqual(paper_table_data.data_languages(self.data_dir, 'en,de'),
                     ('en', 'de'))
    for bad in ('en', 'en,en', 'en,xx', 'en,de,fr'):
      with self.assertRaisesRegex(ValueError, '--languages'):
        paper_table_data.parse_languages(bad)
    with self.assertRaises(SystemExit):
      paper_table.main(['--languages', 'en,klingon', '--out_dir',
                        '/tmp/unused'])
    # TSVs of your own name their languages, by flag or by file.
    mine = tempfile.mkdtemp()
    for name in ('train.tsv', 'test.tsv', 'spm.model'):
      shutil.copy(os.path.join(self.data_dir, name), mine)
    with self.assertRaisesRegex(ValueError, 'pass --languages'):
      paper_table_data.data_languages(mine, None)
    gettext_data.write_languages(mine, ('en', 'xx'))
    with self.assertRaisesRegex(ValueError, 'languages.json: unknown'):
      paper_table_data.data_languages(mine, None)
    gettext_data.write_languages(mine, ('en', 'de'))
    languages = paper_table_data.data_languages(mine, None)
    self.assertEqual(languages, ('en', 'de'))
    paper_table_data.prepare_data('/tmp/unused', self.vocab_size, mine,
                                  lambda _: None, languages)
    try:
      task = seqio.get_mixture_or_task(paper_table_data.TASK)
      example = next(task.get_dataset(
          paper_table.TINY.lengths, split='test',
          shuffle=False).as_numpy_iterator())
    finally:
      paper_table_data.prepare_data(self.out, self.vocab_size, None,
                                    lambda _: None)
    self.assertStartsWith(example['inputs_pretokenized'].decode(),
                          'translate English to German: ')
    # The gettext set translates from English to a catalog language.
    with self.assertRaisesRegex(ValueError, '--languages de,fr'):
      paper_table_data.prepare_data('/tmp/unused', self.vocab_size, None,
                                    print, ('de', 'fr'))
    with mock.patch.object(gettext_data, 'build',
                           side_effect=RuntimeError('built')) as build:
      with self.assertRaisesRegex(RuntimeError, 'built'):
        paper_table_data.prepare_data(tempfile.mkdtemp(), self.vocab_size,
                                      None, lambda _: None, ('en', 'de'))
    self.assertEqual(build.call_args.args[1].language, 'de')
    # The T5X trainer's task module registers the same prompt.
    module = paper_table_train._TASK_MODULE.format(
        task='t', data_dir='/d', spm='/d/spm.model', languages=('en', 'de'))
    self.assertIn("languages=('en', 'de'))", module)
    compile(module, 'task_module', 'exec')

  def test_tiny_run_writes_the_table(self):
    out = tempfile.mkdtemp()
    reports, write = [], paper_table_report.write

    def recorded(results, out_dir):
      reports.append((len(results['runs']), 'wall_seconds' in results))
      return write(results, out_dir)
    with mock.patch.object(paper_table_report, 'write', recorded):
      self.assertEqual(paper_table.main(['--tiny', '--quiet', '--out_dir',
                                         out, '--data_dir', self.data_dir]),
                       0)
    # Reported after each of the 4 runs (the runs so far), then in full.
    self.assertEqual(reports, [(1, False), (2, False), (3, False),
                               (4, False), (4, True)])
    with open(os.path.join(out, 'paper_table.json')) as f:
      results = json.load(f)
    self.assertTrue(os.path.getsize(os.path.join(out, 'paper_table.png')))
    runs = [(r['config'], r['seed'], r['exit_agreement'])
            for r in results['runs']]
    self.assertEqual(runs, [('2L', 0, 0.0), ('2x3', 0, 0.0), ('ed2x3', 0, 0.0),
                            ('2x3', 0, 1.0)])
    for row in results['runs']:
      self.assertBetween(row['bleu'], 0.0, 100.0)
      self.assertBetween(row['chrf'], 0.0, 100.0)
      r = paper_table.CONFIGS[row['config']][1]
      self.assertLen(row['consistency']['flip_rate'], r)
      self.assertEqual(row['final_train']['step'], 3)
      # The learning curve: decoded at every checkpoint.
      self.assertEqual([p['step'] for p in row['curve']], [1, 2, 3])
      self.assertTrue(all(0 <= p['bleu'] <= 100 for p in row['curve']))
      # The long split, decoded to its own length.
      self.assertBetween(row['long']['bleu'], 0.0, 100.0)
      # The same model with int8 weights: its quality beside the float's.
      self.assertBetween(row['int8']['bleu'], 0.0, 100.0)
      self.assertLen(row['int8']['consistency']['loss'], r)
      if r > 1:
        self.assertTrue(row['int8']['speed']['identical_to_greedy'])
        self.assertTrue(row['speed']['identical_to_greedy'])
        self.assertTrue(row['replay']['identical'])
        self.assertTrue(row['long']['replay']['identical'])
        self.assertGreaterEqual(row['long']['speed']['steps_per_token'], 1.0)
        self.assertGreater(row['long']['speed']['tokens'], 0)
        self.assertTrue(row['long']['speed']['identical_to_greedy'])
        self.assertGreaterEqual(
            min(p['speed']['steps_per_token'] for p in row['curve']), 1.0)
        self.assertGreaterEqual(row['speed']['steps_per_token'], 1.0)
        self.assertGreater(row['replay']['speedup'], 0.0)
        self.assertGreater(row['replay']['vs_shallow'], 0.0)
        self.assertEqual(row['replay']['width'], 64)
    for row in results['runs']:
      # The validation curve: a point (and a checkpoint) every step here.
      self.assertEqual([p['step'] for p in row['validation']], [1, 2, 3])
      r = paper_table.CONFIGS[row['config']][1]
      self.assertTrue(all(len(p['loss']) == r and min(p['loss']) > 0
                          for p in row['validation']))
      self.assertEqual(row['plateau']['from_step'], 2)
      # Every position of the packed sequences: 3 steps of 4 x (24 + 24).
      self.assertAlmostEqual(
          row['train_positions_per_second'] * row['train_seconds'],
          3 * 4 * (24 + 24))
    run_dirs = os.listdir(os.path.join(out, 'runs'))
    for run_dir in run_dirs:
      self.assertCountEqual(
          os.listdir(os.path.join(out, 'runs', run_dir, 'checkpoints')),
          ['step_1.msgpack', 'step_2.msgpack', 'step_3.msgpack'])
    last = paper_table_train.load_params(paper_table_train.checkpoint_path(
        os.path.join(out, 'runs', run_dirs[0]), 3))
    final, _ = paper_table_train._load(os.path.join(out, 'runs', run_dirs[0]))
    for a, b in zip(jax.tree.leaves(last), jax.tree.leaves(final)):
      np.testing.assert_array_equal(a, b)
    self.assertIn('exit_1/agreement', results['runs'][3]['final_train'])
    self.assertNotIn('exit_1/agreement', results['runs'][1]['final_train'])
    self.assertCountEqual(results['latency_ms_per_token'],
                          ['greedy 2L', 'greedy 2x3', 'SPEED 2x3',
                           'greedy ed2x3', 'SPEED ed2x3'])
    with open(os.path.join(out, 'paper_table.md')) as f:
      text = f.read()
    self.assertIn('Width 32 (64-wide heads), 3 steps of 4 packed', text)
    self.assertIn('Timed at one-minute load averages up to ', text)
    self.assertGreaterEqual(results['latency_load_average'], 0.0)
    self.assertIn('| 2x3 | agreement λ=1 | 1 |', text)
    self.assertIn('### Long outputs: the long split (8 pairs', text)
    self.assertIn('### int8 weights', text)
    self.assertIn('| 2x3 | 3 | ', text)       # its curve's last point
    for run_dir in run_dirs:
      self.assertTrue(os.path.exists(os.path.join(out, 'runs', run_dir,
                                                  'curve.json')))
    self.assertFalse(any(row['trained_earlier'] for row in results['runs']))
    # Each finished run's record, and a table assembled from them.
    recs = paper_table_records.load_records(os.path.join(out, 'records'))
    self.assertEqual([os.path.basename(r['path']) for r in recs], [
        '2L_seed0.json', '2x3_seed0.json', '2x3_seed0_agree1.json',
        'ed2x3_seed0.json'])
    assembled = paper_table_records.assemble(
        recs, [(c, s, a) for c, s, a in runs] + [('12L', 0, 0.0)])
    self.assertEqual(assembled['missing'], ['12L_seed0'])
    self.assertEqual(assembled['runs'][1]['bleu'], results['runs'][1]['bleu'])
    self.assertEqual(assembled['latency_ms_per_token'],
                     results['latency_ms_per_token'])
    self.assertEqual(recs[0]['data']['files'],
                     paper_table_records.data_digests(self.data_dir))
    self.assertEqual(recs[-1]['encoder_layers'], paper_table.ENCODER_LAYERS)
    self.assertEqual(recs[-1]['model']['num_encoder_layers'],
                     paper_table.ENCODER_LAYERS)
    self.assertLen(os.listdir(os.path.join(out, 'runs')), 4)
    with open(os.path.join(self.data_dir, 'stats.json')) as f:
      self.assertGreater(json.load(f)['counts']['kept'], 10000)

    # `make demo-real` on this table's models, exported as the committed
    # ones are.
    models = tempfile.mkdtemp()
    manifest = demo_real.export(out, models, paper_table.TINY, '2x3',
                                self.data_dir)
    self.assertCountEqual(os.listdir(models), [
        'manifest.json', 'spm.model', '2x3.msgpack'])
    self.assertEqual(manifest['models']['2x3']['test_bleu'],
                     results['runs'][1]['bleu'])
    demo_out = tempfile.mkdtemp()
    self.assertEqual(demo_real.main([
        '--models_dir', models, '--out', demo_out, '--prompts', '8',
        '--long_prompts', '8', '--timed_prompts', '1', '--repeats', '1',
        '--replay_width', '64']), 0)
    with open(os.path.join(demo_out, 'results.json')) as f:
      demo = json.load(f)
    self.assertTrue(demo['same_data'])    # the same catalogs
    self.assertTrue(demo['quality']['speed']['identical_to_greedy'])
    self.assertTrue(demo['long']['speed']['identical_to_greedy'])
    self.assertTrue(demo['replay']['long']['identical'])
    self.assertCountEqual(demo['latency_ms_per_token'],
                          ['greedy 2x3', 'SPEED 2x3'])
    self.assertGreater(demo['replay']['short']['vs_shallow'], 0.0)

    # The agreement sweep on the same models: an adapter setting, two
    # steps, measured, replayed and reported beside the original model (the
    # whole-model route: test_finetune_agree).
    sweep_out = tempfile.mkdtemp()
    self.assertEqual(agreement_sweep.main([
        '--models_dir', models, '--out', sweep_out, '--settings', '6',
        '--steps', '2', '--replay', '--quiet']), 0)
    with open(os.path.join(sweep_out, 'agreement_sweep.json')) as f:
      sweep = json.load(f)
    names = [agreement_sweep.ORIGINAL] + [
        dataclasses.replace(agreement_sweep.SWEEP[6], steps=2).name]
    self.assertEqual(list(sweep['records']), names)
    for name in names:
      record = sweep['records'][name]
      self.assertTrue(record['replay']['test']['identical'], name)
      self.assertIn('steps_lost_per_token', record['measures']['speed'])
      self.assertIn(name, sweep['verdicts'])
    # The adapters leave the final exit, and so the output, as it was.
    self.assertEqual(sweep['records'][names[1]]['measures']['bleu'],
                     sweep['records'][names[0]]['measures']['bleu'])
    self.assertTrue(os.path.exists(os.path.join(sweep_out,
                                                'agreement_sweep.png')))

  def test_train_throughput_measures_both_steps(self):
    out = tempfile.mkdtemp()
    self.assertEqual(train_throughput.main([
        '--tiny', '--configs', '2x3', '--steps', '2', '--rounds', '1',
        '--data_dir', self.data_dir, '--out', out]), 0)
    with open(os.path.join(out, 'train_throughput.json')) as f:
      (row,) = json.load(f)['rows']
    self.assertEqual(row['devices'], 4)     # TINY's batch over 4 devices
    self.assertLess(row['max_relative_gradient_error'], 1e-4)
    self.assertGreater(row['flops_per_step'], 0)
    for which in ('before', 'now'):
      self.assertGreater(row[which]['positions_per_second'], 0)
    self.assertCountEqual(row['matmul_rate'], [
        'attention projections', 'mlp in', 'mlp out', 'logits'])
    with open(os.path.join(out, 'train_throughput.md')) as f:
      self.assertIn('| 2x3 | ', f.read())

  def test_committed_model_is_its_manifests(self):
    # What `make demo-real` loads: the committed 4x3, its bytes as the
    # manifest records them and its parameters the shapes of the manifest's
    # architecture.
    models = demo_real.MODELS_DIR
    with open(os.path.join(models, 'manifest.json')) as f:
      manifest = json.load(f)
    shared = manifest['shared']
    entry = manifest['models'][shared]
    path = os.path.join(models, f'{shared}.msgpack')
    self.assertEqual(demo_real._digest(path), entry['sha256'])
    config = network.TransformerConfig(**{
        k: tuple(v) if isinstance(v, list) else v
        for k, v in entry['config'].items()})
    self.assertEqual((config.num_unique_layers, config.num_repeats), (4, 3))
    shapes = jax.eval_shape(lambda: paper_table_train.module_of(config).init(
        jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
        jnp.ones((1, 4), jnp.int32), enable_dropout=False))['params']
    params = paper_table_train.load_params(path)
    self.assertEqual(jax.tree.map(lambda x: x.shape, shapes),
                     jax.tree.map(np.shape, params))
    self.assertGreater(entry['test_bleu'], 10.0)   # it learned to translate

  def test_t5x_train_gives_the_library_trainers_parameters(self):
    pytest.importorskip('t5x')
    settings = paper_table.TINY
    vocab_size = seqio.get_mixture_or_task(
        paper_table_data.TASK).output_features['targets'].vocabulary.vocab_size
    progress = common.Progress('test', total=1, quiet=True)
    trained = {}
    for which in paper_table_train.TRAINERS:
      _, trained[which], record = paper_table.train_run(
          '2x3', 0, 0.5, settings, vocab_size, self.out, self.data_dir,
          which, progress, quiet=True)
      self.assertFalse(record['cached'])
      self.assertEqual(record['history'][-1]['step'], settings.steps)
      self.assertIn('exit_1/agreement', record['history'][-1])
    self.assertEqual(jax.tree.structure(trained['library']),
                     jax.tree.structure(trained['t5x']))
    for ours, t5xs in zip(jax.tree.leaves(trained['library']),
                          jax.tree.leaves(trained['t5x'])):
      # Tighter than one step's weight decay (lr * 0.01 * |p|).
      np.testing.assert_allclose(ours, t5xs, rtol=2e-6, atol=2e-6)
    # The update was not zero: the runs are equal after training, not
    # merely at initialisation.
    init = network.SpeedTransformer(paper_table.model_config(
        '2x3', settings, vocab_size)).init(
            paper_table_train.t5x_init_rng(0), np.ones((1, 4), np.int32),
            np.ones((1, 4), np.int32), enable_dropout=False)['params']
    moved = max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(init), jax.tree.leaves(trained['t5x'])))
    self.assertGreater(moved, 1e-3)
    # A second table reads the run back instead of training it again.
    _, again, record = paper_table.train_run(
        '2x3', 0, 0.5, settings, vocab_size, self.out, self.data_dir, 't5x',
        progress, quiet=True)
    self.assertTrue(record['cached'])
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(trained['t5x'])):
      np.testing.assert_array_equal(a, b)

  def test_an_interrupted_run_goes_on_from_its_last_point(self):
    settings = paper_table.TINY      # 3 steps, a curve point after each
    vocab_size = seqio.get_mixture_or_task(
        paper_table_data.TASK).output_features['targets'].vocabulary.vocab_size
    progress = common.Progress('test', total=1, quiet=True)
    train = lambda out: paper_table.train_run(
        '2L', 0, 0.0, settings, vocab_size, out, self.data_dir, 'library',
        progress, quiet=True)
    _, whole, whole_record = train(tempfile.mkdtemp())

    class Interrupted(Exception):
      pass
    points, point = [], paper_table.validation_point

    def point_then_stop(module, params, settings):
      if len(points) == 2:
        raise Interrupted     # the process dies at the third point
      points.append(1)
      return point(module, params, settings)
    out = tempfile.mkdtemp()
    with mock.patch.object(paper_table, 'validation_point', point_then_stop):
      with self.assertRaises(Interrupted):
        train(out)
    (run_dir,) = os.listdir(os.path.join(out, 'runs'))
    run_dir = os.path.join(out, 'runs', run_dir)
    self.assertTrue(os.path.exists(os.path.join(run_dir, 'resume.msgpack')))
    # A run goes on only where it had as many devices: its rounding.
    resume_path = os.path.join(run_dir, 'resume.msgpack')
    saved = paper_table_train.load_params(resume_path)
    meta = json.loads(saved['meta'])
    self.assertEqual(meta['devices'], 4)
    other = dict(saved, meta=json.dumps({**meta, 'devices': 2}))
    paper_table_train.save_params(resume_path + '.other', other)
    os.replace(resume_path, resume_path + '.kept')
    os.replace(resume_path + '.other', resume_path)
    with self.assertRaisesRegex(ValueError, 'trained on 2 devices so far'):
      train(out)
    os.replace(resume_path + '.kept', resume_path)
    _, resumed, record = train(out)
    self.assertEqual(record['trained_on']['devices'], 4)
    # Trained data parallel, returned on one device: what decodes it next
    # runs once.
    self.assertEqual({len(x.devices()) for x in jax.tree.leaves(whole)}, {1})
    # The same batches, optimizer state and schedule: the same parameters
    # and records as the uninterrupted run's.
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
      np.testing.assert_array_equal(a, b)
    self.assertEqual(record['history'], whole_record['history'])
    self.assertEqual([p['step'] for p in record['validation']], [1, 2, 3])
    self.assertEqual(record['validation'], whole_record['validation'])
    self.assertGreater(record['train_seconds'], 0.0)
    self.assertFalse(os.path.exists(os.path.join(run_dir, 'resume.msgpack')))

  def test_run_key_follows_what_changes_the_model(self):
    config = paper_table.model_config('2x3', paper_table.TINY, 300)
    recipe = trainer.Recipe(steps=40, learning_rate=3e-3, seed=7)
    key = lambda config=config, recipe=recipe, batch_size=8, data=None: (
        paper_table_train.run_key('2x3', config, recipe, 'library',
                                  batch_size, {'inputs': 24, 'targets': 24},
                                  data or self.data_dir))
    self.assertStartsWith(key(), '2x3_seed7_agree0_library_')
    copy = tempfile.mkdtemp()
    for name in ('train.tsv', 'spm.model'):
      with open(os.path.join(self.data_dir, name), 'rb') as f:
        data = f.read()
      with open(os.path.join(copy, name), 'wb') as f:
        f.write(data)
    self.assertEqual(key(data=copy), key())   # contents, not the path
    self.assertEqual(key(recipe=dataclasses.replace(
        recipe, exit_agreement_target='argmax')), key())   # unused at λ=0
    with open(os.path.join(copy, 'train.tsv'), 'ab') as f:
      f.write(b'Yes\tOui\n')
    self.assertEqual(paper_table_train.run_key(
        '2x3', config, recipe, 'library', 8, {'inputs': 24, 'targets': 24},
        self.data_dir, ('en', 'fr')), key())
    changed = [key(data=copy), key(batch_size=16),
               paper_table_train.run_key(
                   '2x3', config, recipe, 'library', 8,
                   {'inputs': 24, 'targets': 24}, copy, ('en', 'de')),
               key(config=dataclasses.replace(config, mlp_dim=96)),
               key(recipe=dataclasses.replace(recipe, learning_rate=1e-3)),
               key(recipe=dataclasses.replace(recipe, exit_agreement=0.3)),
               key(recipe=dataclasses.replace(recipe,
                                              exit_weighting='uniform'))]
    self.assertLen(set(changed + [key()]), len(changed) + 1)

  def test_t5x_gin_carries_the_recipe(self):
    config = paper_table.model_config('2x3', paper_table.TINY, 300)
    text = paper_table_train.t5x_gin(
        config, trainer.Recipe(steps=40, learning_rate=3e-3, seed=7,
                               exit_agreement=0.3), 'task', 'task_module',
        {'inputs': 24, 'targets': 24}, 8, '/data/spm.model')
    for line in ('NUM_REPEATS = 3', 'RANDOM_SEED = 7',
                 'train/utils.DatasetConfig.seed = 7', 'EXIT_AGREEMENT = 0.3',
                 "LOSS_NORMALIZING_FACTOR = 'NUM_REAL_TARGET_TOKENS'",
                 'Z_LOSS = 0.0', '  warmup_steps = 4', '  decay_steps = 40',
                 '  peak_value = 0.003', f'  end_value = {3e-3 / 20!r}',
                 'optimizers.adamw.weight_decay = 0.01', 'BATCH_SIZE = 8',
                 'network.TransformerConfig.emb_dim = 32'):
      self.assertIn(line + '\n', text)


if __name__ == '__main__':
  absltest.main()
