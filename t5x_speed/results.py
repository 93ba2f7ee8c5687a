"""What a decode returns: `DecodeResult`, with SPEED's `SpeedStats` and
`SpeedSchedule`.

Every decode fn of this package (`decoding.speed_decode`, `greedy_decode`,
`sampling.speed_sample_decode`, `sample_decode`) returns a `DecodeResult` as
its value: the decodes and scores T5X's decode fns return, each decode's
produced length and, from the SPEED decode fns, their statistics, whether
the pipeline ran, and on request the schedule. It unpacks as T5X's
`(decodes, scores)`, so that it stands wherever T5X calls a decode fn:

  decodes, scores = speed_decode(...)   # T5X's contract
  result = speed_decode(...)            # everything: result.stats, ...

`decoding.decode` runs T5X's own decode fns too and gives their
`(decodes, scores)` as a `DecodeResult` (lengths, stats, schedule None);
`inference.generate` returns a `Generation`, a view of one.

Example:
  >>> import jax.numpy as jnp
  >>> result = DecodeResult(sequences=jnp.zeros((2, 1, 5), jnp.int32),
  ...                       scores=jnp.zeros((2, 1)))
  >>> decodes, scores = result
  >>> decodes.shape, scores.shape, result.stats is None
  ((2, 1, 5), (2, 1), True)
"""

import dataclasses
from typing import Any, Dict, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['DecodeResult', 'SpeedStats', 'SpeedSchedule']

Array = jax.Array


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
      saying why it produced nothing (traced bad inputs; see `decoding`).
    pipelined: [batch] 1 where SPEED's pipeline decoded the example, 0 where
      the batch was too large to speculate and the sequential loop did (one
      full-depth step per token, no exits evaluated: flushes,
      stage_evaluations and stage_flips are 0).
    branch_hits: [batch] flips that a candidate branch absorbed (the
      verdict named a branch running beside the token it replaced): no
      flush (`speed_branches`).
    branch_evaluations: [batch] branch slots run while the example was live.
    branches: [batch] the candidate branches per step (K; 0 without them or
      where the sequential loop decoded): each pipelined step runs R + K
      rows per example.
  """

  num_steps: Array
  num_tokens: Array
  occupied_slots: Array
  flushes: Array
  stage_evaluations: Array
  stage_flips: Array
  invalid: Array
  pipelined: Array
  branch_hits: Array
  branch_evaluations: Array
  branches: Array

  @classmethod
  def zeros(cls, batch: int, stages: int) -> 'SpeedStats':
    z = lambda *s: jnp.zeros(s, jnp.int32)
    return cls(z(batch), z(batch), z(batch), z(batch, stages),
               z(batch, stages), z(batch, stages), z(batch),
               jnp.ones((batch,), jnp.int32), z(batch), z(batch), z(batch))

  @classmethod
  def sequential(cls, produced: Array, stages: int,
                 invalid: Array) -> 'SpeedStats':
    """Stats of examples the sequential loop decoded, `produced` [batch]
    tokens each: one full-depth (all R stages) step per token."""
    z = jnp.zeros((produced.shape[0], stages), jnp.int32)
    produced = produced.astype(jnp.int32)
    zero = jnp.zeros_like(produced)
    return cls(num_steps=produced, num_tokens=produced,
               occupied_slots=produced * stages, flushes=z,
               stage_evaluations=z, stage_flips=z, invalid=invalid,
               pipelined=zero, branch_hits=zero, branch_evaluations=zero,
               branches=zero)

  @classmethod
  def from_aux(cls, aux_values: Mapping[str, Any],
               prefix: str = 'speed/') -> Optional['SpeedStats']:
    """Stats of many examples from aux values as models.py writes them.

    `aux_values['speed/<field>']` holds one value per example (a list, as
    seqio and T5X's infer pass them, or an array with the examples first).
    Returns None where the aux holds no SPEED statistics (other decode fns).
    Aux values written before `pipelined` existed count as pipelined, and
    before branches as decoded without them.
    """
    if prefix + 'num_steps' not in aux_values:
      return None
    values = dict(aux_values)
    examples = len(values[prefix + 'num_steps'])
    values.setdefault(prefix + 'pipelined', np.ones(examples, np.int32))
    for name in ('branch_hits', 'branch_evaluations', 'branches'):
      values.setdefault(prefix + name, np.zeros(examples, np.int32))
    return cls(**{f.name: np.stack([np.asarray(v) for v in
                                    values[prefix + f.name]])
                  for f in dataclasses.fields(cls)})

  def summary(self) -> Dict[str, float]:
    """Batch totals and rates as Python numbers (host side); a stage's flip
    rate only where some example ran that stage in the pipeline.

    'flushes' counts the flips that restarted the pipeline, 'branch_hits'
    those a branch absorbed; 'rows_per_step' is R + K per example."""
    s = jax.tree.map(lambda x: np.asarray(x, np.float64).sum(0), self)
    stages = s.flushes.shape[0]
    out = {
        'example_steps': float(s.num_steps),
        'tokens': float(s.num_tokens),
        'steps_per_token': float(s.num_steps / max(s.num_tokens, 1)),
        'occupancy': float(s.occupied_slots / max(s.num_steps * stages, 1)),
        'flushes': float(s.flushes.sum()),
        'invalid_examples': float(np.count_nonzero(np.asarray(self.invalid))),
        'pipelined_examples': float(np.count_nonzero(
            np.asarray(self.pipelined))),
        'branches': float(np.max(np.asarray(self.branches), initial=0)),
        'branch_hits': float(s.branch_hits),
        'rows_per_step': float(stages + np.max(np.asarray(self.branches),
                                               initial=0)),
    }
    for r in range(stages):
      out[f'flushes/stage_{r + 1}'] = float(s.flushes[r])
      if r and s.stage_evaluations[r]:  # none where no example pipelined
        out[f'flip_rate/stage_{r + 1}'] = float(
            s.stage_flips[r] / s.stage_evaluations[r])
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
    candidates: with K candidate branches, [steps, batch, R+K, 1+K]: each
      row's pick and its K runners-up (`speed_branches.runners_up`), the
      branch rows after the R stages; None without branches.
  """

  positions: Array
  tokens: Array
  predictions: Array
  flushes: Array
  num_steps: Array
  candidates: Optional[Array] = None


@flax.struct.dataclass
class DecodeResult:
  """What a decode fn produced.

  Attributes:
    sequences: [batch, num_decodes, length] int32; sequences[b, d, k] is the
      token at position k+1, the prompt included, zeros after the end (0 is
      also a token id: `lengths` says where the produced tokens end). The
      decodes of an example come by increasing score, as T5X sorts them.
    scores: [batch, num_decodes] float32 log-probabilities of the produced
      tokens (T5X's decode fns: their own scores, e.g. beam search's
      length-normalised ones); NaN for an invalid example.
    lengths: [batch, num_decodes] int32: how many tokens each decode
      produced after its prompt, EOS included (0 for an invalid example);
      None from T5X's decode fns, which do not report it.
    stats: `SpeedStats` ([batch] and [batch, R] counters, summed over an
      example's decodes) from SPEED and SPEED sampling; None from the other
      decode fns.
    schedule: `SpeedSchedule` ([steps, rows, R], rows = batch *
      num_decodes, example-major) when the SPEED decode fn was asked to
      record it (`record_schedule=True`); else None.
    pipelined: static: True where a SPEED decode fn ran its pipeline, False
      where the batch had more rows than `max_speculative_rows` and it
      decoded with the full-depth step instead (the same tokens; no exits
      evaluated); None from other decode fns.
  """

  sequences: Array
  scores: Array
  lengths: Optional[Array] = None
  stats: Optional['SpeedStats'] = None
  schedule: Optional['SpeedSchedule'] = None
  pipelined: Optional[bool] = flax.struct.field(pytree_node=False,
                                                default=None)

  def __iter__(self):
    """T5X's decode-fn contract: `decodes, scores = result`."""
    return iter((self.sequences, self.scores))
