"""Checkpoints of T5X's own decoder-only model, through our gin files.

Trains T5X's tiny decoder-only model (t5x/examples/decoder_only/models/
base.gin at tiny size) with the stock `t5x.train`, then:

* `t5x.infer` restores it through t5x_speed/gin/models/t5x_base_12l.gin and decodes
  greedily: the predictions are T5X's model's own (its sampler at
  temperature 0), and our model scores like T5X's;
* t5x_speed/gin/runs/warm_start_from_t5x.gin starts a 2x3 shared model from its first
  two layers.

Skipped when T5X is absent (it is not on PyPI).
"""

from concurrent import futures
import glob
import json
import os
import pathlib
import tempfile

from absl.testing import absltest
import jax
import numpy as np
import pytest

t5x = pytest.importorskip('t5x')
import seqio  # pylint: disable=g-import-not-at-top
from t5x import adafactor
import orbax.checkpoint as ocp
from t5x import models as t5x_models
from t5x.examples.decoder_only import network as t5x_network

from t5x_speed import decoding
from t5x_speed import models
from t5x_speed import network
import t5x_helpers as th
import test_t5x_binaries as binaries

REPO = pathlib.Path(__file__).resolve().parents[1]
T5X_GIN = pathlib.Path(t5x.__file__).resolve().parents[1]
STEPS = 30
SIZES = dict(vocab_size=128, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
LAYERS = 3


def _run(binary: str, root: str, gin_files, bindings):
  th.run_t5x(binary, root, gin_files, bindings, search_paths=(T5X_GIN,))


def _task():
  return ["MIXTURE_OR_TASK_NAME = 'e2e_reverse'",
          "MIXTURE_OR_TASK_MODULE = 'e2e_tasks'",
          "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 16}",
          'USE_CACHED_TASKS = False']


def _t5x_bindings(root):
  """T5X's base.gin at tiny size, float32, with the test's vocabulary."""
  return [f'network.TransformerConfig.{k} = {v}' for k, v in SIZES.items()
         ] + [f'network.TransformerConfig.num_layers = {LAYERS}',
              "network.TransformerConfig.dtype = 'float32'",
              "seqio.SentencePieceVocabulary.sentencepiece_model_file = "
              f"'{root}/spm.model'"] + _task()


def _our_bindings(root, unique_layers=LAYERS, repeats=1):
  return [f'network.TransformerConfig.{k} = {v}' for k, v in SIZES.items()
         ] + [f'NUM_UNIQUE_LAYERS = {unique_layers}',
              f'NUM_REPEATS = {repeats}', "ACTIVATION_DTYPE = 'float32'",
              f"SENTENCEPIECE_MODEL = '{root}/spm.model'"] + _task()


VOCAB = seqio.PassThroughVocabulary(SIZES['vocab_size'], eos_id=1)


def _our_model(unique_layers, repeats):
  return models.SpeedDecoderOnlyModel(
      network.SpeedTransformer(network.TransformerConfig(
          num_unique_layers=unique_layers, num_repeats=repeats,
          dtype='float32', **SIZES)), VOCAB, adafactor.Adafactor(),
      decode_fn=decoding.greedy_decode)


def _t5x_model():
  return t5x_models.DecoderOnlyModel(
      t5x_network.DecoderWrapper(t5x_network.TransformerConfig(
          num_layers=LAYERS, dtype='float32', logits_via_embedding=True,
          dropout_rate=0.0, mlp_activations=('gelu', 'linear'), **SIZES)),
      VOCAB, adafactor.Adafactor(), decode_fn=th.T5X_GREEDY)


def _checkpoint_params(path):
  """The parameters saved in checkpoint directory `path` (T5X's Orbax format)."""
  return ocp.PyTreeCheckpointer().restore(os.path.join(path, 'state'))['target']


def _predictions(out_dir):
  files = [f for f in glob.glob(os.path.join(out_dir, 'e2e_reverse-*.jsonl*'))
           if not f.endswith('.COMPLETED')]
  assert len(files) == 1, files
  with open(files[0]) as f:
    return [(r['inputs'], r['prediction']) for r in map(json.loads, f)]


class StockT5XCheckpointTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = tempfile.mkdtemp()
    binaries._write_data(cls.root)  # pylint: disable=protected-access
    model_dir = os.path.join(cls.root, 't5x_model')
    _run('train', cls.root, [
        T5X_GIN / 't5x/examples/decoder_only/models/base.gin',
        T5X_GIN / 't5x/configs/runs/pretrain.gin'],
         _t5x_bindings(cls.root) + [
             f"MODEL_DIR = '{model_dir}'", f'TRAIN_STEPS = {STEPS}',
             'BATCH_SIZE = 8', 'DROPOUT_RATE = 0.0',
             "utils.create_learning_rate_scheduler.factors = 'constant'",
             'utils.create_learning_rate_scheduler.base_learning_rate = 0.01'])
    cls.checkpoint = os.path.join(model_dir, f'checkpoint_{STEPS}')
    assert os.path.isdir(cls.checkpoint), os.listdir(model_dir)
    # The binaries that read the checkpoint are independent: all start now
    # (each keeps about one core busy importing and tracing), and each test
    # waits for its own, whose failure it raises.
    runs = cls._binary_runs()
    cls.pool = futures.ThreadPoolExecutor(len(runs))
    cls.runs = {name: cls.pool.submit(_run, *args)
                for name, args in runs.items()}

  @classmethod
  def tearDownClass(cls):
    cls.pool.shutdown(cancel_futures=True)
    super().tearDownClass()

  @classmethod
  def _binary_runs(cls):
    """{name: _run's arguments} of the binaries that read the checkpoint."""
    root, checkpoint = cls.root, cls.checkpoint
    return {
        'infer_t5x': ('infer', root, [
            T5X_GIN / 't5x/examples/decoder_only/models/base.gin',
            T5X_GIN / 't5x/configs/runs/infer.gin'],
                      _t5x_bindings(root) + [
                          f"CHECKPOINT_PATH = '{checkpoint}'",
                          f"INFER_OUTPUT_DIR = '{root}/infer_t5x'",
                          'DROPOUT_RATE = 0.0',
                          'decoding.temperature_sample.temperature = 0.0',
                          'decoding.temperature_sample.topk = 1',
                          'utils.DatasetConfig.batch_size = 4']),
        'infer_ours': ('infer', root, [
            REPO / 't5x_speed/gin/models/t5x_base_12l.gin',
            REPO / 't5x_speed/gin/runs/infer.gin'],
                       _our_bindings(root) + [
                           f"CHECKPOINT_PATH = '{checkpoint}'",
                           f"INFER_OUTPUT_DIR = '{root}/infer_ours'",
                           'utils.DatasetConfig.batch_size = 4']),
        # A zero learning rate keeps the restored parameters as they are.
        'warm_start': ('train', root, [
            REPO / 't5x_speed/gin/models/speed_base_4x3.gin',
            REPO / 't5x_speed/gin/runs/warm_start_from_t5x.gin'],
                       _our_bindings(root, unique_layers=2, repeats=3) + [
                           f"MODEL_DIR = '{root}/warm_start'",
                           'BATCH_SIZE = 8',
                           f"INITIAL_CHECKPOINT_PATH = '{checkpoint}'",
                           'FINETUNE_STEPS = 1',
                           'INPUTS_BIDIRECTIONAL_ATTENTION = False',
                           'utils.create_learning_rate_scheduler.'
                           'base_learning_rate = 0.0']),
    }

  def test_restores_into_base_12l_and_decodes_as_t5x(self):
    # Scores: the restored parameters in both models (while the binaries
    # run), each method jitted as T5X's binaries jit it.
    our_model, t5x_model = _our_model(LAYERS, 1), _t5x_model()
    params = _checkpoint_params(self.checkpoint)
    batch = th.prefix_lm_batch(seed=3, batch=6)
    np.testing.assert_allclose(jax.jit(our_model.score_batch)(params, batch),
                               jax.jit(t5x_model.score_batch)(params, batch),
                               rtol=1e-5)
    np.testing.assert_array_equal(
        jax.jit(our_model.predict_batch)(params, batch),
        jax.jit(t5x_model.predict_batch)(params, batch))

    self.runs['infer_t5x'].result()
    self.runs['infer_ours'].result()
    theirs = _predictions(os.path.join(self.root, 'infer_t5x'))
    ours = _predictions(os.path.join(self.root, 'infer_ours'))
    self.assertLen(ours, 12)
    self.assertEqual(ours, theirs)
    self.assertTrue(any(p for _, p in ours))

  def test_warm_start_of_a_shared_model_from_the_first_layers(self):
    self.runs['warm_start'].result()
    source = _checkpoint_params(self.checkpoint)
    warm = _checkpoint_params(os.path.join(self.root, 'warm_start',
                                           f'checkpoint_{STEPS + 1}'))
    self.assertEqual(sorted(warm['decoder']),
                     ['decoder_norm', 'layers_0', 'layers_1', 'relpos_bias',
                      'token_embedder'])
    for name in warm['decoder']:
      for (path, a), (source_path, b) in zip(
          _leaves(warm['decoder'][name]), _leaves(source['decoder'][name])):
        self.assertEqual(path, source_path)
        # One Adafactor step at learning rate 0 moves them by float32
        # rounding only (a fresh initialisation would differ entirely).
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7,
                                   err_msg=f'{name}{path}')


def _leaves(tree, prefix=''):
  if isinstance(tree, dict):
    for k in sorted(tree):
      yield from _leaves(tree[k], f'{prefix}/{k}')
  else:
    yield prefix, np.asarray(tree)


if __name__ == '__main__':
  absltest.main()
