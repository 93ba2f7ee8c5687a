"""The main job: SPEED on a freshly trained shared model, end to end.

    python -m tools.demo [--config 2x3] [--steps N] [--out demo_out]

1. builds the generated `speed_demo_numbers` seqio task (numbers to words);
2. trains a small GxR cyclic-shared model with the weighted early-exit loss
   (or reloads it from --out when trained before with the same settings);
3. decodes held-out prompts one at a time with greedy (the model's default
   numerics, the few-row kernel where built, and XLA's dot) and SPEED on
   that model, and greedy on the G-layer model of the same width (its first
   repetition); SPEED's speedup is over the faster greedy;
4. replays that SPEED schedule on a wide GxR model (--replay_width, default
   768, T5-Base's; random weights, each exit's argmax forced to the trained
   model's, as `tools.bench` does) and decodes it with greedy and SPEED:
   at that width decoding is dominated by weight reads, which is what SPEED
   saves, while the width-64 model is dominated by per-op overheads;
5. prints tokens/s, SPEED's speedup, whether outputs are identical, task
   accuracy, per-stage flip rates, loop steps per token, pipeline occupancy
   and where the wall time went;
6. writes consistency.png (per-exit prediction consistency, as the paper's
   Figure 4), latency.png and results.json to --out (`tools.demo_report`).

No T5X, GPU or download is needed.
"""

import time

_START = time.perf_counter()  # the demo's wall time includes its imports

# pylint: disable=g-import-not-at-top,g-bad-import-order
import argparse
import dataclasses
import functools
import os
import sys
from typing import Any, Dict, List

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

import jax
import numpy as np

from t5x_speed import inference
from t5x_speed import network
from tools import common
from tools import demo_model
from tools import demo_report
from tools import replay
# pylint: enable=g-import-not-at-top,g-bad-import-order

DEFAULTS = demo_model.DemoSettings()


def _flags(argv):
  parser = argparse.ArgumentParser(
      prog='python -m tools.demo', description=__doc__,
      formatter_class=common.HelpFormatter)
  parser.add_argument('--config', default='2x3',
                      help='GxR: G unique layers repeated R times.')
  parser.add_argument('--width', type=int, default=DEFAULTS.width,
                      help='model width; 4 heads of width/4.')
  parser.add_argument('--steps', type=int, default=DEFAULTS.steps,
                      help='training steps of --batch_size packed sequences.')
  parser.add_argument('--batch_size', type=int, default=DEFAULTS.batch_size,
                      help='packed sequences per training step.')
  parser.add_argument('--learning_rate', type=float,
                      default=DEFAULTS.learning_rate,
                      help='peak learning rate (linear warm-up over the '
                      'first tenth of the steps, cosine decay to a 20th).')
  parser.add_argument('--out', default='demo_out',
                      help='output directory: parameters, plots, results.')
  parser.add_argument('--retrain', action='store_true',
                      help='train even if --out holds a model trained with '
                      'the same settings.')
  parser.add_argument('--prompts', type=int, default=40,
                      help='held-out prompts decoded at batch 1.')
  parser.add_argument('--replay_width', type=int, default=768,
                      help='width of the replayed wide model (a multiple of '
                      '64; 0 skips the replay).')
  parser.add_argument('--replay_prompts', type=int, default=8,
                      help='held-out prompts replayed at batch 1.')
  parser.add_argument('--repeats', type=int, default=3,
                      help='timed passes over the prompts per method; the '
                      'median is reported (the wide replay: the fastest).')
  return parser.parse_args(argv)


def _decode_all(module, params, prompts, lengths, method, max_steps):
  """Decodes every prompt alone (batch 1); returns outputs and seconds."""
  outputs = []
  start = time.perf_counter()
  for prompt, length in zip(prompts, lengths):
    out = inference.generate(module, params, prompt[None], length[None],
                             max_decode_steps=max_steps, method=method,
                             bidirectional=True)
    jax.block_until_ready(out.tokens)
    outputs.append(out)
  return outputs, time.perf_counter() - start


def replay_wide(settings: demo_model.DemoSettings, params, width: int,
                num_prompts: int, repeats: int) -> Dict[str, Any]:
  """Greedy and SPEED on a width-`width` GxR model replaying `params`' SPEED
  schedule (batch 1): the same loop steps, flushes and tokens."""
  source = (network.SpeedTransformer(settings.config()), params)
  prompts, lengths, _ = demo_model.held_out(num_prompts)
  recs = [replay.record(source, prompts[i:i + 1], lengths[i:i + 1])
          for i in range(len(prompts))]
  module, wide_params = replay.init_model(demo_model.wide_config(
      settings.num_unique_layers, settings.num_repeats, width))
  calls = {}
  for name, method, mod in (('greedy', 'greedy', module),
                            ('greedy_xla', 'greedy', _with_xla_dot(module)),
                            ('speed', 'speed', module)):
    fn = replay.replay_decoder(method, mod)
    calls[name] = [functools.partial(fn, wide_params,
                                     *replay.replay_args(rec))
                   for rec in recs]
  seconds, outputs = common.interleaved_passes(calls, repeats)
  tokens = sum(rec['tokens'] for rec in recs)
  out = {'width': width, 'prompts': len(recs), 'tokens': tokens,
         'identical': all(np.array_equal(a.sequences, b.sequences)
                          for a, b in zip(outputs['speed'],
                                          outputs['greedy']))}
  for method, times in seconds.items():
    best = float(np.min(times))
    out[method] = {'seconds': best, 'tokens_per_second': tokens / best,
                   'ms_per_token': 1e3 * best / tokens}
  out.update(_speedups(out))
  return out


def _with_xla_dot(module: network.SpeedTransformer
                  ) -> network.SpeedTransformer:
  """The same model whose decode steps multiply with XLA's dot."""
  return network.SpeedTransformer(
      dataclasses.replace(module.config, decode_matmul='xla'))


def _speedups(results: Dict[str, Any]) -> Dict[str, Any]:
  """SPEED's speedup over the faster greedy ('greedy' or 'greedy_xla'),
  and over 'greedy', whose numerics (and so tokens) SPEED's are."""
  tps = lambda m: results[m]['tokens_per_second']
  best = max(('greedy', 'greedy_xla'), key=tps)
  return {'best_greedy': best, 'speedup': tps('speed') / tps(best),
          'speedup_same_numerics': tps('speed') / tps('greedy')}


def _decode_trained(settings, params, args) -> Dict[str, Any]:
  """Greedy and SPEED on the trained model, greedy on its first
  repetition: timings, exact match, SPEED's statistics, examples."""
  r = settings.num_repeats
  vocab = demo_model.task().output_features['targets'].vocabulary
  shared = network.SpeedTransformer(settings.config())
  g_layers = network.SpeedTransformer(settings.config(num_repeats=1))
  models = {'greedy': (shared, 'greedy'),
            'greedy_xla': (_with_xla_dot(shared), 'greedy'),
            'speed': (shared, 'speed'),
            'greedy_g_layers': (g_layers, 'greedy')}

  prompts, lengths, targets = demo_model.held_out(args.prompts)
  max_steps = demo_model.LENGTHS['targets']
  print(f'\nDecoding {len(prompts)} held-out prompts one at a time '
        f'(warm-up, then {args.repeats} interleaved timed passes)...',
        flush=True)
  for module, method in models.values():  # compile once per method
    _decode_all(module, params, prompts[:1], lengths[:1], method, max_steps)
  seconds: Dict[str, List[float]] = {m: [] for m in demo_report.METHODS}
  outputs = {}
  for _ in range(args.repeats):
    for name, (module, method) in models.items():
      outputs[name], elapsed = _decode_all(module, params, prompts, lengths,
                                           method, max_steps)
      seconds[name].append(elapsed)

  results = {'prompts': len(prompts)}
  texts = {}
  for name in demo_report.METHODS:
    toks = [np.asarray(o.tokens[0]) for o in outputs[name]]
    produced = common.produced_count(toks)
    texts[name] = [vocab.decode(common.tokens_until_eos(t)) for t in toks]
    median = float(np.median(seconds[name]))
    results[name] = {
        'tokens': int(produced), 'seconds': median,
        'tokens_per_second': produced / median,
        'ms_per_token': 1e3 * median / produced,
        'exact_match': float(np.mean([p == t for p, t in
                                      zip(texts[name], targets)])),
    }
  speed_tokens = [np.asarray(o.tokens) for o in outputs['speed']]
  greedy_tokens = [np.asarray(o.tokens) for o in outputs['greedy']]
  results['identical'] = all(np.array_equal(a, b) for a, b in
                             zip(speed_tokens, greedy_tokens))
  results.update(_speedups(results))
  stats = [o.stats.summary() for o in outputs['speed']]
  totals = {k: sum(s[k] for s in stats) for k in stats[0]}
  steps, tokens = totals['example_steps'], totals['tokens']
  results['speed_stats'] = {
      'loop_steps': steps, 'tokens': tokens,
      'steps_per_token': steps / tokens,
      'occupancy': float(np.mean([s['occupancy'] for s in stats])),
      'flushes': totals['flushes'],
      'flip_rate': {f'stage_{i}': float(np.mean(
          [s[f'flip_rate/stage_{i}'] for s in stats]))
                    for i in range(2, r + 1)},
  }
  results['examples'] = [
      {'target': t, 'speed': s} for t, s in
      zip(targets[:3], texts['speed'][:3])]
  return results


def run(args) -> Dict[str, Any]:
  """Trains (or reloads), decodes and replays; returns the results."""
  g, r = demo_model.parse_gxr(args.config)
  settings = demo_model.DemoSettings(
      num_unique_layers=g, num_repeats=r, width=args.width, steps=args.steps,
      batch_size=args.batch_size, learning_rate=args.learning_rate)
  wall = {}
  start = time.perf_counter()
  params, meta = demo_model.load_or_train(settings, args.out, args.retrain)
  wall['model'] = time.perf_counter() - start

  start = time.perf_counter()
  results = {'settings': meta['settings'],
             'train_seconds': meta.get('train_seconds'),
             'model_loaded': meta['loaded'],
             **_decode_trained(settings, params, args)}
  results['consistency'] = {
      k: v.tolist() for k, v in demo_model.exit_consistency(
          settings, params).items()}
  wall['decode'] = time.perf_counter() - start
  if args.replay_width:
    print(f'\nReplaying the SPEED schedule on a width-{args.replay_width} '
          f'{g}x{r} model ({args.replay_prompts} prompts, batch 1)...',
          flush=True)
    start = time.perf_counter()
    results['replay'] = replay_wide(settings, params, args.replay_width,
                                    args.replay_prompts, args.repeats)
    wall['replay'] = time.perf_counter() - start
  wall['total'] = time.perf_counter() - _START
  results['wall_seconds'] = wall
  return results


def main(argv=None):
  args = _flags(sys.argv[1:] if argv is None else argv)
  results = run(args)
  demo_report.report(results, args.out)
  if not results['identical'] or not results.get('replay', {}).get(
      'identical', True):
    print('ERROR: SPEED and greedy outputs differ.', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
