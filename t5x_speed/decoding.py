"""Greedy and SPEED decoding under T5X's decode-fn contract.

Both functions take what T5X's `DecoderOnlyModel.predict_batch_with_aux`
passes to its `decode_fn` (`inputs`, a prefilled `cache`, `tokens_to_logits`,
`eos_id`, `num_decodes`, `initial_index`, `cache_offset`, decoder params) and
return `(decodes [batch, 1, length], scores [batch, 1])`; `decodes[:, 0, k]` is
the token at position k+1, the prompt included, zeros after the end.

Positions follow T5X: `inputs[:, 0]` is BOS (0), the cache holds positions
< `initial_index`, and the first step feeds `inputs[:, initial_index]`, the
last prompt token. An example ends when its *final-stage* prediction is
`eos_id` (prompt EOS tokens do not count) or when it has produced the token at
position min(length, initial_index + max_decode_steps). `eos_id` and
`max_decode_steps` may be one integer or one per example ([batch]); an
`eos_id` outside the vocabulary never ends an example (e.g. -1 disables EOS).

Bad inputs raise `ValueError` before the loop where they are concrete, and
end the example as *invalid* where they are traced: see `decode_args`.

Every loop is bounded: greedy by length + 1 steps, SPEED by R * (length + 1)
(a committed token takes at most R steps). No valid example reaches the
bound; one that did would be reported as `INVALID_STEP_LIMIT`.

Non-finite parameters or caches are not checked here (that would cost a pass
over the weights per call): they give NaN logits, the argmax of which is
token 0, so such an example repeats token 0 with a NaN score. Check weights
once at load with `inference.check_finite`.
"""

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decode_args
# Re-exported: what callers of the decode fns check and read.
from t5x_speed.decode_args import (  # pylint: disable=unused-import
    INVALID_INITIAL_INDEX, INVALID_STEP_LIMIT, INVALID_TOKEN_ID, IntOrArray,
    check_greedy_params, check_token_range)

Array = jax.Array
# (tokens [B], carry [B, R-1, E], positions [B, R], cache)
#   -> (logits [B, R, V], hidden [B, R, E], cache)
PipelineStepFn = Callable[[Array, Array, Array, Any], Tuple[Array, Array, Any]]



@flax.struct.dataclass
class DecodingState:
  """What `tokens_to_logits` sees; the fields of T5X's `DecodingState`.

  Attributes:
    cur_index: [batch] position of `cur_token`; -1 for a finished example,
      whose step must write nothing.
    sequences: [batch, length] tokens so far.
    cur_token: [batch, 1] the token to run.
    cache: the model's cache.
  """

  cur_index: Array
  sequences: Array
  cur_token: Array
  cache: Any


def _first_tokens(inputs: Array, initial_index: Array) -> Tuple[Array, Array]:
  """The [batch, length + 1] sequence buffer and the tokens at initial_index."""
  sequences = jnp.pad(inputs.astype(jnp.int32), ((0, 0), (0, 1)))
  return sequences, jnp.take_along_axis(sequences, initial_index[:, None], 1)[:, 0]


def _token_log_prob(logits: Array, tokens: Array) -> Array:
  """log_softmax(logits)[tokens]: [batch, vocab], [batch] -> [batch]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return jnp.take_along_axis(log_probs, tokens[:, None], -1)[:, 0]


def _write(sequences: Array, positions: Array, tokens: Array,
           where: Array) -> Array:
  """sequences[b, positions[b]] = tokens[b] where `where`, else untouched."""
  rows = jnp.arange(sequences.shape[0])
  positions = jnp.where(where, positions, sequences.shape[1])  # dropped
  return sequences.at[rows, positions].set(tokens, mode='drop')


class TokenRule(Protocol):
  """How a decode loop picks each next token (greedy, or `sampling`'s).

  `tokens` sees logits [batch, S, vocab] for S tokens per example (S = 1
  sequentially, R in SPEED's pipeline) and the position each would fill
  [batch, S]; it must treat every (example, position) alike wherever it is
  computed, so that SPEED's final stage picks what the sequential loop picks.
  `log_prob` scores a picked token [batch] from its logits [batch, vocab].
  """

  def tokens(self, logits: Array, positions: Array) -> Array:
    ...

  def log_prob(self, logits: Array, tokens: Array) -> Array:
    ...


def argmax(logits: Array) -> Array:
  """jnp.argmax(logits, -1) as int32: the first maximum, or the first NaN.

  XLA:CPU runs jnp.argmax's (value, index) reduction one element at a time,
  0.3 ms for SPEED's 3 x 32128 logits per step; two plain reductions and a
  masked minimum vectorise (5-6x faster) and pick the same index.

  Example:
    >>> int(argmax(jnp.array([1.0, 3.0, 2.0, 3.0])))
    1
  """
  nan = jnp.isnan(logits)
  top = jnp.max(logits, -1, keepdims=True)
  hit = jnp.where(jnp.any(nan, -1, keepdims=True), nan, logits == top)
  ids = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(hit, ids, logits.shape[-1]), -1)


class _Argmax:
  """Greedy: the most likely token, scored by its log-probability."""

  def tokens(self, logits: Array, positions: Array) -> Array:
    del positions
    return argmax(logits)

  def log_prob(self, logits: Array, tokens: Array) -> Array:
    return _token_log_prob(logits, tokens)


ARGMAX = _Argmax()


# ----------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class GreedyState:
  """Loop state of `greedy_decode`.

  Attributes:
    cur_index: [batch] position of `cur_token`.
    cur_token: [batch] token to run next.
    sequences: [batch, length + 1] token at each position.
    ended: [batch] bool.
    log_prob: [batch] summed log-probabilities of the produced tokens.
    cache: the model's cache.
    step: [] loop steps taken (the loop stops at length + 1).
  """

  cur_index: Array
  cur_token: Array
  sequences: Array
  ended: Array
  log_prob: Array
  cache: Any
  step: Array


def greedy_decode(inputs: Array,
                  cache: Any,
                  tokens_to_logits: Callable[[DecodingState], Tuple[Array, Any]],
                  eos_id: IntOrArray,
                  num_decodes: int = 1,
                  initial_index: Optional[Array] = None,
                  max_decode_steps: Optional[IntOrArray] = None,
                  cache_offset: int = 0,
                  decode_rng: Optional[Array] = None,
                  temperature: Any = 0.0,
                  topk: Any = 1,
                  topp: Any = 0.0,
                  max_decode_steps_hard_limit: Optional[int] = None
                  ) -> Tuple[Array, Array]:
  """Stripped-down greedy decoding: one full-depth token per loop step.

  Args:
    inputs: [batch, length] BOS-shifted prompts, zeros after the prompt.
    cache: cache prefilled for positions < initial_index.
    tokens_to_logits: `DecodingState` -> (logits [batch, vocab], new cache).
    eos_id: end-of-sequence id, an integer or [batch] integers.
    num_decodes: must be 1.
    initial_index: [batch] prompt lengths, in [0, length); defaults to 0
      (decode from BOS).
    max_decode_steps: optional limit on produced tokens per example (>= 1),
      an integer or [batch] integers.
    cache_offset: the batch axis of the cache's leaves (unused: one decode
      per example needs no cache expansion).
    decode_rng: ignored (greedy is deterministic); accepted for T5X.
    temperature: T5X's sampling temperature, accepted where it keeps the
      decode greedy (see `check_greedy_params`): 0 (or any with topk 1).
    topk: T5X's top-k, likewise: 1 (or any at temperature 0).
    topp: T5X's top-p, likewise: 0 (or any at temperature 0).
    max_decode_steps_hard_limit: as T5X's: if > 0, caps `max_decode_steps`.

  Returns:
    (decodes [batch, 1, length], scores [batch, 1]); the score of an invalid
    example (see the module docstring) is NaN.

  Raises:
    ValueError: for bad arguments, see the module docstring; also for
      sampling parameters (`check_greedy_params`).
  """
  del decode_rng
  max_decode_steps = check_greedy_params(
      'greedy_decode', temperature, topk, topp, max_decode_steps,
      max_decode_steps_hard_limit)
  decode_args.check_one_decode(num_decodes)
  checked = check_sequential(inputs, cache, tokens_to_logits, initial_index,
                             max_decode_steps, eos_id, cache_offset)
  sequences, scores = sequential_loop(inputs, cache, tokens_to_logits,
                                      checked, ARGMAX)
  return sequences[:, None, 1:], scores[:, None]


def check_sequential(inputs, cache, tokens_to_logits, initial_index,
                     max_decode_steps, eos_id, cache_offset
                     ) -> decode_args.Checked:
  """Checks a full-depth decode's arguments (see the module docstring)."""
  batch, length = decode_args.check_structure(inputs, cache_offset, cache)
  logits_shape = jax.eval_shape(tokens_to_logits, DecodingState(
      cur_index=jax.ShapeDtypeStruct((batch,), jnp.int32),
      sequences=jax.ShapeDtypeStruct((batch, length), jnp.int32),
      cur_token=jax.ShapeDtypeStruct((batch, 1), jnp.int32),
      cache=decode_args.shape_of(cache)))[0]
  return decode_args.validate(inputs, initial_index, max_decode_steps,
                              eos_id, vocab_size=logits_shape.shape[-1])


def sequential_loop(inputs: Array, cache: Any,
                    tokens_to_logits: Callable[[DecodingState],
                                               Tuple[Array, Any]],
                    checked: decode_args.Checked,
                    rule: TokenRule) -> Tuple[Array, Array]:
  """One full-depth token per loop step, chosen by `rule`.

  Returns:
    (sequences [batch, length + 1] with BOS first, scores [batch]: the
    summed log-probabilities of the produced tokens as `rule.log_prob`
    gives them, NaN for an invalid example).
  """
  batch, length = inputs.shape
  initial_index, max_len = checked.initial_index, checked.max_len
  sequences, token0 = _first_tokens(inputs, initial_index)

  def greedy_cond_fn(state: GreedyState) -> Array:
    # Each step advances every live example by one position: length + 1
    # steps bound any input.
    return ~jnp.all(state.ended) & (state.step <= length)

  def greedy_body_fn(state: GreedyState) -> GreedyState:
    live = ~state.ended
    logits, cache = tokens_to_logits(DecodingState(
        cur_index=jnp.where(live, state.cur_index, -1),
        sequences=state.sequences[:, :length],
        cur_token=state.cur_token[:, None],
        cache=state.cache))
    position = state.cur_index + 1
    token = rule.tokens(logits[:, None], position[:, None])[:, 0]
    ended = state.ended | (live & ((token == checked.eos_id) |
                                   (position >= max_len)))
    return GreedyState(
        cur_index=jnp.where(live, position, state.cur_index),
        cur_token=token,
        sequences=_write(state.sequences, position, token, live),
        ended=ended,
        log_prob=state.log_prob + jnp.where(
            live, rule.log_prob(logits, token), 0.0),
        cache=cache,
        step=state.step + 1)

  final = lax.while_loop(greedy_cond_fn, greedy_body_fn, GreedyState(
      cur_index=initial_index, cur_token=token0, sequences=sequences,
      ended=checked.done,
      log_prob=jnp.zeros((batch,), jnp.float32), cache=cache,
      step=jnp.zeros((), jnp.int32)))
  invalid = (checked.invalid != 0) | ~final.ended
  return final.sequences, jnp.where(invalid, jnp.nan, final.log_prob)


# ----------------------------------------------------------------------------
# SPEED
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class SpeedStats:
  """Per-example SPEED counters (B examples, R stages).

  Attributes:
    num_steps: [batch] loop steps taken while the example was live.
    num_tokens: [batch] tokens committed.
    occupied_slots: [batch] occupied stages summed over live steps.
    flushes: [batch, R] restarts triggered by a mismatch at each stage.
    stage_evaluations: [batch, R] tokens run at each stage, flushed included.
    stage_flips: [batch, R] of those, predictions that differ from the same
      token's prediction at the previous stage (always 0 at stage 0).
    invalid: [batch] 0 for a decoded example, else the `INVALID_*` flags
      saying why it produced nothing (traced bad inputs; see the module
      docstring).
  """

  num_steps: Array
  num_tokens: Array
  occupied_slots: Array
  flushes: Array
  stage_evaluations: Array
  stage_flips: Array
  invalid: Array

  @classmethod
  def zeros(cls, batch: int, stages: int) -> 'SpeedStats':
    z = lambda *s: jnp.zeros(s, jnp.int32)
    return cls(z(batch), z(batch), z(batch), z(batch, stages),
               z(batch, stages), z(batch, stages), z(batch))

  @classmethod
  def from_aux(cls, aux_values: Mapping[str, Any],
               prefix: str = 'speed/') -> Optional['SpeedStats']:
    """Stats of many examples from aux values as models.py writes them.

    `aux_values['speed/<field>']` holds one value per example (a list, as
    seqio and T5X's infer pass them, or an array with the examples first).
    Returns None where the aux holds no SPEED statistics (other decode fns).
    """
    if prefix + 'num_steps' not in aux_values:
      return None
    return cls(**{f.name: np.stack([np.asarray(v) for v in
                                    aux_values[prefix + f.name]])
                  for f in dataclasses.fields(cls)})

  def summary(self) -> Dict[str, float]:
    """Batch totals and rates as Python numbers (host side)."""
    s = jax.tree.map(lambda x: np.asarray(x, np.float64).sum(0), self)
    stages = s.flushes.shape[0]
    out = {
        'example_steps': float(s.num_steps),
        'tokens': float(s.num_tokens),
        'steps_per_token': float(s.num_steps / max(s.num_tokens, 1)),
        'occupancy': float(s.occupied_slots / max(s.num_steps * stages, 1)),
        'flushes': float(s.flushes.sum()),
        'invalid_examples': float(np.count_nonzero(np.asarray(self.invalid))),
    }
    for r in range(stages):
      out[f'flushes/stage_{r + 1}'] = float(s.flushes[r])
      if r:
        out[f'flip_rate/stage_{r + 1}'] = float(
            s.stage_flips[r] / max(s.stage_evaluations[r], 1))
    return out


@flax.struct.dataclass
class SpeedSchedule:
  """What each loop step ran, for inspection and replay; [steps, batch, R].

  Attributes:
    positions: position at each stage, -1 for empty stages.
    tokens: token at each stage (meaningful where positions >= 0).
    predictions: each stage's exit prediction.
    flushes: bool, the stage whose mismatch flushed its successors.
    num_steps: [] loop steps recorded.
  """

  positions: Array
  tokens: Array
  predictions: Array
  flushes: Array
  num_steps: Array


@flax.struct.dataclass
class SpeedState:
  """Loop state of `speed_decode` (B examples, R stages, width E).

  Attributes:
    stage_positions: [B, R] position of the token at each stage, -1 when the
      stage is empty (the paper's iteration_indices).
    stage_tokens: [B, R] token at each stage; stage_tokens[:, 0] enters next.
    stage_last_preds: [B, R] each token's prediction at its previous stage.
    carry: [B, R-1, E] hidden states entering stages 1..R-1.
    sequences: [B, length + 1] committed token at each position.
    ended: [B] bool.
    log_prob: [B] final-stage log-probabilities of the committed tokens.
    cache: the model's cache.
    stats: `SpeedStats`.
    schedule: `SpeedSchedule`, or None when not recorded.
    step: [] loop steps taken (the loop stops at R * (length + 1)).
  """

  stage_positions: Array
  stage_tokens: Array
  stage_last_preds: Array
  carry: Array
  sequences: Array
  ended: Array
  log_prob: Array
  cache: Any
  stats: SpeedStats
  schedule: Optional[SpeedSchedule]
  step: Array


def speed_decode(inputs: Array,
                 cache: Any,
                 tokens_to_logits: Optional[Callable[..., Any]] = None,
                 eos_id: IntOrArray = 1,
                 num_decodes: int = 1,
                 initial_index: Optional[Array] = None,
                 max_decode_steps: Optional[IntOrArray] = None,
                 cache_offset: int = 0,
                 decode_rng: Optional[Array] = None,
                 *,
                 pipeline_step_fn: Optional[PipelineStepFn] = None,
                 num_stages: Optional[int] = None,
                 initial_carry: Optional[Array] = None,
                 return_stats: bool = False,
                 record_schedule: bool = False,
                 temperature: Any = 0.0,
                 topk: Any = 1,
                 topp: Any = 0.0,
                 max_decode_steps_hard_limit: Optional[int] = None):
  """SPEED: speculative pipelined greedy decoding of a shared-exit model.

  Each loop step runs the G shared layers once over R slots per example, slot
  r holding the token at stage (repetition) r (`pipeline_step_fn`). Then:

  * the token leaving the last stage is committed: its final-stage prediction
    is the next output token;
  * a token whose new prediction differs from the token its successor (found
    by position) was started with flushes every later token; of several such
    mismatches the oldest (lowest position) wins;
  * the newest surviving token's prediction enters stage 0.

  The output is greedy decoding of the final exit, token for token.

  Worked example (R = 3, prompt = BOS at position 0, eos_id = 1). The middle
  and final exits predict 5 6 7 8 1 for positions 1..5; the first exit agrees
  except that, run on position 2, it predicts 9 (not 7) for position 3. "p:t"
  is position p holding token t; "commits" is the token committed for the
  position after the last stage's:

    step | stage 1 | stage 2 | stage 3 | commits | flush
       1 | 0:0     | -       | -       |         |
       2 | 1:5     | 0:0     | -       |         |
       3 | 2:6     | 1:5     | 0:0     | 5       |
       4 | 3:9     | 2:6     | 1:5     | 6       | stage 2
       5 | 3:7     | -       | 2:6     | 7       |
       6 | 4:8     | 3:7     | -       |         |
       7 | 5:1     | 4:8     | 3:7     | 8       |
       8 | 6:0     | 5:1     | 4:8     | 1       |

  At step 4 the middle exit of position 2 predicts 7 while position 3 was
  started with 9: position 3 restarts at stage 1 with 7 (step 5) and the
  flushed 3:9 never reaches stage 2. Output: 5 6 7 8 1 in 8 loop steps with
  one flush (greedy: 5 full-depth steps). tests/test_decoding.py replays this
  table.

  Args:
    inputs: [batch, length] BOS-shifted prompts, zeros after the prompt.
    cache: cache prefilled for positions < initial_index.
    tokens_to_logits: unused; accepted so T5X can pass it.
    eos_id: end-of-sequence id, an integer or [batch] integers.
    num_decodes: must be 1.
    initial_index: [batch] prompt lengths, in [0, length); defaults to 0.
    max_decode_steps: optional limit on produced tokens per example (>= 1),
      an integer or [batch] integers.
    cache_offset: the batch axis of the cache's leaves (unused: one decode
      per example needs no cache expansion).
    decode_rng: ignored; accepted for T5X.
    pipeline_step_fn: (tokens [B], carry [B, R-1, E], positions [B, R], cache)
      -> (logits [B, R, V], hidden [B, R, E], cache). Stage r-1's logits
      only steer speculation; the last stage's must be the model's.
    num_stages: R, the model's number of stages (repetitions), an integer
      >= 1; pipeline_step_fn must return logits for R stages.
    initial_carry: [B, R-1, E] hidden states entering stages 1..R-1 of the
      empty pipeline (zeros; their values are never used), cast to the dtype
      of the step's hidden states. `steps.BoundSteps.decode_fn_kwargs`
      supplies pipeline_step_fn, num_stages and initial_carry.
    return_stats: also return `SpeedStats`.
    record_schedule: also return the `SpeedSchedule` (memory grows with
      R * length steps).
    temperature: T5X's sampling temperature, accepted where it keeps the
      decode greedy (see `check_greedy_params`): 0 (or any with topk 1).
    topk: T5X's top-k, likewise: 1 (or any at temperature 0).
    topp: T5X's top-p, likewise: 0 (or any at temperature 0).
    max_decode_steps_hard_limit: as T5X's: if > 0, caps `max_decode_steps`.

  Returns:
    (decodes [batch, 1, length], scores [batch, 1]), followed by `SpeedStats`
    if `return_stats` and by `SpeedSchedule` if `record_schedule`. The score
    of an invalid example (see the module docstring) is NaN.

  Raises:
    ValueError: for bad arguments, see the module docstring; also when
      `num_stages` or `initial_carry` do not match `pipeline_step_fn`, and
      for sampling parameters (`check_greedy_params`).
  """
  del tokens_to_logits, decode_rng
  max_decode_steps = check_greedy_params(
      'speed_decode', temperature, topk, topp, max_decode_steps,
      max_decode_steps_hard_limit)
  decode_args.check_one_decode(num_decodes)
  stages, initial_carry, checked = check_pipeline(
      inputs, cache, pipeline_step_fn, num_stages, initial_carry,
      initial_index, max_decode_steps, eos_id, cache_offset)
  final, scores = pipelined_loop(inputs, cache, pipeline_step_fn, stages,
                                 initial_carry, checked, ARGMAX,
                                 record_schedule)
  outputs = (final.sequences[:, None, 1:], scores[:, None])
  if return_stats:
    outputs += (final.stats,)
  if record_schedule:
    outputs += (final.schedule,)
  return outputs


def check_pipeline(inputs, cache, pipeline_step_fn, num_stages,
                   initial_carry, initial_index, max_decode_steps, eos_id,
                   cache_offset) -> Tuple[int, Array, decode_args.Checked]:
  """Checks a pipelined decode's arguments: (R, initial carry, checked)."""
  if pipeline_step_fn is None or num_stages is None or initial_carry is None:
    raise ValueError(
        'speed_decode needs pipeline_step_fn, num_stages and initial_carry: '
        'the model must have shared exits (e.g. '
        't5x_speed.models.SpeedDecoderOnlyModel; '
        '`steps.BoundSteps.decode_fn_kwargs` supplies them). Use '
        'greedy_decode or temperature_sample for other models.')
  stages = decode_args.check_int('num_stages', num_stages, 1)
  batch, _ = decode_args.check_structure(inputs, cache_offset, cache)
  carry_shape = getattr(initial_carry, 'shape', ())
  if len(carry_shape) != 3 or carry_shape[:2] != (batch, stages - 1):
    raise ValueError(
        f'initial_carry must be [batch={batch}, R-1={stages - 1}, width] for '
        f'num_stages R = {stages}, got shape {carry_shape}.')
  try:
    logits_shape, hidden_shape, _ = jax.eval_shape(
        pipeline_step_fn, jax.ShapeDtypeStruct((batch,), jnp.int32),
        decode_args.shape_of(initial_carry),
        jax.ShapeDtypeStruct((batch, stages), jnp.int32),
        decode_args.shape_of(cache))
  except (TypeError, ValueError, IndexError) as e:
    raise ValueError(
        f'pipeline_step_fn fails with num_stages R = {stages} and '
        f'initial_carry of shape {carry_shape} (width {carry_shape[2]}): '
        'they must be the model\'s R and [batch, R-1, width] (see '
        '`steps.BoundSteps.decode_fn_kwargs`).') from e
  if logits_shape.shape[:2] != (batch, stages) or hidden_shape.shape != (
      batch, stages, carry_shape[2]):
    raise ValueError(
        f'num_stages R = {stages} and initial_carry {carry_shape} (width '
        f'{carry_shape[2]}) do not match pipeline_step_fn, which returns '
        f'logits {logits_shape.shape} and hidden states {hidden_shape.shape} '
        f'([batch, R, vocab], [batch, R, width]): this model has '
        f'R = {hidden_shape.shape[1]} stages of width '
        f'{hidden_shape.shape[-1]}.')
  checked = decode_args.validate(inputs, initial_index, max_decode_steps,
                                 eos_id, vocab_size=logits_shape.shape[-1])
  return stages, jnp.asarray(initial_carry, hidden_shape.dtype), checked


def pipelined_loop(inputs: Array, cache: Any,
                   pipeline_step_fn: PipelineStepFn, stages: int,
                   initial_carry: Array, checked: decode_args.Checked,
                   rule: TokenRule, record_schedule: bool = False
                   ) -> Tuple[SpeedState, Array]:
  """SPEED's loop (see `speed_decode`), each stage's token chosen by `rule`.

  Returns:
    (the final `SpeedState`, its `stats.invalid` filled in; scores [batch]:
    the summed final-stage log-probabilities of the committed tokens as
    `rule.log_prob` gives them, NaN for an invalid example).
  """
  batch, length = inputs.shape
  initial_index, max_len = checked.initial_index, checked.max_len
  sequences, token0 = _first_tokens(inputs, initial_index)
  rows = jnp.arange(batch)
  stage_ids = jnp.arange(stages)
  # A committed token takes at most R steps (a flush restarts its successor
  # with the final prediction), and at most `length` tokens are committed.
  max_steps = stages * (length + 1)

  def speed_cond_fn(state: SpeedState) -> Array:
    return ~jnp.all(state.ended) & (state.step < max_steps)

  def speed_body_fn(state: SpeedState) -> SpeedState:
    pos, tok = state.stage_positions, state.stage_tokens
    valid = pos >= 0                                             # [B, R]
    logits, hidden, cache = pipeline_step_fn(tok[:, 0], state.carry, pos,
                                             state.cache)
    preds = rule.tokens(logits, pos + 1)                         # [B, R]

    # The token leaving the last stage commits its final-stage prediction.
    commits = valid[:, -1]
    committed, commit_at = preds[:, -1], pos[:, -1] + 1
    ended = state.ended | (commits & ((committed == checked.eos_id) |
                                      (commit_at >= max_len)))

    # Successors are found by position: flushes leave gaps between stages.
    # is_succ[b, r, s]: stage s holds the successor of stage r's token.
    is_succ = valid[:, None, :] & (pos[:, None, :] == pos[:, :, None] + 1)
    succ_token = jnp.sum(jnp.where(is_succ, tok[:, None, :], 0), -1)
    mismatch = valid & jnp.any(is_succ, -1) & (succ_token != preds)
    # The oldest (lowest-position) mismatch wins; later tokens are flushed.
    cut = jnp.min(jnp.where(mismatch, pos, length + 1), -1)       # [B]
    survive = valid & (pos <= cut[:, None]) & ~ended[:, None]
    flushed_by = mismatch & (pos == cut[:, None]) & ~ended[:, None]

    # The newest survivor's prediction enters stage 0, if within the limit.
    newest = jnp.argmax(jnp.where(survive, pos, -1), -1)          # [B]
    new_pos = pos[rows, newest] + 1
    enters = jnp.any(survive, -1) & (new_pos < max_len)

    # Survivors advance one stage; the last stage's token has left.
    shift = lambda first, x: jnp.concatenate([first[:, None], x[:, :-1]], 1)
    stats = state.stats
    live = ~state.ended
    stats = SpeedStats(
        num_steps=stats.num_steps + live,
        num_tokens=stats.num_tokens + commits,
        occupied_slots=stats.occupied_slots + valid.sum(-1),
        flushes=stats.flushes + flushed_by,
        stage_evaluations=stats.stage_evaluations + valid,
        stage_flips=stats.stage_flips + (
            valid & (stage_ids > 0) & (preds != state.stage_last_preds)),
        invalid=stats.invalid)
    schedule = state.schedule
    if schedule is not None:
      step = jnp.minimum(schedule.num_steps, max_steps - 1)
      record = lambda buf, x: buf.at[step].set(x)
      schedule = SpeedSchedule(
          positions=record(schedule.positions, pos),
          tokens=record(schedule.tokens, tok),
          predictions=record(schedule.predictions, preds),
          flushes=record(schedule.flushes, flushed_by),
          num_steps=schedule.num_steps + 1)
    return SpeedState(
        stage_positions=shift(jnp.where(enters, new_pos, -1),
                              jnp.where(survive, pos, -1)),
        stage_tokens=shift(preds[rows, newest], tok),
        stage_last_preds=shift(jnp.zeros_like(newest), preds),
        carry=hidden[:, :-1],
        sequences=_write(state.sequences, commit_at, committed, commits),
        ended=ended,
        log_prob=state.log_prob + jnp.where(
            commits, rule.log_prob(logits[:, -1], committed), 0.0),
        cache=cache,
        stats=stats,
        schedule=schedule,
        step=state.step + 1)

  schedule = None
  if record_schedule:
    buf = lambda dtype: jnp.zeros((max_steps, batch, stages), dtype)
    schedule = SpeedSchedule(buf(jnp.int32), buf(jnp.int32), buf(jnp.int32),
                             buf(bool), jnp.zeros((), jnp.int32))
  empty = jnp.full((batch, stages - 1), -1, jnp.int32)
  first = jnp.where(checked.done, -1, initial_index)   # done: empty pipeline
  final = lax.while_loop(speed_cond_fn, speed_body_fn, SpeedState(
      stage_positions=jnp.concatenate([first[:, None], empty], 1),
      stage_tokens=jnp.concatenate([token0[:, None], 0 * empty], 1),
      stage_last_preds=jnp.zeros((batch, stages), jnp.int32),
      carry=initial_carry,
      sequences=sequences,
      ended=checked.done,
      log_prob=jnp.zeros((batch,), jnp.float32),
      cache=cache,
      stats=SpeedStats.zeros(batch, stages),
      schedule=schedule,
      step=jnp.zeros((), jnp.int32)))
  invalid = checked.invalid | jnp.where(final.ended, 0, INVALID_STEP_LIMIT)
  return (final.replace(stats=final.stats.replace(invalid=invalid)),
          jnp.where(invalid != 0, jnp.nan, final.log_prob))
