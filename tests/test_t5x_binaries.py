"""End to end through T5X's stock train / eval / infer binaries.

The binaries run t5x_speed as a user installs it: built into a wheel and
installed into a fresh venv beside T5X (`helpers.installed_package`), run
from a directory outside the checkout, with the gin files named as installed
(`t5x_speed/gin/...`, found on T5X's default search path). Trains a tiny 2x3 shared model on a seqio task built here (local text, a
SentencePiece model trained here), evaluates it (the task metric with SPEED's
statistics, and per-exit metrics), and runs inference once with SPEED and
once with greedy decoding: the prediction files must be identical, and
SPEED's statistics are written as metrics; then with T5X's beam search and
multi-sample decoding, and with exact SPEED sampling.
Skipped when T5X is absent (it is not on PyPI).
"""

import functools
import glob
import json
import os
import tempfile
import textwrap

from absl.testing import absltest
import pytest

pytest.importorskip('t5x')
import tensorflow as tf

import helpers  # pylint: disable=g-import-not-at-top
import t5x_helpers as th  # pylint: disable=g-import-not-at-top

STEPS = 40
FT_STEPS = 4
TASK_MODULE = textwrap.dedent('''\
    """A tiny seqio task for the binaries test: reverse a list of words."""
    import functools
    import os
    import seqio
    import tensorflow as tf
    from t5x_speed.tasks import metrics

    DATA = os.path.dirname(os.path.abspath(__file__))
    VOCAB = seqio.SentencePieceVocabulary(os.path.join(DATA, 'spm.model'))

    def parse(ds):
      def fn(line):
        inputs, targets = tf.strings.split(line, '\\t')[0], tf.strings.split(
            line, '\\t')[1]
        return {'inputs': inputs, 'targets': targets}
      return ds.map(fn, num_parallel_calls=tf.data.AUTOTUNE)

    def exact_match(targets, predictions):
      hits = sum(t == p for t, p in zip(targets, predictions))
      return {'exact_match': 100.0 * hits / max(len(targets), 1)}

    seqio.TaskRegistry.add(
        'e2e_reverse',
        source=seqio.TextLineDataSource({
            split: os.path.join(DATA, f'{split}.tsv')
            for split in ('train', 'validation', 'test')}),
        preprocessors=[parse, seqio.preprocessors.tokenize,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={
            'inputs': seqio.Feature(VOCAB, add_eos=True),
            'targets': seqio.Feature(VOCAB, add_eos=True)},
        metric_fns=[metrics.with_speed_statistics(exact_match)])
    ''')
WORDS = ('red green blue black white cat dog bird fish tree house car road '
         'sun moon star').split()


def _write_data(root: str):
  rng = __import__('random').Random(0)
  sizes = {'train': 400, 'validation': 16, 'test': 12}
  lines = []
  for split, n in sizes.items():
    with open(os.path.join(root, f'{split}.tsv'), 'w') as f:
      for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        line = f"{' '.join(words)}\t{' '.join(reversed(words))}"
        f.write(line + '\n')
        lines.append(line.replace('\t', ' '))
  helpers.train_sentencepiece(root, lines, vocab_size=32)
  with open(os.path.join(root, 'e2e_tasks.py'), 'w') as f:
    f.write(TASK_MODULE)


def _tiny_bindings(root: str):
  return [
      'NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3',
      'network.TransformerConfig.vocab_size = 128',
      'network.TransformerConfig.emb_dim = 32',
      'network.TransformerConfig.num_heads = 2',
      'network.TransformerConfig.head_dim = 16',
      'network.TransformerConfig.mlp_dim = 64',
      "ACTIVATION_DTYPE = 'float32'",
      f"SENTENCEPIECE_MODEL = '{root}/spm.model'",
      "MIXTURE_OR_TASK_NAME = 'e2e_reverse'",
      "MIXTURE_OR_TASK_MODULE = 'e2e_tasks'",
      "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 16}",
  ]


def _run(binary: str, root: str, files, bindings):
  return th.run_t5x(binary, root, [f't5x_speed/gin/{f}' for f in files],
                    _tiny_bindings(root) + bindings, search_paths=(),
                    python=helpers.installed_package().python, cwd=root)


def _scalars(event_dir: str):
  """{tag: {step: value}} of the TensorBoard scalars in event_dir."""
  scalars = {}
  for path in glob.glob(os.path.join(event_dir, 'events.out.tfevents*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        if v.HasField('simple_value'):
          value = v.simple_value
        else:
          value = tf.make_ndarray(v.tensor)
          if value.ndim or value.dtype.kind not in 'fiu':
            continue  # text summaries (the gin config)
        scalars.setdefault(v.tag, {})[event.step] = float(value)
  return scalars


class StockBinariesTest(absltest.TestCase):

  def test_train_eval_infer_speed_equals_greedy(self):
    root = tempfile.mkdtemp()
    _write_data(root)
    model_dir = os.path.join(root, 'model')
    model = 'models/speed_base_4x3.gin'
    # The run files as shipped (eval period, uncached data, schedule); only
    # sizes, steps and the task differ.
    _run('train', root, [model, 'runs/pretrain_c4.gin'], [
        f"MODEL_DIR = '{model_dir}'", f'TRAIN_STEPS = {STEPS}',
        'BATCH_SIZE = 8'])
    pretrained = os.path.join(model_dir, f'checkpoint_{STEPS}')
    self.assertTrue(os.path.isdir(pretrained))
    scalars = _scalars(os.path.join(model_dir, 'train'))
    for tag in ('exit_1/loss', 'exit_3/loss', 'exit_1/accuracy',
                'exit_3/accuracy', 'exit_2/flip_rate', 'exit_3/flip_rate',
                'loss', 'accuracy'):
      self.assertIn(tag, scalars)

    # Finetuning counts its steps and its warmup from the restored step.
    ft_dir = os.path.join(root, 'finetune')
    _run('train', root, [model, 'runs/finetune.gin'], [
        f"MODEL_DIR = '{ft_dir}'", f"INITIAL_CHECKPOINT_PATH = '{pretrained}'",
        f'FINETUNE_STEPS = {FT_STEPS}', 'BATCH_SIZE = 8'])
    checkpoint = os.path.join(ft_dir, f'checkpoint_{STEPS + FT_STEPS}')
    self.assertTrue(os.path.isdir(checkpoint))
    # constant 1e-3 * linear warmup over 1,000 steps counted from step
    # STEPS: the rate logged at the end is the last update's, made from step
    # STEPS + FT_STEPS - 1 (without the offset it would be 1e-3).
    lr = _scalars(os.path.join(ft_dir, 'train'))['learning_rate/current']
    self.assertAlmostEqual(lr[STEPS + FT_STEPS], 1e-3 * (FT_STEPS - 1) / 1000,
                           delta=1e-10)

    # Evaluation and the four decodings, each from the finetuned checkpoint.
    eval_dir = os.path.join(root, 'eval')
    decodings = {  # name: (extra gin files, extra bindings)
        'speed': ([], []),
        'greedy': ([], ['DECODING_FN = @decoding.greedy_decode']),
        'beam_search': (['decoding/beam_search.gin'], []),
        'sample': (['decoding/sample.gin'], []),
        'speed_sample': (['decoding/speed_sample.gin'],
                         ['NUM_SAMPLES = 2', 'SAMPLE_TOPP = 0.9'])}

    def infer(name):
      out = os.path.join(root, f'infer_{name}')
      files, bindings = decodings[name]
      _run('infer', root, [model, 'runs/infer.gin'] + files, [
          f"CHECKPOINT_PATH = '{checkpoint}'", f"INFER_OUTPUT_DIR = '{out}'",
          'utils.DatasetConfig.batch_size = 4'] + bindings)
      files = [f for f in glob.glob(os.path.join(out, 'e2e_reverse-*.jsonl*'))
               if not f.endswith('.COMPLETED')]
      self.assertLen(files, 1)
      with open(files[0]) as f:
        return [json.loads(line) for line in f]

    results = th.run_concurrently(
        lambda: _run('eval', root, [model, 'runs/eval.gin'], [
            f"CHECKPOINT_PATH = '{checkpoint}'",
            f"EVAL_OUTPUT_DIR = '{eval_dir}'"]),
        *[functools.partial(infer, name) for name in decodings])
    predictions = dict(zip(decodings, results[1:]))
    # t5x.eval: the task metric with SPEED's statistics over the split
    # (tasks/metrics.py), and each exit's loss, accuracy and flip rate from
    # the training evaluator.
    eval_scalars = {}
    for events in glob.glob(os.path.join(eval_dir, '**', 'events.out.*'),
                            recursive=True):
      for tag, values in _scalars(os.path.dirname(events)).items():
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
    self.assertIn('speed/steps_per_token',
                  _scalars(os.path.join(root, 'infer_speed',
                                        'speed_statistics')))
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


if __name__ == '__main__':
  absltest.main()
