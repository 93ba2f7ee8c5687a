"""The bench's report: the markdown table (bench.md) and the console lines."""

from typing import Any, Dict, List, Optional, Tuple

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


def markdown(results: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
  """bench.md: the machine, then one table row per method and row group,
  then each row group's replayed schedule."""
  lines = [f'Machine: {meta["machine"]}; JAX {meta["jax"]} on '
           f'{meta["backend"]}; measured memory bandwidth '
           f'{meta["bandwidth_gb_s"]:.1f} GB/s (reduction)'
           + (f', {meta["copy_gb_s"]:.1f} GB/s (copy, r+w)'
              if 'copy_gb_s' in meta else '') + '; '
           f'{meta.get("dtype", "float32")}; few-row kernel '
           f'{meta.get("kernel", "?")}; exits: replay of '
           f'demo models trained '
           f'{meta.get("replay_steps", demo_model.REPLAY_STEPS)} steps (see '
           'tools/bench.py); end-to-end time per batch, '
           f'{bench_measure.PROMPTS} prompts per row group. tokens/s and vs '
           'greedy: end to end, prefill included; decode columns: decoding '
           'alone; best greedy: the faster of greedy and greedy_xla. '
           'rows-free ideal = R / steps per '
           'token; bytes ideal = greedy\'s bytes per token / the method\'s '
           '(weights + KV cache); bandwidth-bound = time those bytes take at '
           'the bandwidth probed in every timed round (median, listed below) '
           '/ measured decoding time.', '',
           '| config | batch | length | method | tokens/s | vs greedy | '
           'decode tokens/s | decode ms/token/seq | decode vs greedy | '
           'decode vs best greedy | decode vs G-layer | steps/token | '
           'rows-free ideal | bytes ideal | bandwidth-bound | '
           'replay consistent |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for res in results:
    for method, row in res['methods'].items():
      lines.append(
          f'| {res["config"]} | {res["batch"]} | {res["length"]} | {method} | '
          f'{row["tokens_per_second"]:.1f} | '
          f'{row["vs_greedy_same_model"]:.2f}x | '
          f'{row["decode_tokens_per_second"]:.1f} | '
          f'{row["decode_ms_per_token_per_sequence"]:.1f} | '
          f'{row["decode_vs_greedy_same_model"]:.2f}x | '
          f'{ratio(row.get("decode_vs_best_greedy"))} | '
          f'{ratio(row.get("decode_vs_unshared_g_layers"))} | '
          f'{row["steps_per_token"]:.2f} | '
          f'{ratio(row["rows_free_ideal_speedup"])} | '
          f'{row["bytes_ideal_speedup"]:.2f}x | '
          f'{row["bandwidth_bound_fraction"]:.0%} | '
          f'{row["replay_consistent"]} |')
  lines.append('')
  lines.append('Replayed schedules (flip rate = share of tokens whose '
               'prediction changes at that stage):')
  for res in results:
    flips = ', '.join(f'{k.split("/")[1]} {v:.1%}'
                      for k, v in res['replay']['flip_rate'].items())
    lines.append(f'- {res["config"]} batch {res["batch"]} {res["length"]}: '
                 f'{res["replay"]["steps_per_token"]:.2f} steps/token, '
                 f'{res["replay"]["flushes"]:.0f} flushes; {flips}' +
                 _probes(res.get('bandwidth_probes_gb_s')))
  return '\n'.join(lines)


def _decode_ms(row: Dict[str, Any]) -> float:
  return row['decode_ms_per_token_per_sequence']


def targets(results: List[Dict[str, Any]], meta: Dict[str, Any]
            ) -> List[Tuple[str, float, str, Optional[bool]]]:
  """The performance targets this run measures: (target, value, how the
  value reads, met; None where SPEED ran greedy's program and only noise
  separates them). Float32 targets from a float32 run, the bfloat16 ones
  from a bfloat16 run, the paper-flip-rate one from a --replay_steps 150
  run (its 4x3 batch-1 group); decoding alone, against the best greedy.
  The targets are the CPU's decoder-only ones: a run on another backend or
  of encoder-decoder models measures none."""
  out = []
  if meta.get('backend', 'cpu') != 'cpu' or meta.get('encoder_layers'):
    return out
  dtype = meta.get('dtype', 'float32')
  paper_flips = meta.get('replay_steps') == 150
  for res in results:
    m, cfg, batch = res['methods'], res['config'], res['batch']
    greedy, speed = bench_measure.best_row(m, 'greedy'), m.get('speed')
    if greedy is None or speed is None:
      continue
    vs = _decode_ms(greedy) / _decode_ms(speed)
    if cfg == '4x3' and batch == 1 and paper_flips:
      out.append(('4x3 b1, paper flip rates: SPEED >= 1.45x the best '
                  'greedy', vs, f'{vs:.2f}x', vs >= 1.45))
    elif cfg == '4x3' and batch == 1 and dtype == 'float32':
      share = greedy['bandwidth_bound_fraction']
      out.append(('4x3 b1: greedy >= 80% of its bandwidth bound', share,
                  f'{share:.0%}', share >= 0.8))
      out.append(('4x3 b1: SPEED >= 1.8x the best greedy', vs, f'{vs:.2f}x',
                  vs >= 1.8))
      shallow = bench_measure.best_row(m, 'greedy_g')
      if shallow is not None:
        lat = _decode_ms(speed) / _decode_ms(shallow)
        out.append(('4x3 b1: SPEED latency <= 1.15x the unshared 4-layer '
                    'model\'s', lat, f'{lat:.2f}x', lat <= 1.15))
    elif cfg == '4x3' and batch == 1 and dtype == 'bfloat16':
      share = greedy['bandwidth_bound_fraction']
      out.append(('bf16 4x3 b1: SPEED >= 1.7x the best greedy', vs,
                  f'{vs:.2f}x', vs >= 1.7))
      out.append(('bf16 4x3 b1: greedy >= 70% of its bandwidth bound',
                  share, f'{share:.0%}', share >= 0.7))
    elif batch in (4, 16) and dtype == 'float32' and not paper_flips:
      goal = 1.3 if (cfg, batch) == ('4x3', 4) else 1.0
      shown = f'{vs:.2f}x'
      met = vs >= goal
      if not speed.get('pipelined', True):
        # greedy's own loop: equal to greedy up to the run's noise.
        shown += ' (greedy\'s step, beyond max_speculative_rows)'
        met = None if goal == 1.0 else False
      out.append((f'{cfg} b{batch}: SPEED (default settings) >= {goal}x the '
                  'best greedy', vs, shown, met))
  return out


def targets_markdown(rows: List[Tuple[str, float, str, Optional[bool]]]
                     ) -> str:
  """The targets as a table with met / missed / equal."""
  if not rows:
    return ''
  verdict = {True: 'met', False: 'missed', None: 'equal (same program)'}
  lines = ['| target | measured | |', '|---|---|---|']
  lines += [f'| {t} | {shown} | {verdict[met]} |'
            for t, _, shown, met in rows]
  return '\n'.join(lines)


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
