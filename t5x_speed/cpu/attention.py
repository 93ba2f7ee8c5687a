"""A decode step's attention over its key/value caches, row by row, on CPU.

A decode step writes each of its few rows' key and value into the caches
(greedy's one row, SPEED's R slots, each in its stage's cache) and attends
each query over its stage. XLA:CPU runs that as a scatter, batched dots, a
softmax and their fusions around the caches (and, for bfloat16 caches,
float32 or uint16 copies of them), and its arithmetic for a row may depend
on how many rows it runs with. `cached_attention` is one C++ `jax.ffi` call
in the CPU kernels' library (`build`, `csrc/row_attention.h`): it writes
the rows into the caches in place, then attends each row in float32 with one
fixed sequence of operations, reading float32 or bfloat16 caches as they
are, only up to the last unmasked key, and each slot's stage where it lies.
So SPEED's attention, like its weight products, is bit-identical to
greedy's. `attention` is the same attention over caches the step does not
write (an encoder-decoder model's cross-attention keys and values).

Which passes use it is decided by the decode step's
`dispatch.DecodeNumerics`, with the weight matmuls.

Example:
  >>> q = jnp.ones((1, 2, 12, 64))          # [batch, slots, heads, head_dim]
  >>> cache = jnp.zeros((3, 1, 12, 16, 64))  # [stages, batch, heads, len, d]
  >>> bias = jnp.zeros((1, 2, 12, 16))      # [batch, slots, heads, len]
  >>> context, keys, values = cached_attention(
  ...     q, cache, cache, bias, q, q, jnp.array([[4, 7]]), stages=(0, 2))
  >>> context.shape, float(keys[2, 0, 0, 7, 0])
  ((1, 2, 12, 64), 1.0)
"""

import functools
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed.cpu import build
from t5x_speed.cpu import matmul

__all__ = ['cached_attention', 'attention', 'reference', 'write_reference']

Array = jax.Array

_TARGET = 't5x_speed_cached_attention'
_ATTEND_TARGET = 't5x_speed_attention'


def _read_stages(cache: Array, stages: Sequence[int]) -> Array:
  """The caches of `stages`: [slots, batch, heads, length, head_dim]."""
  if tuple(stages) == tuple(range(cache.shape[0])):
    return cache
  if len(stages) == 1:
    return cache[stages[0]][None]
  return cache[np.asarray(stages)]


def reference(query: Array, keys: Array, values: Array, bias: Array,
              stages: Sequence[int]) -> Array:
  """The same attention by XLA's ops (T5X's arithmetic: dots and softmax in
  the operands' dtype).

  The cache keeps length next to head_dim, so both products contract over
  contiguous memory without moving the cache.

  Args: as `cached_attention`.
  """
  query = jnp.swapaxes(query, 0, 1)                     # [s, b, h, d]
  bias = jnp.swapaxes(bias, 0, 1)
  if len(stages) > 1 and len(set(stages)) == 1:
    # Every slot reads one cache (cross-attention): no copy per slot.
    keys, values = keys[stages[0]], values[stages[0]]
    weights = jnp.einsum('sbhd,bhld->sbhl', query, keys)
    weights = jax.nn.softmax(weights + bias.astype(weights.dtype))
    context = jnp.einsum('sbhl,bhld->sbhd', weights.astype(query.dtype),
                         values)
    return jnp.swapaxes(context, 0, 1)
  keys, values = _read_stages(keys, stages), _read_stages(values, stages)
  weights = jnp.einsum('sbhd,sbhld->sbhl', query, keys)
  weights = jax.nn.softmax(weights + bias.astype(weights.dtype))
  context = jnp.einsum('sbhl,sbhld->sbhd', weights.astype(query.dtype), values)
  return jnp.swapaxes(context, 0, 1)


def write_reference(cache: Array, stages: Sequence[int], positions: Array,
                    rows: Array) -> Array:
  """`cache` with slot s's row written at positions[:, s] of stage stages[s]
  (positions outside the cache write nothing), by XLA's scatter.

  Args:
    cache: [stages, batch, heads, length, head_dim].
    stages: static stage of each slot.
    positions: [batch, slots] int.
    rows: [batch, slots, heads, head_dim].
  """
  length = cache.shape[3]
  positions = jnp.where(positions >= 0, positions, length)  # -1 -> dropped
  stage_idx = jnp.asarray(stages, jnp.int32)[None, :]        # [1, slots]
  batch_idx = jnp.arange(cache.shape[1])[:, None]            # [batch, 1]
  # Indices [batch, slots] around the head slice: rows [b, s, heads, d].
  return cache.at[stage_idx, batch_idx, :, positions].set(
      rows.astype(cache.dtype), mode='drop')


def _check_attention(query: Array, keys: Array, values: Array, bias: Array,
                     stages: Sequence[int]) -> None:
  """Raises ValueError where the shapes of an attention call do not match."""
  if (query.ndim != 4 or keys.ndim != 5 or values.shape != keys.shape or
      bias.ndim != 4):
    raise ValueError(f'attention needs query [b, s, h, d], keys and values '
                     f'[stages, b, h, len, d] and bias [b, s, h, len], got '
                     f'{query.shape}, {keys.shape}, {values.shape}, '
                     f'{bias.shape}.')
  b, s, h, d = query.shape
  if (keys.shape[1:3] != (b, h) or keys.shape[4] != d or
      bias.shape != (b, s, h, keys.shape[3]) or len(stages) != s or
      not all(0 <= st < keys.shape[0] for st in stages)):
    raise ValueError(f'attention: shapes do not match (query {query.shape}, '
                     f'keys {keys.shape}, bias {bias.shape}, stages '
                     f'{tuple(stages)}).')


def _ffi(query, keys, values, bias, new_keys, new_values, positions, stages,
         threads):
  call = jax.ffi.ffi_call(
      _TARGET,
      (jax.ShapeDtypeStruct(query.shape, query.dtype),
       jax.ShapeDtypeStruct(keys.shape, keys.dtype),
       jax.ShapeDtypeStruct(values.shape, values.dtype)),
      # The caches are updated in place where XLA can reuse their buffers.
      input_output_aliases={1: 1, 2: 2},
      # Equal leading axes on every operand.
      vmap_method='broadcast_all')
  return tuple(call(query, keys, values, bias, new_keys, new_values,
                    positions, stages=np.asarray(stages, np.int64),
                    threads=np.int64(threads)))


def _xla(query, keys, values, bias, new_keys, new_values, positions, stages):
  keys = write_reference(keys, stages, positions, new_keys)
  values = write_reference(values, stages, positions, new_values)
  return reference(query, keys, values, bias, stages), keys, values


# Forward-only custom call; a derivative (should a decode step ever be
# differentiated) is XLA's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel(query, keys, values, bias, new_keys, new_values, positions,
            stages, threads):
  return _ffi(query, keys, values, bias, new_keys, new_values, positions,
              stages, threads)


def _kernel_fwd(query, keys, values, bias, new_keys, new_values, positions,
                stages, threads):
  return (_ffi(query, keys, values, bias, new_keys, new_values, positions,
               stages, threads),
          (query, keys, values, bias, new_keys, new_values, positions))


def _kernel_bwd(stages, threads, res, g):
  del threads
  *differentiable, positions = res
  _, vjp = jax.vjp(lambda *a: _xla(*a, positions, stages), *differentiable)
  no_tangent = np.zeros(positions.shape, jax.dtypes.float0)  # integers
  return (*vjp(g), no_tangent)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def cached_attention(query: Array, keys: Array, values: Array, bias: Array,
                     new_keys: Array, new_values: Array, positions: Array, *,
                     stages: Sequence[int], force_xla: bool = False,
                     threads: int = 0) -> Tuple[Array, Array, Array]:
  """Writes a decode step's keys and values, then attends over the caches.

  Each slot s writes its new key and value at positions[:, s] of stage
  stages[s] (a position outside the cache, e.g. -1 for an empty slot,
  writes nothing); then each slot's query attends over its stage's cache.

  Args:
    query: [batch, slots, heads, head_dim].
    keys: [stages, batch, heads, length, head_dim], one cache per stage.
    values: like `keys`.
    bias: [batch, slots, heads, length], relative-position bias plus the mask
      (-1e10, as T5X) of keys after each query's own position.
    new_keys: [batch, slots, heads, head_dim], written as the caches' dtype.
    new_values: like `new_keys`.
    positions: [batch, slots] int, absolute positions.
    stages: static stage of each slot, len(stages) == slots.
    force_xla: always use XLA's ops (`write_reference`, `reference`).
    threads: threads the kernel uses, 0 for one per core. The result does
      not depend on it.

  Returns:
    (context [batch, slots, heads, head_dim] in the query's dtype, keys,
    values). The kernel computes in float32 and rounds the context once; it
    runs where it is built and the operands are float32 or bfloat16 (the
    caches of one dtype), else XLA's ops.

  Raises:
    ValueError: on shapes that do not match, a stage out of range or a bad
      `threads`.
  """
  stages = tuple(int(s) for s in stages)
  _check_attention(query, keys, values, bias, stages)
  if (new_keys.shape != query.shape or new_values.shape != query.shape or
      positions.shape != query.shape[:2]):
    raise ValueError(f'cached_attention: shapes do not match (query '
                     f'{query.shape}, new keys {new_keys.shape}, new values '
                     f'{new_values.shape}, positions {positions.shape}).')
  matmul.check_threads(threads)
  dtypes = matmul.KERNEL_DTYPES
  if (force_xla or query.dtype not in dtypes or keys.dtype not in dtypes or
      values.dtype != keys.dtype or bias.dtype not in dtypes or
      keys.shape[3] == 0 or not build.available()):
    return _xla(query, keys, values, bias, new_keys, new_values, positions,
                stages)
  return _kernel(query, keys, values, bias, new_keys.astype(keys.dtype),
                 new_values.astype(keys.dtype),
                 jnp.asarray(positions, jnp.int32), stages, int(threads))


def _attend_ffi(query, keys, values, bias, stages, threads):
  call = jax.ffi.ffi_call(
      _ATTEND_TARGET, jax.ShapeDtypeStruct(query.shape, query.dtype),
      vmap_method='broadcast_all')
  return call(query, keys, values, bias, stages=np.asarray(stages, np.int64),
              threads=np.int64(threads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend_kernel(query, keys, values, bias, stages, threads):
  return _attend_ffi(query, keys, values, bias, stages, threads)


def _attend_kernel_fwd(query, keys, values, bias, stages, threads):
  return (_attend_ffi(query, keys, values, bias, stages, threads),
          (query, keys, values, bias))


def _attend_kernel_bwd(stages, threads, res, g):
  del threads
  _, vjp = jax.vjp(lambda *a: reference(*a, stages), *res)
  return vjp(g)


_attend_kernel.defvjp(_attend_kernel_fwd, _attend_kernel_bwd)


def attention(query: Array, keys: Array, values: Array, bias: Array, *,
              stages: Sequence[int], force_xla: bool = False,
              threads: int = 0) -> Array:
  """Each slot's query over its stage's cache, which this call does not
  write (an encoder-decoder's cross-attention keys and values).

  The same arithmetic as `cached_attention`'s attention, row by row: a row's
  context does not depend on the other rows of the call.

  Args:
    query: [batch, slots, heads, head_dim].
    keys: [stages, batch, heads, length, head_dim].
    values: like `keys`.
    bias: [batch, slots, heads, length] additive bias (-1e10 masks a key).
    stages: static stage of each slot, len(stages) == slots.
    force_xla: always use XLA's ops (`reference`).
    threads: threads the kernel uses, 0 for one per core.

  Returns:
    context [batch, slots, heads, head_dim] in the query's dtype.

  Raises:
    ValueError: on shapes that do not match, a stage out of range or a bad
      `threads`.
  """
  stages = tuple(int(s) for s in stages)
  _check_attention(query, keys, values, bias, stages)
  matmul.check_threads(threads)
  dtypes = matmul.KERNEL_DTYPES
  if (force_xla or query.dtype not in dtypes or keys.dtype not in dtypes or
      values.dtype != keys.dtype or bias.dtype not in dtypes or
      keys.shape[3] == 0 or not build.available()):
    return reference(query, keys, values, bias, stages)
  return _attend_kernel(query, keys, values, bias, stages, int(threads))
