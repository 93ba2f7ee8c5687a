"""The tools' trainer: SPEED's models trained with optax, without T5X.

A `network.SpeedTransformer` on batches from `seqio.DecoderFeatureConverter`
or an `encoder_decoder.SpeedEncoderDecoder` on `seqio.EncDecFeatureConverter`
batches: the weighted multi-exit loss (and, if asked, the exits' agreement
term of `losses.exit_agreement`), averaged over target tokens; AdamW with a
linear warmup over the first tenth of the steps and cosine decay to a
twentieth of the peak rate.
`exit_consistency` measures the exits on held-out batches, teacher-forced;
`train` can call it (or any evaluation) every few steps.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional,
                    Sequence, Tuple, Union)

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from t5x_speed import losses
from t5x_speed import schedules

WEIGHT_DECAY = 0.01
# XLA:CPU options of the training step: YNNPACK fusions for its dots and
# the elementwise work around them. They spread a step's many small
# width-128 products over the cores far better than the default thunks
# (docs/real_data.md#training-throughput); the values are float rounding
# apart from the default's.
CPU_COMPILER_OPTIONS = {
    'xla_cpu_experimental_ynn_fusion_type':
        'LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE'}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a model is trained."""

  steps: int
  learning_rate: float
  seed: int = 0
  exit_weighting: losses.ExitWeighting = 'linear'
  exit_agreement: float = 0.0        # lambda of `losses.exit_agreement`
  exit_agreement_target: str = 'distribution'
  log_every: int = 20                # steps between history records


@dataclasses.dataclass
class TrainState:
  """Where training stands after `step` steps: enough to go on from there
  (given the batches after the first `step`)."""

  step: int
  params: Any
  opt_state: Any
  history: List[Dict[str, float]]


def schedule_settings(recipe: Recipe) -> Dict[str, float]:
  """The arguments of optax's `warmup_cosine_decay_schedule` for `recipe`
  (`schedules.warmup_cosine_settings`)."""
  return schedules.warmup_cosine_settings(recipe.learning_rate, recipe.steps)


def forward(module, params, batch, enable_dropout: bool = False,
            rngs=None) -> jax.Array:
  """Every exit's logits [R, batch, length, vocab] on a converted batch
  (length: K, at the batch's `exit_positions` [batch, K] if it has them),
  of a `network.SpeedTransformer` (prefix-LM batches) or an
  `encoder_decoder.SpeedEncoderDecoder` (encoder-decoder batches)."""
  if module.config.is_encoder_decoder:
    args = (batch['encoder_input_tokens'], batch['decoder_input_tokens'],
            batch['decoder_target_tokens'], batch.get('encoder_segment_ids'),
            batch.get('decoder_segment_ids'))
  else:
    args = (batch['decoder_input_tokens'], batch['decoder_target_tokens'],
            batch.get('decoder_segment_ids'), batch.get('decoder_positions'),
            batch['decoder_causal_attention'])
  return module.apply({'params': params}, *args,
                      enable_dropout=enable_dropout, rngs=rngs,
                      exit_positions=batch.get('exit_positions'))


def with_exit_positions(batch: Dict[str, np.ndarray], multiple: int = 32
                        ) -> Dict[str, np.ndarray]:
  """`batch` with the positions that carry loss weight, per row, for the
  exits to score alone: 'exit_positions' [batch, K] and the targets and
  weights there ('exit_targets', 'exit_weights'; weight 0 where a row has
  fewer than K). K, the most of any row rounded up to `multiple` (so that
  few shapes compile), is about a third of a packed prefix-LM row, whose
  inputs and padding need no logits.

  >>> out = with_exit_positions({'decoder_target_tokens': np.array(
  ...     [[5, 6, 7, 8], [5, 6, 7, 0]]), 'decoder_loss_weights': np.array(
  ...     [[0, 1, 0, 1], [0, 0, 1, 0]])}, multiple=2)
  >>> out['exit_positions'].tolist(), out['exit_targets'].tolist()
  ([[1, 3], [2, 0]], [[6, 8], [7, 5]])
  >>> out['exit_weights'].tolist()
  [[1, 1], [1, 0]]
  """
  weights = np.asarray(batch['decoder_loss_weights'])
  most = int((weights > 0).sum(1).max())
  k = min(max(-(-most // multiple) * multiple, multiple),
          weights.shape[1])
  # A stable sort puts each row's weighted positions first, in order.
  positions = np.argsort(weights <= 0, axis=1, kind='stable')[:, :k]
  take = lambda x: np.take_along_axis(np.asarray(x), positions, 1)
  return {**batch, 'exit_positions': positions.astype(np.int32),
          'exit_targets': take(batch['decoder_target_tokens']),
          'exit_weights': take(weights)}


# `train`'s compiler_options default: `default_compiler_options()`.
DEFAULT_OPTIONS = object()


def data_parallel_devices(batch_size: int, devices=None) -> List[Any]:
  """The most of `devices` (default: the local devices) that split
  `batch_size` rows evenly: the devices a step runs data parallel on.

  >>> len(data_parallel_devices(6, ['d0', 'd1', 'd2', 'd3']))
  3
  """
  devices = list(jax.local_devices() if devices is None else devices)
  count = max(n for n in range(1, len(devices) + 1) if batch_size % n == 0)
  return devices[:count]


def data_parallel_shardings(devices: Sequence[Any]
                            ) -> Tuple[jax.sharding.NamedSharding,
                                       jax.sharding.NamedSharding]:
  """(replicated, rows) over `devices`: parameters and optimizer state whole
  on each device, a batch's rows split between them."""
  mesh = jax.sharding.Mesh(np.asarray(devices), ('data',))
  return (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))


def default_compiler_options() -> Optional[Dict[str, str]]:
  """`CPU_COMPILER_OPTIONS` on a CPU backend; None (XLA's defaults) on
  others."""
  return CPU_COMPILER_OPTIONS if jax.default_backend() == 'cpu' else None


def loss_and_statistics(module, recipe: Recipe, params, batch,
                        frozen=None, statistics: bool = True):
  """(loss per target token, (per-exit logs, exit statistics)) of `params`
  on a batch of `with_exit_positions`: the training objective. `frozen`
  parameters join `params` as constants; without `statistics` the exits'
  accuracy and flip counts (`losses.exit_statistics`) are not computed."""
  agreement = losses.check_exit_agreement(recipe.exit_agreement,
                                          recipe.exit_agreement_target)
  exit_logits = forward(module, _merge(frozen, params) if frozen else params,
                        batch)
  targets, weights = batch['exit_targets'], batch['exit_weights']
  loss, _, per_exit, weight_sum = losses.multi_exit_cross_entropy(
      exit_logits, targets, weights, recipe.exit_weighting)
  logs = {'loss': per_exit / weight_sum}
  if agreement and exit_logits.shape[0] > 1:
    terms = losses.exit_agreement(exit_logits, weights,
                                  recipe.exit_agreement_target)
    loss = loss + agreement * jnp.mean(terms)
    logs['agreement'] = terms / weight_sum
  stats = (losses.exit_statistics(exit_logits, targets, weights)
           if statistics else {})
  return loss / weight_sum, (logs, stats)


def train_step_fn(module, recipe: Recipe, optimizer, statistics: bool,
                  compiler_options: Optional[Dict[str, str]] = None):
  """The compiled training step (params, opt_state, batch, frozen) ->
  (params, opt_state, logs, stats); params and optimizer state donated.
  Its shardings follow its arguments' (`train` places them)."""
  def step(params, opt_state, batch, frozen):
    (_, (logs, stats)), grads = jax.value_and_grad(
        functools.partial(loss_and_statistics, module, recipe,
                          statistics=statistics),
        has_aux=True)(params, batch, frozen)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, logs, stats
  return jax.jit(step, donate_argnums=(0, 1),
                 compiler_options=compiler_options)


def placed_batches(batches: Iterator[Dict[str, Any]], sharding,
                   depth: int = 2) -> Iterator[Dict[str, Any]]:
  """`batches` with exit positions (`with_exit_positions`), placed by
  `sharding`: a thread converts and copies each batch while the steps
  before it compute. Reads up to `depth` batches ahead of the caller.

  Raises:
    ValueError: a batch's rows do not split evenly over the devices.
  """
  queue = collections.deque()
  pool = concurrent.futures.ThreadPoolExecutor(1)
  devices = len(sharding.device_set)

  def prepare(batch):
    rows = len(batch['decoder_input_tokens'])
    if rows % devices:
      raise ValueError(f'a batch of {rows} rows does not split over '
                       f'{devices} devices.')
    return jax.device_put(with_exit_positions(batch), sharding)
  try:
    for batch in batches:
      queue.append(pool.submit(prepare, batch))
      if len(queue) > depth:
        yield queue.popleft().result()
    while queue:
      yield queue.popleft().result()
  finally:
    pool.shutdown(cancel_futures=True)


def _merge(flat: Dict[Tuple[str, ...], Any], params: Any) -> Any:
  """`params` (nested) with the leaves of `flat` put in."""
  return traverse_util.unflatten_dict(
      {**traverse_util.flatten_dict(params), **flat})


def train(module, batches: Iterator[Dict[str, Any]],
          recipe: Recipe, progress_bar: bool = True, desc: str = 'training',
          init_rng: Optional[jax.Array] = None,
          evaluate: Optional[Callable[[TrainState], None]] = None,
          evaluate_every: int = 0,
          restore: Optional[Callable[[TrainState], TrainState]] = None,
          init_params: Any = None,
          trainable: Optional[Callable[[Tuple[str, ...]], bool]] = None,
          devices: Optional[Sequence[Any]] = None,
          compiler_options: Union[object, Dict[str, str], None] = (
              DEFAULT_OPTIONS)
          ) -> Tuple[Any, List[Dict[str, float]]]:
  """Trains `module` on `batches`; returns (params, history).

  The parameters are initialised from `init_rng`, by default
  `PRNGKey(recipe.seed)`; `init_params` (a fine-tune) replaces those it
  holds, so that only parameters it lacks (e.g. new exit adapters) start
  fresh. With `trainable`, a predicate on parameter paths (name tuples from
  the root), only those parameters train, and the others are neither
  differentiated nor changed. The history has a record every
  `recipe.log_every` steps and at the last: the step, each exit's loss and
  accuracy, flip rates and, with the agreement term on, each early exit's
  A_i (all per target token).
  `progress_bar` shows the steps, losses and flip rates on stderr.
  `evaluate(state)` runs every `evaluate_every` steps (0: never) and
  after the last, outside the timed step (checkpoints, validation curves).
  `restore(initial_state)` returns the state to go on from (e.g. one that
  `evaluate` saved, read into the initial state's structure); `batches`
  then starts after that state's step.
  The steps run data parallel over `devices` (default: the local devices,
  as many as split the batch evenly: `data_parallel_devices`), compiled
  with `compiler_options` (DEFAULT_OPTIONS: `default_compiler_options`;
  None: XLA's own); either changes only the rounding of what is computed.
  The parameters returned, and those `evaluate` sees, are on the first of
  them alone: a program they then enter runs once, not once per device.
  """
  # Before any compile: a bad agreement setting fails at once.
  losses.check_exit_agreement(recipe.exit_agreement,
                              recipe.exit_agreement_target)
  first = next(batches)
  if init_rng is None:
    init_rng = jax.random.PRNGKey(recipe.seed)
  inputs = (['encoder_input_tokens'] if module.config.is_encoder_decoder
            else []) + ['decoder_input_tokens', 'decoder_target_tokens']
  params = module.init(init_rng, *(first[k][:1] for k in inputs),
                       enable_dropout=False)['params']
  if init_params is not None:
    params = _merge(traverse_util.flatten_dict(dict(init_params)),
                    dict(params))
  frozen = {}
  if trainable is not None:
    flat = traverse_util.flatten_dict(dict(params))
    frozen = {p: v for p, v in flat.items() if not trainable(p)}
    if len(frozen) == len(flat):
      raise ValueError('trainable selects none of the parameters.')
    params = traverse_util.unflatten_dict(
        {p: v for p, v in flat.items() if p not in frozen})
  schedule = optax.warmup_cosine_decay_schedule(**schedule_settings(recipe))
  optimizer = optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
  state = TrainState(0, params, optimizer.init(params), [])
  if restore is not None:
    state = restore(state)
  # Data parallel: each device takes an equal share of a batch's rows, and
  # the parameters, optimizer state and frozen parameters are replicated.
  devices = data_parallel_devices(len(first['decoder_input_tokens']),
                                  devices)
  replicated, rows = data_parallel_shardings(devices)
  if compiler_options is DEFAULT_OPTIONS:
    compiler_options = default_compiler_options()
  # Copies, never views of the replicated buffers the next step donates.
  on_one = lambda tree: jax.device_put(tree, devices[0], may_alias=False)
  # The exits' statistics only where the history records them.
  steps_of = {statistics: train_step_fn(module, recipe, optimizer, statistics,
                                        compiler_options)
              for statistics in (False, True)}

  num_repeats = module.config.num_repeats
  params, opt_state, frozen = jax.device_put(
      (state.params, state.opt_state, frozen), replicated)
  history = state.history
  bar = tqdm.tqdm(range(state.step + 1, recipe.steps + 1), desc=desc,
                  unit='step', initial=state.step, total=recipe.steps,
                  dynamic_ncols=True, disable=not progress_bar)
  placed = contextlib.closing(
      placed_batches(itertools.chain([first], batches), rows))
  with placed as placed, bar:
    for step in bar:
      params, opt_state = _train_one(step, placed, params, opt_state, frozen,
                                     steps_of, recipe, history, bar,
                                     num_repeats)
      if evaluate is not None and (step == recipe.steps or (
          evaluate_every and step % evaluate_every == 0)):
        evaluate(TrainState(step, on_one(_merge(frozen, params) if frozen
                                         else params), opt_state, history))
  return on_one(_merge(frozen, params) if frozen else params), history


def _train_one(step, placed, params, opt_state, frozen, steps_of, recipe,
               history, bar, num_repeats):
  """`train`'s step `step`: (params, opt_state) after it, and its record
  in `history` at log points (the only host syncs)."""
  logged = step % recipe.log_every == 0 or step == recipe.steps
  params, opt_state, logs, stats = steps_of[logged](
      params, opt_state, next(placed), frozen)
  if logged:
    record = {'step': step}
    for name, values in logs.items():
      for i, value in enumerate(np.asarray(values)):
        record[f'exit_{i + 1}/{name}'] = float(value)
    for name, (total, count) in stats.items():
      record[name] = float(total) / max(float(count), 1.0)
    history.append(record)
    postfix = {f'loss{i + 1}': f'{record[f"exit_{i + 1}/loss"]:.3f}'
               for i in range(num_repeats)}
    postfix.update({f'flip{i}': f'{record[f"exit_{i}/flip_rate"]:.1%}'
                    for i in range(2, num_repeats + 1)})
    bar.set_postfix(postfix, refresh=False)
  return params, opt_state


def exit_consistency(module, params,
                     batches: Iterable[Dict[str, Any]]
                     ) -> Dict[str, np.ndarray]:
  """Teacher-forced per-exit loss, accuracy and agreement with the final
  exit.

  Returns {'loss': [R], 'accuracy': [R], 'agrees_with_final': [R],
  'flip_rate': [R]} over the target tokens of `batches` (loss: cross-entropy
  per target token; flip_rate[0] is 0: exit 1 has no predecessor).
  """
  correct = agree = flips = loss = 0.0
  count = 0.0
  for batch in batches:
    weights = batch['decoder_loss_weights']
    # [R, batch, length] argmax and summed cross-entropy of every exit.
    preds, nll = _exit_predictions(module, params, batch)
    preds = np.asarray(preds)
    loss += np.asarray(nll)
    correct += np.sum((preds == batch['decoder_target_tokens']) * weights,
                      (1, 2))
    agree += np.sum((preds == preds[-1]) * weights, (1, 2))
    flips += np.sum((preds != np.roll(preds, 1, 0)) * weights, (1, 2))
    count += weights.sum()
  flips[0] = 0.0
  return {'loss': loss / count, 'accuracy': correct / count,
          'agrees_with_final': agree / count, 'flip_rate': flips / count}


@functools.partial(jax.jit, static_argnums=0)
def _exit_predictions(module, params, batch):
  logits = forward(module, params, batch)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  target_logp = jnp.take_along_axis(
      logp, batch['decoder_target_tokens'][None, ..., None], -1)[..., 0]
  nll = -jnp.sum(target_logp * batch['decoder_loss_weights'], (1, 2))
  return jnp.argmax(logits, -1), nll
