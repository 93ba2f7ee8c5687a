"""The performance record: SPEED against greedy at T5-Base width, side by side.

    python -m tools.bench [--configs 4x3] [--batch_sizes 1,4,16]
                          [--lengths short,long] [--exits trained|demo]
                          [--out bench_out] [--records FILE]
                          [--encoder_layers 12] [--quiet]

Base-width training is out of reach on a CPU, so the shared models' exits are
a clearly labelled *replay*: a smaller trained model with the same number of
stages R decodes held-out prompts with SPEED while its schedule (live
stages, positions, tokens, predictions, flushes per step) is recorded, and
the Base-width model then runs the full computation and control logic of
every step with each exit's argmax forced to the recorded prediction. The
Base model thus takes exactly the recorded loop steps and flushes; greedy
runs are forced to the same tokens. Whose exits (--exits):

  trained  (the default) the committed 4x3 that learned real text
           (figures/real_data/models, `make demo-real`): 16 held-out test
           prompts ('short', median 15 output tokens) and 4 of the long
           split ('long', about 100), with its BLEU on them; the exits users
           get from a trained model. Needs seqio, TensorFlow and this
           machine's gettext catalogs (or --records).
  demo     a width-64 model trained on the demo task (number spelling,
           --replay_steps steps, reloaded from --demo_out): exits that agree
           far more often ('low flips'), and any R (e.g. 2x6); 'short' is one
           number (~20-45 tokens), 'long' two (~50-90), 16 prompts each.

Methods (all in --dtype and --weights, same prompts, interleaved, medians):

  greedy        greedy_decode on the GxR shared model (full depth per token)
  speed         speed_decode on the GxR shared model
  speed_short   speed_decode, speculative exits over the first K token ids
  speed_pipeline, speed_short_pipeline
                the same with max_speculative_rows=None, where batch x R
                exceeds the backend's limit and the two above decode
                sequentially as users get them
  greedy_g      greedy on the unshared G-layer model (one repetition)
  greedy_12l    greedy on the unshared 12-layer model
  greedy_float  with --weights int8: greedy on the same model's float weights
  t5x_sample    T5X's decoding.temperature_sample (topk=1), when T5X exists
  *_xla         with --xla_baseline: greedy, speed, greedy_g, greedy_12l,
                greedy_float and t5x_sample
                with decode_matmul='xla' (XLA's dot, not the few-row kernel)

"vs best greedy" divides by the fastest of greedy, t5x_sample and their
_xla twins (T5X's decode fn counts where T5X is installed; the table says
when it is not), decoding alone and end to end.

Bytes read per token (weights, plus each virtual layer's KV cache over the
cache length) divided by a measured memory bandwidth show how close each
method is to the memory-bandwidth limit; the bandwidth is the faster of a
jitted reduction and a STREAM-like copy (read + write bytes), probed before
every timed round (a shared host's bandwidth drifts) and taken as the median,
so the share can exceed 100% only where a method reads faster than both.

--encoder_layers N times encoder-decoder models instead (T5 1.1 Base's shape,
an N-layer encoder, the decoders as above, T5 1.1's separate classifier):
the same recorded schedules, each prompt encoded and the decoder started
from BOS (`replay.encoder_decoder_record`); the prefill, timed apart,
includes the encoder.

--records FILE keeps each row group's recorded schedules and prompts: a
second run replays them without the demo models, seqio or TensorFlow, so a
recording made on a CPU times another backend (a GPU: JAX's default backend
runs everything; there XLA's dot is the only path).

Decode-step matmuls use the few-row kernel (`t5x_speed.cpu.matmul`) when it
is built, else XLA's dot (the JSON records which). Each batch's prefill
(XLA's dot, all layers over the prompt: the same work for every method of a
model) and its decoding are timed apart, each run to completion; rows give
both end to end and decoding alone ("decode"), and the bandwidth bound is
taken on decoding alone, whose bytes it counts.

What the replay cannot show: exactness at Base width (every method is forced
to the recorded tokens; `replay_consistent` only checks the forcing held, and
exactness is the test suite's job), and, for speed_short, extra flushes that
a shortlist of a 32k vocabulary could cause (the demo's byte ids all lie in
it). The demo task's outputs are 20-90 bytes, shorter than summaries.

Progress (row group, method being compiled or timed, round, time elapsed and
an estimate of the time left) goes to stderr; --quiet leaves it out. The
measurement is in `tools.bench_measure`, the table in `tools.bench_report`.
"""

import argparse
import json
import os
import sys
from typing import Optional, Sequence

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

import jax  # pylint: disable=g-import-not-at-top

from t5x_speed import quantize
from t5x_speed.cpu import build
from tools import bench_budget
from tools import bench_measure
from tools import bench_report
from tools import common
from tools import ctranslate2_engine
from tools import demo_model
from tools import replay


def parser() -> argparse.ArgumentParser:
  """The bench's command line."""
  p = argparse.ArgumentParser(prog='python -m tools.bench',
                              description=__doc__,
                              formatter_class=common.HelpFormatter)
  p.add_argument('--configs', default='4x3',
                 help='comma-separated GxR shared models (G unique layers '
                 'repeated R times) at T5-Base width; with --exits trained, '
                 'of the trained model\'s R (3).')
  p.add_argument('--exits', default='trained', choices=('trained', 'demo'),
                 help='whose exits are replayed: the committed trained '
                 'model\'s or the demo model\'s (low flips; any R).')
  p.add_argument('--models_dir', default=common.MODELS_DIR,
                 help='the trained model of --exits trained (its '
                 'manifest.json); its data is rebuilt into --out/data.')
  p.add_argument('--batch_sizes', default='1,4,16',
                 help=f'comma-separated batch sizes; each must divide the '
                 f'{bench_measure.PROMPTS} short prompts (--exits trained: '
                 'the long split\'s 4 prompts, or one batch of them).')
  p.add_argument('--lengths', default='short,long',
                 help='prompts of short and long outputs (see --exits), in '
                 'batches of each batch size.')
  p.add_argument('--repeats', type=int, default=3,
                 help='timed runs of every method; the median is reported.')
  p.add_argument('--branches', default='1,2',
                 help='comma-separated candidate branches K of the speed_bK '
                 'methods (SPEED with speed_branches=K, replaying a schedule '
                 'recorded with K branches); empty leaves them out.')
  p.add_argument('--speculative_vocab', type=int, default=4096,
                 help='K of the speed_short method; 0 leaves it out.')
  p.add_argument('--out', default='bench_out',
                 help='directory bench.json and bench.md are written to.')
  p.add_argument('--dtype', default='float32',
                 choices=('float32', 'bfloat16'),
                 help='activations and weights of the Base-width models '
                 '(bfloat16: weights cast to bf16 once, logits in f32).')
  p.add_argument('--weights', default='as_given',
                 choices=quantize.DECODE_WEIGHTS,
                 help='as_given: weights in --dtype; int8: every model\'s '
                 'weights quantized once to int8 with a float32 scale per '
                 'output channel (t5x_speed.quantize), activations in '
                 '--dtype.')
  p.add_argument('--replay_steps', type=int,
                 default=demo_model.REPLAY_STEPS,
                 help='with --exits demo: training steps of the demo models '
                 'whose schedules are replayed; fewer steps leave the exits '
                 'less consistent (e.g. 150 gives flip rates near the '
                 'paper\'s 6-17%%).')
  p.add_argument('--encoder_layers', type=int, default=0,
                 help='encoder-decoder rows: T5 1.1 Base with an encoder of '
                 'this many layers (12 is T5\'s) and the GxR decoders; the '
                 'recorded prompts are encoded and the decoder starts from '
                 'BOS. 0: decoder-only models.')
  p.add_argument('--xla_baseline', action='store_true',
                 help='also time greedy, speed, greedy_g, greedy_12l (and '
                 'greedy_float, t5x_sample) with XLA\'s dot (the few-row '
                 'kernel off), side by side.')
  p.add_argument('--demo_out', default='demo_out',
                 help='where the demo models are saved / trained.')
  p.add_argument('--records', default='',
                 help='a JSON file of recorded schedules: row groups saved '
                 'there are replayed from it (no demo model, seqio or '
                 'TensorFlow needed, e.g. on a GPU machine), the others are '
                 'recorded and added to it.')
  p.add_argument('--ctranslate2', action='store_true',
                 help='also time CTranslate2\'s greedy (f32 and int8) on the '
                 'unshared equivalents of each --configs model built from '
                 'the same float weights: its G*R virtual layers unrolled and '
                 'its first G layers (tools/ctranslate2_engine.py); needs the '
                 'ctranslate2 extra, else says so and goes on.')
  p.add_argument('--budget', action='store_true',
                 help='the latency budget (tools/bench_budget.py): batch 1, '
                 'the kernel\'s and XLA\'s paths, no shortlist; where '
                 'SPEED\'s, the best greedy\'s and the G-layer model\'s time '
                 'per token goes, written to budget.{json,md,png} beside '
                 'bench.*.')
  p.add_argument('--quick', action='store_true',
                 help='4x3, batch 1, short only, greedy vs SPEED (overrides '
                 '--configs, --batch_sizes and --lengths; no G-layer, '
                 '12-layer, shortlist or T5X baselines).')
  common.add_quiet_flag(p)
  return p


def budget_label(meta) -> str:
  """The budget's conditions: machine, numerics and exits."""
  numerics = (meta['dtype'] if meta['weights'] == 'as_given' else
              f'{meta["weights"]} weights, {meta["dtype"]} activations')
  return f'{meta["machine"]}, {numerics}, {meta["exits"]} exits, batch 1'


def write_budget(results, meta, out: str) -> None:
  """budget.{json,md,png}: `bench_budget` of every row group."""
  budgets = [bench_budget.budget(res, demo_model.parse_gxr(
      res['config'].split('+')[-1])[1]) for res in results]
  table = bench_budget.markdown(budgets)
  print('\n' + table)
  with open(os.path.join(out, 'budget.json'), 'w') as f:
    json.dump({'meta': meta, 'budgets': budgets}, f, indent=1)
  with open(os.path.join(out, 'budget.md'), 'w') as f:
    f.write(f'Latency budget: {budget_label(meta)} '
            '(tools/bench_budget.py).\n\n' + table + '\n')
  bench_budget.plot(budgets, os.path.join(out, 'budget.png'),
                    f'Where the time per token goes\n{budget_label(meta)}')
  print(f'Wrote {out}/budget.json, budget.md and budget.png.')


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parser().parse_args(sys.argv[1:] if argv is None else argv)
  if args.quick:
    args.configs, args.batch_sizes, args.lengths = '4x3', '1', 'short'
  if args.budget:
    args.batch_sizes, args.xla_baseline, args.speculative_vocab = '1', True, 0
  groups = [(*demo_model.parse_gxr(text), int(batch), length)
            for text in args.configs.split(',')
            for batch in args.batch_sizes.split(',')
            for length in args.lengths.split(',')]
  os.makedirs(args.out, exist_ok=True)
  bandwidth = bench_measure.memory_bandwidth()
  copy = bench_measure.copy_bandwidth()
  on_cpu = jax.default_backend() == 'cpu'
  machine = f'{common.cpu_model()}, {os.cpu_count()} cores'
  if not on_cpu:
    machine += f'; {jax.devices()[0].device_kind}'
  meta = {'machine': machine,
          'jax': jax.__version__, 'backend': jax.default_backend(),
          'dtype': args.dtype, 'weights': args.weights,
          'bandwidth_gb_s': bandwidth / 1e9, 'copy_gb_s': copy / 1e9,
          'kernel': (build.isa() if on_cpu else None) or 'off (XLA dot)',
          'encoder_layers': args.encoder_layers, 'exits': args.exits,
          'replay_steps': args.replay_steps,
          't5x': bench_measure.t5x_available()}
  print(f'Measured memory bandwidth: {bandwidth / 1e9:.1f} GB/s (reduction), '
        f'{copy / 1e9:.1f} GB/s (copy, read + write). Few-row kernel: '
        f'{meta["kernel"]}. Exits are replayed from '
        + ('the committed trained model' if args.exits == 'trained' else
           'demo models (low flips)') + ' (see --help).', flush=True)
  # A unit of progress: one method's compile or one timed pass over it.
  units = sum(len(bench_measure.method_configs(g, r, args, batch)) *
              (1 + args.repeats) for g, r, batch, _ in groups)
  progress = common.Progress('bench', units, quiet=args.quiet)
  results, models, sources = [], {}, {}
  for index, (g, r, batch, length) in enumerate(groups):
    progress.log(f'row group {index + 1}/{len(groups)}: {g}x{r} batch '
                 f'{batch} {length}')
    res = bench_measure.bench_case(g, r, batch, length, args, models,
                                   progress, sources)
    results.append(res)
    print(bench_report.row_group_line(res), flush=True)
  ctranslate2 = []
  if args.ctranslate2:
    meta['ctranslate2'] = ctranslate2_engine.available()
    if meta['ctranslate2'] is None:
      print('CTranslate2 is not installed (pip install -e ".[ctranslate2]"); '
            'its rows are left out.', flush=True)
    elif args.encoder_layers:
      print('CTranslate2 rows are for decoder-only models; left out.',
            flush=True)
    else:
      float_models = {f'{g}x{r}': replay.init_model(
          bench_measure.base_config(g, r, 'float32'))
                      for g, r in dict.fromkeys((g, r) for g, r, _, _ in
                                                groups)}
      ctranslate2 = ctranslate2_engine.bench_rows(
          float_models, os.path.join(args.out, 'ctranslate2_models'),
          prompt_length=demo_model.LENGTHS['inputs'],
          repeats=args.repeats, log=progress.log)
  table = bench_report.markdown(results, meta, ctranslate2)
  print('\n' + table)
  with open(os.path.join(args.out, 'bench.json'), 'w') as f:
    json.dump({'meta': meta, 'results': results,
               'ctranslate2': ctranslate2}, f, indent=1)
  with open(os.path.join(args.out, 'bench.md'), 'w') as f:
    f.write(table + '\n')
  print(f'\nWrote {args.out}/bench.json and {args.out}/bench.md.')
  if args.budget:
    write_budget(results, meta, args.out)
  ok = all(row['replay_consistent'] for res in results
           for row in res['methods'].values())
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
