"""SPEED sampling against sequential sampling, next to greedy, side by side.

    python -m tools.sample_bench [--config 4x3] [--prompts 8]
                                     [--width 768] [--out bench_out]

For each setting (greedy; temperature 0.5, 0.7 and 1.0; temperature 1.0
with top-p 0.9) this measures, on held-out prompts at batch 1:

1. on the trained demo model with R stages (the `bench` replay source,
   trained or reloaded from --demo_out): SPEED's loop steps per token, the
   flip rate per stage, and the time of SPEED (`speed_decode`, or
   `sampling.speed_sample_decode`) against the sequential decode
   (`greedy_decode`, or `sampling.sample_decode`) with identical outputs;
2. at width --width (768) and vocabulary --vocab_size (32128), T5-Base's,
   with random weights, the same schedules replayed (each exit forced to the demo model's token, as `bench` does):
   SPEED's time against the sequential decode's, with every step's full
   computation (the sampler's Gumbel noise over the vocabulary and its top-p
   sort included).

Sampling rows use the position-keyed randomness of `t5x_speed.sampling`
(decode_rng = PRNGKey(prompt index)), so SPEED's samples are the sequential
sampler's. Results go to --out/sample_bench.json and .md.
"""

import argparse
import functools
import json
import os
import time
from typing import Any, Dict, List

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from tools import bench
from t5x_speed import decoding
from tools import demo_model
from t5x_speed import inference
from t5x_speed import rowmatmul

SETTINGS = (('greedy', None), ('T=0.5', dict(temperature=0.5, topp=0.0)),
            ('T=0.7', dict(temperature=0.7, topp=0.0)),
            ('T=1.0', dict(temperature=1.0, topp=0.0)),
            ('T=1.0, top-p 0.9', dict(temperature=1.0, topp=0.9)))


def _flags(argv):
  p = argparse.ArgumentParser(
      prog='python -m tools.sample_bench', description=__doc__,
      formatter_class=bench._HelpFormatter)  # pylint: disable=protected-access
  p.add_argument('--config', default='4x3',
                 help='GxR of the replayed wide model; the demo model has R '
                 'stages and max(6 // R, 1) unique layers')
  p.add_argument('--prompts', type=int, default=8,
                 help='held-out prompts (test split, 1-2 numbers), batch 1')
  p.add_argument('--width', type=int, default=768,
                 help='width of the replayed model (T5-Base: 768; 0 skips '
                 'the replay)')
  p.add_argument('--vocab_size', type=int, default=32128,
                 help='vocabulary of the replayed model (T5\'s 32128: the '
                 'classifier, the sampler\'s noise and top-p sort span it)')
  p.add_argument('--repeats', type=int, default=3,
                 help='timed passes per method; the median is reported')
  p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'),
                 help='activation and weight dtype of the replayed model')
  p.add_argument('--replay_steps', type=int, default=600,
                 help='training steps of the demo model')
  p.add_argument('--demo_out', default='demo_out',
                 help='where trained demo models are kept and reloaded')
  p.add_argument('--out', default='bench_out', help='output directory')
  return p.parse_args(argv)


def _generate(module, params, prompt, length, method, setting, seed,
              record=False):
  return inference.generate(
      module, params, prompt[None], length[None],
      max_decode_steps=demo_model.LENGTHS['targets'], method=method,
      bidirectional=True, record_schedule=record, rng=jax.random.PRNGKey(seed),
      **(setting or {}))


def _methods(setting):
  """(sequential, SPEED) method names of `inference.generate`."""
  return ('greedy', 'speed') if setting is None else ('sample', 'speed_sample')


def _timed(calls: Dict[str, List[Any]], repeats: int):
  """Interleaved passes over each method's calls: (median s, outputs)."""
  seconds = {m: [] for m in calls}
  outputs = {}
  for method, fns in calls.items():
    jax.block_until_ready(fns[0]())      # compile and warm up
  for _ in range(repeats):
    for method, fns in calls.items():
      start = time.perf_counter()
      outputs[method] = [jax.block_until_ready(fn()) for fn in fns]
      seconds[method].append(time.perf_counter() - start)
  return {m: float(np.median(s)) for m, s in seconds.items()}, outputs


def run(args) -> Dict[str, Any]:
  g, r = demo_model.parse_gxr(args.config)
  module, params = bench.demo_schedule_source(r, args.demo_out,
                                              args.replay_steps)
  prompts, lengths, _ = demo_model.held_out(args.prompts, split='test',
                                            min_numbers=1, max_numbers=2)
  wide = None
  if args.width:
    wide = bench._init(demo_model.wide_config(  # pylint: disable=protected-access
        g, r, args.width, args.dtype, args.vocab_size))
  rows = []
  for name, setting in SETTINGS:
    sequential, speed = _methods(setting)
    print(f'{name}: demo model ({module.config.num_unique_layers}x{r})...',
          flush=True)
    calls = {m: [functools.partial(_generate, module, params, p, n, m,
                                   setting, i)
                 for i, (p, n) in enumerate(zip(prompts, lengths))]
             for m in (sequential, speed)}
    seconds, outputs = _timed(calls, args.repeats)
    identical = all(np.array_equal(a.tokens, b.tokens) for a, b in
                    zip(outputs[speed], outputs[sequential]))
    summary = decoding.SpeedStats(*[np.concatenate([
        np.asarray(getattr(o.stats, f)) for o in outputs[speed]])
        for f in decoding.SpeedStats.__dataclass_fields__]).summary()
    row = {'setting': name, 'temperature': (setting or {}).get(
        'temperature', 0.0), 'topp': (setting or {}).get('topp', 0.0),
           'tokens': summary['tokens'],
           'steps_per_token': summary['steps_per_token'],
           'flip_rate': {k: v for k, v in summary.items()
                         if k.startswith('flip_rate')},
           'identical': identical,
           'demo': {'sequential_seconds': seconds[sequential],
                    'speed_seconds': seconds[speed],
                    'speedup': seconds[sequential] / seconds[speed]}}
    if wide is not None:
      print(f'{name}: replay at width {args.width} ({g}x{r})...', flush=True)
      recs = [bench.replay_record(
          _generate(module, params, p, n, speed, setting, i, record=True),
          p[None], n[None]) for i, (p, n) in enumerate(zip(prompts, lengths))]
      calls = {}
      for method in (sequential, speed):
        fn = bench.replay_decoder(method, wide[0])
        calls[method] = [functools.partial(
            fn, wide[1], *(jnp.asarray(rec[k]) for k in (
                'prompts', 'lengths', 'by_position', 'predictions')),
            sample=None if setting is None else dict(
                decode_rng=jax.random.PRNGKey(i),
                temperature=jnp.float32(setting['temperature']),
                topp=jnp.float32(setting['topp'])))
            for i, rec in enumerate(recs)]
      seconds, outputs = _timed(calls, args.repeats)
      row['replay'] = {
          'width': args.width, 'vocab_size': args.vocab_size,
          'dtype': args.dtype,
          'sequential_ms_per_token': 1e3 * seconds[sequential] /
                                     summary['tokens'],
          'speed_ms_per_token': 1e3 * seconds[speed] / summary['tokens'],
          'speedup': seconds[sequential] / seconds[speed],
          'consistent': all(np.array_equal(a[0], b[0]) for a, b in zip(
              outputs[speed], outputs[sequential]))}
    rows.append(row)
    print(json.dumps(row), flush=True)
  return {'config': args.config, 'prompts': args.prompts,
          'width': args.width, 'vocab_size': args.vocab_size,
          'dtype': args.dtype,
          'demo_model': f'{module.config.num_unique_layers}x{r}, width '
                        f'{module.config.emb_dim}, trained '
                        f'{args.replay_steps} steps',
          'kernel': rowmatmul.available(), 'rows': rows}


def _markdown(results: Dict[str, Any]) -> str:
  lines = [
      f"Demo model {results['demo_model']}; replay: {results['config']} at "
      f"width {results['width']}, vocabulary {results['vocab_size']} "
      f"({results['dtype']}, kernel "
      f"{'on' if results['kernel'] else 'off'}); {results['prompts']} "
      'held-out prompts at batch 1; speedup = sequential time / SPEED time '
      '(same outputs).', '',
      '| setting | steps/token | flip rate per stage | identical | demo '
      'speedup | replay ms/token seq. | replay ms/token SPEED | replay '
      'speedup |', '|---|---|---|---|---|---|---|---|']
  for row in results['rows']:
    flips = ', '.join(f'{v:.1%}' for v in row['flip_rate'].values())
    rp = row.get('replay')
    replay = (f"{rp['sequential_ms_per_token']:.1f} | "
              f"{rp['speed_ms_per_token']:.1f} | {rp['speedup']:.2f}x"
              if rp else '– | – | –')
    lines.append(f"| {row['setting']} | {row['steps_per_token']:.2f} | "
                 f"{flips} | {row['identical']} | "
                 f"{row['demo']['speedup']:.2f}x | {replay} |")
  return '\n'.join(lines) + '\n'


def main(argv=None):
  args = _flags(argv)
  results = run(args)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'sample_bench.json'), 'w') as f:
    json.dump(results, f, indent=1)
  table = _markdown(results)
  with open(os.path.join(args.out, 'sample_bench.md'), 'w') as f:
    f.write(table)
  print(table)
  if not all(row['identical'] for row in results['rows']):
    raise SystemExit('SPEED and sequential outputs differ.')


if __name__ == '__main__':
  main()
