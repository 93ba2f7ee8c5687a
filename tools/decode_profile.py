"""Where a Base-width decode loop's time goes, op by op (output on host B:
figures/avx512/decode_profile.txt).

    python -m tools.decode_profile [float32|bfloat16]
                                   [speed|greedy|greedy_g|greedy_12l]

Runs the bench's replay (`replay.replay_decode`, batch 1, the first short
test prompt, exits of the replayed 2x3 demo model in --demo_out) once under
`jax.profiler`, and sums XLA:CPU's per-thunk trace events over the loop:
`ffi_call` are the few-row kernel's weight products, the rest XLA's own ops
(attention over the cache, norms, argmax, cache writes, ...). Figures are per
loop step; the profiler adds a little to each op.
"""

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time
from typing import Optional, Sequence

import jax
import numpy as np

from tools import bench_measure
from tools import common
from tools import demo_model
from tools import replay

# Events that enclose others (the whole executable, Python frames).
ENCLOSING = ('ThunkExecutor', '$', 'PjitFunction', 'Common', 'ParseArg',
             'while', 'end: ')
# (G, R) of each method's Base-width model.
MODELS = {'speed': (4, 3), 'greedy': (4, 3), 'greedy_g': (4, 1),
          'greedy_12l': (12, 1)}


def _trace_events(fn) -> list:
  """The complete ('X') trace events of one profiled call of `fn`."""
  trace_dir = tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  jax.block_until_ready(fn())
  jax.profiler.stop_trace()
  path = sorted(glob.glob(f'{trace_dir}/**/*.trace.json.gz', recursive=True))
  with gzip.open(path[-1]) as f:
    return [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']


def profile(dtype: str, method: str, demo_out: str = 'demo_out'):
  """Prints the loop's time per step: unprofiled, then by op."""
  g, r = MODELS[method]
  source = replay.demo_schedule_source(3, demo_out)
  prompts, lengths, _ = demo_model.held_out(16, split='test', min_numbers=1,
                                            max_numbers=1)
  rec = replay.record(source, prompts[:1], lengths[:1])
  module, params = replay.init_model(bench_measure.base_config(g, r, dtype))
  prefill = replay.replay_prefill(module)
  decode = replay.replay_decode('speed' if method == 'speed' else 'greedy',
                                module)
  prompts_j, lengths_j, by_position, predictions = replay.replay_args(rec)
  inputs, cache = prefill(params, prompts_j, lengths_j)
  run = lambda: decode(params, inputs, cache, lengths_j, by_position,
                       predictions)
  result = jax.block_until_ready(run())
  steps = (int(np.asarray(result.stats.num_steps).max())
           if result.stats is not None else rec['tokens'])
  start = time.perf_counter()
  jax.block_until_ready(run())
  wall = time.perf_counter() - start
  ops = collections.Counter()
  for e in _trace_events(run):
    if not e['name'].startswith(ENCLOSING):
      ops[e['name']] += e['dur'] / steps
  kernel = sum(t for name, t in ops.items() if name.startswith('ffi_call'))
  xla = collections.Counter()
  for name, t in ops.items():
    if not name.startswith('ffi_call'):
      xla[name.split('.')[0]] += t
  print(f'{dtype} {method}: {steps} loop steps, {1e3 * wall / steps:.2f} ms '
        f'per step unprofiled; profiled per step: kernel calls '
        f'{kernel / 1e3:.2f} ms, XLA ops {sum(xla.values()) / 1e3:.2f} ms')
  for name, t in xla.most_common(8):
    print(f'  {t:7.0f} us  {name}')


def main(argv: Optional[Sequence[str]] = None):
  p = argparse.ArgumentParser(prog='python -m tools.decode_profile',
                              description=__doc__,
                              formatter_class=common.HelpFormatter)
  p.add_argument('dtype', nargs='?', default='float32',
                 choices=('float32', 'bfloat16'),
                 help='dtype of the Base-width model')
  p.add_argument('method', nargs='?', default='speed', choices=tuple(MODELS),
                 help='the decode loop profiled')
  p.add_argument('--demo_out', default='demo_out',
                 help='where the replayed demo model is kept (trained there '
                 'if absent)')
  args = p.parse_args(argv)
  profile(args.dtype, args.method, args.demo_out)


if __name__ == '__main__':
  main()
