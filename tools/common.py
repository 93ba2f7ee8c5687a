"""Pieces the tools share: help layout, progress lines, timing, the host.

Nothing here is specific to one tool: `HelpFormatter` for their command
lines, `Progress` for the lines that long runs write to stderr, `best_time`
and `interleaved_passes` for timing, `tokens_until_eos` and
`produced_count` for decoded rows, `cpu_model` for reports, and where
the committed real-data models are (`MODELS_DIR`).
"""

import argparse
from concurrent import futures
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from typing import (Any, Callable, Dict, Iterable, List, Optional, TextIO,
                    Tuple)

import jax
import numpy as np


# The committed models that learned real text (`make demo-real`).
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'figures', 'real_data', 'models')


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
  """Keeps the module docstring's layout and shows every flag's default."""


def add_quiet_flag(parser: argparse.ArgumentParser):
  """The tools' --quiet: no progress lines on stderr."""
  parser.add_argument('--quiet', action='store_true',
                      help='write no progress lines (stage, elapsed time, '
                      'estimated time left) to stderr; results still print.')


def _clock(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return (f'{hours}:{rest // 60:02d}:{rest % 60:02d}' if hours else
          f'{rest // 60}:{rest % 60:02d}')


class Progress:
  """Progress lines on stderr: what runs now, time elapsed and time left.

  Work is counted in units (`total` of them, e.g. one per timed pass); the
  estimate of the time left assumes the remaining units take as long as the
  finished ones did on average.

  Example:
    >>> progress = Progress('bench', total=4, quiet=True)
    >>> progress.log('batch 1: compiling')
    >>> progress.advance(2)
    >>> progress.done
    2.0
  """

  def __init__(self, name: str, total: float, quiet: bool = False,
               stream: Optional[TextIO] = None):
    if total < 0:
      raise ValueError(f'total must be >= 0, got {total}.')
    self.name = name
    self.total = float(total)
    self.quiet = quiet
    self.done = 0.0
    self._stream = stream
    self._start = time.perf_counter()

  def elapsed(self) -> float:
    return time.perf_counter() - self._start

  def remaining(self) -> Optional[float]:
    """Estimated seconds left, None before the first finished unit."""
    if self.done <= 0 or self.total <= 0:
      return None
    return self.elapsed() / self.done * max(self.total - self.done, 0.0)

  def advance(self, units: float = 1.0):
    self.done += units

  def log(self, message: str):
    """Writes `[name elapsed, left ~ETA, done/total] message` to stderr."""
    if self.quiet:
      return
    left = self.remaining()
    eta = '' if left is None else f', ~{_clock(left)} left'
    share = (f', {self.done / self.total:.0%} done' if self.total else '')
    stream = self._stream or sys.stderr
    print(f'[{self.name} {_clock(self.elapsed())}{eta}{share}] {message}',
          file=stream, flush=True)


def best_time(fn: Callable[[], Any], repeats: int = 5) -> float:
  """Seconds of the fastest of `repeats` calls of `fn`, after a warm-up."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.min(times))


def warm_up(fns: Iterable[Callable[[], Any]], threads: int = 2) -> None:
  """Calls each of `fns` once to completion, `threads` at a time (their
  compiles run in parallel; nothing here is timed)."""
  with futures.ThreadPoolExecutor(threads) as pool:
    for done in [pool.submit(lambda f=f: jax.block_until_ready(f()))
                 for f in fns]:
      done.result()


def compile_all(jobs: Dict[str, Tuple[Any, Tuple[Any, ...]]],
                threads: int = 2) -> Dict[str, Any]:
  """{name: jitted fn compiled ahead of time for args} of {name: (jitted fn,
  args)}, `threads` compiles at a time (XLA compiles a program on one
  core)."""
  with futures.ThreadPoolExecutor(threads) as pool:
    jobs = {name: pool.submit(lambda f=fn, a=args: f.lower(*a).compile())
            for name, (fn, args) in jobs.items()}
    return {name: job.result() for name, job in jobs.items()}


def interleaved_passes(calls: Dict[str, List[Callable[[], Any]]],
                       repeats: int, on_pass: Optional[Callable[[str, int],
                                                                None]] = None,
                       warm: bool = True
                       ) -> Tuple[Dict[str, List[float]], Dict[str, List[Any]]]:
  """Times passes over each method's calls, the methods interleaved.

  Every method's first call runs once first (compile and warm up; not
  with `warm` False, for calls compiled ahead of time), two methods at a
  time: XLA compiles a program on one core, so the warm-ups of two methods
  take about the time of one on two cores. Then each of
  `repeats` rounds runs every method's calls in turn, each to completion.
  `on_pass(method, round)` is called before each timed pass.

  Returns:
    ({method: seconds of each round's pass}, {method: outputs of the last
    pass}).
  """
  if warm:
    warm_up(fns[0] for fns in calls.values())
  seconds = {m: [] for m in calls}
  outputs = {}
  for round_index in range(repeats):
    for method, fns in calls.items():
      if on_pass:
        on_pass(method, round_index)
      start = time.perf_counter()
      outputs[method] = [jax.block_until_ready(fn()) for fn in fns]
      seconds[method].append(time.perf_counter() - start)
  return seconds, outputs


def tokens_until_eos(row) -> List[int]:
  """A decoded row's tokens before its first EOS (id 1).

  >>> tokens_until_eos(np.array([5, 6, 1, 0]))
  [5, 6]
  """
  tokens = np.asarray(row).tolist()
  return tokens[:tokens.index(1)] if 1 in tokens else tokens


def produced_count(rows) -> int:
  """Tokens produced over decoded rows, each up to and including its EOS.

  >>> produced_count(np.array([[5, 6, 1, 0], [7, 8, 9, 9]]))
  7
  """
  total = 0
  for row in rows:
    before_eos = len(tokens_until_eos(row))
    total += before_eos + (before_eos < len(row))  # the EOS itself
  return total


def use_cores_as_devices() -> int:
  """Makes each CPU core this process may run on a JAX device, for
  training steps that run data parallel over them (`trainer.train`); a
  program on one device still uses every core. Only before JAX starts its
  backends; where it has started, or XLA_FLAGS sets a device count (the
  tests' 4), the devices stay as they are, and it says so on stderr.
  Returns the device count."""
  cores = len(os.sched_getaffinity(0))
  if '--xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS',
                                                                ''):
    reason = 'XLA_FLAGS sets the host device count'
  else:
    try:
      jax.config.update('jax_num_cpu_devices', cores)
      reason = None
    except RuntimeError:
      reason = 'JAX had started'
  count = jax.local_device_count()
  if reason and count != cores:
    print(f'{count} JAX device(s) for {cores} cores: {reason}.',
          file=sys.stderr)
  return count


def write_report(out_dir: str, stem: str, results: Dict[str, Any],
                 text: str) -> List[str]:
  """Writes `<out_dir>/<stem>.json` (`results`) and `<stem>.md` (`text`);
  returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, f'{stem}.{ext}') for ext in ('json', 'md')]
  with open(paths[0], 'w') as f:
    json.dump(results, f, indent=1)
  with open(paths[1], 'w') as f:
    f.write(text)
  return paths


def file_digest(path: str) -> str:
  """sha256 of the file at `path`, hex."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def git_commit(repo: str = os.path.dirname(MODELS_DIR)) -> str:
  """HEAD of the checkout, '+dirty' if tracked files have changed."""
  def run(*args):
    return subprocess.run(['git', *args], cwd=repo, capture_output=True,
                          text=True, check=False).stdout.strip()
  head = run('rev-parse', 'HEAD') or 'unknown'
  return head + ('+dirty' if run('status', '--porcelain',
                                 '--untracked-files=no') else '')


def cpu_model(cpuinfo: str = '/proc/cpuinfo') -> str:
  r"""The CPU's model name, from `cpuinfo` where there is one, with its x86
  family and model numbers: a virtual machine's name ('AMD EPYC') can hide
  the generation, which decides the memory system the figures measure.

  >>> import tempfile
  >>> with tempfile.NamedTemporaryFile('w', suffix='cpuinfo') as f:
  ...   _ = f.write('cpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n')
  ...   f.flush()
  ...   cpu_model(f.name)
  'AMD EPYC (family 26, model 2)'
  """
  fields = {}
  try:
    with open(cpuinfo) as f:
      for line in f:
        if not line.strip():
          break  # the first processor's fields
        key, _, value = line.partition(':')
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  name = fields.get('model name')
  if not name:
    return platform.processor() or platform.machine()
  if 'cpu family' in fields and 'model' in fields:
    return f"{name} (family {fields['cpu family']}, model {fields['model']})"
  return name
