"""T5's relative position bias: distances bucketed, one learned bias per
bucket and head (t5x/examples/decoder_only/layers.py's
RelativePositionBiases, with the same parameter name and logical axes)."""

from typing import Any

from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['RelativePositionBias', 'relative_position_bucket']

Array = jax.Array
param_with_axes = nn_partitioning.param_with_axes


def relative_position_bucket(distance: np.ndarray, num_buckets: int,
                             max_distance: int,
                             bidirectional: bool = False) -> np.ndarray:
  """T5's bucket of `distance` = query_pos - key_pos.

  Unidirectional (a decoder's): distances <= 0 share bucket 0. Bidirectional
  (an encoder's): half the buckets for keys before the query, half for keys
  after it. Exact for small distances, logarithmic up to `max_distance`,
  then one bucket. Computed in NumPy float32 like T5X, so the table is
  bit-identical to it.
  """
  n = np.asarray(distance, np.int32)
  offset = 0
  if bidirectional:
    num_buckets //= 2
    offset = (n < 0).astype(np.int32) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  val_if_large = max_exact + (
      np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps) /
      np.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(np.int32)
  val_if_large = np.minimum(val_if_large, num_buckets - 1)
  return offset + np.where(n < max_exact, n, val_if_large)


class RelativePositionBias(nn.Module):
  """T5 relative-position attention bias shared by all layers of a stack (as
  in T5X); `bidirectional` for an encoder's (`full` only)."""

  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: Any = jnp.float32
  bidirectional: bool = False

  def setup(self):
    self.rel_embedding = param_with_axes(
        'rel_embedding',
        nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'),
        (self.num_heads, self.num_buckets), jnp.float32,
        axes=('heads', 'relpos_buckets'))

  def by_distance(self, length: int) -> Array:
    """Bias of every distance 0..length-1: [heads, length] (a decoder's)."""
    if self.bidirectional:
      raise ValueError('RelativePositionBias.by_distance and .at are a '
                       'decoder\'s (unidirectional) bias; a bidirectional '
                       'one has only `full`.')
    buckets = relative_position_bucket(
        np.arange(length), self.num_buckets, self.max_distance)
    return jnp.asarray(self.rel_embedding, self.dtype)[:, buckets]

  def full(self, length: int) -> Array:
    """Bias of a whole sequence: [1, heads, q_len, k_len]."""
    pos = np.arange(length)
    if self.bidirectional:
      buckets = relative_position_bucket(pos[:, None] - pos[None, :],
                                         self.num_buckets, self.max_distance,
                                         bidirectional=True)
      return jnp.asarray(self.rel_embedding, self.dtype)[:, buckets][None]
    distance = np.maximum(pos[:, None] - pos[None, :], 0)
    return self.by_distance(length)[:, distance][None]

  def at(self, positions: Array, length: int) -> Array:
    """Bias of queries at `positions` [...] against keys 0..length-1.

    Returns [..., heads, length]. Keys after the query get the distance-0
    bucket, exactly as T5X's unidirectional bias; they are masked anyway.
    """
    distance = jnp.clip(positions[..., None] - jnp.arange(length), 0,
                        length - 1)                       # [..., length]
    table = self.by_distance(length)                      # [heads, length]
    return jnp.moveaxis(table[:, distance], 0, -2)        # [..., heads, length]
