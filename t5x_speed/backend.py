"""Which implementation a traced pass's matmuls, gathers and scatters use.

Every numerics choice of `t5x_speed.layers` is made here, from what is being
traced:

* Weight matmuls (`layers.Dense`, `layers.dense_group`, the tied classifier
  `layers.Embed.attend`).
  Full-sequence passes (training, scoring, prefill) always use XLA's dot,
  whatever their row count, so that their arithmetic is T5X's. A decode step
  multiplies a few token rows by every weight matrix, where XLA:CPU packs the
  weights for a GEMM and a few rows cost well over one weight read; there,
  `DecodeNumerics.matmul` (the model's
  `TransformerConfig.decode_matmul`) chooses:

  - 'auto': the few-row kernel of `t5x_speed.rowmatmul` on a CPU backend
    where it is built, else XLA's dot;
  - 'kernel': the kernel; where it cannot be built or loaded, or the backend
    is not a CPU, XLA's dot, logged once per process;
  - 'xla': XLA's dot (the baseline of an A/B comparison).

  The kernel computes each row alone, so SPEED's R-row products are
  bit-identical to greedy's one-row ones; weights that multiply the same
  rows (q, k and v; an MLP's input projections) share one call. A decode
  step that does not use it runs 2 to `MATVEC_MAX_ROWS` rows as one XLA
  GEMV per row when the weights fit in the last-level cache: they are read
  from memory once and from cache after, instead of packed for a GEMM.

* A decode step's cache writes and attention (`layers.cached_attention`,
  and `layers.attention` over an encoder's keys and values): where the
  step's weight matmuls use the kernel, one call of `t5x_speed.rowattention`
  (same library) writes the caches in place and attends row by row, so that
  SPEED's attention is bit-identical to greedy's too; elsewhere
  `layers.write_cache` and XLA's ops.

* Gathers and scatters of 16-bit floats (`layers.Embed`, `layers.write_cache`)
  move the bits as uint16 in every pass: they only move values, and XLA:CPU
  would convert the whole operand to float32 and back. Their derivative is
  the plain gather's or scatter's. A decode step with the kernel instead
  gathers embedding rows with `rowmatmul.gather_rows`, which copies only
  the rows (the uint16 view of the table would be a copy per step).

* A decode loop's token choice (`token_rules.ARGMAX`,
  `sampling.PositionKeyedSampler`): on a CPU backend where the library is
  built, `t5x_speed.rowsample`'s one call per loop step instead of XLA's
  passes over the vocabulary (`sampler_kernel_runs`), whatever the model's
  `decode_matmul`, so that the sequential and SPEED loops always share it.

* How many rows SPEED speculates with (`resolve_max_speculative_rows`). A
  SPEED step multiplies batch x R rows by each weight. While that is a few
  rows the step costs about one weight read, as greedy's one row does; with
  many rows the products, not the reads, set the time, and R rows per step
  (plus the flushed ones) cost more than greedy's one. Beyond
  `CPU_MAX_SPECULATIVE_ROWS` rows on CPU, SPEED's decode fns therefore
  decode with the full-depth step, which gives the same tokens.

The one context is `decode_step`, entered by
`network.SpeedTransformer.decode_step` and `speed_step` with the numerics of
the model's config: it is read while tracing, so a compiled decode step keeps
the numerics it was traced with, and two models differing only in their
numerics are two programs.

Example:
  >>> with decode_step(DecodeNumerics(matmul='xla')):
  ...   choose_matmul(rows=3, weight_elements=768 * 2048)
  <Matmul.ROW_MATVECS: 'row_matvecs'>
  >>> choose_matmul(rows=3, weight_elements=768 * 2048)  # not a decode step
  <Matmul.XLA: 'xla'>
"""

import contextlib
import contextvars
import dataclasses
import enum
import functools
import logging
from typing import Callable, Iterator, Optional, Sequence, Tuple

import jax
from jax import lax
import jax.numpy as jnp

from t5x_speed import rowattention
from t5x_speed import rowmatmul

Array = jax.Array

# Values of `DecodeNumerics.matmul` (and `TransformerConfig.decode_matmul`).
DECODE_MATMULS = ('auto', 'kernel', 'xla')

# Per-row GEMVs: at most this many rows, and weights of at most this many
# elements (16 MiB of float32, within a CPU's last-level cache).
MATVEC_MAX_ROWS = 4
MATVEC_MAX_WEIGHT_ELEMENTS = 4 * 1024 * 1024

# Gathers and scatters move these dtypes as the unsigned integers of their
# width.
_MOVE_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
              jnp.dtype(jnp.float16): jnp.dtype(jnp.uint16)}

# Rows per step (batch x R) up to which SPEED's pipeline beats the
# full-depth step on CPU with the few-row kernel, as tools.bench measures it
# (docs/performance.md#large-batches).
CPU_MAX_SPECULATIVE_ROWS = 8

_log = logging.getLogger(__name__)


def check_decode_matmul(value: str, name: str = 'decode_matmul') -> None:
  """Raises ValueError, naming `name`, unless `value` is in DECODE_MATMULS."""
  if not isinstance(value, str) or value not in DECODE_MATMULS:
    raise ValueError(f'{name} must be one of {list(DECODE_MATMULS)}, got '
                     f'{value!r}.')


def check_kernel_threads(value: int, name: str = 'kernel_threads') -> None:
  """Raises ValueError, naming `name`, unless `value` is an integer >= 0."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f'{name} must be an integer >= 0 (0: one per core), got '
                     f'{value!r}.')


def resolve_max_speculative_rows(value) -> Optional[int]:
  """SPEED's `max_speculative_rows` argument as a number of rows, or None.

  Args:
    value: 'auto' (`CPU_MAX_SPECULATIVE_ROWS` on a CPU backend; no limit on
      others, where it has not been measured), None (no limit: always run
      the pipeline) or an integer >= 1.

  Raises:
    ValueError: naming `max_speculative_rows`, for any other value.
  """
  if value is None:
    return None
  if isinstance(value, str) and value == 'auto':
    return (CPU_MAX_SPECULATIVE_ROWS if jax.default_backend() == 'cpu'
            else None)
  if (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise ValueError("max_speculative_rows must be 'auto', None or an "
                     f'integer >= 1, got {value!r}.')
  return value


@dataclasses.dataclass(frozen=True)
class DecodeNumerics:
  """How one decode step's weight matmuls run.

  Attributes:
    matmul: 'auto', 'kernel' or 'xla' (see the module docstring).
    kernel_threads: threads one kernel call uses, 0 for one per core. A
      traced constant of the step; results do not depend on it.
  """

  matmul: str = 'auto'
  kernel_threads: int = 0

  def __post_init__(self):
    check_decode_matmul(self.matmul, 'DecodeNumerics.matmul')
    check_kernel_threads(self.kernel_threads, 'DecodeNumerics.kernel_threads')


_DECODE_STEP = contextvars.ContextVar('t5x_speed_decode_step', default=None)


@contextlib.contextmanager
def decode_step(numerics: DecodeNumerics) -> Iterator[None]:
  """Marks what is traced inside as one decode step run with `numerics`."""
  if not isinstance(numerics, DecodeNumerics):
    raise TypeError(f'numerics must be a DecodeNumerics, got {numerics!r}.')
  token = _DECODE_STEP.set(numerics)
  try:
    yield
  finally:
    _DECODE_STEP.reset(token)


def decode_numerics() -> Optional[DecodeNumerics]:
  """The numerics of the decode step being traced; None outside one."""
  return _DECODE_STEP.get()


class Matmul(enum.Enum):
  """Implementations of a weight matmul."""

  XLA = 'xla'                  # one XLA dot over all rows
  ROW_MATVECS = 'row_matvecs'  # one XLA dot per row
  KERNEL = 'kernel'            # `kernel_matmul`


@functools.lru_cache(maxsize=None)
def _kernel_needs_cpu_notice(platform: str) -> None:
  _log.warning('t5x_speed: decode_matmul=\'kernel\' needs the CPU backend, '
               'not %s; using XLA\'s dot.', platform)


def _kernel_runs(matmul: str) -> bool:
  """Whether a decode step with `matmul` uses the kernel (logs why not)."""
  if matmul == 'xla':
    return False
  platform = jax.default_backend()
  if platform != 'cpu':
    if matmul == 'kernel':
      _kernel_needs_cpu_notice(platform)  # once per process
    return False
  return rowmatmul.available()  # a build failure is logged once


def choose_matmul(rows: int, weight_elements: int) -> Matmul:
  """The implementation of a weight matmul over `rows` rows, as traced now.

  Args:
    rows: rows of activations (the product of the leading axes).
    weight_elements: elements of the weight matrix as multiplied.

  Returns:
    `Matmul.XLA` outside a decode step; inside one, as the module docstring
    describes.
  """
  numerics = decode_numerics()
  if numerics is None or rows < 1:
    return Matmul.XLA
  if rows <= rowmatmul.MAX_ROWS and _kernel_runs(numerics.matmul):
    return Matmul.KERNEL
  if (1 < rows <= MATVEC_MAX_ROWS and
      weight_elements <= MATVEC_MAX_WEIGHT_ELEMENTS and
      jax.default_backend() == 'cpu'):
    return Matmul.ROW_MATVECS
  return Matmul.XLA


def kernel_matmul(x: Array, w: Array, *, transpose_w: bool = False,
                  cols: Optional[int] = None, scale: float = 1.0) -> Array:
  """`rowmatmul.matmul` with the threads of the decode step being traced."""
  numerics = decode_numerics() or DecodeNumerics()
  return rowmatmul.matmul(x, w, transpose_w=transpose_w, cols=cols,
                          scale=scale, threads=numerics.kernel_threads)


def kernel_matmuls(x: Array, ws: Sequence[Array]) -> Tuple[Array, ...]:
  """`rowmatmul.matmuls` with the threads of the decode step being traced."""
  numerics = decode_numerics() or DecodeNumerics()
  return rowmatmul.matmuls(x, ws, threads=numerics.kernel_threads)


def step_uses_kernel() -> bool:
  """Whether the decode step being traced attends and gathers through the
  kernel's library.

  It does where its weight matmuls may use the kernel: a CPU backend, a
  built kernel and `DecodeNumerics.matmul` other than 'xla'.
  """
  numerics = decode_numerics()
  return numerics is not None and _kernel_runs(numerics.matmul)


def kernel_attention(query: Array, keys: Array, values: Array, bias: Array,
                     new_keys: Array, new_values: Array, positions: Array,
                     stages: Sequence[int]) -> Tuple[Array, Array, Array]:
  """`rowattention.cached_attention` with the step's kernel threads."""
  numerics = decode_numerics() or DecodeNumerics()
  return rowattention.cached_attention(
      query, keys, values, bias, new_keys, new_values, positions,
      stages=stages, threads=numerics.kernel_threads)


def kernel_attend(query: Array, keys: Array, values: Array, bias: Array,
                  stages: Sequence[int]) -> Array:
  """`rowattention.attention` with the step's kernel threads."""
  numerics = decode_numerics() or DecodeNumerics()
  return rowattention.attention(query, keys, values, bias, stages=stages,
                                threads=numerics.kernel_threads)


def sampler_kernel_runs(logits_dtype, row_keys: Optional[Array] = None
                        ) -> bool:
  """Whether a decode loop's token choice over these logits uses `rowsample`.

  Args:
    logits_dtype: the dtype of the logits the loop chooses from.
    row_keys: the sampler's per-row PRNG keys (raw or typed); None for
      greedy, which draws no random bits.

  Returns:
    True on a CPU backend with the library built, for float32 or bfloat16
    logits, and, when sampling, for threefry keys whose Gumbel noise
    jax.random draws as the kernel does (`jax_threefry_partitionable` on,
    `jax_high_dynamic_range_gumbel` off: JAX's defaults).
  """
  if row_keys is not None:
    if jax.dtypes.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
      threefry = 'threefry2x32' in str(jax.random.key_impl(row_keys))
    else:
      threefry = (row_keys.shape[-1:] == (2,) and
                  row_keys.dtype == jnp.uint32 and
                  jax.config.jax_default_prng_impl == 'threefry2x32')
    if not (threefry and jax.config.jax_threefry_partitionable and
            not jax.config.jax_high_dynamic_range_gumbel):
      return False
  return (jnp.dtype(logits_dtype) in rowmatmul.KERNEL_DTYPES and
          rowmatmul.available())


def move_values(move: Callable[..., Array], values: Sequence[Array],
                *indices: Array) -> Array:
  """`move(*values, *indices)` for a `move` that only moves values.

  Args:
    move: a gather or scatter, linear in `values` (e.g. `lambda t, i: t[i]`).
    values: the arrays whose elements are moved, all of one dtype.
    *indices: the other (integer) operands.

  Returns:
    What `move` returns. 16-bit floats are moved as their bits, with the
    derivative of `move` itself.
  """
  dtype = jnp.dtype(values[0].dtype)
  bits = _MOVE_BITS.get(dtype)
  if bits is None:
    return move(*values, *indices)

  @jax.custom_jvp
  def moved(values, indices):
    out = move(*(lax.bitcast_convert_type(v, bits) for v in values), *indices)
    return lax.bitcast_convert_type(out, dtype)

  @moved.defjvp
  def moved_jvp(primals, tangents):
    values, indices = primals
    # The derivative of `move` on the values themselves: JAX's own rule,
    # which stays transposable where a scatter's indices may repeat.
    _, tangent = jax.jvp(lambda *v: move(*v, *indices), values, tangents[0])
    return moved(values, indices), tangent

  return moved(tuple(values), tuple(indices))
