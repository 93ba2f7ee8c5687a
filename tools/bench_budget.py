"""The latency budget (`tools.bench --budget`): where SPEED's time per token
goes, beside the best greedy's and the unshared G-layer model's.

At batch 1 each decode call produces one sequence, so a method's time per
token splits exactly into

  prefill      the prompt's pass through every layer, per token produced;
  tokens       one loop step per committed token, at the method's step cost;
  fill         SPEED's R - 1 steps per sequence before its first commit;
  flushes      SPEED's steps lost to flushes, per stage: a flush at stage s
               restarts its successor s - 1 stages back;
  per call     the decode call's dispatch, argument handling and loop
               entry and exit (`bench_measure.BatchRun.call_overhead`);

where a method's step cost is its decoding time less its calls' overhead,
over its loop steps. SPEED with candidate branches (speed_bK) has a row of
its own: fewer flushes, at the cost of K more rows per step. What is left of SPEED's steps after tokens, fill and
flushes ('other', from examples ending inside a flush) is listed too. The
levers: what SPEED would save per token without flushes, without fill,
with the G-layer model's step cost and with its prefill.
"""

from typing import Any, Dict, List, Optional

PARTS = ('prefill', 'tokens', 'fill', 'flushes', 'per call', 'other')
COLORS = {'prefill': '#8c6d31', 'tokens': '#2a7ab9', 'fill': '#9ecae1',
          'flushes': '#d62728', 'per call': '#7f7f7f', 'other': '#bbbbbb'}


def method_budget(row: Dict[str, Any], calls: int, stages: int = 1,
                  flushes_per_stage: Optional[List[float]] = None
                  ) -> Dict[str, Any]:
  """ms per token of each part of one method's time (see the module
  docstring): {'parts': {part: ms}, 'step_ms', 'total_ms', ...}.

  Two sequences of 10 tokens in all, 16 loop steps (10 tokens, 2 x 2 fill,
  one flush at stage 3 costing 2):

  >>> b = method_budget({'tokens': 10, 'loop_steps': 16, 'seconds': 0.092,
  ...     'prefill_seconds': 0.01, 'decode_seconds': 0.082,
  ...     'call_overhead_seconds': 0.001}, 2, stages=3,
  ...     flushes_per_stage=[0, 0, 1])
  >>> b['step_ms'], {k: round(v, 3) for k, v in b['parts'].items()}
  ... # doctest: +NORMALIZE_WHITESPACE
  (5.0, {'prefill': 1.0, 'tokens': 5.0, 'fill': 2.0, 'flushes/stage_2': 0.0,
         'flushes/stage_3': 1.0, 'per call': 0.2, 'other': 0.0})
  >>> round(b['total_ms'], 3), round(b['measured_ms'], 3)
  (9.2, 9.2)
  """
  tokens, steps = row['tokens'], row['loop_steps']
  overhead = row.get('call_overhead_seconds', 0.0) * calls
  step_ms = 1e3 * (row['decode_seconds'] - overhead) / steps
  parts = {'prefill': 1e3 * row['prefill_seconds'] / tokens,
           'tokens': step_ms}
  counted = tokens
  if stages > 1:
    parts['fill'] = step_ms * (stages - 1) * calls / tokens
    counted += (stages - 1) * calls
    for s, flushes in enumerate(flushes_per_stage or [], start=1):
      if s > 1:
        parts[f'flushes/stage_{s}'] = step_ms * (s - 1) * flushes / tokens
        counted += (s - 1) * flushes
  parts['per call'] = 1e3 * overhead / tokens
  parts['other'] = step_ms * (steps - counted) / tokens
  return {'parts': parts, 'step_ms': step_ms, 'steps_per_token':
          steps / tokens, 'total_ms': sum(parts.values()),
          'measured_ms': 1e3 * row['seconds'] / tokens,
          'overhead_measured': 'call_overhead_seconds' in row}


def _best(rows: Dict[str, Any], names) -> Optional[str]:
  """The fastest end to end of `names` (our decode fns only: the budget
  needs their per-call overhead)."""
  found = [n for n in names if n in rows]
  return min(found, key=lambda n: rows[n]['ms_per_token_per_sequence'],
             default=None)


def budget(res: Dict[str, Any], stages: int) -> Dict[str, Any]:
  """The budget of one batch-1 row group: SPEED, the best greedy (of ours:
  the kernel's or XLA's) and the best unshared G-layer model, and the
  levers in ms per token."""
  rows, calls = res['methods'], res['replay']['calls']
  chosen = {'SPEED': 'speed'}
  for method, row in rows.items():
    if row.get('branches') and row.get('pipelined'):
      k = row['branches']
      chosen[f'SPEED, {k} branch{"es" if k > 1 else ""}'] = method
  chosen.update({
      'best greedy': _best(rows, ('greedy', 'greedy_xla')),
      'G-layer greedy': _best(rows, ('greedy_g', 'greedy_g_xla'))})
  out = {'config': res['config'], 'length': res['length'],
         'exits': res.get('exits'), 'methods': {}}
  for label, method in chosen.items():
    if method is None:
      continue
    pipelined = label.startswith('SPEED')
    out['methods'][label] = {
        'method': method, **method_budget(
            rows[method], calls, stages if pipelined else 1,
            rows[method].get('flushes_per_stage') or
            res['replay']['flushes_per_stage'] if pipelined else None)}
  speed = out['methods']['SPEED']
  flushes = sum(v for k, v in speed['parts'].items()
                if k.startswith('flushes'))
  levers = {'no flushes': flushes, 'no fill': speed['parts']['fill']}
  shallow = out['methods'].get('G-layer greedy')
  if shallow:
    levers['step at the G-layer model\'s cost'] = (
        (speed['step_ms'] - shallow['step_ms']) * speed['steps_per_token'])
    levers['prefill at the G-layer model\'s'] = (
        speed['parts']['prefill'] - shallow['parts']['prefill'])
  out['levers'] = levers
  t5x = rows.get('t5x_sample')
  if t5x is not None:
    out['t5x_sample_ms'] = t5x['ms_per_token_per_sequence']
  return out


def markdown(budgets: List[Dict[str, Any]]) -> str:
  """The budget tables: ms per token by part, and the levers."""
  parts = []
  for b in budgets:
    for m in b['methods'].values():
      parts += [p for p in m['parts'] if p not in parts]
  lines = ['| outputs | method | step, ms | steps/token | ' +
           ' | '.join(parts) + ' | total, ms/token | measured |',
           '|' + '---|' * (len(parts) + 6)]
  for b in budgets:
    for label, m in b['methods'].items():
      lines.append(
          f'| {b["length"]} | {label} ({m["method"]}) | {m["step_ms"]:.2f} | '
          f'{m["steps_per_token"]:.2f} | ' + ' | '.join(
              f'{m["parts"][p]:.2f}' if p in m['parts'] else '–'
              for p in parts) +
          f' | {m["total_ms"]:.2f} | {m["measured_ms"]:.2f} |')
  lines += ['', '| outputs | lever | SPEED saves, ms/token | SPEED then, '
            'ms/token |', '|---|---|---|---|']
  for b in budgets:
    total = b['methods']['SPEED']['total_ms']
    for name, saved in b['levers'].items():
      lines.append(f'| {b["length"]} | {name} | {saved:.2f} | '
                   f'{total - saved:.2f} |')
  return '\n'.join(lines)


def plot(budgets: List[Dict[str, Any]], path: str, title: str) -> None:
  """One stacked bar per method and output length."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(9, 5))
  labels, positions, x, top = [], [], 0.0, 0.0
  seen = set()
  for b in budgets:
    for label, m in b['methods'].items():
      bottom = 0.0
      for part, value in m['parts'].items():
        kind = 'flushes' if part.startswith('flushes') else part
        ax.bar(x, value, bottom=bottom, color=COLORS[kind],
               alpha=0.6 if part.endswith('_3') else 1.0, edgecolor='white',
               label=None if part in seen else part.replace('/', ', '))
        seen.add(part)
        bottom += value
      ax.text(x, bottom, f'{bottom:.2f}', ha='center', va='bottom',
              fontsize=8)
      top = max(top, bottom)
      labels.append(f'{label}\n{b["length"]}')
      positions.append(x)
      x += 1
    x += 0.5   # a gap between output lengths
  ax.set_xticks(positions, labels, fontsize=8)
  ax.set_ylim(0, 1.08 * top)  # room for the totals above the bars
  ax.set_ylabel('ms per token (batch 1)')
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8, loc='upper right')
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)

