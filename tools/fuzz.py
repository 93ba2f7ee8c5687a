r"""Exactness fuzz: SPEED == greedy == an uncached forward, on random models.

  python -m tools.fuzz --cases 300 --seed 0 [--dtype float32|bfloat16]
                       [--family decoder_only|encoder_decoder]
                       [--weights as_given|int8] [--branches drawn|on]
  # A long run in shards (machines or sessions), then their total:
  python -m tools.fuzz --cases 10000 --shard 0/4 --json s0.json ...
  python -m tools.fuzz --merge s0.json s1.json s2.json s3.json

Cases come in groups that share one architecture and one set of shapes, so
that each group compiles its functions once; each case draws fresh weights
(four variants, from exits that disagree everywhere to exits that agree
everywhere), ragged prompts, and per-row decode limits and EOS ids
(`tools.fuzz_cases`), quantized to int8 with --weights int8. Per case the
run compares greedy with EOS against
greedy without it, SPEED against greedy (tokens; in float32 also scores and
statistics), and greedy against the model's uncached forward pass
(`tools.fuzz_check`). SPEED runs with 0-3 candidate branches per group
(`speed_branches`; --branches on: 1-3), and the report counts the flips
they absorbed.

Everything is compiled as `inference.generate` compiles
(`inference.COMPILER_OPTIONS`: bf16 values rounded where the program says);
--xla-excess-precision compiles with XLA's defaults instead, as a jit outside
this package (T5X's) does, where bf16 SPEED can differ from greedy at
near-ties.

Where SPEED's and greedy's programs run every decode-step matmul on the
row-independent kernel (B * R <= `t5x_speed.cpu.matmul.MAX_ROWS` rows) and
each case is run as `generate` runs it (bfloat16 cases, one at a time,
compiled as generate compiles), SPEED's tokens must equal greedy's: the fuzz
has found no mismatch there (the attention and norms, XLA ops, can still
round the last bits differently), so one is reported as a *real bug*, to be
looked at.
Elsewhere (float32 cases are vmapped for speed; B * R > MAX_ROWS runs
SPEED's matmuls through XLA's GEMM; --xla-excess-precision) a float32 token
mismatch is a *near-tie* when the reference's top-2 logit margin at the
first differing position (from the uncached forward) is below the tolerance
(`fuzz_check.NEAR_TIE[dtype]` times max(1, |top logit|)): different but
valid float rounding. In bfloat16 such mismatches are counted, not
classified. Any other mismatch, or a statistics or score mismatch, is a
*real bug*. The run prints the counts and exits 1 on a real bug.

Progress (case group, cases done, counts so far, time left) goes to stderr;
--quiet leaves it out.
"""

import argparse
import dataclasses
import json
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from t5x_speed import quantize
from tools import common
from tools import fuzz_cases
from tools import fuzz_check


def plan(cases: int, seed: int, cases_per_group: int, dtype: str,
         shard: int = 0, num_shards: int = 1, family: str = 'decoder_only',
         branches: str = 'drawn'
         ) -> List[Tuple[int, fuzz_cases.Group, int, np.random.RandomState]]:
  """The groups that `shard` of `num_shards` runs: (index, group, cases, rng).

  Group i holds cases [i * cases_per_group, ...) and draws everything (its
  architecture here, then its cases from the returned rng in
  `fuzz_cases.run_cases`) from RandomState([seed, i]), so a run split into
  shards (group i goes to shard i mod num_shards), on one machine or
  several, checks exactly the cases of the unsplit run.
  """
  out = []
  for i in range(shard, -(-cases // cases_per_group), num_shards):
    rng = np.random.RandomState([seed, i])
    out.append((i, fuzz_cases.draw_group(rng, dtype, family, branches),
                min(cases_per_group, cases - i * cases_per_group), rng))
  return out


def run(cases: int, seed: int = 0, dtype: str = 'float32',
        cases_per_group: int = 25, log: Optional[Callable[[str], None]] = None,
        shard: int = 0, num_shards: int = 1, excess_precision: bool = False,
        progress: Optional[common.Progress] = None,
        family: str = 'decoder_only',
        weights: str = 'as_given', branches: str = 'drawn'
        ) -> fuzz_check.Report:
  """Runs `cases` fuzz cases (or one shard's groups); returns the `Report`.

  `excess_precision`: compile with XLA's default precision (see above).
  `weights`: 'int8' decodes each case's weights quantized to int8.
  `branches`: how groups draw SPEED's candidate branches
  (`fuzz_cases.BRANCHES`).
  `log` gets a line per finished group; `progress` a line per group started
  and finished, and one unit per case.
  """
  if dtype not in fuzz_check.NEAR_TIE:
    raise ValueError(f'dtype must be one of {sorted(fuzz_check.NEAR_TIE)}, '
                     f'got {dtype!r}.')
  quantize.check_decode_weights(weights, 'weights')
  if cases < 1 or cases_per_group < 1:
    raise ValueError('cases and cases_per_group must be >= 1, got '
                     f'{cases} and {cases_per_group}.')
  if not 0 <= shard < num_shards:
    raise ValueError(f'shard must be in [0, num_shards), got {shard} of '
                     f'{num_shards}.')
  report = fuzz_check.Report(dtype=dtype, tolerance=fuzz_check.NEAR_TIE[dtype])
  if family not in fuzz_cases.FAMILIES:
    raise ValueError(f'family must be one of {fuzz_cases.FAMILIES}, got '
                     f'{family!r}.')
  groups = plan(cases, seed, cases_per_group, dtype, shard, num_shards,
                family, branches)
  if progress is None:
    progress = common.Progress('fuzz', 0, quiet=True)
  progress.total = float(sum(count for _, _, count, _ in groups))
  start = time.time()
  for number, (index, group, count, rng) in enumerate(groups):
    progress.log(f'group {number + 1}/{len(groups)} (index {index}, {count} '
                 f'cases): compiling {group}')
    compiled = fuzz_cases.Compiled(group, excess_precision)
    report.groups += 1
    chunk = group.cases_per_call()
    for first in range(0, count, chunk):
      in_call = min(chunk, count - first)
      fuzz_cases.run_cases(compiled, rng, report, in_call,
                           f'seed {seed} group {index} case {first}', weights)
      progress.advance(in_call)
    line = (f'group {index} done; so far {report.cases} cases, near-ties '
            f'{report.near_ties}, real bugs {report.real_bugs}, SPEED != '
            f'greedy {report.speed_mismatches}')
    progress.log(line)
    if log:
      log(f'[{time.time() - start:6.0f} s] {line}  ({group})')
  report.seconds = time.time() - start
  return report


def _shard(text: str) -> Tuple[int, int]:
  try:
    k, n = (int(v) for v in text.split('/'))
  except ValueError:
    raise argparse.ArgumentTypeError(f'--shard wants K/N, got {text!r}')
  if not 0 <= k < n:
    raise argparse.ArgumentTypeError(
        f'--shard K/N needs 0 <= K < N, got {text}')
  return k, n


def save(path: str, report: fuzz_check.Report, **run_settings):
  """Writes a run's (or shard's) settings and counts for `merge_files`."""
  with open(path, 'w') as f:
    json.dump({'run': run_settings, 'report': dataclasses.asdict(report)}, f,
              indent=1)


def merge_files(paths: List[str]) -> fuzz_check.Report:
  """Merges the `--json` files of every shard of one run, checking they are."""
  runs, reports = [], []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    runs.append(data['run'])
    reports.append(fuzz_check.Report(**data['report']))
  same = {k: v for k, v in runs[0].items() if k != 'shard'}
  for path, r in zip(paths, runs):
    if {k: v for k, v in r.items() if k != 'shard'} != same:
      raise ValueError(f'{path} is from another run: {r} vs {runs[0]}')
  shards = sorted(r['shard'] for r in runs)
  if shards != list(range(same['num_shards'])):
    raise ValueError(f'shards {shards} are not each of 0..'
                     f'{same["num_shards"] - 1} exactly once.')
  return fuzz_check.merge(reports)


def _print(report: fuzz_check.Report):
  for line in report.ties[:20]:
    print('near-tie:' if report.tolerance is not None else 'rounding:', line)
  for line in report.bugs[:50]:
    print('REAL BUG:', line)
  print(report.summary())


def parser() -> argparse.ArgumentParser:
  """The fuzz's command line."""
  p = argparse.ArgumentParser(
      prog='python -m tools.fuzz', description=__doc__,
      formatter_class=common.HelpFormatter)
  p.add_argument('--cases', type=int, default=300,
                 help='number of cases (each a batch of rows)')
  p.add_argument('--seed', type=int, default=0,
                 help='seed of every draw: a run is reproducible')
  p.add_argument('--dtype', default='float32',
                 choices=sorted(fuzz_check.NEAR_TIE),
                 help='activation dtype of the random models')
  p.add_argument('--family', default='decoder_only',
                 choices=fuzz_cases.FAMILIES,
                 help='random decoder-only models, or encoder-decoder models '
                 '(random encoders, encoder lengths and padded inputs)')
  p.add_argument('--weights', default='as_given',
                 choices=quantize.DECODE_WEIGHTS,
                 help='int8: every case decodes its weights quantized to int8 '
                 '(t5x_speed.quantize)')
  p.add_argument('--branches', default='drawn', choices=fuzz_cases.BRANCHES,
                 help='SPEED\'s candidate branches per group with R > 1: '
                 'drawn from 0..3, or on (1..3 in every such group).')
  p.add_argument('--cases-per-group', type=int, default=25,
                 help='cases sharing one architecture (one compile)')
  p.add_argument('--shard', type=_shard, default='0/1', metavar='K/N',
                 help='run only groups i with i mod N == K (0-based); '
                 'the N shards together are the whole run')
  p.add_argument('--json', metavar='PATH',
                 help='also write the run settings and counts here '
                 "(with --merge: the merged run's)")
  p.add_argument('--merge', nargs='+', metavar='JSON',
                 help='print the summary of a sharded run from its '
                 "shards' --json files (runs nothing)")
  p.add_argument('--xla-excess-precision', action='store_true',
                 help="compile with XLA's default precision (bf16 values "
                 'may stay float32), not inference.COMPILER_OPTIONS')
  p.add_argument('--quiet', action='store_true',
                 help='print only the summary: no progress lines on stderr')
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parser().parse_args(argv)
  if args.merge:
    report = merge_files(args.merge)
    if args.json:   # the whole run's settings and counts
      with open(args.merge[0]) as f:
        settings = json.load(f)['run']
      del settings['shard']
      save(args.json, report, **settings)
  else:
    shard, num_shards = args.shard
    report = run(args.cases, args.seed, args.dtype, args.cases_per_group,
                 shard=shard, num_shards=num_shards,
                 excess_precision=args.xla_excess_precision,
                 progress=common.Progress('fuzz', 0, quiet=args.quiet),
                 family=args.family, weights=args.weights,
                 branches=args.branches)
    if args.json:
      save(args.json, report, seed=args.seed, cases=args.cases,
           dtype=args.dtype, family=args.family, weights=args.weights,
           branches=args.branches,
           cases_per_group=args.cases_per_group,
           shard=shard, num_shards=num_shards,
           xla_excess_precision=args.xla_excess_precision)
  _print(report)
  return 1 if report.real_bugs else 0


if __name__ == '__main__':
  sys.exit(main())
