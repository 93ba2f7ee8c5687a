"""Encoder-decoder models end to end through T5X's stock binaries.

As `test_t5x_binaries.py` runs the decoder-only models (the installed
package, each binary in a fork of one server, the gin files named as
installed): one checkpoint of T5X's own tiny T5 1.1 encoder-decoder
(t5x/examples/t5/t5_1_1/base.gin), trained by the stock `t5x.train` on the
same generated seqio task, serves every test. From it:

* `t5x.infer` restores it through
  t5x_speed/gin/models/encoder_decoder/base_12l.gin and decodes greedily:
  the predictions are T5X's model's own (its sampler at temperature 0), and
  our model scores and decodes like T5X's;
* t5x_speed/gin/runs/warm_start_from_t5x.gin starts a 2x3 shared decoder
  (models/encoder_decoder/speed_4x3.gin resized) from the checkpoint's
  encoder and first two decoder layers;
* the warm-started model is evaluated by `t5x.eval` (task metric, SPEED's
  statistics, per-exit metrics) and decoded by `t5x.infer` with SPEED,
  greedy, T5X's beam search and exact SPEED sampling: SPEED's and greedy's
  prediction files are identical.

Skipped when T5X is absent (it is not on PyPI).
"""

import functools
import os
import pathlib
import tempfile

from absl.testing import absltest
import jax
import numpy as np
import pytest

t5x = pytest.importorskip('t5x')
import seqio  # pylint: disable=g-import-not-at-top
from t5x import adafactor  # pylint: disable=g-import-not-at-top
from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top
from t5x.examples.t5 import network as t5x_t5_network  # pylint: disable=g-import-not-at-top

from t5x_speed import decoding  # pylint: disable=g-import-not-at-top
from t5x_speed import encoder_decoder
from t5x_speed import models
from t5x_speed import network
import helpers  # pylint: disable=g-import-not-at-top
import t5x_helpers as th  # pylint: disable=g-import-not-at-top

STEPS = 30
SIZES = dict(vocab_size=128, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
ENCODER_LAYERS = 2
DECODER_LAYERS = 3
T5X_GIN = pathlib.Path(t5x.__file__).resolve().parents[1]
T5X_MODEL = T5X_GIN / 't5x/examples/t5/t5_1_1/base.gin'
MODEL = 't5x_speed/gin/models/encoder_decoder/speed_4x3.gin'
VOCAB = seqio.PassThroughVocabulary(SIZES['vocab_size'], eos_id=1)
# T5X's EncoderDecoderModel decodes with beam search by default; its
# sampler at temperature 0 is greedy.
T5X_GREEDY_GIN = """from __gin__ import dynamic_registration
from t5x import decoding
from t5x import models
models.EncoderDecoderModel.decode_fn = @decoding.temperature_sample
decoding.temperature_sample.temperature = 0.0
decoding.temperature_sample.topk = 1
"""


def _t5x_bindings(root):
  """T5X's T5 1.1 base.gin at tiny size, float32, the test's vocabulary."""
  return [f'network.T5Config.{k} = {v}' for k, v in SIZES.items()] + [
      f'network.T5Config.num_encoder_layers = {ENCODER_LAYERS}',
      f'network.T5Config.num_decoder_layers = {DECODER_LAYERS}',
      "network.T5Config.dtype = 'float32'", 'DROPOUT_RATE = 0.0',
      "seqio.SentencePieceVocabulary.sentencepiece_model_file = "
      f"'{root}/spm.model'"] + th.reverse_task_bindings()


def _our_bindings(root, unique_layers=2, repeats=3):
  return [f'network.TransformerConfig.{k} = {v}' for k, v in SIZES.items()
         ] + [f'NUM_UNIQUE_LAYERS = {unique_layers}',
              f'NUM_REPEATS = {repeats}',
              f'NUM_ENCODER_LAYERS = {ENCODER_LAYERS}',
              "ACTIVATION_DTYPE = 'float32'",
              f"SENTENCEPIECE_MODEL = '{root}/spm.model'"
             ] + th.reverse_task_bindings()


def _our_model():
  return models.SpeedEncoderDecoderModel(
      encoder_decoder.SpeedEncoderDecoder(network.TransformerConfig(
          num_unique_layers=DECODER_LAYERS, num_repeats=1,
          num_encoder_layers=ENCODER_LAYERS, dtype='float32',
          logits_via_embedding=False, **SIZES)), VOCAB, VOCAB,
      adafactor.Adafactor(), decode_fn=decoding.greedy_decode)


def _t5x_model():
  return t5x_models.EncoderDecoderModel(
      t5x_t5_network.Transformer(t5x_t5_network.T5Config(
          num_encoder_layers=ENCODER_LAYERS,
          num_decoder_layers=DECODER_LAYERS, dtype='float32',
          logits_via_embedding=False, dropout_rate=0.0,
          mlp_activations=('gelu', 'linear'), **SIZES)),
      VOCAB, VOCAB, adafactor.Adafactor(), decode_fn=th.T5X_GREEDY)


class StockBinariesEncoderDecoderTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = root = tempfile.mkdtemp()
    th.write_reverse_task(root)
    with open(os.path.join(root, 't5x_greedy.gin'), 'w') as f:
      f.write(T5X_GREEDY_GIN)
    cls.server = th.BinaryServer(helpers.installed_package().python, root,
                                 th.binary_env(root))
    cls.addClassCleanup(cls.server.close)
    model_dir = os.path.join(root, 't5x_model')
    th.run_t5x(
        cls.server, 'train',
        [T5X_MODEL, T5X_GIN / 't5x/configs/runs/pretrain.gin'],
        _t5x_bindings(root) + th.TRAIN_SEEDS + [
            f"MODEL_DIR = '{model_dir}'", f'TRAIN_STEPS = {STEPS}',
            "utils.create_learning_rate_scheduler.factors = 'constant'",
            'utils.create_learning_rate_scheduler.base_learning_rate = 0.01'],
        search_paths=(T5X_GIN,))
    cls.checkpoint = os.path.join(model_dir, f'checkpoint_{STEPS}')
    assert os.path.isdir(cls.checkpoint), os.listdir(model_dir)
    cls.warm_checkpoint = os.path.join(root, 'warm_start',
                                       f'checkpoint_{STEPS + 1}')
    # The three binaries that read the checkpoint, two at a time; each test
    # waits for its own and raises their failure.
    cls.runs = dict(zip(('infer_t5x', 'infer_ours', 'warm_start'),
                        th.run_concurrently(
                            lambda: _safe(cls._infer_t5x),
                            lambda: _safe(cls._infer_ours),
                            lambda: _safe(cls._warm_start))))

  @classmethod
  def _infer_t5x(cls):
    th.run_t5x(
        cls.server, 'infer',
        [T5X_MODEL, T5X_GIN / 't5x/configs/runs/infer.gin',
         os.path.join(cls.root, 't5x_greedy.gin')],
        _t5x_bindings(cls.root) + [
            f"CHECKPOINT_PATH = '{cls.checkpoint}'",
            f"INFER_OUTPUT_DIR = '{cls.root}/infer_t5x'",
            'utils.DatasetConfig.batch_size = 4'], search_paths=(T5X_GIN,))

  @classmethod
  def _infer_ours(cls):
    th.run_t5x(
        cls.server, 'infer',
        ['t5x_speed/gin/models/encoder_decoder/base_12l.gin',
         't5x_speed/gin/runs/infer.gin'],
        _our_bindings(cls.root, unique_layers=DECODER_LAYERS, repeats=1) + [
            f"CHECKPOINT_PATH = '{cls.checkpoint}'",
            f"INFER_OUTPUT_DIR = '{cls.root}/infer_ours'",
            'utils.DatasetConfig.batch_size = 4'])

  @classmethod
  def _warm_start(cls):
    # A zero learning rate keeps the restored parameters as they are.
    th.run_t5x(
        cls.server, 'train',
        [MODEL, 't5x_speed/gin/runs/warm_start_from_t5x.gin'],
        _our_bindings(cls.root) + [
            f"MODEL_DIR = '{cls.root}/warm_start'",
            f"INITIAL_CHECKPOINT_PATH = '{cls.checkpoint}'",
            'FINETUNE_STEPS = 1',
            'utils.create_learning_rate_scheduler.base_learning_rate = 0.0'])

  def _result(self, name):
    if isinstance(self.runs[name], Exception):
      raise self.runs[name]

  def test_restores_into_base_12l_and_decodes_as_t5x(self):
    our_model, t5x_model = _our_model(), _t5x_model()
    params = th.checkpoint_params(self.checkpoint)
    batch = th.encdec_batch(seed=3, batch=6)
    np.testing.assert_allclose(jax.jit(our_model.score_batch)(params, batch),
                               jax.jit(t5x_model.score_batch)(params, batch),
                               rtol=1e-5)
    np.testing.assert_array_equal(
        jax.jit(our_model.predict_batch)(params, batch),
        jax.jit(t5x_model.predict_batch)(params, batch))
    self._result('infer_t5x')
    self._result('infer_ours')
    text = lambda rows: [(r['inputs'], r['prediction']) for r in rows]
    theirs = text(th.prediction_rows(os.path.join(self.root, 'infer_t5x')))
    ours = text(th.prediction_rows(os.path.join(self.root, 'infer_ours')))
    self.assertLen(ours, 12)
    self.assertEqual(ours, theirs)
    self.assertTrue(any(p for _, p in ours))

  def test_warm_start_eval_and_infer_speed_equals_greedy(self):
    self._result('warm_start')
    source = th.checkpoint_params(self.checkpoint)
    warm = th.checkpoint_params(self.warm_checkpoint)
    self.assertEqual(sorted(warm), ['decoder', 'encoder', 'token_embedder'])
    self.assertEqual(sorted(k for k in warm['decoder']
                            if k.startswith('layers_')),
                     ['layers_0', 'layers_1'])
    for name in ('encoder', 'decoder', 'token_embedder'):
      for path, a in th.tree_leaves(warm[name]):
        b = dict(th.tree_leaves(source[name]))[path]
        # One Adafactor step at learning rate 0: float32 rounding only.
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7,
                                   err_msg=f'{name}{path}')
    root, checkpoint = self.root, self.warm_checkpoint
    eval_dir = os.path.join(root, 'eval')
    decodings = {  # name: (extra gin files, extra bindings)
        'speed': ([], ['utils.DatasetConfig.batch_size = 2']),
        'greedy': ([], ['DECODING_FN = @decoding.greedy_decode']),
        'beam_search': (['decoding/beam_search.gin'], []),
        'speed_sample': (['decoding/speed_sample.gin'],
                         ['NUM_SAMPLES = 2', 'SAMPLE_TOPP = 0.9',
                          'sampling.speed_sample_decode.max_speculative_rows'
                          ' = None'])}

    def infer(name):
      out = os.path.join(root, f'infer_{name}')
      files, bindings = decodings[name]
      th.run_t5x(self.server, 'infer', [
          MODEL, 't5x_speed/gin/runs/infer.gin'] + [
              f't5x_speed/gin/{f}' for f in files], _our_bindings(root) + [
              f"CHECKPOINT_PATH = '{checkpoint}'",
              f"INFER_OUTPUT_DIR = '{out}'",
              'utils.DatasetConfig.batch_size = 4'] + bindings)
      return th.prediction_rows(out)

    results = th.run_concurrently(
        lambda: th.run_t5x(
            self.server, 'eval', [MODEL, 't5x_speed/gin/runs/eval.gin'],
            _our_bindings(root) + [f"CHECKPOINT_PATH = '{checkpoint}'",
                                   f"EVAL_OUTPUT_DIR = '{eval_dir}'"]),
        *[functools.partial(infer, name) for name in decodings])
    predictions = dict(zip(decodings, results[1:]))
    tags = set()
    for events in pathlib.Path(eval_dir).rglob('events.out.*'):
      tags |= set(th.tensorboard_scalars(str(events.parent)))
    for tag in ('exact_match', 'speed/steps_per_token', 'exit_1/loss',
                'exit_3/accuracy'):
      self.assertTrue(any(t.endswith(tag) for t in tags), (tag, tags))
    text = lambda rows: [(r['inputs'], r['prediction']) for r in rows]
    self.assertLen(predictions['speed'], 12)
    self.assertEqual(text(predictions['speed']), text(predictions['greedy']))
    for row in predictions['speed']:
      self.assertGreaterEqual(row['aux']['speed/num_steps'],
                              row['aux']['speed/num_tokens'])
      self.assertEqual(row['aux']['speed/pipelined'], 1)
    for row in predictions['speed_sample']:
      self.assertBetween(row['aux']['scores'], -1e6, 0.0)
      self.assertEqual(row['aux']['speed/pipelined'], 1)
    for row in predictions['beam_search']:
      self.assertIsInstance(row['prediction'], str)
      self.assertNotIn('speed/num_steps', row['aux'])


def _safe(fn):
  """fn()'s result, or the exception it raised (for a test to re-raise)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    return e


if __name__ == '__main__':
  absltest.main()
