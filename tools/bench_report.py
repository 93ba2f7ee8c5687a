"""The bench's report: the markdown table (bench.md) and the console lines."""

from typing import Any, Dict, List, Optional

import numpy as np

from tools import bench_measure
from tools import demo_model


def ratio(value: Optional[float]) -> str:
  """'1.23x', or '–' where a ratio does not apply: a baseline that was not
  run (the G-layer model with --quick) or greedy's rows-free ideal."""
  return '–' if value is None else f'{value:.2f}x'


def _probes(gb_s: Optional[List[float]]) -> str:
  if not gb_s:  # results without per-round probes
    return ''
  return (f'; bandwidth probes {np.median(gb_s):.1f} GB/s median '
          f'({min(gb_s):.1f}-{max(gb_s):.1f})')


def _exits(meta: Dict[str, Any]) -> str:
  if meta.get('exits', 'demo') == 'trained':
    return ('exits: replay of the committed trained model (what it '
            'learned: below)')
  return ('exits: replay of demo models trained '
          f'{meta.get("replay_steps", demo_model.REPLAY_STEPS)} steps (low '
          'flips)')


def _group(res: Dict[str, Any]) -> str:
  """The row group's first cells: config, exits, batch, length."""
  exits = ('trained' if res.get('exits', 'demo') == 'trained' else
           'demo (low flips)')
  return (f'| {res["config"]} | {exits} | {res["batch"]} | '
          f'{res["length"]} |')


def _speed_methods(rows: Dict[str, Any]) -> List[str]:
  """SPEED as users get it, then with each number of candidate branches."""
  return ['speed'] + [m for m, row in rows.items()
                      if row.get('branches') and m != 'speed']


def headline(results: List[Dict[str, Any]]) -> List[str]:
  """Per row group: SPEED (and SPEED with candidate branches) against the
  best greedy, end to end and decoding alone, and its latency against the
  unshared G-layer model."""
  lines = ['| config | exits | batch | length | SPEED method | steps/token | '
           'best greedy, ms/token (method) | SPEED, ms/token | SPEED vs best '
           'greedy | decoding alone: best greedy / SPEED, ms/token | '
           'decoding alone: SPEED vs best greedy | latency vs G-layer |',
           '|' + '---|' * 12]
  for res in results:
    rows, best = res['methods'], res.get('best_greedy', {})
    e2e = rows.get(best.get('end_to_end'), rows['greedy'])
    dec = rows.get(best.get('decode'), rows['greedy'])
    for method in _speed_methods(rows):
      speed = rows[method]
      lines.append(
        f'{_group(res)} {method} | {speed["steps_per_token"]:.2f} | '
        f'{e2e["ms_per_token_per_sequence"]:.2f} '
        f'({best.get("end_to_end", "greedy")}) | '
        f'{speed["ms_per_token_per_sequence"]:.2f} | '
        f'**{ratio(speed.get("vs_best_greedy"))}** | '
        f'{dec["decode_ms_per_token_per_sequence"]:.2f} / '
        f'{speed["decode_ms_per_token_per_sequence"]:.2f} | '
        f'{ratio(speed.get("decode_vs_best_greedy"))} | '
        f'{ratio(speed.get("latency_vs_best_g_layers"))} |')
  return lines


def markdown(results: List[Dict[str, Any]], meta: Dict[str, Any],
             ctranslate2: Optional[List[Dict[str, Any]]] = None) -> str:
  """bench.md: the machine, SPEED against the best greedy per row group,
  then one table row per method and row group, then each row group's
  replayed schedule and what its model learned."""
  ours_only = ('' if meta.get('t5x', True) else
               ' (T5X is not installed here: ours only)')
  lines = [f'Machine: {meta["machine"]}; JAX {meta["jax"]} on '
           f'{meta["backend"]}; measured memory bandwidth '
           f'{meta["bandwidth_gb_s"]:.1f} GB/s (reduction)'
           + (f', {meta["copy_gb_s"]:.1f} GB/s (copy, r+w)'
              if 'copy_gb_s' in meta else '') + '; '
           f'{meta.get("dtype", "float32")}'
           + (' activations, int8 weights'
              if meta.get('weights') == 'int8' else '') + '; few-row kernel '
           f'{meta.get("kernel", "?")}; {_exits(meta)}; end-to-end times per '
           'batch (prefill included); decode columns: decoding alone. Best '
           'greedy: the fastest of greedy, t5x_sample (T5X\'s '
           f'temperature_sample at top-k 1) and their _xla twins{ours_only}. '
           'speed_bK: SPEED with K candidate branches (rows/step = batch x '
           '(R + K); a flip to a branch costs no flush: branch hits). '
           'rows-free ideal = R / steps per token; bytes ideal = greedy\'s '
           'bytes per token / the method\'s (weights + KV cache); '
           'bandwidth-bound = time those bytes take at the bandwidth probed '
           'in every timed round (median, listed below) / measured decoding '
           'time; latency vs G-layer = SPEED\'s time per token over the '
           'faster path of the unshared G-layer model\'s, end to end.', '',
           *headline(results), '',
           '| config | exits | batch | length | method | tokens/s | '
           'vs greedy | vs best greedy | decode tokens/s | decode '
           'ms/token/seq | decode vs greedy | decode vs best greedy | decode '
           'vs G-layer | steps/token | rows/step | flushes | branch hits | '
           'rows-free ideal | bytes ideal | bandwidth-bound | replay '
           'consistent |', '|' + '---|' * 21]
  for res in results:
    for method, row in res['methods'].items():
      lines.append(
          f'{_group(res)} {method} | '
          f'{row["tokens_per_second"]:.1f} | '
          f'{row["vs_greedy_same_model"]:.2f}x | '
          f'{ratio(row.get("vs_best_greedy"))} | '
          f'{row["decode_tokens_per_second"]:.1f} | '
          f'{row["decode_ms_per_token_per_sequence"]:.1f} | '
          f'{row["decode_vs_greedy_same_model"]:.2f}x | '
          f'{ratio(row.get("decode_vs_best_greedy"))} | '
          f'{ratio(row.get("decode_vs_unshared_g_layers"))} | '
          f'{row["steps_per_token"]:.2f} | {row.get("rows_per_step", "–")} | '
          f'{_count(row.get("flushes"))} | {_count(row.get("branch_hits"))} | '
          f'{ratio(row["rows_free_ideal_speedup"])} | '
          f'{row["bytes_ideal_speedup"]:.2f}x | '
          f'{row["bandwidth_bound_fraction"]:.0%} | '
          f'{row["replay_consistent"]} |')
  lines.append('')
  floats = [(res, method, row['decode_vs_best_float_greedy'])
            for res in results for method, row in res['methods'].items()
            if 'decode_vs_best_float_greedy' in row and
            not method.startswith('greedy_float')]
  if floats:
    lines.append('Against the same model\'s float weights (decoding alone, '
                 'vs the faster of greedy_float and greedy_float_xla): ' +
                 '; '.join(f'{res["config"]} batch {res["batch"]} '
                           f'{res["length"]} {method} {ratio(value)}'
                           for res, method, value in floats) + '.')
    lines.append('')
  lines.append('Replayed schedules (flip rate = share of tokens whose '
               'prediction changes at that stage):')
  for res in results:
    flips = ', '.join(f'{k.split("/")[1]} {v:.1%}'
                      for k, v in res['replay']['flip_rate'].items())
    lines.append(f'- {res["config"]} batch {res["batch"]} {res["length"]}, '
                 f'{res["replay"].get("source", "replayed demo exits")}: '
                 f'{res["replay"]["steps_per_token"]:.2f} steps/token, '
                 f'{res["replay"]["flushes"]:.0f} flushes; {flips}'
                 f'{_learned(res)}' + _probes(res.get('bandwidth_probes_gb_s')))
  if ctranslate2:
    lines += ['', *ctranslate2_lines(results, meta, ctranslate2)]
  return '\n'.join(lines)


def _count(value: Optional[int]) -> str:
  return '–' if value is None else str(value)


def _learned(res: Dict[str, Any]) -> str:
  """What the replayed model learned, on the row group's prompts."""
  exact = res['replay'].get('exact_match')
  if exact is not None:
    return (f'; the replayed model decodes {exact:.0%} of these prompts '
            'exactly right')
  learned = res['replay'].get('learned')
  if not learned:
    return ''
  example = learned['examples'][0]
  return (f'; on these {res.get("prompts", "?")} prompts it scores BLEU '
          f'{learned["bleu"]:.1f} (chrF {learned["chrf"]:.1f}), e.g. '
          f'{example["prediction"]!r} for {example["reference"]!r}')


def ctranslate2_lines(results: List[Dict[str, Any]], meta: Dict[str, Any],
                      rows: List[Dict[str, Any]]) -> List[str]:
  """CTranslate2's greedy beside this run's batch-1 decoding, ms/token."""
  lines = [f'CTranslate2 {meta.get("ctranslate2")} in this run, the same '
           'float weights (its G*R-layer model computes greedy on the GxR '
           'model; its G-layer model has the unshared G-layer shape): greedy '
           f'at batch 1 after a {demo_model.LENGTHS["inputs"]}-token prompt, '
           'decode ms/token over 128 tokens, best of --repeats, one fresh '
           'process per model. Ours: decode ms/token of the batch-1 short '
           'row group above (replayed schedules).', '',
           '| config | engine | model | weights | decode ms/token |',
           '|---|---|---|---|---|']
  for row in rows:
    lines.append(f'| {row["config"]} | CTranslate2 | {row["model"]} | '
                 f'{row["compute_type"]} | {row["ms_per_token"]:.2f} |')
  weights = 'int8' if meta.get('weights') == 'int8' else meta.get('dtype')
  for res in results:
    if res['batch'] != 1 or res['length'] != 'short':
      continue
    for method, row in res['methods'].items():
      lines.append(f'| {res["config"]} | t5x_speed | {method} | {weights} | '
                   f'{row["decode_ms_per_token_per_sequence"]:.2f} |')
  return lines


def row_group_line(res: Dict[str, Any]) -> str:
  """One console line per finished row group: every method's tokens/s and
  SPEED's speedup over greedy."""
  methods = res['methods']
  speed = methods['speed']
  return (f'{res["config"]} batch {res["batch"]} {res["length"]}: ' +
          ', '.join(f'{k} {v["tokens_per_second"]:.1f} tok/s'
                    for k, v in methods.items()) +
          f'; SPEED {speed["vs_greedy_same_model"]:.2f}x greedy '
          f'({speed["decode_vs_greedy_same_model"]:.2f}x decoding alone), '
          f'{speed["steps_per_token"]:.2f} steps/token')
