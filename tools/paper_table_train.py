"""Training the paper table's runs: the tools' trainer or stock `t5x.train`.

Both trainers get the same recipe and produce the same parameters (up to
float rounding): the initial parameters from the key `t5x.train` draws from
its `random_seed`, the same seqio pipeline and shuffle seed, the loss per
target token without z-loss, and optax's AdamW with the same schedule
(wrapped by `t5x.optimizers` under T5X).

Each run is kept in `<out_dir>/runs/<run name>/` (`params.msgpack`,
`train.json`, and under T5X its model directory), keyed by everything that
changes the trained model, so that an interrupted or extended table
retrains only what is missing.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import flax.serialization
import jax
import numpy as np

from t5x_speed import encoder_decoder
from t5x_speed import network
from tools import common
from tools import paper_table_data
from tools import trainer

TRAINERS = ('library', 't5x')
GETTEXT = paper_table_data.GETTEXT_LANGUAGES
# Part of every run's key: raise it when a change to the trainers' code
# changes what they train, so that runs kept from before are not reused.
RECIPE_VERSION = 1
# What t5x.train needs to see the table's task: it imports this module.
_TASK_MODULE = '''"""Registers {task!r} for t5x.train (tools.paper_table)."""
from t5x_speed import tasks

tasks.register_translation_tsv_task({task!r}, {data_dir!r}, {spm!r},
                                    languages={languages!r})
'''


def run_label(name: str, seed: int, agreement: float) -> str:
  """How progress names a run: '2x3 seed 1 agreement 0.3'."""
  return f'{name} seed {seed}' + (f' agreement {agreement:g}' if agreement
                                  else '')


def module_of(config: network.TransformerConfig):
  """The model module of `config`: decoder-only or encoder-decoder."""
  if config.is_encoder_decoder:
    return encoder_decoder.SpeedEncoderDecoder(config)
  return network.SpeedTransformer(config)


def t5x_init_rng(seed: int) -> jax.Array:
  """The key `t5x.train` initialises parameters from, for `random_seed`."""
  return jax.random.split(jax.random.PRNGKey(seed), 2)[0]


def run_key(name: str, config: network.TransformerConfig,
            recipe: trainer.Recipe, trainer_kind: str, batch_size: int,
            lengths: Dict[str, int], data_dir: str,
            languages: Tuple[str, str] = GETTEXT) -> str:
  """The directory name of one run: readable, plus a hash of everything else
  that changes the trained model (architecture, recipe, batches and the
  contents of the training data and vocabulary, and the languages its
  prompt names)."""
  training = dataclasses.asdict(recipe)
  del training['log_every']
  if not recipe.exit_agreement:
    del training['exit_agreement_target']
  digest = hashlib.sha256(json.dumps({
      'config': dataclasses.asdict(config), 'recipe': training,
      'weight_decay': trainer.WEIGHT_DECAY, 'version': RECIPE_VERSION,
      'batch_size': batch_size, 'lengths': lengths,
      # Only where they are not the gettext set's: runs trained before the
      # option existed keep their keys.
      **({'languages': list(languages)}
         if tuple(languages) != GETTEXT else {}),
      'data': [common.file_digest(os.path.join(data_dir, f))
               for f in ('train.tsv', 'spm.model')]},
                                     sort_keys=True, default=str).encode())
  return (f'{name}_seed{recipe.seed}_agree{recipe.exit_agreement:g}_'
          f'{trainer_kind}_{digest.hexdigest()[:10]}')


def _write_atomically(path: str, data: bytes):
  with open(path + '.tmp', 'wb') as f:
    f.write(data)
  os.replace(path + '.tmp', path)


def save_params(path: str, params) -> None:
  _write_atomically(path, flax.serialization.msgpack_serialize(
      jax.device_get(params)))


def load_params(path: str):
  with open(path, 'rb') as f:
    return flax.serialization.msgpack_restore(f.read())


def _save(run_dir: str, params, record: Dict[str, Any]):
  """Parameters first, the record last: a run is complete once its record
  exists."""
  save_params(os.path.join(run_dir, 'params.msgpack'), params)
  _write_atomically(os.path.join(run_dir, 'train.json'),
                    json.dumps(record, indent=1).encode())


def _load(run_dir: str):
  paths = [os.path.join(run_dir, f) for f in ('params.msgpack', 'train.json')]
  if not all(os.path.exists(p) for p in paths):
    return None
  with open(paths[1]) as f:
    return load_params(paths[0]), json.load(f)


def train_library(module: network.SpeedTransformer, batches, recipe:
                  trainer.Recipe, quiet: bool, desc: str,
                  evaluate=None, evaluate_every: int = 0, restore=None
                  ) -> Tuple[Any, List[Dict[str, float]]]:
  """The tools' trainer, initialised as `t5x.train` initialises."""
  return trainer.train(module, batches, recipe, progress_bar=not quiet,
                       desc=desc, init_rng=t5x_init_rng(recipe.seed),
                       evaluate=evaluate, evaluate_every=evaluate_every,
                       restore=restore)


def checkpoint_path(run_dir: str, step: int) -> str:
  """Where a run keeps its parameters after `step` (the curves' points)."""
  return os.path.join(run_dir, 'checkpoints', f'step_{step}.msgpack')


def t5x_gin(config: network.TransformerConfig, recipe: trainer.Recipe,
            task: str, task_module: str, lengths: Dict[str, int],
            batch_size: int, spm: str) -> str:
  """The gin file of one run through stock `t5x.train`: the project's
  decoder-only model and T5X's pretrain run, with the library trainer's
  recipe."""
  return '\n'.join([
      '# Written by tools.paper_table: one run of the paper table through',
      '# stock t5x.train, with the recipe of tools.trainer.',
      'from __gin__ import dynamic_registration',
      'import optax',
      'import __main__ as train_script',
      'from t5x import optimizers',
      'from t5x import utils',
      'from t5x_speed import network',
      "include 't5x_speed/gin/models/decoder_only/__init__.gin'",
      "include 't5x/configs/runs/pretrain.gin'",
      f'NUM_UNIQUE_LAYERS = {config.num_unique_layers}',
      f'NUM_REPEATS = {config.num_repeats}',
      "ACTIVATION_DTYPE = 'float32'",
      *[f'network.TransformerConfig.{f} = {getattr(config, f)}'
        for f in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim',
                  'mlp_dim')],
      'DROPOUT_RATE = 0.0',
      f'SENTENCEPIECE_MODEL = {spm!r}',
      f'MIXTURE_OR_TASK_NAME = {task!r}',
      f'MIXTURE_OR_TASK_MODULE = {task_module!r}',
      f'TASK_FEATURE_LENGTHS = {lengths!r}',
      'USE_CACHED_TASKS = False',
      f'TRAIN_STEPS = {recipe.steps}',
      f'BATCH_SIZE = {batch_size}',
      f'RANDOM_SEED = {recipe.seed}',
      f'train/utils.DatasetConfig.seed = {recipe.seed}',
      # The tools' trainer: loss per target token, no z-loss, AdamW.
      'Z_LOSS = 0.0',
      "LOSS_NORMALIZING_FACTOR = 'NUM_REAL_TARGET_TOKENS'",
      f'EXIT_WEIGHTING = {recipe.exit_weighting!r}',
      f'EXIT_AGREEMENT = {recipe.exit_agreement!r}',
      f'EXIT_AGREEMENT_TARGET = {recipe.exit_agreement_target!r}',
      'OPTIMIZER = @optimizers.adamw()',
      'optimizers.adamw.learning_rate = '
      '@optax.warmup_cosine_decay_schedule()',
      f'optimizers.adamw.weight_decay = {trainer.WEIGHT_DECAY}',
      'optax.warmup_cosine_decay_schedule:',
      *[f'  {name} = {value!r}' for name, value in
        trainer.schedule_settings(recipe).items()],
      'train_script.train.train_eval_dataset_cfg = None',
      f'utils.SaveCheckpointConfig.period = {recipe.steps}',
      ''])


def _exit_scalars(event_dir: str) -> Dict[int, Dict[str, float]]:
  """{step: {tag: value}} of the per-exit scalars T5X wrote."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for path in sorted(tf.io.gfile.glob(os.path.join(event_dir, 'events.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if not value.tag.startswith('exit_'):
          continue
        scalar = (value.simple_value if value.HasField('simple_value') else
                  float(tf.make_ndarray(value.tensor)))
        out.setdefault(int(event.step), {})[value.tag] = scalar
  return out


def train_t5x(config: network.TransformerConfig, recipe: trainer.Recipe,
              run_dir: str, task: str, data_dir: str, lengths: Dict[str, int],
              batch_size: int, progress: common.Progress,
              languages: Tuple[str, str] = GETTEXT
              ) -> Tuple[Any, List[Dict[str, float]]]:
  """Stock `python -m t5x.train` on the table's task; returns the trained
  parameters of its last checkpoint and the per-exit training metrics T5X
  wrote last (averages over its summary period, which here is the whole
  run: the tools' trainer records single steps)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  spm = os.path.join(os.path.abspath(data_dir), 'spm.model')
  module_name = 'paper_table_task'
  with open(os.path.join(run_dir, module_name + '.py'), 'w') as f:
    f.write(_TASK_MODULE.format(task=task, data_dir=os.path.abspath(data_dir),
                                spm=spm, languages=tuple(languages)))
  gin_file = os.path.join(run_dir, 'train.gin')
  with open(gin_file, 'w') as f:
    f.write(t5x_gin(config, recipe, task, module_name, lengths, batch_size,
                    spm))
  model_dir = os.path.join(run_dir, 'model')
  # T5X would resume from what an interrupted run left (its first
  # checkpoint, or an emergency one) but read the data from the start.
  shutil.rmtree(model_dir, ignore_errors=True)
  # One device, as the tools' trainer trains: a forced host device count
  # would make T5X shard the model's heads.
  xla_flags = ' '.join(
      flag for flag in os.environ.get('XLA_FLAGS', '').split()
      if not flag.startswith('--xla_force_host_platform_device_count='))
  env = dict(os.environ, T5X_SPEED_VOCAB=spm, XLA_FLAGS=xla_flags,
             PYTHONPATH=os.pathsep.join(
                 [run_dir, os.environ.get('PYTHONPATH', '')]))
  log_path = os.path.join(run_dir, 't5x_train.log')
  progress.log(f't5x.train: {gin_file}; its log: {log_path}')
  with open(log_path, 'w') as log:
    done = subprocess.run(
        [sys.executable, '-m', 't5x.train', f'--gin_file={gin_file}',
         f'--gin.MODEL_DIR={model_dir!r}', '--alsologtostderr'],
        stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
  if done.returncode:
    with open(log_path) as f:
      tail = ''.join(f.readlines()[-30:])
    raise RuntimeError(f't5x.train failed ({done.returncode}); the end of '
                       f'{log_path}:\n{tail}')
  state = ocp.PyTreeCheckpointer().restore(os.path.join(
      model_dir, f'checkpoint_{recipe.steps}', 'state'))
  scalars = _exit_scalars(os.path.join(model_dir, 'train'))
  last = max(scalars, default=0)
  record = {'step': last, **dict(sorted(scalars.get(last, {}).items()))}
  return jax.tree.map(np.asarray, state['target']), [record]


def trained_run(name: str, config: network.TransformerConfig,
                recipe: trainer.Recipe, trainer_kind: str, out_dir: str,
                data_dir: str, task: str,
                batches_fn: Callable[[int], Iterator[Dict[str, np.ndarray]]],
                lengths: Dict[str, int], batch_size: int,
                progress: common.Progress, quiet: bool,
                languages: Tuple[str, str] = GETTEXT,
                evaluate: Optional[Callable[[Any], Dict[str, Any]]] = None,
                evaluate_every: int = 0
                ) -> Tuple[network.SpeedTransformer, Any, Dict[str, Any]]:
  """(module, params, {'history', 'train_seconds', 'trainer', 'cached',
  'validation', 'run_dir'}) of one run: trained by `trainer_kind`
  ('library' or 't5x') on `batches_fn(skip)` (the library; the batches
  after the first `skip`) or on `task` (T5X), or read back from the run
  directory when an earlier table trained it.

  With the library trainer, every `evaluate_every` steps and after the last
  the parameters are kept (`checkpoint_path`) and `evaluate(params)` adds a
  point to the record's 'validation' curve; its time is not training time.
  An interrupted run goes on from its last such point (`resume.msgpack`
  holds the optimizer's state too, until the run completes).
  """
  if trainer_kind not in TRAINERS:
    raise ValueError(f'trainer must be one of {TRAINERS}, got '
                     f'{trainer_kind!r}.')
  if trainer_kind == 't5x' and config.is_encoder_decoder:
    raise ValueError(f'{name}: the table trains encoder-decoder models with '
                     'the library trainer only.')
  module = module_of(config)
  key = run_key(name, config, recipe, trainer_kind, batch_size, lengths,
                data_dir, languages)
  run_dir = os.path.join(out_dir, 'runs', key)
  label = run_label(name, recipe.seed, recipe.exit_agreement)
  cached = _load(run_dir)
  if cached is not None:
    progress.log(f'{label}: trained earlier ({run_dir})')
    params, record = cached
    return module, params, {**record, 'cached': True, 'run_dir': run_dir}
  os.makedirs(run_dir, exist_ok=True)
  resume_path = os.path.join(run_dir, 'resume.msgpack')
  # Read once: its step says which batches to skip, its state restores.
  resumed = (load_params(resume_path)
             if evaluate_every and os.path.exists(resume_path) else None)
  resumed_meta = json.loads(resumed['meta']) if resumed else None
  validation = []
  # Where the steps ran: the rounding of a run is its devices' and code's.
  trained_on = {'commit': common.git_commit(), 'cpu': common.cpu_model(),
                'devices': (len(trainer.data_parallel_devices(batch_size))
                            if trainer_kind == 'library' else 1)}
  if resumed_meta and resumed_meta.get('devices') not in (
      None, trained_on['devices']):
    raise ValueError(
        f'{resume_path}: trained on {resumed_meta["devices"]} devices so '
        f'far, and this process has {trained_on["devices"]}: the run would '
        'change its rounding mid-way. Go on where it had as many, or delete '
        'the file to start over.')
  # Seconds of training and of evaluation before this process went on with
  # the run, and this process's evaluation.
  seconds = {'train': 0.0, 'evaluate': 0.0, 'evaluated': 0.0}
  start = time.perf_counter()

  def elapsed():
    return {'train_seconds': seconds['train'] + time.perf_counter() - start
                             - seconds['evaluated'],
            'evaluate_seconds': seconds['evaluate'] + seconds['evaluated']}

  def on_evaluate(state):
    began = time.perf_counter()
    path = checkpoint_path(run_dir, state.step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_params(path, state.params)
    if evaluate is not None:
      validation.append({'step': state.step, **evaluate(state.params)})
    seconds['evaluated'] += time.perf_counter() - began
    meta = {'step': state.step, 'history': state.history,
            'validation': validation, 'devices': trained_on['devices'],
            **elapsed()}
    _write_atomically(resume_path, flax.serialization.msgpack_serialize({
        'meta': json.dumps(meta), 'state': flax.serialization.to_state_dict(
            jax.device_get({'params': state.params,
                            'opt_state': state.opt_state}))}))

  def restore(initial):
    meta = resumed_meta
    state = flax.serialization.from_state_dict(
        {'params': initial.params, 'opt_state': initial.opt_state},
        resumed['state'])
    validation.extend(meta['validation'])
    seconds.update(train=meta['train_seconds'],
                   evaluate=meta['evaluate_seconds'])
    progress.log(f'{label}: going on from step {meta["step"]}')
    return trainer.TrainState(meta['step'], state['params'],
                              state['opt_state'], meta['history'])

  if trainer_kind == 'library':
    skip = resumed_meta['step'] if resumed else 0
    progress.log(f'training {label}: {recipe.steps} steps (library trainer)')
    params, history = train_library(
        module, batches_fn(skip), recipe, quiet, label,
        on_evaluate if evaluate_every else None, evaluate_every,
        restore if skip else None)
  else:
    progress.log(f'training {label}: {recipe.steps} steps (t5x trainer)')
    params, history = train_t5x(config, recipe, run_dir, task, data_dir,
                                lengths, batch_size, progress, languages)
  record = {'history': history, 'validation': validation, **elapsed(),
            'trainer': trainer_kind, 'trained_on': trained_on}
  _save(run_dir, params, record)
  if os.path.exists(resume_path):
    os.remove(resume_path)
  return module, params, {**record, 'cached': False, 'run_dir': run_dir}

