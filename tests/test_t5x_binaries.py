"""End to end through T5X's stock train / eval / infer binaries.

The binaries run t5x_speed as a user installs it: built into a wheel and
installed into a fresh venv beside T5X (`helpers.installed_package`), run
from a directory outside the checkout, with the gin files named as installed
(`t5x_speed/gin/...`, found on T5X's default search path). Each binary runs
as `python -m t5x.<binary>` does, in a fork of one server process that has
imported T5X's libraries (`t5x_helpers.BinaryServer`). One trained
checkpoint serves every test: T5X's own tiny decoder-only model
(t5x/examples/decoder_only/models/base.gin), trained with the stock
`t5x.train` on a seqio task built here (local text, a SentencePiece model
trained here). From it:

* `t5x.infer` restores it through
  t5x_speed/gin/models/decoder_only/t5x_base.gin and decodes greedily: the
  predictions are T5X's model's own (its sampler at temperature 0), and our
  model scores like T5X's;
* t5x_speed/gin/runs/warm_start_from_t5x.gin starts a 2x3 shared model from
  its first two layers, and t5x_speed/gin/runs/finetune.gin trains that
  further, counting its steps and warmup from the restored step;
* the finetuned shared model is evaluated (the task metric with SPEED's
  statistics, and per-exit metrics) and decoded by `t5x.infer` once with
  SPEED and once with greedy decoding: the prediction files must be
  identical, and SPEED's statistics are written as metrics; then with T5X's
  beam search and multi-sample decoding, and with exact SPEED sampling;
* t5x_speed/gin/runs/finetune_agree.gin adds exit adapters to it and trains
  them alone: the rest is kept bit for bit, the exits flip less, and SPEED
  on the result decodes greedy's predictions.

Skipped when T5X is absent (it is not on PyPI).
"""

from concurrent import futures
import functools
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
from t5x import adafactor  # pylint: disable=g-import-not-at-top
from t5x import models as t5x_models  # pylint: disable=g-import-not-at-top
from t5x.examples.decoder_only import network as t5x_network  # pylint: disable=g-import-not-at-top

from t5x_speed import decoding  # pylint: disable=g-import-not-at-top
from t5x_speed import models  # pylint: disable=g-import-not-at-top
from t5x_speed import network  # pylint: disable=g-import-not-at-top
import helpers  # pylint: disable=g-import-not-at-top
import t5x_helpers as th  # pylint: disable=g-import-not-at-top

STEPS = 30      # T5X's model
FT_STEPS = 4    # the shared model's finetuning, after its one warm-start step
AGREE_STEPS = 20  # runs/finetune_agree.gin's exit adapters, after that
AGREE_RANK = 4
SIZES = dict(vocab_size=128, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
LAYERS = 3
# T5X's own gin files, by path: T5X ships them as data, not as packages.
T5X_GIN = pathlib.Path(t5x.__file__).resolve().parents[1]
T5X_MODEL = T5X_GIN / 't5x/examples/decoder_only/models/base.gin'
MODEL = 't5x_speed/gin/models/decoder_only/speed_4x3.gin'
VOCAB = seqio.PassThroughVocabulary(SIZES['vocab_size'], eos_id=1)


def _t5x_bindings(root):
  """T5X's base.gin at tiny size, float32, with the test's vocabulary."""
  return [f'network.TransformerConfig.{k} = {v}' for k, v in SIZES.items()
         ] + [f'network.TransformerConfig.num_layers = {LAYERS}',
              "network.TransformerConfig.dtype = 'float32'",
              'DROPOUT_RATE = 0.0',
              "seqio.SentencePieceVocabulary.sentencepiece_model_file = "
              f"'{root}/spm.model'"] + th.reverse_task_bindings()


def _our_bindings(root, unique_layers=2, repeats=3):
  return [f'network.TransformerConfig.{k} = {v}' for k, v in SIZES.items()
         ] + [f'NUM_UNIQUE_LAYERS = {unique_layers}',
              f'NUM_REPEATS = {repeats}', "ACTIVATION_DTYPE = 'float32'",
              f"SENTENCEPIECE_MODEL = '{root}/spm.model'"
             ] + th.reverse_task_bindings()


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


class StockBinariesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = root = tempfile.mkdtemp()
    th.write_reverse_task(root)
    # Every binary runs in a fork of one server under the installed
    # package's interpreter, from a directory outside the checkout.
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
    cls.ft_checkpoint = os.path.join(root, 'finetune',
                                     f'checkpoint_{STEPS + 1 + FT_STEPS}')
    cls.agree_checkpoint = os.path.join(
        root, 'agree', f'checkpoint_{STEPS + 1 + FT_STEPS + AGREE_STEPS}')
    # The binaries that read the checkpoint start now, two at a time (each
    # keeps about one core busy importing and tracing); the finetuning waits
    # for the warm start. Each test waits for its own runs and raises their
    # failure.
    cls.pool = futures.ThreadPoolExecutor(2)
    cls.runs = {name: cls.pool.submit(run) for name, run in (
        ('warm_start', cls._warm_start), ('infer_t5x', cls._infer_t5x),
        ('infer_ours', cls._infer_ours), ('finetune', cls._finetune),
        ('infer_greedy', cls._infer_greedy),
        ('agree', cls._finetune_agree))}

  @classmethod
  def tearDownClass(cls):
    cls.pool.shutdown(cancel_futures=True)
    super().tearDownClass()

  @classmethod
  def _infer_t5x(cls):
    th.run_t5x(
        cls.server, 'infer',
        [T5X_MODEL, T5X_GIN / 't5x/configs/runs/infer.gin'],
        _t5x_bindings(cls.root) + [
            f"CHECKPOINT_PATH = '{cls.checkpoint}'",
            f"INFER_OUTPUT_DIR = '{cls.root}/infer_t5x'",
            'decoding.temperature_sample.temperature = 0.0',
            'decoding.temperature_sample.topk = 1',
            'utils.DatasetConfig.batch_size = 4'], search_paths=(T5X_GIN,))

  @classmethod
  def _infer_ours(cls):
    th.run_t5x(
        cls.server, 'infer', ['t5x_speed/gin/models/decoder_only/t5x_base.gin',
                              't5x_speed/gin/runs/infer.gin'],
        _our_bindings(cls.root, unique_layers=LAYERS, repeats=1) + [
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
            'FINETUNE_STEPS = 1', 'INPUTS_BIDIRECTIONAL_ATTENTION = False',
            'utils.create_learning_rate_scheduler.base_learning_rate = 0.0'])

  @classmethod
  def _finetune(cls):
    cls.runs['warm_start'].result()
    th.run_t5x(
        cls.server, 'train', [MODEL, 't5x_speed/gin/runs/finetune.gin'],
        _our_bindings(cls.root) + th.TRAIN_SEEDS + [
            f"MODEL_DIR = '{cls.root}/finetune'",
            f"INITIAL_CHECKPOINT_PATH = '{cls.warm_checkpoint}'",
            f'FINETUNE_STEPS = {FT_STEPS}'])

  @classmethod
  def _infer_greedy(cls):
    """The finetuned model's greedy predictions (SPEED's must equal them)."""
    cls.runs['finetune'].result()
    out = os.path.join(cls.root, 'infer_greedy')
    th.run_t5x(
        cls.server, 'infer', [MODEL, 't5x_speed/gin/runs/infer.gin'],
        _our_bindings(cls.root) + [
            f"CHECKPOINT_PATH = '{cls.ft_checkpoint}'",
            f"INFER_OUTPUT_DIR = '{out}'",
            'utils.DatasetConfig.batch_size = 4',
            'DECODING_FN = @decoding.greedy_decode'])
    return th.prediction_rows(out)

  @classmethod
  def _finetune_agree(cls):
    cls.runs['finetune'].result()
    th.run_t5x(
        cls.server, 'train', [MODEL, 't5x_speed/gin/runs/finetune_agree.gin'],
        _our_bindings(cls.root) + th.TRAIN_SEEDS + [
            f"MODEL_DIR = '{cls.root}/agree'",
            f"INITIAL_CHECKPOINT_PATH = '{cls.ft_checkpoint}'",
            f'FINETUNE_STEPS = {AGREE_STEPS}',
            f'EXIT_ADAPTER_RANK = {AGREE_RANK}', 'LEARNING_RATE = 1e-2'])
    th.run_t5x(
        cls.server, 'infer', [MODEL, 't5x_speed/gin/runs/infer.gin'],
        _our_bindings(cls.root) + [
            f"CHECKPOINT_PATH = '{cls.agree_checkpoint}'",
            f"INFER_OUTPUT_DIR = '{cls.root}/infer_agree'",
            f'EXIT_ADAPTER_RANK = {AGREE_RANK}',
            'utils.DatasetConfig.batch_size = 2'])

  def test_restores_into_base_12l_and_decodes_as_t5x(self):
    # Scores: the restored parameters in both models (while the binaries
    # run), each method jitted as T5X's binaries jit it.
    our_model, t5x_model = _our_model(LAYERS, 1), _t5x_model()
    params = th.checkpoint_params(self.checkpoint)
    batch = th.prefix_lm_batch(seed=3, batch=6)
    np.testing.assert_allclose(jax.jit(our_model.score_batch)(params, batch),
                               jax.jit(t5x_model.score_batch)(params, batch),
                               rtol=1e-5)
    np.testing.assert_array_equal(
        jax.jit(our_model.predict_batch)(params, batch),
        jax.jit(t5x_model.predict_batch)(params, batch))

    self.runs['infer_t5x'].result()
    self.runs['infer_ours'].result()
    text = lambda rows: [(r['inputs'], r['prediction']) for r in rows]
    theirs = text(th.prediction_rows(os.path.join(self.root, 'infer_t5x')))
    ours = text(th.prediction_rows(os.path.join(self.root, 'infer_ours')))
    self.assertLen(ours, 12)
    self.assertEqual(ours, theirs)
    self.assertTrue(any(p for _, p in ours))

  def test_warm_start_of_a_shared_model_from_the_first_layers(self):
    self.runs['warm_start'].result()
    # The shared model's training writes every exit's metrics.
    scalars = th.tensorboard_scalars(os.path.join(self.root, 'warm_start',
                                                  'train'))
    for tag in ('exit_1/loss', 'exit_3/loss', 'exit_1/accuracy',
                'exit_3/accuracy', 'exit_2/flip_rate', 'exit_3/flip_rate',
                'loss', 'accuracy'):
      self.assertIn(tag, scalars)
    source = th.checkpoint_params(self.checkpoint)
    warm = th.checkpoint_params(self.warm_checkpoint)
    self.assertEqual(sorted(warm['decoder']),
                     ['decoder_norm', 'layers_0', 'layers_1', 'relpos_bias',
                      'token_embedder'])
    for name in warm['decoder']:
      for (path, a), (source_path, b) in zip(
          th.tree_leaves(warm['decoder'][name]),
          th.tree_leaves(source['decoder'][name])):
        self.assertEqual(path, source_path)
        # One Adafactor step at learning rate 0 moves them by float32
        # rounding only (a fresh initialisation would differ entirely).
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7,
                                   err_msg=f'{name}{path}')

  def test_finetune_eval_infer_speed_equals_greedy(self):
    self.runs['finetune'].result()
    root, checkpoint = self.root, self.ft_checkpoint
    self.assertTrue(os.path.isdir(checkpoint))
    # Finetuning counts its warmup from the restored step: constant 1e-3 *
    # linear warmup over 1,000 steps counted from step STEPS + 1. The rate
    # logged at the end is the last update's, made from step
    # STEPS + FT_STEPS (without the offset it would be 1e-3 * 34 / 1000).
    lr = th.tensorboard_scalars(os.path.join(root, 'finetune', 'train'))[
        'learning_rate/current']
    self.assertAlmostEqual(lr[STEPS + 1 + FT_STEPS],
                           1e-3 * (FT_STEPS - 1) / 1000, delta=1e-10)

    # Evaluation and the five decodings, each from the finetuned checkpoint.
    eval_dir = os.path.join(root, 'eval')
    # SPEED pipelines by default at 2 examples x R = 6 rows; SPEED sampling's
    # 4 x 2 samples x R rows need the explicit binding.
    decodings = {  # name: (extra gin files, extra bindings)
        'speed': ([], ['utils.DatasetConfig.batch_size = 2']),
        'beam_search': (['decoding/beam_search.gin'], []),
        'sample': (['decoding/sample.gin'], []),
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
            _our_bindings(root) + [
                f"CHECKPOINT_PATH = '{checkpoint}'",
                f"EVAL_OUTPUT_DIR = '{eval_dir}'"]),
        *[functools.partial(infer, name) for name in decodings])
    predictions = dict(zip(decodings, results[1:]),
                       greedy=self.runs['infer_greedy'].result())
    # t5x.eval: the task metric with SPEED's statistics over the split
    # (tasks/metrics.py), and each exit's loss, accuracy and flip rate from
    # the training evaluator.
    eval_scalars = {}
    for events in glob.glob(os.path.join(eval_dir, '**', 'events.out.*'),
                            recursive=True):
      for tag, values in th.tensorboard_scalars(
          os.path.dirname(events)).items():
        eval_scalars[os.path.relpath(os.path.dirname(events), eval_dir) + ':'
                     + tag] = values
    tags = {t.split(':', 1)[1] for t in eval_scalars}
    for tag in ('exact_match', 'speed/steps_per_token', 'speed/flushes',
                'speed/flip_rate/stage_3', 'exit_1/loss', 'exit_3/loss',
                'exit_1/accuracy', 'exit_3/flip_rate'):
      self.assertTrue(any(t.endswith(tag) for t in tags), (tag, tags))
    steps_per_token = [v for t, v in eval_scalars.items()
                       if t.endswith('speed/steps_per_token')][0]
    self.assertGreaterEqual(min(steps_per_token.values()), 1.0)
    self.assertLen(predictions['speed'], 12)
    text = lambda rows: [(r['inputs'], r['prediction']) for r in rows]
    self.assertEqual(text(predictions['speed']), text(predictions['greedy']))
    self.assertTrue(any(p['prediction'] for p in predictions['speed']))
    # predict_with_aux (infer.gin) writes SPEED's statistics per example.
    for row in predictions['speed']:
      self.assertGreaterEqual(row['aux']['speed/num_steps'],
                              row['aux']['speed/num_tokens'])
      self.assertEqual(row['aux']['speed/pipelined'], 1)
    self.assertNotIn('speed/num_steps', predictions['greedy'][0]['aux'])
    # ... and their sums as metrics (infer.gin's write_fn).
    with open(os.path.join(root, 'infer_speed', 'speed_statistics.jsonl')) as f:
      (summary,) = [json.loads(line) for line in f]
    total = lambda field: sum(r['aux'][f'speed/{field}']
                              for r in predictions['speed'])
    self.assertAlmostEqual(summary['speed/steps_per_token'],
                           total('num_steps') / total('num_tokens'))
    self.assertEqual(summary['speed/tokens'], total('num_tokens'))
    self.assertIn('speed/flip_rate/stage_2', summary)
    self.assertIn('speed/steps_per_token', th.tensorboard_scalars(
        os.path.join(root, 'infer_speed', 'speed_statistics')))
    self.assertFalse(os.path.exists(
        os.path.join(root, 'infer_greedy', 'speed_statistics.jsonl')))

    # Exact SPEED sampling (2 samples per example, top-p 0.9): the best
    # sample's log-probability and SPEED's statistics, summed over samples.
    rows = predictions['speed_sample']
    self.assertLen(rows, 12)
    for row in rows:
      self.assertBetween(row['aux']['scores'], -1e6, 0.0)
      self.assertGreaterEqual(row['aux']['speed/num_steps'],
                              row['aux']['speed/num_tokens'])
      self.assertEqual(row['aux']['speed/invalid'], 0)
      self.assertEqual(row['aux']['speed/pipelined'], 1)
    with open(os.path.join(root, 'infer_speed_sample',
                           'speed_statistics.jsonl')) as f:
      (summary,) = [json.loads(line) for line in f]
    self.assertEqual(summary['speed/tokens'],
                     sum(r['aux']['speed/num_tokens'] for r in rows))

    # T5X's beam search and multi-sample decoding on the shared model.
    for name in ('beam_search', 'sample'):
      rows = predictions[name]
      self.assertLen(rows, 12)
      self.assertEqual([r['inputs'] for r in rows],
                       [r['inputs'] for r in predictions['speed']])
      # (This barely trained model's best beam is often EOS at once: its
      # length-penalised score, about -1, beats greedy's long outputs.)
      for row in rows:
        self.assertIsInstance(row['prediction'], str)
        self.assertBetween(row['aux']['scores'], -1e6, 0.0)
        self.assertNotIn('speed/num_steps', row['aux'])

  def test_finetune_agree_trains_the_exit_adapters_alone(self):
    """runs/finetune_agree.gin adds exit adapters to the finetuned shared
    model and trains them alone: every parameter of the checkpoint is kept
    bit for bit, the exits flip less on the task's validation examples, and
    SPEED decodes the result as greedy decoded the checkpoint."""
    self.runs['agree'].result()
    before = th.checkpoint_params(self.ft_checkpoint)
    after = th.checkpoint_params(self.agree_checkpoint)
    adapters = after['decoder'].pop('exit_adapters')
    self.assertEqual([p for p, _ in th.tree_leaves(after)],
                     [p for p, _ in th.tree_leaves(before)])
    for (path, a), (_, b) in zip(th.tree_leaves(after),
                                 th.tree_leaves(before)):
      np.testing.assert_array_equal(a, b, err_msg=path)
    self.assertEqual(adapters['down'].shape, (2, SIZES['emb_dim'],
                                              AGREE_RANK))
    self.assertFalse(np.all(adapters['up'] == 0))
    batch = th.reverse_task_batch(self.root, 'validation')
    module = network.SpeedTransformer(network.TransformerConfig(
        num_unique_layers=2, num_repeats=3, dtype='float32',
        exit_adapter_rank=AGREE_RANK, **SIZES))
    untrained = {**adapters, 'scale': np.ones_like(adapters['scale']),
                 'up': np.zeros_like(adapters['up'])}
    flips = [th.teacher_forced_flips(module, {'decoder': {
        **after['decoder'], 'exit_adapters': a}}, batch)
             for a in (untrained, adapters)]
    self.assertLess(sum(flips[1]), sum(flips[0]), flips)
    greedy = self.runs['infer_greedy'].result()
    speed = th.prediction_rows(os.path.join(self.root, 'infer_agree'))
    text = lambda rows: [(r['inputs'], r['prediction']) for r in rows]
    self.assertEqual(text(speed), text(greedy))
    self.assertTrue(all(r['aux']['speed/pipelined'] for r in speed))


if __name__ == '__main__':
  absltest.main()
