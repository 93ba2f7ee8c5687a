"""Where a Base-width decode loop's time goes, op by op (output on host B:
figures/avx512/decode_profile.txt).

    python figures/decode_profile.py [float32|bfloat16] [speed|greedy|greedy_g|greedy_12l]

Runs the bench's replay (`bench.replay_decode`, batch 1, the first short
test prompt, exits of the 600-step 2x3 demo model in demo_out/) once under
`jax.profiler`, and sums XLA:CPU's per-thunk trace events over the loop:
`ffi_call` are the few-row kernel's weight products, the rest XLA's own ops
(attention over the cache, norms, argmax, cache writes, ...). Figures are per
loop step; the profiler adds a little to each op.
"""

import collections
import glob
import gzip
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from tools import bench
from tools import demo_model

# Events that enclose others (the whole executable, Python frames).
ENCLOSING = ('ThunkExecutor', '$', 'PjitFunction', 'Common', 'ParseArg',
             'while', 'end: ')


def main(dtype: str, method: str):
  g, r = {'greedy_12l': (12, 1), 'greedy_g': (4, 1)}.get(method, (4, 3))
  source = bench.demo_schedule_source(3, 'demo_out', 600)
  prompts, lengths, _ = demo_model.held_out(16, split='test', min_numbers=1,
                                            max_numbers=1)
  rec = bench.record(source, prompts[:1], lengths[:1])
  module, params = bench._init(bench.base_config(g, r, dtype))  # pylint: disable=protected-access
  prefill = bench.replay_prefill(module)
  decode = bench.replay_decode('speed' if method == 'speed' else 'greedy',
                               module)
  replay = [jnp.asarray(rec[k]) for k in ('lengths', 'by_position',
                                          'predictions')]
  inputs, cache = prefill(params, jnp.asarray(rec['prompts']),
                          jnp.asarray(rec['lengths']))
  out = jax.block_until_ready(decode(params, inputs, cache, *replay))
  steps = (int(np.asarray(out[1].num_steps).max()) if out[1] is not None
           else rec['tokens'])
  start = time.perf_counter()
  jax.block_until_ready(decode(params, inputs, cache, *replay))
  wall = time.perf_counter() - start
  trace_dir = tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  jax.block_until_ready(decode(params, inputs, cache, *replay))
  jax.profiler.stop_trace()
  path = sorted(glob.glob(f'{trace_dir}/**/*.trace.json.gz', recursive=True))
  with gzip.open(path[-1]) as f:
    events = [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']
  ops = collections.Counter()
  for e in events:
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


if __name__ == '__main__':
  main(*(sys.argv[1:] + ['float32', 'speed'][len(sys.argv) - 1:]))
