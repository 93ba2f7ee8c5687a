"""A decode step's attention over its key/value caches, row by row, on CPU.

A decode step attends each of its few query rows (greedy's one, SPEED's R
slots) over its stage's cache. XLA:CPU runs that as batched dots, a softmax
and their fusions around the caches (and, for bfloat16 caches, float32
copies of them), and its arithmetic for a row may depend on how many rows
it runs with. `cached_attention` is a C++ `jax.ffi` call in the library of
`t5x_speed.rowmatmul` (`csrc/row_attention.h`): each row in float32 with
one fixed sequence of operations, reading float32 or bfloat16 caches as they
are, only up to the last unmasked key, and each slot's stage in place (no
copy of the stage). So SPEED's attention, like its weight products, is
bit-identical to greedy's.

Which passes use it is decided in `t5x_speed.backend`, with the weight
matmuls: a decode step whose matmuls use the kernel.

Example:
  >>> q = jnp.ones((1, 2, 12, 64))                  # [batch, slots, heads, d]
  >>> cache = jnp.ones((3, 1, 12, 16, 64))          # [stages, batch, heads, len, d]
  >>> bias = jnp.zeros((1, 2, 12, 16))              # [batch, slots, heads, len]
  >>> cached_attention(q, cache, cache, bias, stages=(0, 2)).shape
  (1, 2, 12, 64)
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import rowmatmul

Array = jax.Array

_TARGET = 't5x_speed_cached_attention'
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


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
  keys, values = _read_stages(keys, stages), _read_stages(values, stages)
  query = jnp.swapaxes(query, 0, 1)                     # [s, b, h, d]
  weights = jnp.einsum('sbhd,sbhld->sbhl', query, keys)
  weights = jax.nn.softmax(weights + jnp.swapaxes(bias, 0, 1).astype(
      weights.dtype))
  context = jnp.einsum('sbhl,sbhld->sbhd', weights.astype(query.dtype), values)
  return jnp.swapaxes(context, 0, 1)


def _ffi(query, keys, values, bias, stages, threads):
  call = jax.ffi.ffi_call(_TARGET,
                          jax.ShapeDtypeStruct(query.shape, query.dtype),
                          # Equal leading axes on every operand.
                          vmap_method='broadcast_all')
  return call(query, keys, values, bias,
              stages=np.asarray(stages, np.int64), threads=np.int64(threads))


# Forward-only custom call; a derivative (should a decode step ever be
# differentiated) is the XLA reference's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _kernel(query, keys, values, bias, stages, threads):
  return _ffi(query, keys, values, bias, stages, threads)


def _kernel_fwd(query, keys, values, bias, stages, threads):
  return (_ffi(query, keys, values, bias, stages, threads),
          (query, keys, values, bias))


def _kernel_bwd(stages, threads, res, g):
  del threads
  _, vjp = jax.vjp(lambda *a: reference(*a, stages), *res)
  return vjp(g)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def cached_attention(query: Array, keys: Array, values: Array, bias: Array,
                     *, stages: Sequence[int], force_xla: bool = False,
                     threads: int = 0) -> Array:
  """Attention of each slot's query over its own stage's cache.

  Args:
    query: [batch, slots, heads, head_dim].
    keys: [stages, batch, heads, length, head_dim], one cache per stage.
    values: like `keys`.
    bias: [batch, slots, heads, length], relative-position bias plus the mask
      (-1e10, as T5X) of keys after each query's own position.
    stages: static stage of each slot, len(stages) == slots.
    force_xla: always use `reference` (XLA's ops).
    threads: threads the kernel uses, 0 for one per core. The result does
      not depend on it.

  Returns:
    [batch, slots, heads, head_dim] in the query's dtype: the kernel's
    float32 arithmetic rounded once, where it is built and the operands are
    float32 or bfloat16 (keys and values of one dtype); else `reference`.

  Raises:
    ValueError: on shapes that do not match, a stage out of range or a bad
      `threads`.
  """
  stages = tuple(int(s) for s in stages)
  if (query.ndim != 4 or keys.ndim != 5 or values.shape != keys.shape or
      bias.ndim != 4):
    raise ValueError(f'cached_attention needs query [b, s, h, d], keys and '
                     f'values [stages, b, h, len, d] and bias [b, s, h, len], '
                     f'got {query.shape}, {keys.shape}, {values.shape}, '
                     f'{bias.shape}.')
  b, s, h, d = query.shape
  if (keys.shape[1:3] != (b, h) or keys.shape[4] != d or
      bias.shape != (b, s, h, keys.shape[3]) or len(stages) != s or
      not all(0 <= st < keys.shape[0] for st in stages)):
    raise ValueError(f'cached_attention: shapes do not match (query '
                     f'{query.shape}, keys {keys.shape}, bias {bias.shape}, '
                     f'stages {stages}).')
  if (isinstance(threads, bool) or
      not isinstance(threads, (int, np.integer)) or threads < 0):
    raise ValueError(f'threads must be an integer >= 0, got {threads!r}.')
  if (force_xla or query.dtype not in _DTYPES or keys.dtype not in _DTYPES or
      values.dtype != keys.dtype or bias.dtype not in _DTYPES or
      keys.shape[3] == 0 or not rowmatmul.available()):
    return reference(query, keys, values, bias, stages)
  return _kernel(query, keys, values, bias, stages, int(threads))
