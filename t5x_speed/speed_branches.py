"""SPEED's candidate branches: runners-up of the newest token, in spare rows.

A flip (a later exit choosing another token than the one its successor was
started with) flushes the successor and everything after it. With K
branches, each loop step also runs, at stage 0 and the newest token's
position, the K most likely tokens other than the one that entered
(`runners_up`): slots R..R+K-1 of the pipelined step. When the verdict on
that position (the next exit's choice, or the final exit's after a gap)
names one of them, the pipeline continues on that branch instead of
flushing: its hidden state enters stage 1, its prediction enters stage 0,
and its keys and values become stage 0's at that position.

Each branch attends over a cache of its own, so that its attention reads
exactly the keys a main-path row at that position reads (the same
positions, bias and summation order: a branch computes what greedy's step
computes for that token, bit for bit): the cache holds R+K stages, stage
R+k a copy of stage 0 (`add_branch_stages`); after each step the surviving
stage-0 entry, the main token's or the accepted branch's, is copied into
stage 0 and every branch stage (`sync_stage_zero`).

The layout this relies on is the `network.KVCache`'s: self-attention leaves
[stages, batch, heads, length, head_dim] (`steps`' module docstring).

Example:
  >>> import jax.numpy as jnp
  >>> logits = jnp.array([[[0.0, 3.0, 1.0, 2.0]]])   # [batch, rows, vocab]
  >>> runners_up(logits, jnp.array([[1]]), 2).tolist()
  [[[3, 2]]]
"""

from typing import Any

import jax
import jax.numpy as jnp

from t5x_speed import cpu
from t5x_speed import token_rules

__all__ = ['runners_up', 'add_branch_stages', 'sync_stage_zero']

Array = jax.Array


def runners_up(logits: Array, picks: Array, branches: int) -> Array:
  """The `branches` most likely tokens of each row other than its pick.

  Args:
    logits: [batch, rows, vocab].
    picks: [batch, rows] the token each row's rule picked.
    branches: K.

  Returns:
    [batch, rows, K] token ids, most likely first (ties: lowest id).
  """
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
  taken = ids == picks[..., None]
  out = []
  for _ in range(branches):
    best = token_rules.argmax(jnp.where(taken, -jnp.inf, logits))
    out.append(best)
    taken = taken | (ids == best[..., None])
  return jnp.stack(out, -1)


def _is_self_attention(x: Any, stages: int) -> bool:
  return getattr(x, 'ndim', 0) == 5 and x.shape[0] == stages


def add_branch_stages(cache: Any, stages: int, branches: int) -> Any:
  """`cache` with each self-attention leaf's R stages followed by K copies
  of stage 0 (the branches' caches)."""
  if not branches:
    return cache
  return jax.tree.map(
      lambda x: jnp.concatenate([x] + [x[:1]] * branches, 0)
      if _is_self_attention(x, stages) else x, cache)


def sync_stage_zero(cache: Any, stages: int, branches: int, source: Array,
                    position: Array) -> Any:
  """Copies each example's surviving stage-0 entry into every stage-0 cache.

  Args:
    cache: with R+K stages (`add_branch_stages`).
    stages: R.
    branches: K.
    source: [batch] the cache stage holding the survivor: 0 for the main
      token, R+k for branch k.
    position: [batch] its position, -1 where stage 0 has no survivor (then
      nothing is written).

  Returns:
    The cache with that entry in stage 0 and stages R..R+K-1.
  """
  targets = (0,) + tuple(range(stages, stages + branches))

  def sync(x):
    if not _is_self_attention(x, stages + branches):
      return x
    batch = x.shape[1]
    entry = x[source, jnp.arange(batch), :, jnp.maximum(position, 0), :]
    update = jnp.broadcast_to(entry[:, None],
                              (batch, len(targets)) + entry.shape[1:])
    where = jnp.broadcast_to(position[:, None], (batch, len(targets)))
    return cpu.attention.write_reference(x, targets, where, update)

  return jax.tree.map(sync, cache)
