"""End to end through T5X's stock train / eval / infer binaries.

Trains a tiny 2x3 shared model on a seqio task built here (local text, a
SentencePiece model trained here), evaluates it, and runs inference once with
SPEED and once with greedy decoding: the prediction files must be identical.
Skipped when T5X is absent (it is not on PyPI).
"""

import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest
import pytest

pytest.importorskip('t5x')
import sentencepiece as spm  # pylint: disable=g-import-not-at-top
import tensorflow as tf

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 40
TASK_MODULE = textwrap.dedent('''\
    """A tiny seqio task for the binaries test: reverse a list of words."""
    import functools
    import os
    import seqio
    import tensorflow as tf

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
        metric_fns=[exact_match])
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
  with open(os.path.join(root, 'text.txt'), 'w') as f:
    f.write('\n'.join(lines))
  spm.SentencePieceTrainer.train(
      input=os.path.join(root, 'text.txt'),
      model_prefix=os.path.join(root, 'spm'), vocab_size=32, pad_id=0,
      eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
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


def _write_train_overrides(root: str) -> str:
  """Binds `__main__.train` arguments, which flags cannot name by alias."""
  path = os.path.join(root, 'train_overrides.gin')
  with open(path, 'w') as f:
    f.write(textwrap.dedent(f'''\
        from __gin__ import dynamic_registration
        import __main__ as train_script
        train_script.train:
          eval_period = {STEPS // 2}
          eval_steps = 2
        '''))
  return path


def _run(binary: str, root: str, files, bindings, extra_files=()):
  cmd = [sys.executable, '-m', f't5x.{binary}']
  cmd += [f'--gin_file={REPO / "gin" / f}' for f in files]
  cmd += [f'--gin_file={f}' for f in extra_files]
  cmd += [f'--gin.{b}' for b in _tiny_bindings(root) + bindings]
  cmd += [f'--gin_search_paths={REPO}', '--alsologtostderr']
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root, os.environ.get('PYTHONPATH', '')]), CUDA_VISIBLE_DEVICES='',
             JAX_PLATFORMS='cpu', XLA_FLAGS='')
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=900)
  if proc.returncode:
    raise AssertionError(f'{binary} failed:\n{proc.stderr[-6000:]}')
  return proc


def _scalar_tags(event_dir: str):
  tags = set()
  for path in glob.glob(os.path.join(event_dir, 'events.out.tfevents*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  return tags


class StockBinariesTest(absltest.TestCase):

  def test_train_eval_infer_speed_equals_greedy(self):
    root = tempfile.mkdtemp()
    _write_data(root)
    model_dir = os.path.join(root, 'model')
    model = 'models/speed_base_4x3.gin'
    _run('train', root, [model, 'runs/pretrain_c4.gin'], [
        f"MODEL_DIR = '{model_dir}'", f'TRAIN_STEPS = {STEPS}',
        'BATCH_SIZE = 8', 'USE_CACHED_TASKS = False',
        f'utils.SaveCheckpointConfig.period = {STEPS}',
        'utils.create_learning_rate_scheduler.warmup_steps = 100'],
         extra_files=[_write_train_overrides(root)])
    checkpoint = os.path.join(model_dir, f'checkpoint_{STEPS}')
    self.assertTrue(os.path.isdir(checkpoint))
    tags = _scalar_tags(os.path.join(model_dir, 'train'))
    for tag in ('exit_1/loss', 'exit_3/loss', 'exit_1/accuracy',
                'exit_3/accuracy', 'exit_2/flip_rate', 'exit_3/flip_rate',
                'loss', 'accuracy'):
      self.assertIn(tag, tags)

    eval_dir = os.path.join(root, 'eval')
    _run('eval', root, [model, 'runs/eval.gin'], [
        f"CHECKPOINT_PATH = '{checkpoint}'", f"EVAL_OUTPUT_DIR = '{eval_dir}'"])
    self.assertTrue(glob.glob(os.path.join(eval_dir, '**', '*'),
                              recursive=True))

    predictions = {}
    for name, flag in (('speed', []),
                       ('greedy', ['DECODING_FN = @decoding.greedy_decode'])):
      out = os.path.join(root, f'infer_{name}')
      _run('infer', root, [model, 'runs/infer.gin'], [
          f"CHECKPOINT_PATH = '{checkpoint}'", f"INFER_OUTPUT_DIR = '{out}'",
          'utils.DatasetConfig.batch_size = 4'] + flag)
      files = [f for f in glob.glob(os.path.join(out, 'e2e_reverse-*.jsonl*'))
               if not f.endswith('.COMPLETED')]
      self.assertLen(files, 1)
      with open(files[0]) as f:
        predictions[name] = [json.loads(line) for line in f]
    self.assertLen(predictions['speed'], 12)
    self.assertEqual(predictions['speed'], predictions['greedy'])
    self.assertTrue(any(p['prediction'] for p in predictions['speed']))


if __name__ == '__main__':
  absltest.main()
