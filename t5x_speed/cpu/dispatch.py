"""Which implementation a decode uses: every such choice is made here.

A model's full-sequence passes (training, scoring, the prefill) always run
XLA's ops, T5X's arithmetic. A decode step multiplies a few token rows by
every weight; there XLA:CPU packs the weights for a GEMM, so a few rows cost
well over one weight read, and its arithmetic for a row may depend on how
many rows it runs with. The choices for decoding are resolved here, from
explicit settings, into values that the model code and the decode loops
take as arguments:

* `decode_numerics(decode_matmul, kernel_threads)` resolves a model's
  `TransformerConfig.decode_matmul` and `kernel_threads` into a
  `DecodeNumerics`, which `network.Decoder.decode_step` / `speed_step` pass
  down to every layer (`steps.BoundSteps.numerics` holds the one a decode
  uses):

  - 'auto': the kernels of `t5x_speed.cpu` on a CPU backend where the
    library is built, else XLA's ops;
  - 'kernel': the kernels; where they cannot run (no compiler, not a CPU
    backend), XLA's ops, logged once per process;
  - 'xla': XLA's ops (the baseline of an A/B comparison).

  With the kernels, a step's weight products (`matmul`), cache writes and
  attention (`attention`) and embedding gathers run row by row in the
  library, so SPEED's R-row step is bit-identical to greedy's one-row step.
  Without them, on CPU, a weight product of 2 to `MATVEC_MAX_ROWS` rows runs
  as one XLA GEMV per row where the weights fit in the last-level cache
  (`DecodeNumerics.row_matvecs`): read from memory once, from cache after,
  instead of packed for a GEMM.
* `token_kernel(token_choice, ...)`: whether a decode loop picks its tokens
  with `sample.pick` (one call per loop step) or XLA's passes over the
  vocabulary; every decode fn of this package takes `token_choice` ('auto',
  'kernel', 'xla'), and greedy and SPEED resolve it alike, so that the two
  loops pick identically.
* `max_speculative_rows(value)`: how many rows (batch x R) SPEED's pipeline
  takes before its decode fns use the full-depth step (same tokens).

Only this module chooses: the kernels' own modules fall back to XLA's ops
where the library is not built, but never pick an implementation.

Example:
  >>> numerics = DecodeNumerics(kernel=False, row_matvecs=4)
  >>> numerics.matmul_path(rows=3, weight_elements=768 * 2048)
  <Matmul.ROW_MATVECS: 'row_matvecs'>
  >>> numerics.matmul_path(rows=8, weight_elements=768 * 2048)
  <Matmul.XLA: 'xla'>
"""

import dataclasses
import enum
import functools
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed.config import check_decode_matmul
from t5x_speed.config import check_kernel_threads
from t5x_speed.cpu import build
from t5x_speed.cpu import matmul

__all__ = ['DecodeNumerics', 'Matmul', 'decode_numerics', 'token_kernel',
           'check_token_choice', 'max_speculative_rows', 'TOKEN_CHOICES',
           'MATVEC_MAX_ROWS', 'CPU_MAX_SPECULATIVE_ROWS', 'speed_branches',
           'CPU_AUTO_BRANCHES']

# Per-row GEMVs: at most this many rows, and weights of at most this many
# elements (16 MiB of float32, within a CPU's last-level cache).
MATVEC_MAX_ROWS = 4
MATVEC_MAX_WEIGHT_ELEMENTS = 4 * 1024 * 1024

# Rows per step (batch x R) up to which SPEED's pipeline beats the
# full-depth step on CPU with the kernels (docs/performance.md, large
# batches).
CPU_MAX_SPECULATIVE_ROWS = 8

# SPEED's candidate branches per example that 'auto' picks on CPU, by
# activation dtype, at batch 1 (docs/performance.md, "Candidate branches").
CPU_AUTO_BRANCHES = {'float32': 0, 'bfloat16': 0}

# Values of a decode fn's `token_choice`.
TOKEN_CHOICES = ('auto', 'kernel', 'xla')

_log = logging.getLogger(__name__)


class Matmul(enum.Enum):
  """Implementations of a weight product."""

  XLA = 'xla'                  # one XLA dot over all rows
  ROW_MATVECS = 'row_matvecs'  # one XLA dot per row
  KERNEL = 'kernel'            # `matmul.matmul`'s kernel


@dataclasses.dataclass(frozen=True)
class DecodeNumerics:
  """How a decode step computes, as resolved by `decode_numerics`.

  Attributes:
    kernel: the step's weight products of up to `matmul.MAX_ROWS` rows,
      its cache writes and attention and its embedding gathers run in the
      library's kernels (each falls back to XLA's op where the library is
      not built).
    row_matvecs: without the kernel, weight products of 2 to this many
      rows run as one XLA dot per row when the weights fit in the cache
      (0: never).
    threads: threads of each kernel call, 0 for one per core; results do
      not depend on it.
  """

  kernel: bool = False
  row_matvecs: int = 0
  threads: int = 0

  def __post_init__(self):
    if not isinstance(self.kernel, bool):
      raise ValueError(f'DecodeNumerics.kernel must be a bool, got '
                       f'{self.kernel!r}.')
    for name in ('row_matvecs', 'threads'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'DecodeNumerics.{name} must be an integer >= 0, '
                         f'got {value!r}.')

  def matmul_path(self, rows: int, weight_elements: int) -> Matmul:
    """The implementation of a product of `rows` rows by a weight of
    `weight_elements` elements."""
    if rows < 1:
      return Matmul.XLA
    if self.kernel and rows <= matmul.MAX_ROWS:
      return Matmul.KERNEL
    if (1 < rows <= self.row_matvecs and
        weight_elements <= MATVEC_MAX_WEIGHT_ELEMENTS):
      return Matmul.ROW_MATVECS
    return Matmul.XLA


@functools.lru_cache(maxsize=None)
def _notice(message: str) -> None:
  _log.warning(message)  # once per process and message


def decode_numerics(decode_matmul: str = 'auto',
                    kernel_threads: int = 0) -> DecodeNumerics:
  """A model's decode-step numerics on the platform JAX runs on.

  Args:
    decode_matmul: 'auto', 'kernel' or 'xla' (the module docstring).
    kernel_threads: threads of each kernel call, 0 for one per core.

  Raises:
    ValueError: naming the argument, for any other value.

  Example:
    >>> decode_numerics('xla').kernel
    False
  """
  check_decode_matmul(decode_matmul)
  check_kernel_threads(kernel_threads)
  platform = jax.default_backend()
  if decode_matmul == 'kernel' and platform != 'cpu':
    _notice(f"t5x_speed: decode_matmul='kernel' needs the CPU backend, not "
            f"{platform}; using XLA's ops.")
  kernel = decode_matmul != 'xla' and build.available()
  cpu = platform == 'cpu'
  return DecodeNumerics(
      kernel=kernel,
      row_matvecs=MATVEC_MAX_ROWS if cpu and not kernel else 0,
      threads=kernel_threads)


def _threefry_as_kernel(row_keys: jax.Array) -> bool:
  """Whether jax.random draws these keys' Gumbel noise as the kernel does:
  threefry keys with `jax_threefry_partitionable` on and
  `jax_high_dynamic_range_gumbel` off (JAX's defaults)."""
  if jax.dtypes.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
    threefry = 'threefry2x32' in str(jax.random.key_impl(row_keys))
  else:
    threefry = (row_keys.shape[-1:] == (2,) and row_keys.dtype == jnp.uint32
                and jax.config.jax_default_prng_impl == 'threefry2x32')
  return (threefry and jax.config.jax_threefry_partitionable and
          not jax.config.jax_high_dynamic_range_gumbel)


def check_token_choice(value: str) -> str:
  """`value` if it is one of `TOKEN_CHOICES`; else ValueError naming
  `token_choice`."""
  if not isinstance(value, str) or value not in TOKEN_CHOICES:
    raise ValueError(f'token_choice must be one of {list(TOKEN_CHOICES)}, '
                     f'got {value!r}.')
  return value


def token_kernel(token_choice: str, logits_dtype,
                 row_keys: Optional[jax.Array] = None) -> bool:
  """Whether a decode loop picks tokens with `sample.pick`'s kernel.

  Args:
    token_choice: 'auto' (the kernel where it runs: a CPU backend, the
      library built, float32 or bfloat16 logits and, when sampling, keys
      whose noise the kernel draws as jax.random does), 'kernel' (the same,
      logged once where it cannot run) or 'xla'.
    logits_dtype: the dtype of the logits the loop picks from.
    row_keys: the sampler's per-row PRNG keys (raw or typed); None for
      greedy, which draws no random bits.

  Raises:
    ValueError: naming `token_choice`, for any other value.
  """
  check_token_choice(token_choice)
  if token_choice == 'xla':
    return False
  runs = (jnp.dtype(logits_dtype) in matmul.KERNEL_DTYPES and
          (row_keys is None or _threefry_as_kernel(row_keys)) and
          build.available())
  if token_choice == 'kernel' and not runs:
    _notice("t5x_speed: token_choice='kernel' cannot run here (it needs the "
            'CPU backend, the built library, float32 or bfloat16 logits and '
            "JAX's default threefry keys); using XLA's ops.")
  return runs


def max_speculative_rows(value) -> Optional[int]:
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
  if (isinstance(value, (bool, np.bool_)) or
      not isinstance(value, (int, np.integer)) or value < 1):
    raise ValueError("max_speculative_rows must be 'auto', None or an "
                     f'integer >= 1, got {value!r}.')
  return int(value)


def speed_branches(value, batch: int, stages: int, dtype: Any) -> int:
  """SPEED's `speed_branches` argument as K, the branches per example.

  Args:
    value: 'auto' (on a CPU backend `CPU_AUTO_BRANCHES[dtype]` at batch 1,
      none at larger batches, where the rows are better spent on examples;
      none on other backends, where they have not been measured), or an
      integer >= 0 (0: today's pipeline, the same program).
    batch: rows decoded at once (examples x decodes).
    stages: R; a model with one stage has no verdict to branch on, so it
      gets none.
    dtype: the activations' dtype.

  Raises:
    ValueError: naming `speed_branches`, for any other value.
  """
  if isinstance(value, str) and value == 'auto':
    if jax.default_backend() != 'cpu' or batch != 1:
      value = 0
    else:
      value = CPU_AUTO_BRANCHES.get(jnp.dtype(dtype).name, 0)
  elif (isinstance(value, (bool, np.bool_)) or
        not isinstance(value, (int, np.integer)) or value < 0):
    raise ValueError("speed_branches must be 'auto' or an integer >= 0, got "
                     f'{value!r}.')
  return int(value) if stages > 1 else 0
