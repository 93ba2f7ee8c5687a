"""Builds and loads the native library of the CPU kernels (`csrc/`).

The library (`csrc/rowmatmul.cc`, `gather_rows.cc`, `row_attention.cc`,
`row_norm.cc`, `row_sample.cc`) is compiled on first use with the system C++
compiler, for the CPU it runs on (`-march=native`), into one build
directory:
`$XDG_CACHE_HOME/t5x_speed` (default `~/.cache/t5x_speed`). Nothing is
written anywhere else, the package's own folder included. Each binary is
named by a hash of what it depends on (sources, jaxlib, compiler and its
flags, the CPU's features), so an upgrade or another machine gets its own
build. `python -m t5x_speed.cpu` builds it ahead of time and says where it
is.

Without a compiler, or where the build fails, `available()` is False, the
reason is logged once per process, and every kernel of `t5x_speed.cpu`
falls back to XLA's ops: decoding is slower on CPU, never wrong.

Example:
  >>> isa() in (None, 'avx512_bf16', 'avx512', 'avx2', 'portable')
  True
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
from typing import Optional

import jax
import jaxlib

__all__ = ['build', 'build_dir', 'isa', 'available']

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc')
_SOURCES = tuple(os.path.join(_CSRC, c)
                 for c in ('rowmatmul.cc', 'gather_rows.cc', 'row_attention.cc',
                           'row_norm.cc', 'row_sample.cc'))
_HEADERS = tuple(os.path.join(_CSRC, h)
                 for h in ('aligned_buffer.h', 'ffi_threads.h',
                           'row_dispatch.h', 'row_kernels.h',
                           'row_kernels_kn.h', 'row_vectors.h',
                           'row_attention.h'))
# Every FFI target of the library and its C symbol.
_SYMBOLS = {'t5x_speed_rowmatmul': 'T5xSpeedRowMatmul',
            't5x_speed_rowmatmul_nt': 'T5xSpeedRowMatmulNT',
            't5x_speed_rowmatmul_q8': 'T5xSpeedRowMatmulQ8',
            't5x_speed_rowmatmul_nt_q8': 'T5xSpeedRowMatmulNTQ8',
            't5x_speed_cached_attention': 'T5xSpeedCachedAttention',
            't5x_speed_attention': 'T5xSpeedAttention',
            't5x_speed_gather_rows': 'T5xSpeedGatherRows',
            't5x_speed_gather_rows_q8': 'T5xSpeedGatherRowsQ8',
            't5x_speed_rms_norm': 'T5xSpeedRmsNorm',
            't5x_speed_sample': 'T5xSpeedSample'}
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


def build_dir() -> str:
  """The build directory: $XDG_CACHE_HOME/t5x_speed, else ~/.cache/t5x_speed."""
  base = os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache')
  return os.path.join(base, 't5x_speed')


def build(verbose: bool = False) -> str:
  """Compiles the library if its binary is missing; returns its path.

  Concurrent processes serialise on a lock file, and the binary appears by
  atomic rename, so no process ever loads a half-written library.

  Raises:
    RuntimeError: no C++ compiler, or the compilation failed.
    OSError: the build directory cannot be written.
  """
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError('no C++ compiler found (set CXX or install g++)')
  directory = build_dir()
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f't5x_speed_cpu-{_build_key(cxx)}.so')
  if os.path.exists(path):
    return path
  with open(os.path.join(directory, '.build.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.path.exists(path):  # built by another process meanwhile
      return path
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=directory)
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
  """Builds and registers the library once; its ISA, or None (logged once)."""
  try:
    return _register(build())
  except Exception as e:  # pylint: disable=broad-except
    _log.warning('t5x_speed: CPU kernels unavailable, using XLA\'s ops '
                 '(decoding is slower on CPU): %s', e)
    return None


def isa() -> Optional[str]:
  """The library's instruction set: 'avx512_bf16', 'avx512', 'avx2',
  'portable'; None where it cannot be built or loaded (logged once).

  'avx512_bf16' is AVX-512 with the CPU's bf16 pair products (vdpbf16ps),
  which multiply bfloat16 rows by bfloat16 weights without widening them.
  Builds and loads the library on first use.
  """
  return _load()


def available() -> bool:
  """Whether the kernels run here: a CPU backend and a loaded library."""
  return jax.default_backend() == 'cpu' and isa() is not None
