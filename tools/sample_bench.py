"""SPEED sampling against sequential sampling, next to greedy, side by side.

    python -m tools.sample_bench [--config 4x3] [--prompts 8]
                                 [--width 768] [--out bench_out] [--quiet]

For each setting (greedy; temperature 0.5, 0.7 and 1.0; temperature 1.0
with top-p 0.9) this measures, on held-out prompts at batch 1:

1. on the trained demo model with R stages (the `bench` replay source,
   trained or reloaded from --demo_out): SPEED's loop steps per token, the
   flip rate per stage, and the time of SPEED (`speed_decode`, or
   `sampling.speed_sample_decode`) against the sequential decode
   (`greedy_decode`, or `sampling.sample_decode`) with identical outputs;
2. at width --width (768) and vocabulary --vocab_size (32128), T5-Base's,
   with random weights, the same schedules replayed (each exit forced to the
   demo model's token, as `bench` does):
   SPEED's time against the sequential decode's, with every step's full
   computation (the sampler's Gumbel noise over the vocabulary and its top-p
   sort included).

Sampling rows use the position-keyed randomness of `t5x_speed.sampling`
(decode_rng = PRNGKey(prompt index)), so SPEED's samples are the sequential
sampler's. Results go to --out/sample_bench.json and .md; progress (setting,
model, method being compiled or timed, time left) to stderr unless --quiet.
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

from t5x_speed import inference
from t5x_speed.cpu import build
from t5x_speed import sampling
from tools import common
from tools import demo_model
from tools import replay

SETTINGS = (('greedy', None), ('T=0.5', dict(temperature=0.5, topp=0.0)),
            ('T=0.7', dict(temperature=0.7, topp=0.0)),
            ('T=1.0', dict(temperature=1.0, topp=0.0)),
            ('T=1.0, top-p 0.9', dict(temperature=1.0, topp=0.9)),
            ('T=0.7, top-p 0.9', dict(temperature=0.7, topp=0.9)))
# The setting of the main sampling measurement (SPEED sampling at T 0.7 /
# top-p 0.9, batch 1, in the width-768 replay, against sequential sampling);
# the sampler alone is timed at it and at T 1.0.
MAIN_SETTING = 'T=0.7, top-p 0.9'


def _flags(argv):
  p = argparse.ArgumentParser(
      prog='python -m tools.sample_bench', description=__doc__,
      formatter_class=common.HelpFormatter)
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
  p.add_argument('--replay_steps', type=int,
                 default=demo_model.REPLAY_STEPS,
                 help='training steps of the demo model')
  p.add_argument('--demo_out', default='demo_out',
                 help='where trained demo models are kept and reloaded')
  p.add_argument('--out', default='bench_out', help='output directory')
  common.add_quiet_flag(p)
  return p.parse_args(argv)


def _generate(module, params, prompt, length, method, setting, seed,
              record=False):
  """One prompt decoded by `method`; a sampling `setting` (None: greedy)
  samples with the PRNG key of `seed`."""
  sampled = {} if setting is None else dict(rng=jax.random.PRNGKey(seed),
                                            **setting)
  return inference.generate(
      module, params, prompt[None], length[None],
      max_decode_steps=demo_model.LENGTHS['targets'], method=method,
      bidirectional=True, record_schedule=record, **sampled)


def _methods(setting):
  """(sequential, SPEED) method names of `inference.generate`."""
  return ('greedy', 'speed') if setting is None else ('sample', 'speed_sample')


def _timed(calls: Dict[str, List[Any]], repeats: int,
           progress: common.Progress, what: str):
  """Interleaved passes over each method's calls: (median s, outputs).

  Takes 1 + len(calls) * repeats units of `progress`: the compiles, then
  each timed pass.
  """
  progress.log(f'{what}: compiling {" and ".join(calls)}')

  def on_pass(method, round_index):
    progress.advance()   # the compiles, or the pass before this one
    progress.log(f'{what}: {method}, pass {round_index + 1}/{repeats}')

  seconds, outputs = common.interleaved_passes(calls, repeats, on_pass)
  progress.advance()
  return {m: float(np.median(s)) for m, s in seconds.items()}, outputs


def _replay(module, params, wide, prompts, lengths, setting, args,
            progress: common.Progress, what: str) -> Dict[str, Any]:
  """SPEED's schedules on the demo model, replayed by the wide model with
  the sequential decode and SPEED: their times and consistency."""
  sequential, speed = _methods(setting)
  recs = [replay.replay_record(
      _generate(module, params, p, n, speed, setting, i, record=True),
      p[None], n[None]) for i, (p, n) in enumerate(zip(prompts, lengths))]
  tokens = sum(rec['tokens'] for rec in recs)
  calls = {}
  for method in (sequential, speed):
    fn = replay.replay_decoder(method, wide[0])
    calls[method] = [functools.partial(
        fn, wide[1], *replay.replay_args(rec),
        sample=replay.replay_sample_args(setting, i))
                     for i, rec in enumerate(recs)]
  seconds, outputs = _timed(calls, args.repeats, progress, what)
  return {
      'width': args.width, 'vocab_size': args.vocab_size,
      'dtype': args.dtype,
      'sequential_ms_per_token': 1e3 * seconds[sequential] / tokens,
      'speed_ms_per_token': 1e3 * seconds[speed] / tokens,
      'speedup': seconds[sequential] / seconds[speed],
      'consistent': all(np.array_equal(a.sequences, b.sequences) for a, b in
                        zip(outputs[speed], outputs[sequential]))}


def _sampler_alone(stages: int, vocab: int, repeats: int
                   ) -> List[Dict[str, Any]]:
  """ms per call of the sampler alone (`PositionKeyedSampler.pick`) on one
  sequence's logits, one row (sequential) or `stages` rows (a SPEED step),
  with the kernel and with XLA's ops; medians of `repeats` rounds of 100."""
  out = []
  for name, setting in SETTINGS:
    if name not in ('T=1.0', MAIN_SETTING):
      continue
    for rows in (1, stages):
      logits = jax.random.normal(jax.random.PRNGKey(rows), (1, rows, vocab))
      positions = jnp.arange(rows, dtype=jnp.int32)[None] + 5
      entry = {'setting': name, 'rows': rows}
      for choice in ('kernel', 'xla'):
        rule = sampling.PositionKeyedSampler(
            row_keys=jax.random.PRNGKey(0)[None],
            temperature=jnp.full((1,), setting['temperature']),
            topp=jnp.float32(setting['topp']), use_topp=setting['topp'] > 0,
            token_choice=choice)
        pick = jax.jit(rule.pick)
        jax.block_until_ready(pick(logits, positions))
        times = []
        for _ in range(repeats):
          start = time.perf_counter()
          for _ in range(100):
            jax.block_until_ready(pick(logits, positions))
          times.append((time.perf_counter() - start) * 10)   # ms per call
        entry[f'{choice}_ms'] = float(
            np.median(times))
      out.append(entry)
  return out


def run(args) -> Dict[str, Any]:
  g, r = demo_model.parse_gxr(args.config)
  progress = common.Progress(
      'sample_bench', len(SETTINGS) * (1 + 2 * args.repeats) *
      (2 if args.width else 1), quiet=args.quiet)
  module, params = replay.demo_schedule_source(
      r, args.demo_out, args.replay_steps, log=progress.log, quiet=args.quiet)
  prompts, lengths, targets = demo_model.held_out(
      args.prompts, split='test', min_numbers=1, max_numbers=2)
  wide = None
  if args.width:
    progress.log(f'initialising the width-{args.width} {g}x{r} model')
    wide = replay.init_model(demo_model.wide_config(
        g, r, args.width, args.dtype, args.vocab_size))
  rows = []
  for index, (name, setting) in enumerate(SETTINGS):
    what = f'setting {index + 1}/{len(SETTINGS)} ({name})'
    sequential, speed = _methods(setting)
    calls = {m: [functools.partial(_generate, module, params, p, n, m,
                                   setting, i)
                 for i, (p, n) in enumerate(zip(prompts, lengths))]
             for m in (sequential, speed)}
    seconds, outputs = _timed(
        calls, args.repeats, progress,
        f'{what}, demo model {module.config.num_unique_layers}x{r}')
    identical = all(np.array_equal(a.tokens, b.tokens) for a, b in
                    zip(outputs[speed], outputs[sequential]))
    summary = jax.tree.map(lambda *rows: np.concatenate(rows), *[
        jax.tree.map(np.asarray, o.stats) for o in outputs[speed]]).summary()
    row = {'setting': name, 'temperature': (setting or {}).get(
        'temperature', 0.0), 'topp': (setting or {}).get('topp', 0.0),
           'tokens': summary['tokens'],
           'steps_per_token': summary['steps_per_token'],
           'flip_rate': {k: v for k, v in summary.items()
                         if k.startswith('flip_rate')},
           'identical': identical,
           # What the demo model learned: its sequential outputs' accuracy.
           'exact_match': demo_model.exact_match(
               [o.tokens[0] for o in outputs[sequential]], targets),
           'demo': {'sequential_seconds': seconds[sequential],
                    'speed_seconds': seconds[speed],
                    'speedup': seconds[sequential] / seconds[speed]}}
    if wide is not None:
      row['replay'] = _replay(module, params, wide, prompts, lengths, setting,
                              args, progress,
                              f'{what}, width-{args.width} replay {g}x{r}')
    rows.append(row)
    print(json.dumps(row), flush=True)
  sampler = []
  if build.available():
    progress.log('timing the sampler alone')
    sampler = _sampler_alone(r, args.vocab_size, args.repeats)
  return {'machine': f'{common.cpu_model()}, {os.cpu_count()} cores',
          'jax': jax.__version__, 'kernel_isa': build.isa(),
          'config': args.config, 'prompts': args.prompts,
          'width': args.width, 'vocab_size': args.vocab_size,
          'sampler_alone': sampler,
          'dtype': args.dtype,
          'demo_model': f'{module.config.num_unique_layers}x{r}, width '
                        f'{module.config.emb_dim}, trained '
                        f'{args.replay_steps} steps',
          'kernel': build.available(), 'rows': rows}


def markdown(results: Dict[str, Any]) -> str:
  lines = [
      f"Machine: {results['machine']}; JAX {results['jax']}; kernel "
      f"{results['kernel_isa'] or 'off'}.", '',
      f"Demo model {results['demo_model']}; replay: {results['config']} at "
      f"width {results['width']}, vocabulary {results['vocab_size']} "
      f"({results['dtype']}, kernel "
      f"{'on' if results['kernel'] else 'off'}); {results['prompts']} "
      'held-out prompts at batch 1; speedup = sequential time / SPEED time '
      '(same outputs); exact match: the share of prompts whose sequential '
      'output is the target text (what the demo model learned).', '',
      '| setting | exact match | steps/token | flip rate per stage | '
      'identical | demo speedup | replay ms/token seq. | replay ms/token '
      'SPEED | replay speedup |', '|---|---|---|---|---|---|---|---|---|']
  for row in results['rows']:
    flips = ', '.join(f'{v:.1%}' for v in row['flip_rate'].values())
    rp = row.get('replay')
    replayed = (f"{rp['sequential_ms_per_token']:.1f} | "
                f"{rp['speed_ms_per_token']:.1f} | {rp['speedup']:.2f}x"
                if rp else '– | – | –')
    lines.append(f"| {row['setting']} | {row['exact_match']:.0%} | "
                 f"{row['steps_per_token']:.2f} | "
                 f"{flips} | {row['identical']} | "
                 f"{row['demo']['speedup']:.2f}x | {replayed} |")
  if results.get('sampler_alone'):
    lines += ['', f"The sampler alone (ms per call, {results['vocab_size']} "
              'ids; one row per sequential token, R rows per SPEED step):',
              '', '| setting | rows | kernel | XLA |', '|---|---|---|---|']
    lines += [f"| {e['setting']} | {e['rows']} | {e['kernel_ms']:.3f} | "
              f"{e['xla_ms']:.3f} |" for e in results['sampler_alone']]
  return '\n'.join(lines) + '\n'


def main(argv=None):
  args = _flags(argv)
  results = run(args)
  table = markdown(results)
  common.write_report(args.out, 'sample_bench', results, table)
  print(table)
  if not all(row['identical'] for row in results['rows']):
    raise SystemExit('SPEED and sequential outputs differ.')


if __name__ == '__main__':
  main()
