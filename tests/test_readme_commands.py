"""Every T5X command in README.md runs as written, through the stock binaries.

The commands are read from the README's ```sh blocks, split into words as
bash splits them, and run from the repository root with the shipped gin
files as `python -m t5x.<binary>` runs them, each in a fork of one server
that has imported T5X's libraries (`t5x_helpers.BinaryServer`, as the
binaries' tests run). The only things appended are size and step overrides
(a tiny width, a few training steps) and paths moved into a temporary
directory, because CI has no GPU, no data and no network:

- the demo's `t5x.train` / `t5x.infer` commands run end to end on the
  generated task and must write predictions with SPEED's statistics;
- the paper's pretrain / finetune / eval / infer commands need TFDS data
  that CI cannot have, so they must stop at the project's clear "not
  prepared" error naming the dataset and the `tfds build` command (not at a
  seqio cache assertion or a T5X configuration error before it);
- T5X_SPEED_VOCAB points at a SentencePiece model trained here, as the
  README says to do offline; the model's vocabulary follows it.
"""

from concurrent import futures
import glob
import json
import os
import pathlib
import re
import shlex
import sys
import tempfile
from typing import List

from absl.testing import absltest
import pytest

pytest.importorskip('t5x')

import helpers  # pylint: disable=g-import-not-at-top
import t5x_helpers as th  # pylint: disable=g-import-not-at-top

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO_STEPS = 20
DEMO_INFER_LENGTHS = {'inputs': 24, 'targets': 32}
# Paths a README command writes or reads, re-rooted under the test's tmp dir.
PATH_MACROS = ('MODEL_DIR', 'INITIAL_CHECKPOINT_PATH', 'CHECKPOINT_PATH',
               'EVAL_OUTPUT_DIR', 'INFER_OUTPUT_DIR')
TINY_MODEL = ['network.TransformerConfig.emb_dim=16',
              'network.TransformerConfig.num_heads=2',
              'network.TransformerConfig.head_dim=8',
              'network.TransformerConfig.mlp_dim=24']


def readme_commands() -> List[str]:
  """The `python -m t5x.*` commands of README.md's sh blocks, one string each."""
  text = (REPO / 'README.md').read_text()
  commands = []
  for block in re.findall(r'```sh\n(.*?)```', text, re.S):
    joined = re.sub(r'\\\n\s*', ' ', block)
    commands += [line.strip() for line in joined.splitlines()
                 if line.strip().startswith('python -m t5x.')]
  return commands


def _gin_value(command: str, macro: str):
  """The value a command binds to `macro` with --gin.MACRO=..., or None."""
  for arg in shlex.split(command):
    if arg.startswith(f'--gin.{macro}='):
      return arg.split('=', 1)[1]
  return None


def _rerooted(command: str, root: str) -> List[str]:
  """--gin flags moving the command's paths under `root`."""
  flags = []
  for macro in PATH_MACROS:
    value = _gin_value(command, macro)
    if value is not None:
      path = value.strip('\'"')
      flags.append(f'--gin.{macro}="\'{root}{path}\'"')
  return flags


def _run(server: th.BinaryServer, command: str, extra_flags: List[str]):
  """`command` (`python -m t5x.<binary> ...`) with `extra_flags`, its words
  split as bash splits them, through `server`."""
  argv = shlex.split(f'{command} {" ".join(extra_flags)}')
  assert argv[:2] == ['python', '-m'], command
  return server.run(argv[2], argv[3:], timeout=900)


class ReadmeCommandsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.commands = readme_commands()
    cls.root = tempfile.mkdtemp()
    cls.tfds_dir = os.path.join(cls.root, 'tensorflow_datasets')  # empty
    os.makedirs(cls.tfds_dir)
    cls.vocab = helpers.train_sentencepiece(cls.root)
    # `python` is this interpreter, as in an activated virtualenv; offline,
    # T5X_SPEED_VOCAB names the SentencePiece model, as the README says.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='', JAX_PLATFORMS='cpu',
               XLA_FLAGS='', TFDS_DATA_DIR=cls.tfds_dir,
               T5X_SPEED_VOCAB=cls.vocab)
    cls.server = th.BinaryServer(sys.executable, str(REPO), env)
    cls.addClassCleanup(cls.server.close)
    # Two runs at a time, since each keeps about one core busy. The demo's
    # (train, then infer) and the paper's runs share the two slots: see
    # _started_runs.
    cls.pool = futures.ThreadPoolExecutor(2)
    cls.runs = None

  @classmethod
  def tearDownClass(cls):
    cls.pool.shutdown(cancel_futures=True)
    super().tearDownClass()

  def _started_runs(self):
    """{'demo': future, 'paper': [future per paper command]}, started once.

    The demo's runs, one after the other, go first; the paper's fill the
    other slot meanwhile. Each test waits for its own runs.
    """
    cls = type(self)
    if cls.runs is None:
      cls.runs = {'demo': cls.pool.submit(self._run_demo)}
      cls.runs['paper'] = [cls.pool.submit(self._run_paper, c)
                           for c in self._paper_commands()]
    return cls.runs

  def _demo_commands(self):
    return [c for c in self.commands if 'demo_2x3.gin' in c]

  def _paper_commands(self):
    return [c for c in self.commands if 'demo_2x3.gin' not in c]

  def _demo_checkpoint(self):
    train = self._demo_commands()[0]
    model_dir = self.root + _gin_value(train, 'MODEL_DIR').strip('\'"')
    return model_dir, os.path.join(model_dir, f'checkpoint_{DEMO_STEPS}')

  def _run_demo(self):
    """(train, infer) CompletedProcesses; infer is None if train failed."""
    train, infer = self._demo_commands()
    train_proc = _run(self.server, train, _rerooted(train, self.root) +
                      [f'--gin.TRAIN_STEPS={DEMO_STEPS}'])
    if train_proc.returncode:
      return train_proc, None
    flags = _rerooted(infer, self.root)
    flags = [f for f in flags if 'CHECKPOINT_PATH' not in f]
    flags.append(f'--gin.CHECKPOINT_PATH="\'{self._demo_checkpoint()[1]}\'"')
    # A size override: the 20-step model never emits EOS, so every one of
    # the 2,000 examples decodes to the target length; 32 instead of 112
    # keeps the run short.
    flags.append(f'--gin.TASK_FEATURE_LENGTHS="{DEMO_INFER_LENGTHS}"')
    return train_proc, _run(self.server, infer, flags)

  def _run_paper(self, command):
    flags = _rerooted(command, self.root) + [
        f'--gin.{b}' for b in TINY_MODEL]
    return _run(self.server, command, flags)

  def test_readme_documents_the_commands(self):
    binaries = [c.split()[2] for c in self.commands]
    self.assertEqual(binaries.count('t5x.train'), 4, self.commands)
    self.assertEqual(binaries.count('t5x.eval'), 1, self.commands)
    self.assertEqual(binaries.count('t5x.infer'), 3, self.commands)
    for command in self.commands:
      for arg in shlex.split(command.replace('$PWD', str(REPO))):
        if arg.startswith('--gin_file='):
          self.assertTrue((REPO / arg.split('=', 1)[1]).is_file(), arg)

  def test_demo_train_then_infer_as_written(self):
    runs = self._started_runs()
    train, infer = self._demo_commands()
    self.assertIn('t5x.train', train)
    self.assertIn('t5x.infer', infer)
    train_proc, infer_proc = runs['demo'].result()
    self.assertEqual(train_proc.returncode, 0, train_proc.stderr[-5000:])
    model_dir, checkpoint = self._demo_checkpoint()
    self.assertTrue(os.path.isdir(checkpoint))
    # The shipped run file evaluates during training.
    self.assertTrue(glob.glob(os.path.join(model_dir, 'training_eval', '*')))

    self.assertEqual(infer_proc.returncode, 0, infer_proc.stderr[-5000:])
    out_dir = self.root + _gin_value(infer, 'INFER_OUTPUT_DIR').strip('\'"')
    files = [f for f in glob.glob(os.path.join(out_dir,
                                               'speed_demo_numbers-*.jsonl*'))
             if not f.endswith('.COMPLETED')]
    self.assertLen(files, 1)
    with open(files[0]) as f:
      rows = [json.loads(line) for line in f]
    self.assertNotEmpty(rows)
    for row in rows:
      aux = row['aux']
      self.assertGreaterEqual(aux['speed/num_steps'], aux['speed/num_tokens'])
      self.assertGreater(aux['speed/num_tokens'], 0)
    # The README's statistics file: their sums over the predictions.
    with open(os.path.join(out_dir, 'speed_statistics.jsonl')) as f:
      (summary,) = [json.loads(line) for line in f]
    self.assertEqual(summary['speed/tokens'],
                     sum(r['aux']['speed/num_tokens'] for r in rows))

  def test_paper_commands_reach_the_data_preparation_error(self):
    runs = self._started_runs()
    commands = self._paper_commands()
    self.assertLen(commands, 6)
    expected = {  # the dataset each command's task reads
        'pretrain_c4.gin': "Dataset 'c4/en:3.1.0'",
        'finetune_wmt_ende.gin': "Dataset 'wmt_t2t_translate/de-en:1.0.0'",
        'eval.gin': "Dataset 'wmt_t2t_translate/de-en:1.0.0'",
        'infer.gin': "Dataset 'wmt_t2t_translate/de-en:1.0.0'",
    }
    procs = [run.result() for run in runs['paper']]
    for command, proc in zip(commands, procs):
      run_file = re.search(r'gin/runs/(\S+\.gin)', command).group(1)
      self.assertNotEqual(proc.returncode, 0, command)
      self.assertIn('DatasetNotPreparedError', proc.stderr, command)
      self.assertIn(expected[run_file] + ' for task', proc.stderr, command)
      self.assertIn(f'is not prepared under \'{self.tfds_dir}\'', proc.stderr)
      self.assertIn('tfds build', proc.stderr)
      self.assertNotIn('task cache directories', proc.stderr)


if __name__ == '__main__':
  absltest.main()
