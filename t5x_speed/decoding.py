"""Greedy and SPEED decoding under T5X's decode-fn contract, and `decode`.

`greedy_decode` and `speed_decode` (and the samplers of `sampling`) take
what T5X's `DecoderOnlyModel.predict_batch_with_aux` passes to its
`decode_fn` (`inputs`, a prefilled `cache`, `tokens_to_logits`, `eos_id`,
`num_decodes`, `initial_index`, `cache_offset`, `decode_rng`, decoder
params) and return a `DecodeResult` (`t5x_speed.results`), which unpacks as
what T5X's decode fns return: `(decodes [batch, num_decodes, length],
scores [batch, num_decodes])`; `decodes[:, d, k]` is the token at position
k+1, the prompt included, zeros after the end. The result also holds each
decode's length and, for SPEED, its `SpeedStats`, whether the pipeline ran
and, with `record_schedule=True`, its `SpeedSchedule`.

`decode(decode_fn, **kwargs)` runs any decode fn, ours or T5X's, and returns
a `DecodeResult`. Our decode fns declare on themselves what they take
(`declare_decode_fn`, read by `decode_fn_spec`); `steps.BoundSteps.
decode_fn_kwargs` builds their arguments from the declaration.

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

The loops live in `sequential_loop` (full depth) and `speed_loop` (SPEED's
pipeline), the token choice in `token_rules` and the argument checks in
`decode_args`.
"""

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax

from t5x_speed import cpu
from t5x_speed import decode_args
from t5x_speed import sequential_loop
from t5x_speed import speed_loop
from t5x_speed import token_rules
from t5x_speed.decode_args import IntOrArray
from t5x_speed.decode_args import check_greedy_params
from t5x_speed.results import DecodeResult
from t5x_speed.speed_loop import PipelineStepFn

__all__ = ['speed_decode', 'greedy_decode', 'decode', 'DecodeFnSpec',
           'declare_decode_fn', 'decode_fn_spec']

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeFnSpec:
  """What a decode fn of this package declares about the arguments it takes.

  Attributes:
    pipelined: it runs SPEED's pipeline: it takes `pipeline_step_fn`,
      `num_stages`, `initial_carry`, `max_speculative_rows`,
      `require_pipeline` and `record_schedule`, and reports `SpeedStats`.
    kv_cache: it takes the model's `network.KVCache` as is and reads each
      example's position from `DecodingState.cur_index`. Decode fns that
      declare nothing (T5X's) get the cache in T5X's form instead
      (`steps.to_t5x_cache`).
  """

  pipelined: bool
  kv_cache: bool = True


_SPEC_ATTRIBUTE = 'decode_fn_spec'


def declare_decode_fn(*, pipelined: bool, kv_cache: bool = True):
  """Decorator declaring a decode fn's `DecodeFnSpec` as its attribute
  `decode_fn_spec`, which gin's configurable wrapper copies
  (`functools.wraps`)."""
  spec = DecodeFnSpec(pipelined=pipelined, kv_cache=kv_cache)

  def declare(decode_fn):
    setattr(decode_fn, _SPEC_ATTRIBUTE, spec)
    return decode_fn

  return declare


def decode_fn_spec(decode_fn: Callable[..., Any]) -> Optional[DecodeFnSpec]:
  """The `DecodeFnSpec` declared on `decode_fn` (or, for a
  `functools.partial`, on the function it binds); None if none is.

  The declaration is the function's own attribute: wrappers that do not
  copy it (`functools.wraps` and gin's configurable do) declare nothing.

  Example:
    >>> decode_fn_spec(functools.partial(speed_decode, max_decode_steps=3))
    DecodeFnSpec(pipelined=True, kv_cache=True)
    >>> decode_fn_spec(print) is None
    True
  """
  while isinstance(decode_fn, functools.partial):
    decode_fn = decode_fn.func
  spec = getattr(decode_fn, _SPEC_ATTRIBUTE, None)
  return spec if isinstance(spec, DecodeFnSpec) else None


def decode(decode_fn: Callable[..., Any], *, record_schedule: bool = False,
           **kwargs) -> DecodeResult:
  """Runs any T5X decode fn, ours or T5X's, and returns its `DecodeResult`.

  `decode_fn` is called with `kwargs` as T5X calls it, through whatever wraps
  it (a partial, gin's configurable), so that its bound arguments apply.
  Ours return their `DecodeResult`; T5X's `(decodes, scores)` come as one
  with lengths, stats and schedule None.

  Args:
    decode_fn: the decode fn, e.g. `speed_decode`, `greedy_decode`,
      `sampling.speed_sample_decode`, `t5x.decoding.beam_search`.
    record_schedule: also record SPEED's `SpeedSchedule` (memory grows with
      R * length steps); only for pipelined decode fns.
    **kwargs: the decode fn's arguments (`steps.BoundSteps.decode_fn_kwargs`
      gives the model's; add eos_id, limits and sampling parameters).

  Returns:
    The `DecodeResult`.

  Raises:
    ValueError: `record_schedule` for a decode fn that is not pipelined; and
      what `decode_fn` raises.
  """
  spec = decode_fn_spec(decode_fn)
  if decode_args.check_bool('record_schedule', record_schedule):
    if not (spec is not None and spec.pipelined):
      raise ValueError(
          'record_schedule needs a SPEED decode fn (decoding.speed_decode or '
          'sampling.speed_sample_decode), got '
          f'{getattr(decode_fn, "__name__", decode_fn)!r}.')
    kwargs['record_schedule'] = True
  out = decode_fn(**kwargs)
  if isinstance(out, DecodeResult):
    return out
  sequences, scores = out
  return DecodeResult(sequences=sequences, scores=scores)


@declare_decode_fn(pipelined=False)
def greedy_decode(inputs: Array,
                  cache: Any,
                  tokens_to_logits: sequential_loop.TokensToLogitsFn,
                  eos_id: IntOrArray,
                  num_decodes: int = 1,
                  initial_index: Optional[Array] = None,
                  max_decode_steps: Optional[IntOrArray] = None,
                  cache_offset: int = 0,
                  decode_rng: Optional[Array] = None,
                  temperature: Any = 0.0,
                  topk: Any = 1,
                  topp: Any = 0.0,
                  max_decode_steps_hard_limit: Optional[int] = None,
                  token_choice: str = 'auto') -> DecodeResult:
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
    token_choice: how each token is picked from the logits: 'auto' (the
      CPU kernel where it runs), 'kernel' or 'xla'
      (`t5x_speed.cpu.dispatch.token_kernel`).

  Returns:
    A `DecodeResult` (no stats), which unpacks as T5X's (decodes [batch, 1,
    length], scores [batch, 1]); the score of an invalid example (see the
    module docstring) is NaN.

  Raises:
    ValueError: for bad arguments, see the module docstring; also for
      sampling parameters (`check_greedy_params`).
  """
  del decode_rng
  max_decode_steps = check_greedy_params(
      'greedy_decode', temperature, topk, topp, max_decode_steps,
      max_decode_steps_hard_limit)
  decode_args.check_one_decode(num_decodes)
  rule = token_rules.Argmax(token_choice)
  checked = sequential_loop.check_sequential(
      inputs, cache, tokens_to_logits, initial_index, max_decode_steps,
      eos_id, cache_offset)
  final, scores = sequential_loop.sequential_loop(
      inputs, cache, tokens_to_logits, checked, rule)
  lengths = final.cur_index - checked.initial_index
  return DecodeResult(sequences=final.sequences[:, None, 1:],
                      scores=scores[:, None], lengths=lengths[:, None])


@declare_decode_fn(pipelined=True)
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
                 temperature: Any = 0.0,
                 topk: Any = 1,
                 topp: Any = 0.0,
                 max_decode_steps_hard_limit: Optional[int] = None,
                 max_speculative_rows: Any = 'auto',
                 require_pipeline: bool = False,
                 record_schedule: bool = False,
                 token_choice: str = 'auto',
                 speed_branches: Any = 'auto') -> DecodeResult:
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
  table. With `speed_branches=1`, were 7 the first exit's second choice for
  position 3, step 4 would also run 3:7 in a spare row; the middle exit's 7
  names it, so it takes 3:9's place and nothing is flushed: 5 6 7 8 1 in 7
  steps (tested there too).

  A batch whose step would multiply more than `max_speculative_rows` rows
  (batch x R) decodes with the full-depth `tokens_to_logits` instead, one
  token per loop step: the same tokens, faster at that size
  (`t5x_speed.cpu.dispatch.max_speculative_rows`); the result's `pipelined`
  is then False, and `require_pipeline` makes it an error instead.

  Args:
    inputs: [batch, length] BOS-shifted prompts, zeros after the prompt.
    cache: cache prefilled for positions < initial_index.
    tokens_to_logits: the full-depth step, as `greedy_decode` takes it, for
      batches beyond `max_speculative_rows`; None always runs the pipeline.
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
    temperature: T5X's sampling temperature, accepted where it keeps the
      decode greedy (see `check_greedy_params`): 0 (or any with topk 1).
    topk: T5X's top-k, likewise: 1 (or any at temperature 0).
    topp: T5X's top-p, likewise: 0 (or any at temperature 0).
    max_decode_steps_hard_limit: as T5X's: if > 0, caps `max_decode_steps`.
    max_speculative_rows: 'auto' (8 rows on CPU, no limit elsewhere), None
      (always pipeline) or the most rows (batch x R) a pipelined step may
      take.
    require_pipeline: raise `ValueError` instead of decoding with the
      full-depth step where the batch exceeds `max_speculative_rows`.
    record_schedule: also record the `SpeedSchedule` (memory grows with R *
      length steps); a recorded decode always runs the pipeline.
    token_choice: how each token is picked from the logits, as
      `greedy_decode`'s.
    speed_branches: candidate branches per example (K): each step also runs
      the K most likely tokens after the newest one's at stage 0, and a
      verdict naming one of them continues on it instead of flushing
      (`t5x_speed.speed_branches`; the same output). 0: none, today's
      pipeline; 'auto': `t5x_speed.cpu.dispatch.speed_branches` (measured
      per CPU dtype at batch 1, none elsewhere). A step then takes
      batch x (R + K) rows.

  Returns:
    A `DecodeResult` with the `SpeedStats`, which unpacks as T5X's (decodes
    [batch, 1, length], scores [batch, 1]); the score of an invalid example
    (see the module docstring) is NaN.

  Raises:
    ValueError: for bad arguments, see the module docstring; also when
      `num_stages` or `initial_carry` do not match `pipeline_step_fn`, for
      sampling parameters (`check_greedy_params`), and where
      `require_pipeline` refuses the batch.
  """
  del decode_rng
  max_decode_steps = check_greedy_params(
      'speed_decode', temperature, topk, topp, max_decode_steps,
      max_decode_steps_hard_limit)
  decode_args.check_one_decode(num_decodes)
  max_rows = cpu.dispatch.max_speculative_rows(max_speculative_rows)
  decode_args.check_bool('require_pipeline', require_pipeline)
  decode_args.check_bool('record_schedule', record_schedule)
  rule = token_rules.Argmax(token_choice)
  stages, initial_carry, checked = speed_loop.check_pipeline(
      inputs, cache, pipeline_step_fn, num_stages, initial_carry,
      initial_index, max_decode_steps, eos_id, cache_offset)
  branches = cpu.dispatch.speed_branches(speed_branches, inputs.shape[0],
                                         stages, initial_carry.dtype)
  out = speed_loop.speed_or_sequential(
      inputs, cache, pipeline_step_fn, tokens_to_logits, stages,
      initial_carry, checked, rule, max_rows, record_schedule,
      require_pipeline, branches=branches)
  return DecodeResult(
      sequences=out.sequences[:, None, 1:], scores=out.scores[:, None],
      lengths=out.lengths[:, None], stats=out.stats, schedule=out.schedule,
      pipelined=out.pipelined)
