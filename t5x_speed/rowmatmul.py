"""Few-row matmuls at memory speed on CPU: a C++ kernel behind `jax.ffi`.

(The same library holds the decode step's other kernels: its attention,
`t5x_speed.rowattention`, and `gather_rows`.)

A decode step multiplies a few token rows by every weight matrix. XLA:CPU
runs one row as a memory-speed GEMV but several rows through a GEMM that
packs the weights first, so a few rows cost well over one weight read, which
defeats SPEED's premise that R rows cost about one. The kernel in
`csrc/rowmatmul.cc` streams each weight once for all rows (register-held
accumulators, AVX-512 / AVX2+FMA / portable, on `threads` threads), and
computes every row with the same arithmetic whatever the number of rows, so
a token's weight products are bit-identical in greedy (1 row) and SPEED (R
rows).

The kernel is compiled on first use with the system C++ compiler into a cache
keyed by the source, jaxlib version, compiler and CPU (`python -m
t5x_speed.rowmatmul --build` does it ahead of time). Without a compiler or on
a non-CPU backend, `matmul` is XLA's dot; a kernel that cannot be built or
loaded is logged once per process.

Which matmuls of a model come here is decided in `t5x_speed.backend`: a
decode step's weight matmuls, as `TransformerConfig.decode_matmul` says;
full-sequence passes (training, prefill) keep XLA's dot whatever their row
count.

Example:
  >>> x, w = jnp.ones((3, 768)), jnp.ones((768, 2048))
  >>> matmul(x, w).shape      # x @ w, by the kernel for <= MAX_ROWS rows
  (3, 2048)
  >>> matmul(x, jnp.ones((32128, 768)), transpose_w=True).shape  # x @ w.T
  (3, 32128)
  >>> [o.shape for o in matmuls(x, [jnp.ones((768, 64)), w])]  # one call
  [(3, 64), (3, 2048)]
"""

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Optional, Sequence, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import jaxlib
import numpy as np

Array = jax.Array

# Rows up to which `matmul` uses the kernel. The kernel's advantage, one
# weight read for all rows, shrinks as rows grow while XLA's GEMM amortises
# its weight packing over them (in float32 it catches up first;
# tools/rowmatmul_microbench.py compares the two). The bound still covers
# SPEED's batch * R rows at the batch sizes it serves, where the kernel's row
# independence is what keeps SPEED's products bit-identical to greedy's.
MAX_ROWS = 64

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc')
_SOURCES = tuple(os.path.join(_CSRC, c)
                 for c in ('rowmatmul.cc', 'row_attention.cc', 'row_sample.cc'))
_HEADERS = tuple(os.path.join(_CSRC, h)
                 for h in ('aligned_buffer.h', 'ffi_threads.h', 'row_kernels.h',
                           'row_vectors.h', 'row_attention.h'))
_TARGETS = {False: 't5x_speed_rowmatmul', True: 't5x_speed_rowmatmul_nt'}
# Every FFI target of the library (the attention's: `t5x_speed.rowattention`;
# the sampler's: `t5x_speed.rowsample`).
_SYMBOLS = {'t5x_speed_rowmatmul': 'T5xSpeedRowMatmul',
            't5x_speed_rowmatmul_nt': 'T5xSpeedRowMatmulNT',
            't5x_speed_cached_attention': 'T5xSpeedCachedAttention',
            't5x_speed_attention': 'T5xSpeedAttention',
            't5x_speed_gather_rows': 'T5xSpeedGatherRows',
            't5x_speed_sample': 'T5xSpeedSample'}
# Operand dtypes the library's kernels take as they are.
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_CXX_FLAGS = ('-O3', '-march=native', '-std=c++17', '-shared', '-fPIC',
              '-fno-math-errno')

_log = logging.getLogger(__name__)


def _compiler() -> Optional[list]:
  """The C++ compiler command ($CXX, else g++ or c++ on PATH), or None."""
  if os.environ.get('CXX'):
    return shlex.split(os.environ['CXX'])
  found = shutil.which('g++') or shutil.which('c++')
  return [found] if found else None


def _cpu_signature() -> str:
  """The CPU's feature flags: a -march=native build is only valid on them."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith(('flags', 'Features')):
          return line
  except OSError:
    pass
  import platform  # pylint: disable=g-import-not-at-top
  return platform.processor() + platform.machine()


def _build_key(cxx: list) -> str:
  """Hash of everything the binary depends on.

  Raises:
    RuntimeError: the compiler cannot be run.
  """
  try:
    version = subprocess.run([*cxx, '--version'], capture_output=True,
                             text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    raise RuntimeError(f'cannot run the C++ compiler {shlex.join(cxx)!r}: '
                       f'{e}') from None
  digest = hashlib.sha256()
  sources = []
  for path in (*_SOURCES, *_HEADERS):
    with open(path, 'rb') as f:
      sources.append(f.read())
  # The command itself: $CXX may carry flags (e.g. a narrower -m option).
  for part in (*sources, jaxlib.__version__.encode(),
               version.encode(), shlex.join(cxx).encode(),
               _cpu_signature().encode(), ' '.join(_CXX_FLAGS).encode()):
    digest.update(part)
    digest.update(b'\0')
  return digest.hexdigest()[:16]


def _cache_dir() -> str:
  """The package's _build dir if writable, else ~/.cache/t5x_speed."""
  package = os.path.join(_CSRC, os.pardir, '_build')
  try:
    os.makedirs(package, exist_ok=True)
    if os.access(package, os.W_OK):
      # Keep build products out of version control in a source checkout.
      ignore = os.path.join(package, '.gitignore')
      if not os.path.exists(ignore):
        with open(ignore, 'w') as f:
          f.write('*\n')
      return os.path.abspath(package)
  except OSError:
    pass
  base = os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache')
  path = os.path.join(base, 't5x_speed')
  os.makedirs(path, exist_ok=True)
  return path


def build(verbose: bool = False) -> str:
  """Compiles the kernel if its cached binary is missing; returns its path.

  Concurrent processes serialise on a lock file, and the binary appears by
  atomic rename, so no process ever loads a half-written library.

  Raises:
    RuntimeError: no C++ compiler, or the compilation failed.
  """
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError('no C++ compiler found (set CXX or install g++)')
  cache = _cache_dir()
  path = os.path.join(cache, f'rowmatmul-{_build_key(cxx)}.so')
  if os.path.exists(path):
    return path
  with open(os.path.join(cache, '.build.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.path.exists(path):  # built by another process meanwhile
      return path
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=cache)
    os.close(fd)
    try:
      _compile_and_link(cxx, tmp, verbose)
    except BaseException:
      os.unlink(tmp)
      raise
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
  return path


def _compile_and_link(cxx: list, out: str, verbose: bool) -> None:
  """Compiles the sources into `out`, one compiler process per source at
  once (the build's wall time is then its largest source's), then links.

  Raises:
    RuntimeError: the compiler cannot be run, or a compilation failed.
  """
  flags = [*_CXX_FLAGS, '-isystem', jax.ffi.include_dir()]
  with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as objects:
    compiles = [[*cxx, *flags, '-c', source, '-o',
                 os.path.join(objects, f'{i}.o')]
                for i, source in enumerate(_SOURCES)]
    link = [*cxx, *flags, *[c[-1] for c in compiles], '-o', out]
    for step in (compiles, [link]):
      if verbose:
        for cmd in step:
          print(shlex.join(cmd), file=sys.stderr)
      try:
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for cmd in step]
      except OSError as e:
        raise RuntimeError(f'cannot run {cxx[0]!r}: {e}') from None
      errors = [proc.communicate()[1] for proc in procs]
      for cmd, proc, err in zip(step, procs, errors):
        if proc.returncode != 0:
          raise RuntimeError(f'{shlex.join(cmd)} failed:\n{err[-4000:]}')


@functools.lru_cache(maxsize=None)
def _register(path: str) -> str:
  """Loads the library at `path` and registers its FFI targets; its ISA.

  Once per library: XLA's target registry is process-wide.
  """
  lib = ctypes.cdll.LoadLibrary(path)
  for target, symbol in _SYMBOLS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform='cpu')
  lib.T5xSpeedRowMatmulIsa.restype = ctypes.c_char_p
  return lib.T5xSpeedRowMatmulIsa().decode()


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
  """Builds and registers the kernel once; its ISA, or None (logged once)."""
  try:
    return _register(build())
  except Exception as e:  # pylint: disable=broad-except
    _log.warning('t5x_speed: few-row matmul kernel unavailable, using XLA\'s '
                 'dot (decoding is slower on CPU): %s', e)
    return None


def isa() -> Optional[str]:
  """The kernel's instruction set: 'avx512_bf16', 'avx512', 'avx2', 'portable'.

  'avx512_bf16' is AVX-512 with the CPU's bf16 pair products (vdpbf16ps),
  which multiply bfloat16 rows by bfloat16 weights without widening them.

  Builds and loads the kernel on first use. None where it cannot be built or
  loaded (the reason is logged once per process).
  """
  return _load()


def available() -> bool:
  """Whether `matmul` can use the kernel: a CPU backend and a loaded kernel."""
  return jax.default_backend() == 'cpu' and isa() is not None


def _ffi(x: Array, ws: Tuple[Array, ...], ns: Tuple[int, ...],
         transpose_w: bool, dtype, threads: int,
         scale: float) -> Tuple[Array, ...]:
  call = jax.ffi.ffi_call(
      _TARGETS[transpose_w],
      tuple(jax.ShapeDtypeStruct((x.shape[0], n), dtype) for n in ns),
      # One call for all vmapped matrices: the kernel takes leading batch
      # axes (size 1 = broadcast).
      vmap_method='expand_dims')
  attrs = {'threads': np.int64(threads)}
  if transpose_w:
    attrs['scale'] = np.float32(scale)
  return tuple(call(x, *ws, **attrs))


# The kernel is a forward-only custom call; the backward pass (if a few-row
# matmul is ever differentiated, e.g. a decode step under grad) uses XLA's
# dots, in f32 for mixed operands, each gradient cast to its operand's dtype.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _kernel(x: Array, ws: Tuple[Array, ...], ns: Tuple[int, ...],
            transpose_w: bool, dtype, threads: int,
            scale: float) -> Tuple[Array, ...]:
  return _ffi(x, ws, ns, transpose_w, dtype, threads, scale)


def _kernel_fwd(x, ws, ns, transpose_w, dtype, threads, scale):
  return _ffi(x, ws, ns, transpose_w, dtype, threads, scale), (x, ws)


def _kernel_bwd(ns, transpose_w, dtype, threads, scale, res, gs):
  del dtype, threads
  x, ws = res
  f32 = lambda a: a.astype(jnp.float32)
  dx = jnp.zeros(x.shape, jnp.float32)
  dws = []
  for w, n, g in zip(ws, ns, gs):
    g = f32(g) * np.float32(scale)
    if transpose_w:
      dx = dx + jnp.dot(g, f32(w[:n]))
      dws.append(jnp.zeros(w.shape, jnp.float32).at[:n].set(
          jnp.dot(g.T, f32(x))).astype(w.dtype))
    else:
      dx = dx + jnp.dot(g, f32(w).T)
      dws.append(jnp.dot(f32(x).T, g).astype(w.dtype))
  return dx.astype(x.dtype), tuple(dws)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def check_threads(threads) -> None:
  """Raises ValueError unless `threads` (a kernel call's) is an int >= 0."""
  if (isinstance(threads, bool) or
      not isinstance(threads, (int, np.integer)) or threads < 0):
    raise ValueError(f'threads must be an integer >= 0, got {threads!r}.')


def _kernel_takes(x: Array, ws: Sequence[Array], rows: int) -> bool:
  """Whether the kernel computes x times every w of `ws` (else XLA's dot)."""
  dtype = jnp.result_type(x.dtype, *(w.dtype for w in ws))
  return (dtype in KERNEL_DTYPES and x.dtype in KERNEL_DTYPES and
          all(w.dtype == ws[0].dtype for w in ws) and
          ws[0].dtype in KERNEL_DTYPES and x.shape[-1] > 0 and
          0 < rows <= MAX_ROWS and available())


def matmul(x: Array, w: Array, *, transpose_w: bool = False,
           cols: Optional[int] = None, scale: float = 1.0,
           force_xla: bool = False, threads: int = 0) -> Array:
  """x @ w (or x @ w[:cols].T * scale) with the kernel for few rows on CPU.

  The kernel takes up to `MAX_ROWS` rows where `available()`; otherwise this
  is XLA's dot.

  Args:
    x: [..., K] activations; leading axes are rows.
    w: [K, N] weights, or [N', K] with `transpose_w` (e.g. an embedding
      table scored by dot products, read in place without a transpose).
    transpose_w: contract over w's last axis instead of its first.
    cols: with `transpose_w`, score only rows [0, cols) of w (default all),
      without copying the slice.
    scale: with `transpose_w` and a float32 result, multiply the products
      by float32(scale), as XLA multiplies them (the kernel scales each
      product as it stores it, saving a pass over the result).
    force_xla: always use XLA's dot (reference / A-B).
    threads: threads the kernel uses, 0 for one per core. The result does
      not depend on it.

  Returns:
    [..., N] in the promoted dtype of x and w, as XLA's dot of the promoted
    operands gives. The kernel takes float32 and bfloat16 operands as they
    are (no converted copy of w) and computes in float32, rounding a
    bfloat16 result once; other dtypes, an empty contraction or zero rows use
    XLA's dot.

  Raises:
    ValueError: on rank or shape mismatch, a bad `cols` or `scale`, or
      negative `threads`.
  """
  check_threads(threads)
  x, w = jnp.asarray(x), jnp.asarray(w)
  if w.ndim != 2 or x.ndim < 1:
    raise ValueError(f'matmul needs x [..., K] and a 2-D w, got {x.shape} and '
                     f'{w.shape}.')
  k_axis = 1 if transpose_w else 0
  if x.shape[-1] != w.shape[k_axis]:
    raise ValueError(f'contraction mismatch: x {x.shape} vs w {w.shape} '
                     f'(transpose_w={transpose_w}).')
  n = w.shape[1 - k_axis]
  if cols is not None:
    if not transpose_w or not 0 < cols <= n:
      raise ValueError(f'cols={cols} needs transpose_w and 0 < cols <= {n}.')
    n = cols
  dtype = jnp.result_type(x.dtype, w.dtype)
  scale = float(scale)
  if scale != 1.0 and not (transpose_w and dtype == jnp.float32):
    raise ValueError(f'scale={scale} needs transpose_w and a float32 result, '
                     f'got transpose_w={transpose_w} and {dtype}.')
  rows = int(np.prod(x.shape[:-1]))
  if force_xla or n == 0 or not _kernel_takes(x, (w,), rows):
    wn = w[:n] if transpose_w else w
    out = lax.dot_general(x.astype(dtype), wn.astype(dtype),
                          (((x.ndim - 1,), (k_axis,)), ((), ())))
    return out if scale == 1.0 else out * np.float32(scale)
  out, = _kernel(x.reshape(rows, x.shape[-1]), (w,), (n,), transpose_w,
                 dtype, int(threads), scale)
  return out.reshape(x.shape[:-1] + (n,))


def matmuls(x: Array, ws: Sequence[Array], *, force_xla: bool = False,
            threads: int = 0) -> Tuple[Array, ...]:
  """(x @ w for w in ws), in one kernel call for few rows on CPU.

  A decode step multiplies the same rows by q, k and v (and by an MLP's
  input projections): one call streams all of them with one wait on its
  threads, where separate calls each wait on theirs. Every output is
  bit-identical to `matmul(x, w)`.

  Args:
    x: [..., K] activations; leading axes are rows.
    ws: [K, N_j] weights, at least one.
    force_xla: always use XLA's dot (reference / A-B).
    threads: threads the kernel uses, 0 for one per core.

  Returns:
    One [..., N_j] per weight, as `matmul(x, w)` gives. Weights of different
    dtypes are multiplied one call each.

  Raises:
    ValueError: on an empty `ws`, rank or shape mismatch, or negative
      `threads`.
  """
  check_threads(threads)
  x, ws = jnp.asarray(x), tuple(jnp.asarray(w) for w in ws)
  if not ws:
    raise ValueError('matmuls needs at least one weight.')
  for w in ws:
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
      raise ValueError(f'matmuls needs x [..., K] and 2-D weights [K, N], got '
                       f'{x.shape} and {[w.shape for w in ws]}.')
  rows = int(np.prod(x.shape[:-1]))
  if (force_xla or len(ws) == 1 or any(w.shape[1] == 0 for w in ws) or
      not _kernel_takes(x, ws, rows)):
    return tuple(matmul(x, w, force_xla=force_xla, threads=threads)
                 for w in ws)
  dtype = jnp.result_type(x.dtype, ws[0].dtype)
  outs = _kernel(x.reshape(rows, x.shape[-1]), ws,
                 tuple(w.shape[1] for w in ws), False, dtype, int(threads),
                 1.0)
  return tuple(o.reshape(x.shape[:-1] + (o.shape[-1],)) for o in outs)


def gather_rows(table: Array, ids: Array, *, force_xla: bool = False) -> Array:
  """table[ids]: the rows of `table` at `ids`, copied as they are.

  XLA:CPU gathers bfloat16 through a float32 or uint16 copy of the whole
  table, which a decode step's embedding would pay per step; the kernel
  copies the rows' bits. Ids out of range are handled as jnp indexing does
  (negative ones from the end, then clamped).

  Args:
    table: [V, E] of any dtype.
    ids: integer array of any shape.
    force_xla: always use XLA's gather.

  Returns:
    ids.shape + (E,), table's dtype. XLA's gather where the kernel is not
    available.
  """
  table, ids = jnp.asarray(table), jnp.asarray(ids)
  if table.ndim != 2:
    raise ValueError(f'gather_rows needs a 2-D table, got {table.shape}.')
  if (force_xla or ids.size == 0 or table.shape[0] == 0 or
      not jnp.issubdtype(ids.dtype, jnp.integer) or not available()):
    return table[ids]
  rows = _gather(table, ids.reshape(-1).astype(jnp.int32))
  return rows.reshape(ids.shape + (table.shape[1],))


@jax.custom_vjp
def _gather(table: Array, ids: Array) -> Array:
  call = jax.ffi.ffi_call(
      't5x_speed_gather_rows',
      jax.ShapeDtypeStruct((ids.size, table.shape[1]), table.dtype),
      vmap_method='broadcast_all')
  return call(table, ids)


def _gather_fwd(table, ids):
  return _gather(table, ids), (table, ids)


def _gather_bwd(res, g):
  table, ids = res  # the derivative of XLA's gather
  _, vjp = jax.vjp(lambda t: t[ids], table)
  return (*vjp(g), np.zeros(ids.shape, jax.dtypes.float0))


_gather.defvjp(_gather_fwd, _gather_bwd)


def main(argv) -> int:
  """`python -m t5x_speed.rowmatmul --build`: compile (or find) the kernel."""
  if argv[1:] != ['--build']:
    print('usage: python -m t5x_speed.rowmatmul --build', file=sys.stderr)
    return 2
  try:
    path = build(verbose=True)
  except (RuntimeError, OSError) as e:
    print(f't5x_speed: kernel not built, XLA\'s dot will be used: {e}',
          file=sys.stderr)
    return 0  # not an installation failure: everything works without it
  print(f't5x_speed: few-row matmul kernel at {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
