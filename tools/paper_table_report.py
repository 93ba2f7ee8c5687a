"""The paper table's report: markdown, JSON and a plot (`tools.paper_table`)."""

import json
import os
from typing import Any, Dict, List, Tuple

import numpy as np

from tools import paper_table_data


def _pct(values) -> str:
  return ' / '.join(f'{100 * v:.1f}' for v in values)


def _conditions(results: Dict[str, Any]) -> str:
  s = results['settings']
  return (f'Width {s["width"]} (64-wide heads), {s["steps"]} steps of '
          f'{s["batch_size"]} packed sequences ({s["inputs_length"]} + '
          f'{s["targets_length"]} tokens), AdamW peak {s["learning_rate"]:g} '
          f'({results.get("trainer", "library")} trainer), '
          f'SentencePiece vocabulary {s["vocab_size"]}, float32, '
          + ('each run on the host under "Records"' if 'records' in results
             else f'{results["devices"]} CPU device(s) on {results["cpu"]}')
          + '. Test BLEU '
          f'and chrF over the first {s["test_examples"]} test pairs; '
          f'teacher-forced exits over {s["consistency_examples"]}; latency '
          f'and replay at batch 1 on {s["latency_prompts"]} test prompts, '
          f'best of {s["repeats"]} interleaved passes; replay at width '
          f'{s["replay_width"]}, vocabulary 32128, against the faster of the '
          'kernel and XLA greedy. ' + _extent(results)
          ) + _timing_load(results)


def _extent(results: Dict[str, Any]) -> str:
  """What the table holds: its records and missing rows, or a run's
  wall time."""
  if 'records' in results:
    missing = results.get('missing')
    return (f'Assembled from {len(results["records"])} run records '
            '(`tools.paper_table_records`; each row\'s commit and host under '
            '"Records"). ' + (f'Missing rows: {", ".join(missing)}.'
                              if missing else 'No row is missing.'))
  if 'wall_seconds' in results:
    return f'Wall time {results["wall_seconds"] / 60:.0f} min.'
  return f'Partial: the runs finished so far, of {results["planned"]}.'


def _timing_load(results: Dict[str, Any]) -> str:
  """' Timed at load averages up to X (N cores).': beside other work (a
  load above the cores), the timings are not the models'."""
  loads = [results.get('latency_load_average')] + [
      part['replay'].get('load_average') for row in results['runs']
      for part in (row, row.get('long', {})) if 'replay' in part]
  loads = [x for x in loads if x is not None]
  if not loads:
    return ''
  return (f' Timed at one-minute load averages up to {max(loads):.1f} '
          f'({results.get("cores", "?")} cores).')


def _validation(row) -> str:
  """'2.31 (yes, 0.4%)': the last validation loss and the plateau."""
  if not row.get('validation'):
    return '-'
  loss = f'{row["validation"][-1]["loss"][-1]:.2f}'
  p = row.get('plateau')
  if not p:
    return loss
  return (f'{loss} ({"yes" if p["reached"] else "no"}, '
          f'{100 * p["improvement"]:.1f}%)')


def _throughput(row) -> str:
  rate = row.get('train_positions_per_second')
  return f'{rate:,.0f}' if rate else '-'


def _main_rows(results) -> List[Dict[str, Any]]:
  first = results['settings']['seeds'][0]
  return [row for row in results['runs']
          if row['seed'] == first and not row['exit_agreement']]


def _mean_flip(row) -> float:
  """The flip rate averaged over stages 2..R."""
  return float(np.mean(row['consistency']['flip_rate'][1:]))


def _agreement_groups(results) -> Dict[Tuple[str, float], List[Dict]]:
  groups = {}
  for row in results['runs']:
    if 'speed' in row:
      groups.setdefault((row['config'], row['exit_agreement']), []).append(row)
  return groups


def markdown(results: Dict[str, Any]) -> str:
  """The tables, with their conditions."""
  lat = results.get('latency_ms_per_token', {})
  # Tables written before the languages were recorded are the gettext set's.
  source, target = results.get('languages',
                               paper_table_data.GETTEXT_LANGUAGES)
  data = 'gettext' if results.get('gettext', True) else 'your data'
  lines = [f'## The paper\'s comparison in miniature: {data} '
           f'{source}->{target}', '',
           _conditions(results), '',
           '| model | validation loss (plateau) | training positions/s | '
           'BLEU | chrF | exit accuracy % | flip rate % (stages 2..R) | SPEED '
           'steps / token | greedy ms/token | SPEED ms/token | Base-width '
           'replay speedup | Base-width latency / unshared G layers |',
           '|' + ' --- |' * 12]
  for row in _main_rows(results):
    name, c = row['config'], row['consistency']
    sp, rp = row.get('speed'), row.get('replay')
    timed = lambda key: f'{lat[key]:.2f}' if key in lat else '-'
    cells = [name, _validation(row), _throughput(row),
             f'{row["bleu"]:.1f}', f'{row["chrf"]:.1f}',
             _pct(c['accuracy']), _pct(c['flip_rate'][1:]) or '-',
             f'{sp["steps_per_token"]:.2f}' if sp else '-',
             timed(f'greedy {name}'), timed(f'SPEED {name}'),
             f'{rp["speedup"]:.2f}x' if rp else '-',
             f'{rp["vs_shallow"]:.2f}x' if rp else '-']
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines += ['', 'Validation loss: the final exit\'s, per target token, at '
            'the last step; plateau: its relative improvement over the last '
            '20% of steps, "yes" below 1%. Flip rates are teacher-forced on '
            'the test split: the share of target tokens whose argmax at an '
            'exit differs from the previous exit\'s. SPEED\'s tokens equal '
            'greedy\'s on every shared model (checked). The last column: '
            'SPEED\'s replayed ms/token over the best greedy of an unshared '
            'model of the shared one\'s G layers at the same width (4L for '
            '4x3), the paper\'s latency claim.', '']
  if any(row['config'].startswith('ed') for row in results['runs']):
    lines[-1:-1] = [f'ed* models are encoder-decoders: an encoder of '
                    f'{results.get("encoder_layers")} layers and the decoder '
                    'named (the prompt is the encoder\'s input).']
  lines += (_depth_lines(results) + _seed_lines(results) +
            _long_lines(results) + _int8_lines(results) +
            _curve_lines(results) + _record_lines(results))
  groups = _agreement_groups(results)
  if any(agreement for _, agreement in groups):
    lines += ['### Exits trained to agree', '',
              '| model | loss | seeds | flip rate % (stages 2..R) | mean '
              'flip % | SPEED steps / token | BLEU | chrF | Base-width replay '
              'speedup |',
              '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
    for (name, agreement), rows in sorted(groups.items()):
      mean = lambda f: np.mean([f(r) for r in rows], 0)
      spread = lambda f: ', '.join(f'{f(r):.2f}' for r in rows)
      loss = f'agreement λ={agreement:g}' if agreement else 'paper'
      lines.append(
          f'| {name} | {loss} | {len(rows)} | '
          f'{_pct(mean(lambda r: r["consistency"]["flip_rate"][1:]))} | '
          f'{100 * mean(_mean_flip):.1f} | '
          f'{mean(lambda r: r["speed"]["steps_per_token"]):.2f} | '
          f'{mean(lambda r: r["bleu"]):.1f} ({spread(lambda r: r["bleu"])}) |'
          f' {mean(lambda r: r["chrf"]):.1f} ({spread(lambda r: r["chrf"])})'
          ' | '
          f'{mean(lambda r: r["replay"]["speedup"]):.2f}x '
          f'({spread(lambda r: r["replay"]["speedup"])}) |')
    lines += ['', 'Means over seeds; per-seed values in parentheses.', '']
  return '\n'.join(lines)


def _depth_lines(results) -> List[str]:
  """How much of the unshared 4L -> 12L gap the 4x3 closes (the paper's
  claim: the quality of depth)."""
  rows = {row['config']: row for row in _main_rows(results)}
  if not all(name in rows for name in ('4L', '12L', '4x3')):
    return []
  lines = ['### Depth: the 4x3 against the unshared 4L and 12L', '']
  for label, value in (('test BLEU', lambda r: r['bleu']),
                       ('validation loss', lambda r: r['validation'][-1][
                           'loss'][-1])):
    shallow, deep, shared = (value(rows[n]) for n in ('4L', '12L', '4x3'))
    gap = deep - shallow
    share = (shared - shallow) / gap if gap else float('nan')
    verdict = (f'the 4x3 closes {100 * share:.0f}% of the 4L -> 12L gap'
               if share <= 1 else
               f'the 4x3 passes the 12L ({100 * share:.0f}% of the 4L -> '
               '12L gap)')
    lines.append(f'- {label}: 4L {shallow:.2f}, 4x3 {shared:.2f}, 12L '
                 f'{deep:.2f}: {verdict}.')
  return lines + ['']


def _seed_lines(results) -> List[str]:
  """Every configuration trained at more than one seed (the paper's loss):
  its spread beside the gaps between configurations."""
  by_config = {}
  for row in results['runs']:
    if not row['exit_agreement']:
      by_config.setdefault(row['config'], []).append(row)
  seeded = {k: v for k, v in by_config.items() if len(v) > 1}
  if not seeded:
    return []
  lines = ['### Seeds', '',
           '| model | seeds | test BLEU per seed | mean | validation loss per '
           'seed | flip rate % per seed (mean of stages 2..R) |',
           '|' + ' --- |' * 6]
  for name, rows in seeded.items():
    rows = sorted(rows, key=lambda r: r['seed'])
    flips = (', '.join(f'{100 * _mean_flip(r):.1f}' for r in rows)
             if len(rows[0]['consistency']['flip_rate']) > 1 else '-')
    seeds = ', '.join(str(r['seed']) for r in rows)
    bleu = ', '.join(f'{r["bleu"]:.1f}' for r in rows)
    loss = ', '.join(f'{r["validation"][-1]["loss"][-1]:.3f}' for r in rows)
    mean = np.mean([r['bleu'] for r in rows])
    lines.append(f'| {name} | {seeds} | {bleu} | {mean:.1f} | {loss} | '
                 f'{flips} |')
  return lines + ['']


def _record_lines(results) -> List[str]:
  """Where each row was trained, and where measured and timed."""
  if 'records' not in results:
    return []
  lines = ['### Records', '',
           '| run | trained: commit, host, devices | measured and timed: '
           'commit, host |', '| --- | --- | --- |']
  for r in results['records']:
    t = r['trained_on']
    lines.append(f'| {r["run"]} | {t["commit"][:10]}, {t["cpu"]}, '
                 f'{t["devices"]} | {r["commit"][:10]}, {r["host"]} |')
  return lines + ['', 'Compare timings (ms/token, positions/s) within a '
                  'host, ratios (speedups) across hosts.', '']


def _long_lines(results) -> List[str]:
  rows = [row for row in _main_rows(results) if 'long' in row]
  if not rows:
    return []
  s = results['settings']
  lines = [f'### Long outputs: the long split ({s["long_examples"]} pairs, '
           f'inputs and targets up to {s["long_length"]} tokens)', '',
           '| model | BLEU | chrF | SPEED steps / token, short -> long | '
           'decoding flip rate % (stages 2..R), long | Base-width replay '
           'speedup, short -> long | Base-width latency / unshared G layers,'
           ' short -> long |', '|' + ' --- |' * 7]
  for row in rows:
    long, sp = row['long'], row.get('speed')
    cells = [row['config'], f'{long["bleu"]:.1f}', f'{long["chrf"]:.1f}',
             f'{sp["steps_per_token"]:.2f} -> '
             f'{long["speed"]["steps_per_token"]:.2f}' if sp else '-',
             _pct(long['speed']['flip_rate'].values()) if sp else '-',
             f'{row["replay"]["speedup"]:.2f}x -> '
             f'{long["replay"]["speedup"]:.2f}x' if sp else '-',
             f'{row["replay"]["vs_shallow"]:.2f}x -> '
             f'{long["replay"]["vs_shallow"]:.2f}x' if sp else '-']
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines += ['', f'The replay decodes the first {s["long_replay_prompts"]} '
            'long prompts at batch 1 (short: the test prompts above). No '
            'model was trained on pairs this long.', '']
  return lines


def _int8_lines(results) -> List[str]:
  rows = [row for row in _main_rows(results) if 'int8' in row]
  if not rows:
    return []
  lines = ['### int8 weights', '',
           '| model | BLEU, f32 -> int8 | chrF, f32 -> int8 | final-exit loss, '
           'f32 -> int8 | exit accuracy %, int8 | flip rate % (stages 2..R), '
           'int8 | SPEED steps / token, f32 -> int8 |', '|' + ' --- |' * 7]
  for row in rows:
    q, c, qc = row['int8'], row['consistency'], row['int8']['consistency']
    sp, qsp = row.get('speed'), q.get('speed')
    cells = [row['config'], f'{row["bleu"]:.1f} -> {q["bleu"]:.1f}',
             f'{row["chrf"]:.1f} -> {q["chrf"]:.1f}',
             f'{c["loss"][-1]:.3f} -> {qc["loss"][-1]:.3f}',
             _pct(qc['accuracy']), _pct(qc['flip_rate'][1:]) or '-',
             f'{sp["steps_per_token"]:.2f} -> {qsp["steps_per_token"]:.2f}'
             if sp else '-']
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines += ['', 'The trained float32 weights quantized once to int8 with a '
            'float32 scale per output channel (`t5x_speed.quantize`), '
            'activations float32; test split, teacher-forced columns on the '
            'same examples as above. SPEED\'s tokens equal greedy\'s on '
            'every int8 model too (checked).', '']
  return lines


def _curve_lines(results) -> List[str]:
  rows = [row for row in _main_rows(results) if row.get('curve')]
  if not rows:
    return []
  s = results['settings']
  lines = ['### Learning curves', '',
           'At each checkpoint: the final exit\'s teacher-forced validation '
           'loss and each exit\'s flip rate on '
           f'{s["validation_examples"]} validation examples; BLEU and '
           f'SPEED\'s steps per token decoding {s["curve_examples"]} '
           'validation prompts.', '',
           '| model | step | validation loss | BLEU | flip rate % (stages '
           '2..R) | SPEED steps / token |', '|' + ' --- |' * 6]
  for row in rows:
    loss = {p['step']: p for p in row['validation']}
    for point in row['curve']:
      tf = loss.get(point['step'], {})
      sp = point.get('speed')
      lines.append('| ' + ' | '.join([
          row['config'], str(point['step']),
          f'{tf["loss"][-1]:.2f}' if tf else '-', f'{point["bleu"]:.1f}',
          _pct(tf['flip_rate'][1:]) if tf and sp else '-',
          f'{sp["steps_per_token"]:.2f}' if sp else '-']) + ' |')
  return lines + ['']


def _curves(axes, results):
  """Validation loss, BLEU, and flips with SPEED's steps per token,
  against training steps."""
  loss_ax, bleu_ax, flip_ax = axes
  steps_ax = flip_ax.twinx()
  for row in _main_rows(results):
    if not row.get('curve'):
      continue
    name, val, curve = row['config'], row['validation'], row['curve']
    line, = loss_ax.plot([p['step'] for p in val],
                         [p['loss'][-1] for p in val], 'o-', label=name)
    bleu_ax.plot([p['step'] for p in curve], [p['bleu'] for p in curve],
                 'o-', color=line.get_color(), label=name)
    if 'speed' in row:
      flip_ax.plot([p['step'] for p in val],
                   [100 * np.mean(p['flip_rate'][1:]) for p in val], 'o-',
                   color=line.get_color(), label=f'{name} flips')
      steps_ax.plot([p['step'] for p in curve],
                    [p['speed']['steps_per_token'] for p in curve], 's:',
                    color=line.get_color(), label=f'{name} steps/token')
  for ax, label in ((loss_ax, 'validation loss (final exit)'),
                    (bleu_ax, 'validation BLEU'),
                    (flip_ax, 'mean flip rate, stages 2..R, %')):
    ax.set_xlabel('training step')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, loc='upper left')
  steps_ax.set_ylabel('SPEED steps per token (dotted)')
  flip_ax.set_title('Flips fall as the model learns')


def _tradeoff(ax, groups):
  """Quality against flips: a point per seed, the mean per λ, joined."""
  for name in sorted({name for name, _ in groups}):
    means, seeds = [], ([], [])
    for agreement in sorted(a for n, a in groups if n == name):
      rows = groups[(name, agreement)]
      flips = [100 * _mean_flip(r) for r in rows]
      bleu = [r['bleu'] for r in rows]
      seeds[0].extend(flips)
      seeds[1].extend(bleu)
      means.append((np.mean(flips), np.mean(bleu), agreement))
    line, = ax.plot([m[0] for m in means], [m[1] for m in means], 'o-',
                    label=f'{name}, mean of seeds')
    ax.scatter(*seeds, s=12, alpha=0.4, color=line.get_color(),
               label=f'{name}, each seed')
    for x, y, agreement in means:
      ax.annotate(f'λ={agreement:g}', (x, y), textcoords='offset points',
                  xytext=(4, 4), fontsize=8)
  ax.set_xlabel('mean flip rate over stages 2..R, % of test tokens')
  ax.set_ylabel('test BLEU (final exit)')
  ax.set_title('Agreement weight: flips vs quality')
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  ax.grid(alpha=0.3)


def _plot(results: Dict[str, Any], path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  (left, middle, right) = axes[0]
  _curves(axes[1], results)
  lat = results.get('latency_ms_per_token', {})
  bars = left.bar(list(lat), list(lat.values()),
                  color=['#2a7ab9' if k.startswith('SPEED') else '#999999'
                         for k in lat])
  left.bar_label(bars, fmt='%.2f')
  left.set_ylabel('ms per token (batch 1)')
  left.set_title('Decoding latency, trained models')
  left.tick_params(axis='x', rotation=30)
  groups = _agreement_groups(results)
  for (name, agreement), rows in sorted(groups.items()):
    flips = np.mean([r['consistency']['flip_rate'][1:] for r in rows], 0)
    stages = np.arange(2, len(flips) + 2)
    middle.plot(stages, 100 * flips, 'o-' if agreement else 's--',
                label=f'{name}, ' + (f'agreement {agreement:g}' if agreement
                                     else 'paper loss'))
  middle.set_xticks(range(2, 1 + max(
      (len(r[0]['consistency']['flip_rate']) for r in groups.values()),
      default=2)))
  middle.set_xlabel('stage')
  middle.set_ylabel('flip rate, % of test tokens')
  middle.set_title('Exit flips: paper loss vs agreement')
  if middle.get_legend_handles_labels()[0]:
    middle.legend(fontsize=8)
  middle.grid(alpha=0.3)
  _tradeoff(right, groups)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(results: Dict[str, Any], out_dir: str) -> List[str]:
  """Writes paper_table.{md,json,png} into `out_dir`; returns the paths."""
  paths = [os.path.join(out_dir, f'paper_table.{ext}')
           for ext in ('md', 'json', 'png')]
  with open(paths[0], 'w') as f:
    f.write(markdown(results) + '\n')
  with open(paths[1], 'w') as f:
    json.dump(results, f, indent=1)
  _plot(results, paths[2])
  return paths
