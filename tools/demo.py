"""The main job: SPEED on a freshly trained shared model, end to end.

    python -m tools.demo [--config 2x3] [--steps 600] [--out demo_out]

1. builds the generated `speed_demo_numbers` seqio task (numbers to words);
2. trains a small GxR cyclic-shared model with the weighted early-exit loss
   (or reloads it from --out when trained before with the same settings);
3. decodes held-out prompts one at a time with greedy and SPEED on that model,
   and greedy on the G-layer model of the same width (its first repetition);
4. replays that SPEED schedule on a wide GxR model (--replay_width, default
   768, T5-Base's; random weights, each exit's argmax forced to the trained
   model's, as `tools.bench` does) and decodes it with greedy and SPEED:
   at that width decoding is dominated by weight reads, which is what SPEED
   saves, while the width-64 model is dominated by per-op overheads;
5. prints tokens/s, SPEED's speedup, whether outputs are identical, task
   accuracy, per-stage flip rates, loop steps per token and pipeline occupancy;
6. writes consistency.png (per-exit prediction consistency, as the paper's
   Figure 4), latency.png and results.json to --out.

No T5X, GPU or download is needed.
"""

import argparse
import functools
import json
import os
import sys
import time
from typing import Dict, List

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from tools import demo_model
from t5x_speed import inference
from t5x_speed import network

METHODS = ('greedy', 'speed', 'greedy_g_layers')


def _flags(argv):
  parser = argparse.ArgumentParser(
      prog='python -m tools.demo', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='2x3',
                      help='GxR: G unique layers repeated R times (default '
                      '2x3).')
  parser.add_argument('--width', type=int, default=64,
                      help='model width; 4 heads of width/4 (default 64).')
  parser.add_argument('--steps', type=int, default=600,
                      help='training steps of 16 packed sequences (default '
                      '600, about 2-3 minutes on 2 CPU cores).')
  parser.add_argument('--out', default='demo_out',
                      help='output directory: parameters, plots, results '
                      '(default demo_out).')
  parser.add_argument('--retrain', action='store_true',
                      help='train even if --out holds a trained model.')
  parser.add_argument('--prompts', type=int, default=40,
                      help='held-out prompts decoded at batch 1 (default 40).')
  parser.add_argument('--replay_width', type=int, default=768,
                      help='width of the replayed wide model (a multiple of '
                      '64; 0 skips the replay; default 768).')
  parser.add_argument('--replay_prompts', type=int, default=16,
                      help='held-out prompts replayed at batch 1 (default 16).')
  parser.add_argument('--repeats', type=int, default=3,
                      help='timed passes over the prompts per method; the '
                      'median is reported (default 3).')
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
                num_prompts: int, repeats: int) -> Dict:
  """Greedy and SPEED on a width-`width` GxR model replaying `params`' SPEED
  schedule (batch 1): the same loop steps, flushes and tokens."""
  from tools import bench  # pylint: disable=g-import-not-at-top
  source = (network.SpeedTransformer(settings.config()), params)
  prompts, lengths, _ = demo_model.held_out(num_prompts)
  recs = [bench.record(source, prompts[i:i + 1], lengths[i:i + 1])
          for i in range(len(prompts))]
  module, wide_params = bench._init(demo_model.wide_config(  # pylint: disable=protected-access
      settings.num_unique_layers, settings.num_repeats, width))
  runs = {}
  for method in ('greedy', 'speed'):
    fn = bench.replay_decoder(method, module)
    runs[method] = [functools.partial(fn, wide_params, *(jnp.asarray(rec[k])
                                                         for k in (
        'prompts', 'lengths', 'by_position', 'predictions'))) for rec in recs]
    jax.block_until_ready(runs[method][0]())  # compile and warm up
  seconds = {m: [] for m in runs}
  outputs = {}
  for _ in range(repeats):
    for method, calls in runs.items():
      start = time.perf_counter()
      outputs[method] = [jax.block_until_ready(call()) for call in calls]
      seconds[method].append(time.perf_counter() - start)
  tokens = sum(rec['tokens'] for rec in recs)
  out = {'width': width, 'prompts': len(recs), 'tokens': tokens,
         'identical': all(np.array_equal(a[0], b[0]) for a, b in
                          zip(outputs['speed'], outputs['greedy']))}
  for method, times in seconds.items():
    best = float(np.min(times))
    out[method] = {'seconds': best, 'tokens_per_second': tokens / best,
                   'ms_per_token': 1e3 * best / tokens}
  out['speedup'] = (out['speed']['tokens_per_second'] /
                    out['greedy']['tokens_per_second'])
  return out


def _text(tokens: np.ndarray, vocab) -> str:
  tokens = tokens.tolist()
  if 1 in tokens:
    tokens = tokens[:tokens.index(1)]
  return vocab.decode(tokens)


def run(args) -> Dict:
  g, r = demo_model.parse_gxr(args.config)
  settings = demo_model.DemoSettings(num_unique_layers=g, num_repeats=r,
                                     width=args.width, steps=args.steps)
  params, meta = demo_model.load_or_train(settings, args.out, args.retrain)
  vocab = demo_model.seqio.get_mixture_or_task(
      demo_model.TASK).output_features['targets'].vocabulary
  shared = network.SpeedTransformer(settings.config())
  g_layers = network.SpeedTransformer(settings.config(num_repeats=1))
  models = {'greedy': (shared, 'greedy'), 'speed': (shared, 'speed'),
            'greedy_g_layers': (g_layers, 'greedy')}

  prompts, lengths, targets = demo_model.held_out(args.prompts)
  max_steps = demo_model.LENGTHS['targets']
  print(f'\nDecoding {len(prompts)} held-out prompts one at a time '
        f'(warm-up, then {args.repeats} interleaved timed passes)...')
  for module, method in models.values():  # compile once per method
    _decode_all(module, params, prompts[:1], lengths[:1], method, max_steps)
  seconds: Dict[str, List[float]] = {m: [] for m in METHODS}
  outputs = {}
  for _ in range(args.repeats):
    for name, (module, method) in models.items():
      outputs[name], elapsed = _decode_all(module, params, prompts, lengths,
                                           method, max_steps)
      seconds[name].append(elapsed)

  results = {'settings': meta['settings'], 'train_seconds':
             meta.get('train_seconds'), 'prompts': len(prompts)}
  texts = {}
  for name in METHODS:
    toks = [np.asarray(o.tokens[0]) for o in outputs[name]]
    produced = sum(list(t).index(1) + 1 if 1 in t else len(t) for t in toks)
    texts[name] = [_text(t, vocab) for t in toks]
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
  results['speedup'] = (results['speed']['tokens_per_second'] /
                        results['greedy']['tokens_per_second'])
  stats = [o.stats.summary() for o in outputs['speed']]
  totals = {k: sum(s[k] for s in stats) for k in stats[0]}
  steps, tokens = totals['example_steps'], totals['tokens']
  results['speed_stats'] = {
      'loop_steps': steps, 'tokens': tokens,
      'steps_per_token': steps / tokens,
      'occupancy': float(np.mean([s['occupancy'] for s in stats])),
      'flushes': totals['flushes'],
      'flip_rate': {f'stage_{i}': float(np.mean(
          [s[f'flip_rate/stage_{i}'] for s in stats])) for i in range(2, r + 1)},
  }
  results['consistency'] = {
      k: v.tolist() for k, v in demo_model.exit_consistency(
          settings, params).items()}
  results['examples'] = [
      {'target': t, 'speed': s} for t, s in
      zip(targets[:3], texts['speed'][:3])]
  if args.replay_width:
    print(f'\nReplaying the SPEED schedule on a width-{args.replay_width} '
          f'{g}x{r} model ({args.replay_prompts} prompts, batch 1)...')
    results['replay'] = replay_wide(settings, params, args.replay_width,
                                    args.replay_prompts, args.repeats)
  return results


def _report(results: Dict, out_dir: str):
  s = results['settings']
  g, r = s['num_unique_layers'], s['num_repeats']
  print(f'\n== SPEED demo: {g}x{r} shared model, width {s["width"]}, '
        f'{s["steps"]} training steps, batch 1 on {jax.devices()[0].platform}'
        f' ==')
  rows = [('greedy, shared model', results['greedy']),
          ('SPEED, shared model', results['speed']),
          (f'greedy, {g}-layer model', results['greedy_g_layers'])]
  print(f'{"method":28s} {"tokens/s":>9s} {"ms/token":>9s} {"exact match":>12s}')
  for name, row in rows:
    print(f'{name:28s} {row["tokens_per_second"]:9.1f} '
          f'{row["ms_per_token"]:9.2f} {row["exact_match"]:11.1%}')
  st = results['speed_stats']
  print(f'\nSPEED speedup over greedy on the same model: '
        f'{results["speedup"]:.2f}x')
  print(f'outputs identical to greedy: {results["identical"]}')
  rp = results.get('replay')
  if rp:
    print(f'\nWidth-{rp["width"]} {g}x{r} model, replaying the schedule above '
          f'(random weights, exits forced to the trained model\'s; '
          f'{rp["tokens"]} tokens):')
    for name in ('greedy', 'speed'):
      print(f'{name + ", wide replay":28s} '
            f'{rp[name]["tokens_per_second"]:9.1f} '
            f'{rp[name]["ms_per_token"]:9.2f}')
    print(f'SPEED speedup over greedy on the wide model: {rp["speedup"]:.2f}x; '
          f'outputs identical: {rp["identical"]}')
  # Without flushes each prompt takes tokens + R - 1 steps (pipeline fill).
  floor = (st['tokens'] + (r - 1) * results['prompts']) / st['tokens']
  print(f'loop steps: {st["loop_steps"]:.0f} for {st["tokens"]:.0f} tokens '
        f'({st["steps_per_token"]:.2f} per token; {floor:.2f} without '
        f'flushes, about {r} if every token flushed); '
        f'{st["flushes"]:.0f} flushes')
  print(f'pipeline occupancy: {st["occupancy"]:.1%} of {r} stages')
  print('flip rate after each stage (decoding): ' + ', '.join(
      f'{k.replace("_", " ")} {v:.1%}' for k, v in st['flip_rate'].items()))
  c = results['consistency']
  print('teacher-forced, held out: ' + ', '.join(
      f'exit {i + 1}: acc {a:.1%}, agrees with final {b:.1%}'
      for i, (a, b) in enumerate(zip(c['accuracy'], c['agrees_with_final']))))
  for ex in results['examples']:
    print(f'  target: {ex["target"]!r}\n  SPEED:  {ex["speed"]!r}')
  paths = _plots(results, out_dir)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  print(f'\nWrote {paths[0]}, {paths[1]} and '
        f'{os.path.join(out_dir, "results.json")}.')


def _plots(results: Dict, out_dir: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  c = results['consistency']
  exits = np.arange(1, len(c['accuracy']) + 1)
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(exits, 100 * np.array(c['agrees_with_final']), 'o-',
          label='prediction agrees with the final exit')
  ax.plot(exits, 100 * np.array(c['accuracy']), 's--', label='token accuracy')
  ax.set_xlabel('exit (after repetition)')
  ax.set_ylabel('% of held-out target tokens')
  ax.set_xticks(exits)
  ax.set_title('Per-stage prediction consistency')
  ax.legend(loc='lower right')
  ax.grid(alpha=0.3)
  consistency = os.path.join(out_dir, 'consistency.png')
  fig.tight_layout()
  fig.savefig(consistency, dpi=120)
  plt.close(fig)

  s = results['settings']
  g, r = s['num_unique_layers'], s['num_repeats']
  names = [f'greedy\n{g}x{r}', f'SPEED\n{g}x{r}', f'greedy\n{g} layers']
  values = [results[m]['ms_per_token'] for m in METHODS]
  fig, ax = plt.subplots(figsize=(5, 3.5))
  bars = ax.bar(names, values, color=['#888888', '#2a7ab9', '#bbbbbb'])
  ax.bar_label(bars, fmt='%.2f')
  ax.set_ylabel('ms per token (batch 1)')
  ax.set_title(f'Decoding latency, SPEED {results["speedup"]:.2f}x greedy')
  latency = os.path.join(out_dir, 'latency.png')
  fig.tight_layout()
  fig.savefig(latency, dpi=120)
  plt.close(fig)
  return consistency, latency


def main(argv=None):
  args = _flags(sys.argv[1:] if argv is None else argv)
  results = run(args)
  _report(results, args.out)
  if not results['identical'] or not results.get('replay', {}).get(
      'identical', True):
    print('ERROR: SPEED and greedy outputs differ.', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
