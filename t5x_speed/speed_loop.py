"""SPEED's pipelined decode loop, with its statistics and schedule.

`decoding.speed_decode` runs `speed_or_sequential` with the argmax,
`sampling.speed_sample_decode` with its position-keyed sampler; the
pipeline is described in `decoding.speed_decode`'s docstring. Positions,
limits and invalid examples follow the contract in `decoding`'s module
docstring.

Where a step would multiply more rows (batch x R) than
`max_speculative_rows`, `speed_or_sequential` runs the sequential loop with
the same token rule instead: its output is the pipeline's, token for token,
and at that size a full-depth step per token is faster (see
`t5x_speed.cpu.dispatch.max_speculative_rows`); its result says so
(`pipelined` False), and `require_pipeline` makes it an error instead.
"""

import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp

from t5x_speed import decode_args
from t5x_speed import speed_branches
from t5x_speed import sequential_loop
from t5x_speed import token_rules
from t5x_speed.decode_args import INVALID_STEP_LIMIT
from t5x_speed.results import SpeedSchedule
from t5x_speed.results import SpeedStats

__all__ = ['PipelineStepFn', 'SpeedState', 'LoopResult', 'check_pipeline',
           'pipelined_loop', 'speculates', 'speed_or_sequential',
           'within_limit']

Array = jax.Array
# (tokens [B], carry [B, R-1, E], positions [B, R], cache)
#   -> (logits [B, R, V], hidden [B, R, E], cache)
PipelineStepFn = Callable[[Array, Array, Array, Any], Tuple[Array, Array, Any]]


@flax.struct.dataclass
class SpeedState:
  """Loop state of `pipelined_loop` (B examples, R stages, width E).

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
    num_steps: [B] loop steps taken while the example was live.
    stage_counts: [B, 3, R] per stage: tokens run, flushes triggered and
      flips (`SpeedStats`' stage_evaluations, flushes and stage_flips, kept
      in one array so that one op per step updates them).
    schedule: `SpeedSchedule`, or None when not recorded.
    step: [] loop steps taken (the loop stops at R * (length + 1)).
    branch_tokens: [B, K] the candidate branches entering stage 0 beside
      stage_tokens[:, 0] (`speed_branches`), or None without branches.
    branch_counts: [B, 2] branches accepted and branch slots run, or None
      without branches.
  """

  stage_positions: Array
  stage_tokens: Array
  stage_last_preds: Array
  carry: Array
  sequences: Array
  ended: Array
  log_prob: Array
  cache: Any
  num_steps: Array
  stage_counts: Array
  schedule: Optional[SpeedSchedule]
  step: Array
  branch_tokens: Optional[Array] = None
  branch_counts: Optional[Array] = None


def check_pipeline(inputs, cache, pipeline_step_fn, num_stages,
                   initial_carry, initial_index, max_decode_steps, eos_id,
                   cache_offset, fn_name: str = 'speed_decode'
                   ) -> Tuple[int, Array, decode_args.Checked]:
  """Checks a pipelined decode's arguments: (R, initial carry, checked).

  `fn_name` names the decode fn in the error for a missing pipelined step.
  """
  if pipeline_step_fn is None or num_stages is None or initial_carry is None:
    raise ValueError(
        f'{fn_name} needs pipeline_step_fn, num_stages and initial_carry: '
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
                   rule: token_rules.TokenRule, record_schedule: bool = False,
                   branches: int = 0
                   ) -> Tuple[SpeedState, SpeedStats, Array]:
  """SPEED's loop (`decoding.speed_decode`), each stage's token chosen by
  `rule`, with `branches` candidate branches (`speed_branches`; 0: none).

  Returns:
    (the final `SpeedState`; its `SpeedStats`; scores [batch]:
    the summed final-stage log-probabilities of the committed tokens as
    `rule.pick` gives them, NaN for an invalid example).
  """
  batch, length = inputs.shape
  initial_index, max_len = checked.initial_index, checked.max_len
  sequences, token0 = sequential_loop.first_tokens(inputs, initial_index)
  stage_ids = jnp.arange(stages)
  # A committed token takes at most R steps (a flush restarts its successor
  # with the final prediction), and at most `length` tokens are committed.
  max_steps = stages * (length + 1)
  slots = stages + branches

  def speed_cond_fn(state: SpeedState) -> Array:
    return ~jnp.all(state.ended) & (state.step < max_steps)

  def speed_body_fn(state: SpeedState) -> SpeedState:
    pos, tok = state.stage_positions, state.stage_tokens
    valid = pos >= 0                                             # [B, R]
    if branches:
      branch_pos = jnp.broadcast_to(pos[:, :1], (batch, branches))
      logits, hidden, cache = pipeline_step_fn(
          jnp.concatenate([tok[:, :1], state.branch_tokens], 1),
          state.carry, jnp.concatenate([pos, branch_pos], 1), state.cache)
      preds, last_log_prob = rule.pick(logits[:, :stages], pos + 1)
      branch_preds, _ = rule.pick(logits[:, stages:], branch_pos + 1)
    else:
      logits, hidden, cache = pipeline_step_fn(tok[:, 0], state.carry, pos,
                                               state.cache)
      preds, last_log_prob = rule.pick(logits, pos + 1)          # [B, R]

    # The token leaving the last stage commits its final-stage prediction.
    commits = valid[:, -1]
    committed, commit_at = preds[:, -1], pos[:, -1] + 1
    ended = state.ended | (commits & ((committed == checked.eos_id) |
                                      (commit_at >= max_len)))

    # Successors are found by position: flushes leave gaps between stages.
    # The stage axis is short (R), so its reductions are written as R
    # elementwise terms: XLA then fuses them with their consumers instead of
    # running each reduction as an op of its own every step.
    stage = lambda x: [x[:, s] for s in range(stages)]
    succ_any = jnp.zeros_like(valid)
    succ_token = jnp.zeros_like(tok)
    for p_s, t_s, v_s in zip(stage(pos), stage(tok), stage(valid)):
      # here[b, r]: stage s holds the successor of stage r's token.
      here = v_s[:, None] & (p_s[:, None] == pos + 1)             # [B, R]
      succ_any = succ_any | here
      succ_token = jnp.where(here, t_s[:, None], succ_token)
    mismatch = valid & succ_any & (succ_token != preds)
    # The oldest (lowest-position) mismatch wins; later tokens are flushed.
    cut = functools.reduce(jnp.minimum, stage(
        jnp.where(mismatch, pos, length + 1)))                    # [B]
    if branches:
      # A verdict on stage 0's token that names a branch keeps the pipeline:
      # that branch takes the token's place, and nothing is flushed.
      verdict = functools.reduce(jnp.add, stage(
          jnp.where(mismatch & (pos == cut[:, None]), preds, 0)))
      hits = ((state.branch_tokens == verdict[:, None]) &
              ((cut + 1 == pos[:, 0]) & valid[:, 0] & ~ended)[:, None])
      accepted = jnp.any(hits, -1)                               # [B]
      which = jnp.argmax(hits, -1)                               # [B]
      flushed_cut = jnp.where(accepted, length + 1, cut)
      take = lambda x: jnp.take_along_axis(
          x, which[:, None], 1)[:, 0]
      stage0_pred = jnp.where(accepted, take(branch_preds), preds[:, 0])
      stage0_token = jnp.where(accepted, take(state.branch_tokens), tok[:, 0])
      stage0_hidden = jnp.where(accepted[:, None],
                                jnp.take_along_axis(
                                    hidden[:, stages:], which[:, None, None],
                                    1)[:, 0], hidden[:, 0])
      preds_now = preds.at[:, 0].set(stage0_pred)
      tok_now = tok.at[:, 0].set(stage0_token)
    else:
      flushed_cut, preds_now, tok_now = cut, preds, tok
    survive = valid & (pos <= flushed_cut[:, None]) & ~ended[:, None]
    flushed_by = mismatch & (pos == flushed_cut[:, None]) & ~ended[:, None]

    # The newest survivor's prediction enters stage 0, if within the limit.
    newest_pos = functools.reduce(jnp.maximum, stage(
        jnp.where(survive, pos, -1)))                             # [B]
    newest_pred = preds_now[:, 0]
    for p_s, s_s, t_s in zip(stage(pos), stage(survive), stage(preds_now)):
      newest_pred = jnp.where(s_s & (p_s == newest_pos), t_s, newest_pred)
    new_pos = newest_pos + 1
    enters = (newest_pos >= 0) & (new_pos < max_len)

    # Statistics: tokens run, flushes triggered and flips, per stage.
    flips = valid & (stage_ids > 0) & (preds != state.stage_last_preds)
    counts = jnp.stack([valid, flushed_by, flips], 1).astype(jnp.int32)
    extra = {}
    if branches:
      # The next branches: the runners-up of the row whose prediction
      # enters, and stage 0's survivor copied into every stage-0 cache.
      newest_row = jnp.where(accepted, stages + which, 0)
      for s in range(1, stages):
        newest_row = jnp.where(survive[:, s] & (pos[:, s] == newest_pos), s,
                               newest_row)
      row_logits = jnp.take_along_axis(
          logits, newest_row[:, None, None], 1)                # [B, 1, V]
      cache = speed_branches.sync_stage_zero(
          cache, stages, branches, jnp.where(accepted, stages + which, 0),
          jnp.where(survive[:, 0], pos[:, 0], -1))
      extra = dict(
          branch_tokens=speed_branches.runners_up(
              row_logits, newest_pred[:, None], branches)[:, 0],
          branch_counts=state.branch_counts + jnp.stack(
              [accepted, valid[:, 0] & ~state.ended], 1).astype(jnp.int32) *
          jnp.asarray([1, branches], jnp.int32))
      hidden = jnp.concatenate([stage0_hidden[:, None], hidden[:, 1:stages]],
                               1)
    schedule = state.schedule
    if schedule is not None:
      step = jnp.minimum(schedule.num_steps, max_steps - 1)
      record = lambda buf, x: buf.at[step].set(x)
      schedule = SpeedSchedule(
          positions=record(schedule.positions, pos),
          tokens=record(schedule.tokens, tok),
          predictions=record(schedule.predictions, preds),
          flushes=record(schedule.flushes, flushed_by),
          num_steps=schedule.num_steps + 1,
          candidates=None if schedule.candidates is None else record(
              schedule.candidates, jnp.concatenate([
                  jnp.concatenate([preds, branch_preds], 1)[..., None],
                  speed_branches.runners_up(
                      logits, jnp.concatenate([preds, branch_preds], 1),
                      branches)], -1)))
    # Survivors advance one stage; the last stage's token has left.
    shift = lambda first, x: jnp.concatenate([first[:, None], x[:, :-1]], 1)
    return SpeedState(
        stage_positions=shift(jnp.where(enters, new_pos, -1),
                              jnp.where(survive, pos, -1)),
        stage_tokens=shift(newest_pred, tok_now),
        stage_last_preds=shift(jnp.zeros_like(newest_pos), preds_now),
        carry=hidden[:, :stages - 1],
        sequences=sequential_loop.write(state.sequences, commit_at,
                                        committed, commits),
        ended=ended,
        log_prob=state.log_prob + jnp.where(
            commits, last_log_prob, 0.0),
        cache=cache,
        num_steps=state.num_steps + ~state.ended,
        stage_counts=state.stage_counts + counts,
        schedule=schedule,
        step=state.step + 1,
        **extra)

  schedule = None
  if record_schedule:
    buf = lambda dtype: jnp.zeros((max_steps, batch, stages), dtype)
    schedule = SpeedSchedule(
        buf(jnp.int32), buf(jnp.int32), buf(jnp.int32), buf(bool),
        jnp.zeros((), jnp.int32),
        candidates=jnp.zeros((max_steps, batch, slots, branches + 1),
                             jnp.int32) if branches else None)
  empty = jnp.full((batch, stages - 1), -1, jnp.int32)
  first = jnp.where(checked.done, -1, initial_index)   # done: empty pipeline
  extra = {}
  if branches:
    cache = speed_branches.add_branch_stages(cache, stages, branches)
    # No branch is accepted before a verdict, so any tokens do at first.
    extra = dict(branch_tokens=jnp.zeros((batch, branches), jnp.int32),
                 branch_counts=jnp.zeros((batch, 2), jnp.int32))
  final = lax.while_loop(speed_cond_fn, speed_body_fn, SpeedState(
      stage_positions=jnp.concatenate([first[:, None], empty], 1),
      stage_tokens=jnp.concatenate([token0[:, None], 0 * empty], 1),
      stage_last_preds=jnp.zeros((batch, stages), jnp.int32),
      carry=initial_carry,
      sequences=sequences,
      ended=checked.done,
      log_prob=jnp.zeros((batch,), jnp.float32),
      cache=cache,
      num_steps=jnp.zeros((batch,), jnp.int32),
      stage_counts=jnp.zeros((batch, 3, stages), jnp.int32),
      schedule=schedule,
      step=jnp.zeros((), jnp.int32),
      **extra))
  invalid = _invalid_flags(checked, final.ended)
  evaluations, flushes, flips = (final.stage_counts[:, i] for i in range(3))
  branch_counts = (final.branch_counts if branches else
                   jnp.zeros((batch, 2), jnp.int32))
  # A token commits exactly when it runs at the last stage.
  stats = SpeedStats(
      num_steps=final.num_steps, num_tokens=evaluations[:, -1],
      occupied_slots=evaluations.sum(-1), flushes=flushes,
      stage_evaluations=evaluations, stage_flips=flips, invalid=invalid,
      pipelined=jnp.ones((batch,), jnp.int32),
      branch_hits=branch_counts[:, 0], branch_evaluations=branch_counts[:, 1],
      branches=jnp.full((batch,), branches, jnp.int32))
  return final, stats, jnp.where(invalid != 0, jnp.nan, final.log_prob)


def _invalid_flags(checked: decode_args.Checked, ended: Array) -> Array:
  """`SpeedStats.invalid`: the traced checks' flags, and the step limit's
  where an example did not end."""
  return checked.invalid | jnp.where(ended, 0, INVALID_STEP_LIMIT)


def within_limit(rows: int, max_speculative_rows: Optional[int],
                 record_schedule: bool) -> bool:
  """Whether `rows` rows (batch x R) run the pipeline whatever the model:
  no limit (None), at most `max_speculative_rows`, or a requested schedule
  (it records the pipeline's steps)."""
  return (max_speculative_rows is None or rows <= max_speculative_rows or
          record_schedule)


def speculates(rows: int, max_speculative_rows: Optional[int],
               tokens_to_logits: Optional[Any], record_schedule: bool) -> bool:
  """Whether a SPEED decode of `rows` rows (batch x R) runs the pipeline.

  It does `within_limit`, and beyond the limit where no full-depth
  `tokens_to_logits` is there to decode sequentially.
  """
  return (within_limit(rows, max_speculative_rows, record_schedule) or
          tokens_to_logits is None)


class LoopResult(NamedTuple):
  """What `speed_or_sequential` produced, per decoded row.

  Attributes:
    sequences: [rows, length + 1] with BOS first.
    scores: [rows], as `pipelined_loop`'s.
    lengths: [rows] tokens produced after the prompt.
    stats: the `SpeedStats`.
    schedule: the `SpeedSchedule`, or None.
    pipelined: whether the pipeline ran (static).
  """
  sequences: Array
  scores: Array
  lengths: Array
  stats: SpeedStats
  schedule: Optional[SpeedSchedule]
  pipelined: bool


def speed_or_sequential(
    inputs: Array, cache: Any, pipeline_step_fn: PipelineStepFn,
    tokens_to_logits: Optional[sequential_loop.TokensToLogitsFn],
    stages: int, initial_carry: Array, checked: decode_args.Checked,
    rule: token_rules.TokenRule, max_speculative_rows: Optional[int],
    record_schedule: bool = False, require_pipeline: bool = False,
    fn_name: str = 'speed_decode', branches: int = 0) -> LoopResult:
  """SPEED's pipeline, or the sequential loop where `speculates` says no.

  Both choose every token by `rule` from the final exit's logits, so the
  sequences are the same either way. The pipeline runs `branches`
  candidate branches per example (`speed_branches`): a step takes
  batch x (R + branches) rows; `max_speculative_rows` bounds batch x R.

  Raises:
    ValueError: naming `max_speculative_rows`, where the pipeline would not
      run and `require_pipeline` is set.
  """
  rows = inputs.shape[0] * stages
  if speculates(rows, max_speculative_rows, tokens_to_logits,
                record_schedule):
    final, stats, scores = pipelined_loop(
        inputs, cache, pipeline_step_fn, stages, initial_carry, checked, rule,
        record_schedule, branches)
    return LoopResult(final.sequences, scores, stats.num_tokens, stats,
                      final.schedule, True)
  if require_pipeline:
    raise ValueError(
        f'{fn_name}: a step of this batch would take {rows} rows (batch x R), '
        f'more than max_speculative_rows={max_speculative_rows}, so it would '
        "decode with the full-depth step (greedy's, the same tokens), but "
        'require_pipeline is set: decode fewer examples at once, raise '
        'max_speculative_rows, or set it to None to always run the pipeline.')
  final, scores = sequential_loop.sequential_loop(
      inputs, cache, tokens_to_logits, checked, rule)
  produced = final.cur_index - checked.initial_index  # 0 where done
  stats = SpeedStats.sequential(produced, stages,
                                _invalid_flags(checked, final.ended))
  return LoopResult(final.sequences, scores, stats.num_tokens, stats, None,
                    False)
