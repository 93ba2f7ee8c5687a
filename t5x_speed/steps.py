"""The cache of a `SpeedTransformer` as T5X's decode fns expect it.

`network.KVCache` keeps, per pass position j, keys and values of shape
[R, batch, heads, length, head_dim] (stage first, so SPEED's attention reads
each stage's cache without a transpose). Our decode fns (`decoding.greedy_decode`,
`decoding.speed_decode`) take it as is and pass each example's position in
`DecodingState.cur_index`.

T5X's decode fns (`t5x.decoding.beam_search`, `temperature_sample` with
`num_decodes > 1`) instead reshape and reorder every cache leaf with
`cache_map`, `flat_batch_beam_expand` and `cache_gather_beams`, which need a
nested dict whose leaves hold the batch on axis `cache_offset`, and they keep
positions in the cache (`beam_search` passes its scalar loop counter as
`cur_index`). `to_t5x_cache` gives them the same arrays, unmoved, as

  {'layers_j': {'cached_key': keys[j], 'cached_value': values[j]}, ...,
   'cache_index': [1, batch] next position of each example}

with the batch on axis 1, the layout of a scanned T5X model's cache, so they
run with `cache_offset=CACHE_OFFSET` (1). `t5x_tokens_to_logits` wraps a
full-depth step to read positions from, and advance, 'cache_index'.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from t5x_speed import network
  >>> kv = network.KVCache(keys=(jnp.zeros((3, 2, 4, 8, 5)),),
  ...                      values=(jnp.zeros((3, 2, 4, 8, 5)),))
  >>> t5x_cache = to_t5x_cache(kv, jnp.array([3, 1]))
  >>> t5x_cache['cache_index'].shape, t5x_cache['layers_0']['cached_key'].shape
  ((1, 2), (3, 2, 4, 8, 5))
  >>> from_t5x_cache(t5x_cache)[1].tolist()
  [3, 1]
"""

from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp

from t5x_speed import network

Array = jax.Array
# (tokens [B], positions [B], cache) -> (logits [B, vocab], cache)
DecodeStepFn = Callable[[Array, Array, network.KVCache],
                        Tuple[Array, network.KVCache]]

# Axis of the batch in every leaf of the T5X-style cache.
CACHE_OFFSET = 1
# Logical axes of a `KVCache` leaf, [R, batch, heads, length, head_dim], for
# T5X's partitioning rules (all in `t5x.partitioning.standard_logical_axis_rules`).
CACHE_AXES = ('layers', 'batch', 'heads', 'length', 'kv')
INDEX = 'cache_index'


def to_t5x_cache(cache: network.KVCache, index: Array) -> Dict[str, Any]:
  """The arrays of `cache` as a T5X-style cache dict (nothing is copied).

  Args:
    cache: the `KVCache`.
    index: the next position of each example, [batch] (the prompt lengths
      after a prefill), or an index already in T5X form (any shape whose
      size is the batch: beam search adds a beam axis to it).

  Returns:
    {'layers_j': {'cached_key', 'cached_value'}, 'cache_index'}; every leaf
    holds the batch on axis `CACHE_OFFSET`.
  """
  index = jnp.asarray(index, jnp.int32)
  if index.ndim == 1:
    index = index[None]
  out: Dict[str, Any] = {
      f'layers_{j}': {'cached_key': k, 'cached_value': v}
      for j, (k, v) in enumerate(zip(cache.keys, cache.values))}
  out[INDEX] = index
  return out


def from_t5x_cache(cache: Dict[str, Any]) -> Tuple[network.KVCache, Array]:
  """Inverse of `to_t5x_cache`: (`KVCache`, positions [flat batch]).

  The positions are 'cache_index' flattened, batch-major, as
  `t5x.decoding.flatten_beam_dim` flattens batch and beams.
  """
  layers = sorted((k for k in cache if k != INDEX),
                  key=lambda name: int(name.rsplit('_', 1)[1]))
  kv = network.KVCache(
      keys=tuple(cache[name]['cached_key'] for name in layers),
      values=tuple(cache[name]['cached_value'] for name in layers))
  return kv, jnp.reshape(cache[INDEX], (-1,))


def t5x_tokens_to_logits(decode_step: DecodeStepFn):
  """A T5X `tokens_to_logits` over the T5X-style cache.

  Args:
    decode_step: a full-depth step, (tokens [B], positions [B], `KVCache`) ->
      (final-exit logits [B, vocab], `KVCache`), e.g.
      `SpeedTransformer.decode_step` bound to parameters. A position at or
      beyond the cache length writes nothing.

  Returns:
    `DecodingState -> (logits, cache)` that runs `state.cur_token` at the
    positions in the cache's 'cache_index' (ignoring `state.cur_index`,
    which `beam_search` sets to its loop counter) and advances it by one,
    keeping its shape.
  """

  def tokens_to_logits(state) -> Tuple[Array, Dict[str, Any]]:
    kv, positions = from_t5x_cache(state.cache)
    tokens = state.cur_token[:, 0]
    if positions.shape != tokens.shape:
      raise ValueError(
          f"The cache's {INDEX} holds {positions.shape[0]} positions for "
          f'{tokens.shape[0]} tokens: expand or reorder the cache with '
          f'cache_offset={CACHE_OFFSET}.')
    logits, kv = decode_step(tokens, positions, kv)
    return logits, to_t5x_cache(kv, state.cache[INDEX] + 1)

  return tokens_to_logits
