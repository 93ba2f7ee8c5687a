"""The demo's report: the console summary, the plots and results.json."""

import json
import os
from typing import Any, Dict, Tuple

import jax
import numpy as np

# The demo's methods, in the order of its table and latency plot.
METHODS = ('greedy', 'greedy_xla', 'speed', 'greedy_g_layers')


def report(results: Dict[str, Any], out_dir: str):
  """Prints the summary and writes the plots and results.json to `out_dir`."""
  s = results['settings']
  g, r = s['num_unique_layers'], s['num_repeats']
  print(f'\n== SPEED demo: {g}x{r} shared model, width {s["width"]}, '
        f'{s["steps"]} training steps of {s["batch_size"]} sequences, '
        f'decoding at batch 1 on {jax.devices()[0].platform} ==')
  rows = [('greedy, shared model', results['greedy']),
          ('greedy, XLA dot', results['greedy_xla']),
          ('SPEED, shared model', results['speed']),
          (f'greedy, {g}-layer model', results['greedy_g_layers'])]
  print(f'{"method":28s} {"tokens/s":>9s} {"ms/token":>9s} '
        f'{"exact match":>12s}')
  for name, row in rows:
    print(f'{name:28s} {row["tokens_per_second"]:9.1f} '
          f'{row["ms_per_token"]:9.2f} {row["exact_match"]:11.1%}')
  st = results['speed_stats']
  print(f'\nSPEED speedup over the faster greedy on the same model '
        f'({results["best_greedy"]}): {results["speedup"]:.2f}x '
        f'({results["speedup_same_numerics"]:.2f}x over greedy with SPEED\'s '
        'numerics, whose tokens it matches)')
  print(f'outputs identical to greedy: {results["identical"]}')
  rp = results.get('replay')
  if rp:
    print(f'\nWidth-{rp["width"]} {g}x{r} model, replaying the schedule above '
          f'(random weights, exits forced to the trained model\'s; '
          f'{rp["tokens"]} tokens):')
    for name in ('greedy', 'greedy_xla', 'speed'):
      print(f'{name + ", wide replay":28s} '
            f'{rp[name]["tokens_per_second"]:9.1f} '
            f'{rp[name]["ms_per_token"]:9.2f}')
    print(f'SPEED speedup over the faster greedy on the wide model '
          f'({rp["best_greedy"]}): {rp["speedup"]:.2f}x; '
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
  print(_wall_time(results))
  paths = _plots(results, out_dir)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  print(f'\nWrote {paths[0]}, {paths[1]} and '
        f'{os.path.join(out_dir, "results.json")}.')


def _clock(seconds: float) -> str:
  return f'{int(seconds) // 60}:{int(seconds) % 60:02d}'


def _wall_time(results: Dict[str, Any]) -> str:
  """Where this run's wall time went (imports and data loading included)."""
  wall = results['wall_seconds']
  model = ('loaded' if results['model_loaded'] else 'trained') + ' in'
  parts = [f'model {model} {_clock(wall["model"])}',
           f'decoding at width {results["settings"]["width"]} '
           f'{_clock(wall["decode"])}']
  if 'replay' in wall:
    parts.append(f'width-{results["replay"]["width"]} replay '
                 f'{_clock(wall["replay"])}')
  return (f'\nwall time: {_clock(wall["total"])} in all (imports and data '
          'included): ' + ', '.join(parts))


def _plots(results: Dict[str, Any], out_dir: str) -> Tuple[str, str]:
  """consistency.png and latency.png; returns their paths."""
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
  names = [f'greedy\n{g}x{r}', f'greedy, XLA\n{g}x{r}', f'SPEED\n{g}x{r}',
           f'greedy\n{g} layers']
  values = [results[m]['ms_per_token'] for m in METHODS]
  fig, ax = plt.subplots(figsize=(5, 3.5))
  bars = ax.bar(names, values,
                color=['#888888', '#aaaaaa', '#2a7ab9', '#bbbbbb'])
  ax.bar_label(bars, fmt='%.2f')
  ax.set_ylabel('ms per token (batch 1)')
  ax.set_title(f'Decoding latency, SPEED {results["speedup"]:.2f}x the '
               'faster greedy')
  latency = os.path.join(out_dir, 'latency.png')
  fig.tight_layout()
  fig.savefig(latency, dpi=120)
  plt.close(fig)
  return consistency, latency
