"""T5's RMSNorm of a decode step's rows, row by row, on CPU.

XLA:CPU vectorises a norm's mean of squares according to the shape it
reduces: at some widths (T5-Base's 768 among them) the same row is summed
in one order inside greedy's one-row step and in another inside SPEED's
R-row step, and the two steps' hidden states then differ in the last bits.
`rms_norm` is one C++ `jax.ffi` call in the CPU kernels' library
(`csrc/row_norm.cc`) that normalises each row alone with one fixed sequence
of operations, so the norms of a decode step, like its weight products and
attention, are bit-identical in greedy and SPEED. Full-sequence passes keep
XLA's norm (T5X's arithmetic); which passes use this one is decided by the
decode step's `dispatch.DecodeNumerics`.

Example:
  >>> x = jnp.array([[3.0, 4.0]])               # root mean square 3.5355
  >>> y = rms_norm(x, jnp.array([1.0, 2.0]), 0.0, jnp.float32)
  >>> [round(float(v), 4) for v in y[0]]
  [0.8485, 2.2627]
"""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from t5x_speed.cpu import build

__all__ = ['rms_norm', 'reference']

Array = jax.Array


def reference(x: Array, scale: Array, epsilon: float, dtype) -> Array:
  """XLA's RMSNorm (`layers.RMSNorm`'s arithmetic): float32 statistics,
  the normalised rows rounded to `dtype`, then times `scale` in `dtype`."""
  x = jnp.asarray(x, jnp.float32)
  mean2 = jnp.mean(lax.square(x), axis=-1, keepdims=True)
  y = jnp.asarray(x * lax.rsqrt(mean2 + np.float32(epsilon)), dtype)
  return y * jnp.asarray(scale, dtype)


def rms_norm(x: Array, scale: Array, epsilon: float, dtype, *,
             force_xla: bool = False) -> Array:
  """T5's RMSNorm of each row of `x` [..., E] with `scale` [E], in `dtype`.

  The kernel sums each row's squares in float32 in a fixed order and
  computes x / sqrt(mean + epsilon) and its product by `scale` with the
  module's roundings; where the library is not built (or `force_xla`), this
  is `reference`. The two agree within float rounding, not bit for bit.
  """
  x, scale = jnp.asarray(x), jnp.asarray(scale, jnp.float32)
  dtype = jnp.dtype(dtype)
  kernel_dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
  if (force_xla or x.ndim < 1 or x.size == 0 or not build.available() or
      x.dtype not in kernel_dtypes or dtype not in kernel_dtypes or
      scale.shape != x.shape[-1:]):
    return reference(x, scale, epsilon, dtype)
  call = jax.ffi.ffi_call('t5x_speed_rms_norm',
                          jax.ShapeDtypeStruct(x.shape, dtype),
                          vmap_method='broadcast_all')
  # The scale as x's shape (a few rows in a decode step): under jax.vmap
  # both then carry the same leading axes.
  return call(x, jnp.broadcast_to(scale, x.shape),
              epsilon=np.float32(epsilon))
