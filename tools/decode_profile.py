"""Where a Base-width decode loop's time goes, op by op (output on host B:
figures/avx512/decode_profile.txt).

    python -m tools.decode_profile [float32|bfloat16]
                                   [speed|speed_pipeline|greedy|greedy_g|
                                    greedy_12l|t5x_sample] [--batch B]

Runs the bench's replay (`replay.replay_decode`, the first B short test
prompts, exits of the replayed 2x3 demo model in --demo_out) once under
`jax.profiler`, and sums XLA:CPU's per-thunk trace events over the loop:
`ffi_call` are the kernel library's weight products, attention and token
choice, the rest XLA's own ops (norms, activations, the loop's
bookkeeping, ...). Kernel calls
are also summed by shape (rows x K x N), with the rate at which they read
their weights. Figures are per loop step; the profiler adds a little to each
op.
"""

import argparse
import collections
import glob
import gzip
import json
import re
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
MODELS = {'speed': (4, 3), 'speed_pipeline': (4, 3), 'greedy': (4, 3),
          'greedy_g': (4, 1), 'greedy_12l': (12, 1), 't5x_sample': (4, 3)}
# A kernel call in the compiled HLO: its name, its outputs' shapes (one per
# weight) and its operands' shapes (x, then the weights).
_KERNEL_CALL = re.compile(
    r'%(ffi_call[\w.]*) = (.*?) custom-call\(.*?'
    r'custom_call_target="(\w+)", '
    r'operand_layout_constraints=\{(.*?)\}, api_version')
_SHAPE = re.compile(r'(\w+)\[([\d,]*)\]')
_BYTES = {'f32': 4, 'bf16': 2}


def _shapes(text: str) -> list:
  return [(dtype, [int(d) for d in dims.split(',') if d])
          for dtype, dims in _SHAPE.findall(text)]


def _kernel_shapes(hlo: str) -> dict:
  """{call name: (label, weight bytes)} of the kernel calls in compiled HLO
  text: matmuls 'rows x K x N dtype' (several weights: N 'N1+N2+...'), the
  attention 'attention: rows x length keys dtype', the token choice
  'token choice: rows x vocab ids dtype' and the embedding gather (no
  weight bytes)."""
  shapes = {}
  for m in _KERNEL_CALL.finditer(hlo):
    outs = _shapes(m.group(2))
    operands = _shapes(m.group(4))
    if 'gather' in m.group(3):
      shapes[m.group(1)] = ('embedding rows', 0)
      continue
    if 'sample' in m.group(3):
      l_dtype, logits = operands[0]
      shapes[m.group(1)] = (f'token choice: {logits[0]} rows x {logits[1]} '
                            f'ids {l_dtype}', 0)
      continue
    if 'attention' in m.group(3):
      (_, query), (c_dtype, cache) = operands[:2]
      shapes[m.group(1)] = (f'attention: {int(np.prod(query[:-1]))} rows x '
                            f'{cache[-2]} keys {c_dtype}', 0)
      continue
    (_, x), (w_dtype, _) = operands[:2]
    rows, k = int(np.prod(x[:-1])), x[-1]
    ns = [out[-1] for _, out in outs]
    shapes[m.group(1)] = (f'{rows} x {k} x {"+".join(map(str, ns))} '
                          f'{w_dtype}', k * sum(ns) * _BYTES.get(w_dtype, 4))
  return shapes


def _trace_events(fn) -> list:
  """The complete ('X') trace events of one profiled call of `fn`."""
  trace_dir = tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  jax.block_until_ready(fn())
  jax.profiler.stop_trace()
  path = sorted(glob.glob(f'{trace_dir}/**/*.trace.json.gz', recursive=True))
  with gzip.open(path[-1]) as f:
    return [e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']


def profile(dtype: str, method: str, demo_out: str = 'demo_out',
            batch: int = 1):
  """Prints the loop's time per step: unprofiled, then by op."""
  g, r = MODELS[method]
  source = replay.demo_schedule_source(3, demo_out)
  prompts, lengths, _ = demo_model.held_out(16, split='test', min_numbers=1,
                                            max_numbers=1)
  rec = replay.record(source, prompts[:batch], lengths[:batch])
  module, params = replay.init_model(bench_measure.base_config(g, r, dtype))
  prefill = replay.replay_prefill(module)
  decode = replay.replay_decode(
      bench_measure.replayed_method(method), module,
      max_speculative_rows=bench_measure.max_speculative_rows(method))
  prompts_j, lengths_j, by_position, predictions = replay.replay_args(rec)
  inputs, cache = prefill(params, prompts_j, lengths_j)
  args = (params, inputs, cache, lengths_j, by_position, predictions)
  run = lambda: decode(*args)
  shapes = _kernel_shapes(decode.lower(*args).compile().as_text())
  result = jax.block_until_ready(run())
  steps = (int(np.asarray(result.stats.num_steps).max())
           if result.stats is not None else int(rec['row_tokens'].max()))
  start = time.perf_counter()
  jax.block_until_ready(run())
  wall = time.perf_counter() - start
  ops = collections.Counter()
  for e in _trace_events(run):
    if not e['name'].startswith(ENCLOSING):
      ops[e['name']] += e['dur'] / steps
  kernel = sum(t for name, t in ops.items() if name.startswith('ffi_call'))
  xla = collections.Counter()
  by_shape = collections.defaultdict(lambda: [0.0, 0, 0])  # us, calls, bytes
  for name, t in ops.items():
    if not name.startswith('ffi_call'):
      xla[name.split('.')[0]] += t
    elif name in shapes:
      label, nbytes = shapes[name]
      by_shape[label][0] += t
      by_shape[label][1] += 1
      by_shape[label][2] += nbytes
  print(f'{dtype} {method}, batch {batch}: {steps} loop steps, '
        f'{1e3 * wall / steps:.2f} ms per step unprofiled; profiled per '
        f'step: kernel calls {kernel / 1e3:.2f} ms, XLA ops '
        f'{sum(xla.values()) / 1e3:.2f} ms')
  for label, (t, calls, nbytes) in sorted(by_shape.items(),
                                          key=lambda kv: -kv[1][0]):
    rate = (f', {nbytes / max(t, 1e-9) / 1e3:.1f} GB/s of weights'
            if nbytes else '')
    print(f'  {t:7.0f} us  kernel {label}: {calls} calls{rate}')
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
  p.add_argument('--batch', type=int, default=1,
                 help='prompts decoded together (at most 16)')
  p.add_argument('--demo_out', default='demo_out',
                 help='where the replayed demo model is kept (trained there '
                 'if absent)')
  args = p.parse_args(argv)
  profile(args.dtype, args.method, args.demo_out, args.batch)


if __name__ == '__main__':
  main()
