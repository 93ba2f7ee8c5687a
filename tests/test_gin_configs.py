"""Every gin file parses, finalizes at tiny size, builds and runs the model."""

import os
import pathlib
import re
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import gin
import jax
import numpy as np
import pytest

t5x = pytest.importorskip('t5x')
import t5x.eval  # pylint: disable=g-import-not-at-top
import t5x.infer
import t5x.train

from t5x_speed import exit_adapters
from t5x_speed import models
from t5x_speed import steps
from t5x_speed.tasks import sources
import helpers
import t5x_helpers as th

REPO = pathlib.Path(__file__).resolve().parents[1]
GIN = REPO / 't5x_speed' / 'gin'
MODEL_FILES = sorted(f for f in (GIN / 'models').glob('*/*.gin')
                     if f.name != '__init__.gin')
# One model file per class (family; shared or not; the demo's vocabulary)
# also trains, scores and decodes: the others differ from theirs only in G
# and R, which every file's built model is checked for.
RUNS_ONE_PER_CLASS = ('decoder_only/speed_4x3.gin', 'decoder_only/base_2l.gin',
                      'decoder_only/demo_2x3.gin',
                      'encoder_decoder/speed_4x3.gin',
                      'encoder_decoder/base_2l.gin')
RUN_FILES = sorted((GIN / 'runs').glob('*.gin'))
# The paper's finetuning runs, one task or mixture each (finetune_agree.gin
# is a run of its own: exits trained to agree).
PAPER_FINETUNE_FILES = [f for f in RUN_FILES if f.name.startswith(
    'finetune_') and f.name != 'finetune_agree.gin']
DECODING_FILES = sorted((GIN / 'decoding').glob('*.gin'))
# Decoding files that give greedy's tokens; the others (beam search, sampling)
# decode num_decodes sequences per example.
GREEDY_DECODING_FILES = ('greedy.gin', 'speed.gin', 't5x_greedy.gin')
MULTI_DECODING_FILES = ('beam_search.gin', 'sample.gin')
SAMPLING_FILES = ('speed_sample.gin',)   # exact SPEED sampling
TINY = [
    "network.TransformerConfig.vocab_size = 128",
    "network.TransformerConfig.emb_dim = 16",
    "network.TransformerConfig.num_heads = 2",
    "network.TransformerConfig.head_dim = 8",
    "network.TransformerConfig.mlp_dim = 24",
    "ACTIVATION_DTYPE = 'float32'",
    "MODEL_DIR = '/tmp/unused'",
    "INITIAL_CHECKPOINT_PATH = '/tmp/unused'",
    "CHECKPOINT_PATH = '/tmp/unused'",
    "INFER_OUTPUT_DIR = '/tmp/unused'",
    "EVAL_OUTPUT_DIR = '/tmp/unused'",
]
# What eval and infer runs require from the user.
TASK = "MIXTURE_OR_TASK_NAME = 'speed_wmt_ende'"


def setUpModule():
  # T5X run files bind `__main__.train` etc.: make them importable here.
  main = sys.modules['__main__']
  for name, fn in (('train', t5x.train.train), ('evaluate', t5x.eval.evaluate),
                   ('infer', t5x.infer.infer)):
    if not hasattr(main, name):
      setattr(main, name, fn)


class GinConfigTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.spm = helpers.train_sentencepiece(cls.tmp)

  def tearDown(self):
    gin.clear_config()
    super().tearDown()

  def _parse(self, *files, bindings=(), tiny=True):
    gin.clear_config()
    # T5X's binaries search the folder holding `t5x` (for `t5x/configs/...`);
    # `t5x_speed/gin/...` resolves through the package itself.
    gin.add_config_file_search_path(
        os.path.dirname(os.path.dirname(t5x.__file__)))
    sizes = TINY if tiny else [b for b in TINY if 'TransformerConfig' not in b]
    gin.parse_config_files_and_bindings(
        [str(f) for f in files],
        sizes + [f"SENTENCEPIECE_MODEL = '{self.spm}'"] + list(bindings),
        finalize_config=True)

  def _model(self) -> models.SpeedDecoderOnlyModel:
    return gin.query_parameter('MODEL/macro.value').scoped_configurable_fn()

  def test_every_file_starts_with_its_header(self):
    files = sorted(GIN.rglob('*.gin'))
    self.assertGreaterEqual(len(files), 17)
    for f in files:
      lines = f.read_text().splitlines()
      self.assertTrue(lines[0].startswith('# Provides: '), f)
      header = []
      for line in lines:
        if not line.startswith('#'):
          break
        header.append(line)
      self.assertTrue(any(l.startswith('# Requires: ') for l in header), f)
      # Example commands name the files as installed (t5x_speed/gin/...).
      for path in re.findall(r'--gin_file=(\S+)', '\n'.join(header)):
        self.assertTrue((REPO / path).is_file(), (f, path))

  @parameterized.parameters(*[f'{f.parent.name}/{f.name}'
                              for f in MODEL_FILES])
  def test_model_file_builds_and_runs(self, name):
    self.assertContainsSubset(
        RUNS_ONE_PER_CLASS, [f'{f.parent.name}/{f.name}' for f in MODEL_FILES])
    run = 'pretrain_c4.gin' if 'base' in name else 'finetune_wmt_ende.gin'
    self._parse(GIN / 'models' / name, GIN / 'runs' / run)
    model = self._model()
    size = name[:-len('.gin')].split('_')[-1]        # '4x3', '12l' or 'base'
    size = {'base': '12l'}.get(size, size)
    g, r = (int(x) for x in size.replace('l', 'x1').split('x'))
    self.assertEqual((model.config.num_unique_layers,
                      model.config.num_repeats), (g, r))
    self.assertEqual(model.config.emb_dim, 16)
    self.assertEqual(steps.uses_pipeline(model.decode_fn), r > 1)
    encoder_decoder = name.startswith('encoder_decoder/')
    self.assertEqual(model.config.is_encoder_decoder, encoder_decoder)
    self.assertIsInstance(model, models.SpeedEncoderDecoderModel
                          if encoder_decoder else models.SpeedDecoderOnlyModel)
    if name not in RUNS_ONE_PER_CLASS:
      return
    batch = (th.encdec_batch(seed=1, batch=2, targets_length=12)
             if encoder_decoder else
             th.prefix_lm_batch(seed=1, batch=2, length=12))
    params = th.init_params(model, batch)
    loss, metrics = th.jitted(model.loss_fn)(params, batch, None)
    self.assertTrue(np.isfinite(loss))
    self.assertIn(f'exit_{r}/accuracy', metrics)
    self.assertEqual(th.jitted(model.score_batch)(params, batch).shape, (2,))
    decodes, aux = th.jitted(model.predict_batch_with_aux)(params, batch)
    self.assertEqual(decodes.shape, (2, 12))
    self.assertEqual('speed/num_steps' in aux, r > 1)

  def _built(self, name):
    """The value gin passes for macro or parameter `name`, references called."""
    value = gin.query_parameter(name)
    if isinstance(value, gin.config.ConfigurableReference):
      return value.scoped_configurable_fn()
    return value

  def _train_dataset(self, model):
    """The train dataset `t5x.train` would build from the parsed config."""
    cfg = self._built('train_script.train.train_dataset_cfg')
    return cfg, t5x.utils.get_dataset(
        cfg, shard_id=0, num_shards=1,
        feature_converter_cls=model.FEATURE_CONVERTER_CLS)

  def test_demo_run_file_trains_on_the_generated_task(self):
    self._parse(GIN / 'models' / 'decoder_only' / 'demo_2x3.gin',
                GIN / 'runs' / 'demo_numbers.gin', tiny=False)
    model = self._model()
    self.assertEqual((model.config.emb_dim, model.config.vocab_size),
                     (64, 384))
    self.assertEqual(model.output_vocabulary.vocab_size, 259)
    self.assertEqual(self._built('train_script.train.total_steps'), 600)
    # T5X refuses periods that do not divide each other.
    eval_period = self._built('train_script.train.eval_period')
    save_period = self._built('utils.SaveCheckpointConfig.period')
    self.assertEqual(max(eval_period, save_period) %
                     min(eval_period, save_period), 0)
    _, dataset = self._train_dataset(model)
    batch = next(iter(dataset))
    self.assertEqual(batch['decoder_target_tokens'].shape, (16, 136))

  @parameterized.parameters(*[f.name for f in RUN_FILES
                              if f.name.startswith('pretrain')] +
                            [f.name for f in PAPER_FINETUNE_FILES])
  def test_paper_training_run(self, name):
    self._parse(GIN / 'models' / 'decoder_only' / 'speed_4x3.gin',
                GIN / 'runs' / name,
                bindings=["INITIAL_CHECKPOINT_PATH = "
                          "'/ckpt/pretrained/checkpoint_524288'"])
    model = self._model()
    lr = self._built('trainer.Trainer.learning_rate_fn')
    at = lambda step: float(lr(np.int32(step)))
    if name == 'pretrain_c4.gin':
      self.assertEqual(self._built('train_script.train.total_steps'), 524288)
      self.assertEqual(model.config.dropout_rate, 0.0)
      # Adafactor's rsqrt decay: 1 / sqrt(max(step, 10k)).
      for step, want in ((0, 0.01), (10000, 0.01), (40000, 0.005),
                         (524288, 524288 ** -0.5)):
        self.assertAlmostEqual(at(step), want, places=7, msg=step)
    else:
      # 262,144 finetuning steps after the checkpoint's 524,288.
      self.assertEqual(self._built('train_script.train.total_steps'), 786432)
      self.assertEqual(model.config.dropout_rate, 0.1)
      # 1e-3 after a 1k linear warmup from the restored step (T5X floors
      # the rate at 1e-8).
      for step, want in ((524288, 1e-8), (524289, 1e-6), (524788, 5e-4),
                         (525288, 1e-3), (786431, 1e-3)):
        self.assertAlmostEqual(at(step), want, places=9, msg=step)
    cfg = self._built('train_script.train.train_dataset_cfg')
    self.assertEqual((cfg.batch_size, cfg.task_feature_lengths, cfg.use_cached,
                      cfg.pack, cfg.split),
                     (128, {'inputs': 512, 'targets': 512}, False, True,
                      'train'))
    task = {'pretrain_c4.gin': 'speed_pretrain',
            'finetune_all.gin': 'speed_finetune_all',
            'finetune_paracrawl_ende.gin': 'speed_paracrawl_paragraph_ende',
            'finetune_wikilingua.gin': 'speed_wikilingua_en'}.get(
                name, 'speed_' + name[len('finetune_'):-len('.gin')])
    self.assertEqual(cfg.mixture_or_task_name, task)
    # Building the dataset reaches the task's own source (uncached): with no
    # data prepared, its clear error, not seqio's cache assertion.
    empty = tempfile.mkdtemp()
    with mock.patch.dict(os.environ, {
        'TFDS_DATA_DIR': empty,
        'T5X_SPEED_PARACRAWL_PARAGRAPH_DIR': empty}):
      with self.assertRaises(sources.DatasetNotPreparedError):
        _, dataset = self._train_dataset(model)
        next(iter(dataset))

  def test_paper_finetuning_runs_in_encoder_decoder_form(self):
    # The same run files: the model class brings seqio's
    # EncDecFeatureConverter, and the data pipeline reaches the task's source.
    import seqio  # pylint: disable=g-import-not-at-top
    self.assertLen(PAPER_FINETUNE_FILES, 5)
    for run_file in PAPER_FINETUNE_FILES:
      self._parse(GIN / 'models' / 'encoder_decoder' / 'speed_4x3.gin',
                  run_file,
                  bindings=["INITIAL_CHECKPOINT_PATH = "
                            "'/ckpt/t5_1_1_base/checkpoint_1000000'"])
      model = self._model()
      self.assertIsInstance(model, models.SpeedEncoderDecoderModel)
      self.assertIs(model.FEATURE_CONVERTER_CLS, seqio.EncDecFeatureConverter)
      self.assertEqual(self._built('train_script.train.total_steps'),
                       1000000 + 262144)
      empty = tempfile.mkdtemp()
      with mock.patch.dict(os.environ, {
          'TFDS_DATA_DIR': empty,
          'T5X_SPEED_PARACRAWL_PARAGRAPH_DIR': empty}):
        with self.assertRaises(sources.DatasetNotPreparedError, msg=run_file):
          _, dataset = self._train_dataset(model)
          next(iter(dataset))

  def test_one_flag_switches_on_exit_agreement(self):
    finetune_files = [GIN / 'runs' / 'finetune.gin'] + PAPER_FINETUNE_FILES
    for run_file in finetune_files:
      for bindings, want in (([], (0.0, 'distribution')),
                             (['EXIT_AGREEMENT = 0.3'], (0.3, 'distribution')),
                             (['EXIT_AGREEMENT = 1.0',
                               "EXIT_AGREEMENT_TARGET = 'argmax'"],
                              (1.0, 'argmax'))):
        self._parse(GIN / 'models' / 'decoder_only' / 'speed_4x3.gin', run_file,
                    bindings=bindings + [
                        "MIXTURE_OR_TASK_NAME = 'speed_wmt_ende'"])
        model = self._model()
        self.assertEqual(
            (model._exit_agreement, model._exit_agreement_target), want,
            (run_file.name, bindings))

  def test_finetune_agree_trains_exit_adapters_or_everything(self):
    checkpoint = "INITIAL_CHECKPOINT_PATH = '/ckpt/ft/checkpoint_786432'"
    for family in ('decoder_only', 'encoder_decoder'):
      self._parse(GIN / 'models' / family / 'speed_4x3.gin',
                  GIN / 'runs' / 'finetune_agree.gin',
                  bindings=[TASK, checkpoint])
      model = self._model()
      self.assertEqual((model._exit_agreement, model._exit_agreement_target,
                        model.config.exit_adapter_rank,
                        model.config.dropout_rate), (1.0, 'argmax', 16, 0.0))
      self.assertEqual(self._built('train_script.train.total_steps'),
                       786432 + 300)
      restore = self._built('utils.CheckpointConfig.restore')
      self.assertTrue(restore.fallback_to_scratch)
      self.assertEqual(restore.assignment_map,
                       ((r'state/param_states.*', None),))
    # AdamW from a fresh state on the adapters alone: their rate warms up
    # over 30 steps to 1e-3 and decays to 5e-5; every other update is 0.
    optimizer = self._built('OPTIMIZER/macro.value').optax_optimizer
    params = {'decoder': {'layers_0': {'w': np.ones(3, np.float32)},
                          'exit_adapters': {'scale': np.ones(3, np.float32)}}}
    state = optimizer.init(params)
    grads = jax.tree.map(np.ones_like, params)
    for step in range(31):
      updates, state = optimizer.update(grads, state, params)
    self.assertEqual(np.abs(updates['decoder']['layers_0']['w']).max(), 0)
    # AdamW's first moments are 1 here: the update is the rate (+ decay).
    np.testing.assert_allclose(
        -updates['decoder']['exit_adapters']['scale'], 1e-3 * 1.01,
        rtol=1e-4)
    self._parse(GIN / 'models' / 'decoder_only' / 'speed_4x3.gin',
                GIN / 'runs' / 'finetune_agree.gin',
                bindings=[TASK, checkpoint, "TRAINABLE = 'all'",
                          'EXIT_ADAPTER_RANK = None', 'EXIT_AGREEMENT = 0.3'])
    self.assertIsNone(self._model().config.exit_adapter_rank)
    optimizer = self._built('OPTIMIZER/macro.value').optax_optimizer
    state = optimizer.init(params)
    for step in range(2):   # the first update's rate is 0
      updates, state = optimizer.update(grads, state, params)
    self.assertGreater(np.abs(updates['decoder']['layers_0']['w']).min(), 0)
    with self.assertRaisesRegex(ValueError, 'trainable must be one of'):
      exit_adapters.param_labels('adapters')
    with self.assertRaisesRegex(ValueError, 'no exit adapters'):
      exit_adapters.param_labels('exit_adapters')({'decoder': {'w': 1.0}})

  def test_eval_and_infer_run_files(self):
    for name in ('eval.gin', 'infer.gin'):
      self._parse(GIN / 'models' / 'decoder_only' / 'speed_4x3.gin',
                  GIN / 'runs' / name,
                  bindings=[TASK])
      self.assertEqual(self._model().config.dropout_rate, 0.0)
      script = ('eval_script.evaluate' if name == 'eval.gin' else
                'infer_script.infer')
      cfg = self._built(f'{script}.dataset_cfg')
      self.assertEqual((cfg.split, cfg.use_cached), ('test', False))
      self.assertEqual(cfg.task_feature_lengths,
                       {'inputs': 512, 'targets': 512})
    # SPEED's statistics are written with the predictions.
    self.assertEqual(self._built('infer_script.infer.mode'),
                     'predict_with_aux')

  @parameterized.parameters('decoder_only', 'encoder_decoder')
  def test_architecture_defaults_are_t5_base_bf16(self, family):
    gin.clear_config()
    gin.add_config_file_search_path(os.path.dirname(os.path.dirname(
        t5x.__file__)))
    gin.parse_config_files_and_bindings(
        [str(GIN / 'models' / family / 'speed_2x6.gin')],
        ['DROPOUT_RATE = 0.1'],
        finalize_config=True)
    model = self._model()
    cfg = model.config
    self.assertEqual(
        (cfg.vocab_size, cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim,
         cfg.num_unique_layers, cfg.num_repeats, str(cfg.dtype)),
        (32128, 768, 12, 64, 2048, 2, 6, 'bfloat16'))
    # T5 1.1 Base's encoder-decoder: 12 unshared encoder layers and the
    # separate classifier; the decoder-only Base ties it.
    t5 = family == 'encoder_decoder'
    self.assertEqual((cfg.num_encoder_layers, cfg.num_encoder_repeats,
                      cfg.logits_via_embedding),
                     (12, 1, False) if t5 else (0, 1, True))
    self.assertEqual(model._z_loss, 1e-4)
    self.assertEqual(model.decode_fn.__name__, 'speed_decode')
    self.assertTrue(steps.uses_pipeline(model.decode_fn))

  def test_one_flag_switches_decoding(self):
    batch = th.prefix_lm_batch(seed=2, batch=3, length=12)
    results = {}
    choices = {
        'speed': ['DECODING_FN = @decoding.speed_decode'],
        # 3 examples x R = 6 rows: beyond the CPU's default limit, SPEED
        # decodes with greedy's loop unless told to pipeline at any batch.
        'speed_pipeline': ['DECODING_FN = @decoding.speed_decode',
                           'decoding.speed_decode.max_speculative_rows = None'],
        'greedy': ['DECODING_FN = @decoding.greedy_decode'],
        't5x': ['DECODING_FN = @t5x.decoding.temperature_sample'],
    }
    self.assertCountEqual([f.name for f in DECODING_FILES],
                          GREEDY_DECODING_FILES + MULTI_DECODING_FILES +
                          SAMPLING_FILES)
    for name in GREEDY_DECODING_FILES:
      choices[name] = []
    params = None
    for name, flag in choices.items():
      extra = [GIN / 'decoding' / name] if name.endswith('.gin') else []
      self._parse(GIN / 'models' / 'decoder_only' / 'speed_2x6.gin',
                  GIN / 'runs' / 'infer.gin', *extra,
                  bindings=flag + [TASK])
      model = self._model()
      if params is None:
        params = th.init_params(model, batch, seed=5)
      decodes, aux = th.jitted(model.predict_batch_with_aux)(params, batch)
      results[name] = np.asarray(decodes)
      if name.startswith('speed'):
        np.testing.assert_array_equal(aux['speed/pipelined'],
                                      [name == 'speed_pipeline'] * 3)
    self.assertLen(results, 7)
    for name, decodes in results.items():
      np.testing.assert_array_equal(decodes, results['speed'], name)

  def test_encoder_decoder_decodes_with_the_same_flags_and_files(self):
    batch = th.encdec_batch(seed=2, batch=3, targets_length=12)
    results, params = {}, None
    choices = {  # name: (extra decoding file, bindings)
        'speed': (None, ['decoding.speed_decode.max_speculative_rows = None']),
        'greedy': (None, ['DECODING_FN = @decoding.greedy_decode']),
        'beam_search': ('beam_search.gin', []),
        # One flag decodes with int8 weights; SPEED is greedy's on them.
        'speed_int8': (None, ["DECODE_WEIGHTS = 'int8'",
                              'decoding.speed_decode.max_speculative_rows = '
                              'None']),
        'greedy_int8': (None, ["DECODE_WEIGHTS = 'int8'",
                               'DECODING_FN = @decoding.greedy_decode'])}
    for name, (extra, bindings) in choices.items():
      self._parse(GIN / 'models' / 'encoder_decoder' / 'speed_2x6.gin',
                  GIN / 'runs' / 'infer.gin',
                  *([GIN / 'decoding' / extra] if extra else []),
                  bindings=bindings + [TASK])
      model = self._model()
      if params is None:
        params = th.init_params(model, batch, seed=5)
      decodes, aux = th.jitted(model.predict_batch_with_aux,
                               return_all_decodes=True)(
                                   params, batch, jax.random.PRNGKey(1))
      results[name] = np.asarray(decodes)
      self.assertEqual('speed/num_steps' in aux, name.startswith('speed'),
                       name)
      self.assertEqual(model._decode_weights,
                       'int8' if name.endswith('int8') else 'as_given')
    np.testing.assert_array_equal(results['speed'], results['greedy'])
    np.testing.assert_array_equal(results['speed_int8'],
                                  results['greedy_int8'])
    # The file binds num_decodes on the encoder-decoder model too.
    self.assertEqual(results['beam_search'].shape, (3, 4, 12))

  def test_flags_select_beam_search_and_every_exit_scores(self):
    self._parse(GIN / 'models' / 'decoder_only' / 'speed_2x6.gin',
                GIN / 'runs' / 'infer.gin',
                bindings=['DECODING_FN = @t5x.decoding.beam_search',
                          'SCORE_ALL_EXITS = True', TASK])
    model = self._model()
    self.assertEqual(model.decode_fn.__name__, 'beam_search')
    batch = th.prefix_lm_batch(seed=4, batch=2, length=12)
    params = th.init_params(model, batch, seed=6)
    self.assertEqual(th.jitted(model.score_batch)(params, batch).shape,
                     (2, 6))

  @parameterized.parameters(*MULTI_DECODING_FILES)
  def test_beam_search_and_sampling_files(self, name):
    batch = th.prefix_lm_batch(seed=3, batch=3, length=12)
    self._parse(GIN / 'models' / 'decoder_only' / 'speed_2x6.gin',
                GIN / 'runs' / 'infer.gin', GIN / 'decoding' / name,
                bindings=[TASK])
    model = self._model()
    self.assertFalse(steps.takes_kv_cache(model.decode_fn))
    params = th.init_params(model, batch, seed=5)
    # The file binds num_decodes = 4 on predict_batch_with_aux.
    decodes, aux = th.jitted(model.predict_batch_with_aux,
                             return_all_decodes=True)(
                                 params, batch, jax.random.PRNGKey(0))
    self.assertEqual(decodes.shape, (3, 4, 12))
    self.assertTrue((np.diff(np.asarray(aux['scores']), axis=1) >= 0).all())
    best, best_aux = th.jitted(model.predict_batch_with_aux)(
        params, batch, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(best, decodes[:, -1])
    np.testing.assert_array_equal(best_aux['scores'], aux['scores'][:, -1])

  def test_speed_sampling_file_and_its_sequential_flag(self):
    batch = th.prefix_lm_batch(seed=3, batch=3, length=12)
    # The pipeline even at 3 examples x 3 samples x R = 6 rows.
    settings = ['NUM_SAMPLES = 3', 'SAMPLE_TEMPERATURE = 0.8', TASK,
                'sampling.speed_sample_decode.max_speculative_rows = None']
    decodes = {}
    for flag in ([], ['DECODING_FN = @sampling.sample_decode']):
      self._parse(GIN / 'models' / 'decoder_only' / 'speed_2x6.gin',
                  GIN / 'runs' / 'infer.gin',
                  GIN / 'decoding' / 'speed_sample.gin',
                  bindings=settings + flag)
      model = self._model()
      self.assertTrue(steps.takes_kv_cache(model.decode_fn))
      if not flag:
        self.assertEqual(model.decode_fn.__name__, 'speed_sample_decode')
        params = th.init_params(model, batch, seed=5)
      # The file binds num_decodes = NUM_SAMPLES on predict_batch_with_aux.
      decodes[bool(flag)], aux = th.jitted(
          model.predict_batch_with_aux, return_all_decodes=True)(
              params, batch, jax.random.PRNGKey(4))
      self.assertEqual(decodes[bool(flag)].shape, (3, 3, 12))
      self.assertTrue((np.diff(np.asarray(aux['scores']), axis=1) >= 0).all())
      self.assertEqual('speed/num_steps' in aux, not flag)
      if not flag:
        np.testing.assert_array_equal(aux['speed/pipelined'], [1, 1, 1])
    # SPEED sampling gives the sequential sampler's samples.
    np.testing.assert_array_equal(decodes[False], decodes[True])
    self.assertEqual(aux['scores'].shape, (3, 3))


if __name__ == '__main__':
  absltest.main()
