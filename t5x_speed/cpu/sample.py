"""Position-keyed sampling of a decode step's logits, row by row, on CPU.

`t5x_speed.sampling` draws the token at position p of a decoded row as the
argmax of its tempered, top-k / top-p filtered logits plus Gumbel noise keyed
by (row key, p). With XLA's ops that is a dozen passes over each row's
vocabulary (the noise alone is a threefry hash per id), once per SPEED stage.
`sample` is one C++ `jax.ffi` call in the CPU kernels' library
(`csrc/row_sample.cc`) that does it in a few vectorised passes per row and
returns each row's token and log-probability.

The noise uses jax.random's bits (threefry2x32, `fold_in(key, position)`,
then the bits of index i as `jax.random.gumbel` draws them) and the kernel's
own logarithms and exponentials, within a few ulps of XLA's; so its tokens
are XLA's sampler's except where two perturbed logits lie that close, or a
probability lies within rounding of the top-p cut. SPEED and sequential
sampling both use it where their decode fn's `token_choice` resolves to it
(`dispatch.token_kernel`), so they sample identically.

Example:
  >>> logits = jnp.log(jnp.array([[0.1, 0.2, 0.7]] * 2))
  >>> keys = jnp.zeros((2, 2), jnp.uint32)
  >>> tokens, log_probs = sample(            # row 0 samples, row 1 is greedy
  ...     logits, keys, jnp.array([3, 3]), jnp.array([1.0, 0.0]),
  ...     jnp.array([0.75, 0.0]), topk=0, rescale=True)
  >>> int(tokens[0]) in (1, 2), int(tokens[1])  # top-p 0.75: ids 2, 1
  (True, 2)
  >>> float(log_probs[1])           # a greedy row scores 0, as T5X's sampler
  0.0
"""

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed.cpu import build
from t5x_speed.cpu import matmul

__all__ = ['sample', 'pick']

Array = jax.Array

_TARGET = 't5x_speed_sample'


def sample(logits: Array, keys: Array, positions: Array, temperature: Array,
           topp: Array, *, topk: int, rescale: bool,
           threads: int = 0) -> tuple:
  """Samples one token per row of logits with position-keyed noise.

  Args:
    logits: [rows, vocab >= 1] float32 or bfloat16.
    keys: [rows, 2] uint32 raw threefry keys, or [rows] typed threefry keys.
    positions: [rows] int, the position each row's token fills (folded into
      its key).
    temperature: [rows] float; at or below 1e-4 a row takes its argmax.
    topp: [rows] float top-p mass, 0 (or below) for none.
    topk: keep the topk largest logits, 0 for all.
    rescale: log-probabilities under the tempered, filtered distribution
      (0 for argmax rows, as T5X's sampler), else under the logits'.
    threads: threads the kernel uses, 0 for one per core. The result does
      not depend on it.

  Returns:
    (tokens [rows] int32, log_probs [rows] float32); a row with a NaN logit
    gets its first NaN's id and a NaN log-probability (0 for a greedy row
    with `rescale`, as XLA's sampler).

  Raises:
    ValueError: on shapes that do not match, an empty vocabulary, a negative
      `topk` or `threads`, a non-bool `rescale`, keys that are not threefry
      keys, or where the kernel is not available (`build.available`).
  """
  if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
    if 'threefry2x32' not in str(jax.random.key_impl(keys)):
      raise ValueError(f'keys must be threefry2x32 keys, got '
                       f'{jax.random.key_impl(keys)}.')
    keys = jax.random.key_data(keys)
  if (logits.ndim != 2 or keys.shape != (logits.shape[0], 2) or
      jnp.shape(positions) != logits.shape[:1] or
      jnp.shape(temperature) != logits.shape[:1] or
      jnp.shape(topp) != logits.shape[:1]):
    raise ValueError(f'sample needs logits [rows, vocab], keys [rows, 2] and '
                     f'positions, temperature, topp [rows]; got '
                     f'{logits.shape}, {keys.shape}, {jnp.shape(positions)}, '
                     f'{jnp.shape(temperature)}, {jnp.shape(topp)}.')
  if logits.shape[1] < 1:
    raise ValueError(f'logits must have a vocabulary of at least 1 id, got '
                     f'shape {logits.shape}.')
  if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or (
      topk < 0):
    raise ValueError(f'topk must be an integer >= 0, got {topk!r}.')
  if not isinstance(rescale, (bool, np.bool_)):
    raise ValueError(f'rescale must be a bool, got {rescale!r}.')
  matmul.check_threads(threads)
  if logits.dtype not in matmul.KERNEL_DTYPES or not build.available():
    raise ValueError('the sampling kernel needs a CPU backend, the built '
                     'kernel and float32 or bfloat16 logits '
                     f'(got {logits.dtype}).')
  rows = logits.shape[0]
  call = jax.ffi.ffi_call(
      _TARGET, (jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows,), jnp.float32)),
      vmap_method='sequential')
  return tuple(call(
      logits, jnp.asarray(keys, jnp.uint32),
      jnp.asarray(positions, jnp.int32),
      jnp.asarray(temperature, jnp.float32), jnp.asarray(topp, jnp.float32),
      topk=np.int64(topk), rescale=np.int64(bool(rescale)),
      threads=np.int64(threads)))


def pick(logits: Array, keys: Array, positions: Array, temperature: Array,
         topp: Array, *, topk: int, rescale: bool) -> tuple:
  """`sample` for a decode loop's S slots per row (`token_rules.TokenRule`).

  Args:
    logits: [rows, S, vocab]: S tokens per row (1 sequentially, R in SPEED's
      pipeline).
    keys, temperature, topp: per row, as `sample` takes them per row; every
      slot of a row uses its row's.
    positions: [rows, S], the position each slot's token fills.
    topk, rescale: as `sample`.

  Returns:
    (tokens [rows, S] int32, the last slot's log-probability [rows]: the
    token a loop commits).
  """
  rows, slots, vocab = logits.shape
  per_slot = lambda x: jnp.repeat(x, slots, 0)
  tokens, log_probs = sample(
      logits.reshape(rows * slots, vocab), per_slot(keys),
      positions.reshape(-1), per_slot(temperature), per_slot(topp),
      topk=topk, rescale=rescale)
  return tokens.reshape(rows, slots), log_probs.reshape(rows, slots)[:, -1]
