"""Small T5X models and batches, and T5X's binaries, for the tests that need
T5X."""

from concurrent import futures
import functools
import glob
import itertools
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import seqio
from t5x import adafactor
from t5x import decoding as t5x_decoding
from t5x import models as t5x_models
from t5x.examples.decoder_only import network as t5x_network
from t5x.examples.t5 import network as t5x_t5_network

from t5x_speed import decoding
from t5x_speed import encoder_decoder
from t5x_speed import models
from t5x_speed import network
from t5x_speed import testing
import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 37
TINY = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
            mlp_activations=('gelu', 'linear'))
T5X_GREEDY = jax.tree_util.Partial(t5x_decoding.temperature_sample,
                                   temperature=0.0, topk=1)


# SPEED's pipeline at any batch: these tests' batches of 4-6 examples x R
# rows are beyond the CPU's default max_speculative_rows, where SPEED would
# decode with greedy's loop (SharedModelTest tests that default).
SPEED_PIPELINE = functools.partial(decoding.speed_decode,
                                   max_speculative_rows=None)


def speed_model(g=2, r=3, decode_fn=SPEED_PIPELINE,
                bidirectional=True, **kwargs):
  module = network.SpeedTransformer(network.TransformerConfig(
      num_unique_layers=g, num_repeats=r, **TINY))
  return models.SpeedDecoderOnlyModel(
      module, seqio.PassThroughVocabulary(VOCAB, eos_id=1),
      adafactor.Adafactor(), decode_fn=decode_fn,
      inputs_bidirectional_attention=bidirectional, z_loss=1e-4, **kwargs)


def t5x_model(num_layers=3, bidirectional=True):
  module = t5x_network.DecoderWrapper(t5x_network.TransformerConfig(
      num_layers=num_layers, dropout_rate=0.0, logits_via_embedding=True,
      **TINY))
  return t5x_models.DecoderOnlyModel(
      module, seqio.PassThroughVocabulary(VOCAB, eos_id=1),
      adafactor.Adafactor(), decode_fn=T5X_GREEDY,
      inputs_bidirectional_attention=bidirectional, z_loss=1e-4)


def prefix_lm_batch(seed=0, batch=4, length=16, max_inputs=6, max_targets=7):
  """A batch as seqio.DecoderFeatureConverter makes for a prefix LM."""
  rng = np.random.RandomState(seed)
  fields = {k: np.zeros((batch, length), np.int32) for k in (
      'decoder_target_tokens', 'decoder_input_tokens',
      'decoder_causal_attention', 'decoder_loss_weights')}
  for b in range(batch):
    n_in, n_tg = rng.randint(1, max_inputs + 1), rng.randint(1, max_targets + 1)
    seq = list(rng.randint(2, VOCAB, n_in - 1)) + [1]
    seq += list(rng.randint(2, VOCAB, n_tg - 1)) + [1]
    fields['decoder_target_tokens'][b, :len(seq)] = seq
    fields['decoder_input_tokens'][b, 1:len(seq)] = seq[:-1]
    fields['decoder_causal_attention'][b, :n_in + 1] = 1
    fields['decoder_loss_weights'][b, n_in:len(seq)] = 1
  return {k: jnp.asarray(v) for k, v in fields.items()}


def speed_encdec_model(g=2, r=3, decode_fn=SPEED_PIPELINE,
                       num_encoder_layers=2, **kwargs):
  """A tiny SpeedEncoderDecoderModel (T5 1.1's untied classifier)."""
  module = encoder_decoder.SpeedEncoderDecoder(network.TransformerConfig(
      num_unique_layers=g, num_repeats=r,
      num_encoder_layers=num_encoder_layers, logits_via_embedding=False,
      **TINY))
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  return models.SpeedEncoderDecoderModel(
      module, vocab, vocab, adafactor.Adafactor(), decode_fn=decode_fn,
      z_loss=1e-4, **kwargs)


def t5x_encdec_model(num_decoder_layers=3, num_encoder_layers=2,
                     decode_fn=T5X_GREEDY):
  """T5X's own EncoderDecoderModel with its T5 1.1 network, same shape."""
  module = t5x_t5_network.Transformer(t5x_t5_network.T5Config(
      num_encoder_layers=num_encoder_layers,
      num_decoder_layers=num_decoder_layers, dropout_rate=0.0,
      logits_via_embedding=False, **TINY))
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  return t5x_models.EncoderDecoderModel(
      module, vocab, vocab, adafactor.Adafactor(), decode_fn=decode_fn,
      z_loss=1e-4)


def encdec_batch(seed=0, batch=4, inputs_length=10, targets_length=12,
                 max_targets=None):
  """A batch as seqio.EncDecFeatureConverter makes (no packing): random
  inputs and targets, each ending in EOS (1), padded with 0."""
  rng = np.random.RandomState(seed)
  max_targets = max_targets or targets_length
  fields = {k: np.zeros((batch, targets_length), np.int32) for k in (
      'decoder_target_tokens', 'decoder_input_tokens',
      'decoder_loss_weights')}
  fields['encoder_input_tokens'] = np.zeros((batch, inputs_length), np.int32)
  for b in range(batch):
    n_in = rng.randint(1, inputs_length + 1)
    n_tg = rng.randint(1, max_targets + 1)
    fields['encoder_input_tokens'][b, :n_in] = list(
        rng.randint(2, VOCAB, n_in - 1)) + [1]
    seq = list(rng.randint(2, VOCAB, n_tg - 1)) + [1]
    fields['decoder_target_tokens'][b, :n_tg] = seq
    fields['decoder_input_tokens'][b, 1:n_tg] = seq[:-1]
    fields['decoder_loss_weights'][b, :n_tg] = 1
  return {k: jnp.asarray(v) for k, v in fields.items()}


def jitted(method, **static):
  """A model's `loss_fn`, `score_batch`, `predict_batch_with_aux`, ...
  jitted as T5X's binaries jit it, with the keyword arguments `static`
  (decode settings) bound: one compiled program, where an eager call
  compiles each of its operations apart."""
  return jax.jit(functools.partial(method, **static))


def assert_scores_and_decodes_match(ours, theirs, params, batch):
  """Asserts that two T5X models score `batch` alike and predict the same
  tokens (jitted as the binaries jit them); returns both aux dicts."""
  np.testing.assert_allclose(jitted(ours.score_batch)(params, batch),
                             jitted(theirs.score_batch)(params, batch),
                             rtol=1e-5)
  decodes, aux = jitted(ours.predict_batch_with_aux)(params, batch)
  t5x_decodes, t5x_aux = jitted(theirs.predict_batch_with_aux)(params, batch)
  np.testing.assert_array_equal(decodes, t5x_decodes)
  return aux, t5x_aux


def init_params(model, batch, seed=0):
  """Random parameters of `model` for `batch`'s shapes
  (`testing.draw_params`)."""
  shapes = {k: v.shape for k, v in batch.items()}
  types = {k: v.dtype for k, v in batch.items()}
  params = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), shapes, types))['params']
  return testing.draw_params(params, seed, model.module.config.head_dim)


# The binaries' server (`BinaryServer`): it imports T5X's libraries once,
# then forks a supervisor per run, which forks the run itself and reports its
# exit status (killing it after its timeout). The run executes the binary as
# `python -m` does: the module as `__main__` through runpy, errors printed
# and turned into the exit status by the interpreter, atexit handlers and
# thread joins at its normal exit.
_SERVER = textwrap.dedent('''\
    import json, os, runpy, signal, socket, sys
    import seqio, tensorflow
    from t5x import checkpoints, gin_utils, models, partitioning, trainer, utils
    server = socket.socket(socket.AF_UNIX)
    server.bind(sys.argv[1])
    server.listen()

    def reap(*_):  # waited for, so that their CPU time counts as this one's
      try:
        while os.waitpid(-1, os.WNOHANG)[0]:
          pass
      except ChildProcessError:
        pass

    signal.signal(signal.SIGCHLD, reap)
    print('ready', flush=True)
    while True:
      conn, _ = server.accept()
      if os.fork():
        conn.close()
        continue
      server.close()
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      request = json.loads(conn.makefile().readline())
      pid = os.fork()
      if pid:
        signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
        signal.alarm(request['timeout'])
        status = os.waitpid(pid, 0)[1]
        conn.sendall(b'%d\\n' % os.waitstatus_to_exitcode(status))
        os._exit(0)
      conn.close()
      for fd, path in ((1, request['stdout']), (2, request['stderr'])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
      sys.argv = [request['module']] + request['args']
      runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
      sys.exit(0)
    ''')


class BinaryServer:
  """Runs T5X's binaries (`python -m t5x.train` etc.) in forks of one server.

  Each binary spends seconds of CPU importing TensorFlow, JAX, seqio and T5X
  before it reads a flag. The server, started once under `python` in `cwd`
  with environment `env`, imports T5X's libraries (not the binaries) and
  forks one process per run, in which the binary runs as `python -m` runs
  it. Neither JAX's backend nor TensorFlow's runtime is started before the
  fork (importing them starts neither), so each run starts its own, as a
  fresh process does.
  """

  def __init__(self, python: str, cwd: str, env: dict):
    self._dir = tempfile.mkdtemp(prefix='t5x_binaries_')
    self._socket = os.path.join(self._dir, 'socket')
    self._log = open(os.path.join(self._dir, 'server.log'), 'w')
    self._proc = subprocess.Popen(
        [python, '-c', _SERVER, self._socket], cwd=cwd, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
        text=True)
    if self._proc.stdout.readline().strip() != 'ready':
      self._log.flush()
      with open(self._log.name) as f:
        log = f.read()
      self.close()
      raise AssertionError(f'the binaries\' server failed:\n{log[-6000:]}')
    self._runs = itertools.count(1)

  def run(self, module: str, args, timeout: int = 900
          ) -> subprocess.CompletedProcess:
    """Runs `python -m module *args`; returns its exit status and output.

    A run still going after `timeout` seconds is killed (exit status -9).
    """
    run = next(self._runs)  # atomic: runs start from two threads
    out = {name: os.path.join(self._dir, f'{run}.{name}')
           for name in ('stdout', 'stderr')}
    with socket.socket(socket.AF_UNIX) as conn:
      conn.connect(self._socket)
      conn.sendall(json.dumps(dict(module=module, args=list(args),
                                   timeout=timeout, **out)).encode() + b'\n')
      code = conn.makefile().readline().strip()
    texts = {}
    for name, path in out.items():
      with open(path) as f:
        texts[name] = f.read()
    return subprocess.CompletedProcess(['python', '-m', module, *args],
                                       int(code) if code else -1, **texts)

  def close(self):
    self._proc.kill()
    self._proc.wait()
    self._log.close()
    shutil.rmtree(self._dir, ignore_errors=True)


def binary_env(root: str) -> dict:
  """The environment of the tests' T5X binaries: on CPU, with `root` (the
  tests' task modules) on PYTHONPATH."""
  return dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root, os.environ.get('PYTHONPATH', '')]), CUDA_VISIBLE_DEVICES='',
              JAX_PLATFORMS='cpu', XLA_FLAGS='')


def run_t5x(server: BinaryServer, binary: str, gin_files, bindings,
            search_paths=()):
  """Runs T5X's binary `t5x.<binary>` through `server`.

  `search_paths` are added to T5X's own gin search path (none: gin files
  resolve as in an installed package). A failure raises AssertionError with
  the end of stderr. Returns the CompletedProcess.
  """
  args = [f'--gin_file={f}' for f in gin_files]
  args += [f'--gin.{b}' for b in bindings]
  if search_paths:
    args.append('--gin_search_paths=' + ','.join(map(str, search_paths)))
  args.append('--alsologtostderr')
  proc = server.run(f't5x.{binary}', args)
  if proc.returncode:
    raise AssertionError(f'{binary} failed:\n{proc.stderr[-6000:]}')
  return proc


def run_concurrently(*calls):
  """Runs the zero-argument `calls` two at a time; returns their results.

  Each T5X binary spends much of its time on one core (importing TensorFlow
  and T5X, tracing), so two at a time on a 2-core machine take about the
  time of one. The first exception raised is re-raised.
  """
  with futures.ThreadPoolExecutor(2) as pool:
    return [f.result() for f in [pool.submit(c) for c in calls]]


TASK_MODULE = textwrap.dedent('''\
    """A tiny seqio task for the binaries test: reverse a list of words."""
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


def write_reverse_task(root: str):
  """Writes the `e2e_reverse` task's data, SentencePiece model and module
  (`e2e_tasks`, importable with `root` on PYTHONPATH) into `root`."""
  rng = random.Random(0)
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


# T5X's run files draw a new initialisation and data order in every run
# (RANDOM_SEED and the train DatasetConfig's seed are None). The tests' tiny
# models train a few steps, so whether their greedy outputs are empty would
# change from run to run: their training runs bind these.
TRAIN_SEEDS = ['RANDOM_SEED = 0', 'train/utils.DatasetConfig.seed = 0']


def reverse_task_bindings():
  """Gin bindings of a run on the `e2e_reverse` task (`write_reverse_task`)."""
  return ["MIXTURE_OR_TASK_NAME = 'e2e_reverse'",
          "MIXTURE_OR_TASK_MODULE = 'e2e_tasks'",
          "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 16}",
          'USE_CACHED_TASKS = False', 'BATCH_SIZE = 8']


def reverse_task_batch(root: str, split: str, length: int = 32):
  """The `e2e_reverse` task's `split` (`write_reverse_task`) as one
  unpacked prefix-LM batch, as seqio's DecoderFeatureConverter makes it."""
  import sentencepiece  # pylint: disable=g-import-not-at-top
  spm = sentencepiece.SentencePieceProcessor(
      model_file=os.path.join(root, 'spm.model'))
  with open(os.path.join(root, f'{split}.tsv')) as f:
    pairs = [line.rstrip('\n').split('\t') for line in f]
  fields = {k: np.zeros((len(pairs), length), np.int32) for k in (
      'decoder_target_tokens', 'decoder_input_tokens',
      'decoder_causal_attention', 'decoder_loss_weights')}
  for b, (inputs, targets) in enumerate(pairs):
    prompt = spm.encode(inputs) + [1]
    seq = prompt + spm.encode(targets) + [1]
    fields['decoder_target_tokens'][b, :len(seq)] = seq
    fields['decoder_input_tokens'][b, 1:len(seq)] = seq[:-1]
    fields['decoder_causal_attention'][b, :len(prompt) + 1] = 1
    fields['decoder_loss_weights'][b, len(prompt):len(seq)] = 1
  return {k: jnp.asarray(v) for k, v in fields.items()}


def teacher_forced_flips(module, params, batch):
  """Per stage 2..R, how many target tokens' exit predictions differ from
  the previous exit's, teacher-forced on a prefix-LM `batch`."""
  logits = jax.jit(module.apply, static_argnames='enable_dropout')(
      {'params': params}, batch['decoder_input_tokens'],
      batch['decoder_target_tokens'],
      decoder_causal_attention=batch['decoder_causal_attention'],
      enable_dropout=False)
  preds = np.asarray(jnp.argmax(logits, -1))
  weights = np.asarray(batch['decoder_loss_weights']) > 0
  return [int(np.sum((preds[i] != preds[i - 1]) & weights))
          for i in range(1, len(preds))]


def checkpoint_params(path):
  """The parameters saved in checkpoint directory `path` (T5X's Orbax
  format)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.PyTreeCheckpointer().restore(os.path.join(path, 'state'))['target']


def prediction_rows(out_dir):
  """The rows of the one `e2e_reverse` prediction file t5x.infer wrote into
  out_dir."""
  files = [f for f in glob.glob(os.path.join(out_dir, 'e2e_reverse-*.jsonl*'))
           if not f.endswith('.COMPLETED')]
  assert len(files) == 1, files
  with open(files[0]) as f:
    return [json.loads(line) for line in f]


def tree_leaves(tree, prefix=''):
  """(path, array) of every leaf of a nested dict, in sorted key order."""
  if isinstance(tree, dict):
    for k in sorted(tree):
      yield from tree_leaves(tree[k], f'{prefix}/{k}')
  else:
    yield prefix, np.asarray(tree)


def tensorboard_scalars(event_dir: str):
  """{tag: {step: value}} of the TensorBoard scalars in event_dir."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
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
