"""The fuzz's checks of one case and their counts (`Report`).

Per case the fuzz runs greedy without EOS (the reference), greedy and SPEED
with the rows' EOS, and the model's uncached full forward pass over the
reference; `check_case` checks each row:

1. greedy with EOS is the reference cut after the row's first EOS;
2. SPEED's tokens equal greedy's; in float32 also its scores (relative 1e-3),
   and its statistics (`num_tokens`, no example flagged invalid);
3. at every reference token, the uncached forward's argmax is that token
   (checked apart from 1 and 2: a row can fail 3 and pass 2).

Where SPEED's and greedy's programs run every decode-step matmul on the
row-independent kernel and the case runs as `inference.generate` runs it
(`bit_exact`), a token mismatch is a *real bug*. Elsewhere a float32 token
mismatch is a *near-tie* when the reference's top-2 logit margin at the first
differing position (from the uncached forward) is below the tolerance
(`NEAR_TIE[dtype]` times max(1, |top logit|)): different but valid float
rounding. Check 3 has its own tolerance, `FORWARD_TIE[dtype]`: the uncached
forward is another computation (XLA's GEMM over all positions, attention
over the full sequence). In bfloat16 such mismatches are counted, not
classified (see `NEAR_TIE`). Any other mismatch, or a statistics or score
mismatch, is a real bug.
"""

import dataclasses
from typing import Any, List, Optional

import numpy as np

# Near-tie tolerance on greedy's top-2 margin, relative to max(1, |top|),
# where SPEED and greedy may round differently (see the module docstring).
# None: counted, not classified. bf16 keeps 8 significant bits, and on these
# random models (up to 32 virtual layers, residual gains up to 4) two
# computations that round differently moved the top-2 margin by up to 0.3
# of the top logit, and the margin itself comes from a bf16 forward: no
# tolerance separates rounding from a bug there (the float32 runs, through
# the same code, do).
NEAR_TIE = {'float32': 1e-4, 'bfloat16': None}
# The same for greedy against the uncached forward pass (check 3).
FORWARD_TIE = {'float32': 1e-4, 'bfloat16': None}
# float32 only. Greedy's and SPEED's programs compute the scores' logits
# with different XLA ops around the kernel (attention over the cache, norms;
# more so under vmap), which round differently: on a 4x8 model of width 216
# the vmapped scores differed by 1.6e-4 relative. A score bug (another
# stage's logits, a flushed token counted) moves them by far more.
SCORE_RTOL = 1e-3


@dataclasses.dataclass
class Report:
  """Counts of a fuzz run."""
  dtype: str
  tolerance: Optional[float]
  cases: int = 0
  groups: int = 0
  rows: int = 0
  tokens_compared: int = 0       # SPEED vs greedy, tokens
  forward_tokens: int = 0        # greedy reference vs uncached forward
  exact_rows: int = 0
  near_ties: int = 0
  real_bugs: int = 0
  speed_mismatches: int = 0      # rows where SPEED's tokens are not greedy's
  unclassified: int = 0          # bf16 mismatches of differently rounded runs
  flushes: int = 0
  branched_cases: int = 0        # cases decoded with candidate branches
  branch_hits: int = 0           # flips a branch absorbed (no flush)
  seconds: float = 0.0
  bugs: List[str] = dataclasses.field(default_factory=list)
  ties: List[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    rate = self.near_ties / max(self.rows, 1)
    return '\n'.join([
        f'fuzz: {self.cases} cases in {self.groups} groups, {self.rows} rows, '
        f'{self.dtype}, {self.seconds:.0f} s',
        f'  tokens compared SPEED vs greedy: {self.tokens_compared}; greedy '
        f'vs uncached forward: {self.forward_tokens}; SPEED flushes: '
        f'{self.flushes}',
        f'  cases with candidate branches: {self.branched_cases}; flips a '
        f'branch absorbed: {self.branch_hits}',
        f'  rows exact: {self.exact_rows}/{self.rows}; SPEED != greedy in '
        f'{self.speed_mismatches} rows '
        f'({self.speed_mismatches / max(self.rows, 1):.3%})',
        f'  near-tie mismatches (top-2 margin < {self.tolerance} x '
        f'max(1, |top logit|)): {self.near_ties} ({rate:.3%} of rows)'
        if self.tolerance is not None else
        f'  mismatches of differently rounded bf16 runs (not classified): '
        f'{self.unclassified} ({self.unclassified / max(self.rows, 1):.3%} '
        'of rows)',
        f'  real-bug mismatches: {self.real_bugs}'])


def merge(reports: List[Report]) -> Report:
  """The report of a run whose shards gave `reports` (one dtype)."""
  if len({r.dtype for r in reports}) != 1:
    raise ValueError('reports of different dtypes cannot be merged.')
  total = Report(dtype=reports[0].dtype, tolerance=reports[0].tolerance)
  for r in reports:
    for f in dataclasses.fields(Report):
      if f.name not in ('dtype', 'tolerance'):
        setattr(total, f.name, getattr(total, f.name) + getattr(r, f.name))
  return total


def cut(tokens: np.ndarray, limit: int, eos: int) -> np.ndarray:
  """The first `limit` tokens, ending after the first `eos`."""
  tokens = tokens[:limit]
  hits = np.flatnonzero(tokens == eos)
  return tokens[:hits[0] + 1] if hits.size else tokens


def check_case(group: Any, report: Report, case_id: str, bit_exact: bool,
               inputs, lengths, limit, eos, ref, greedy, g_scores, speed,
               s_scores, stats, fwd_argmax, fwd_top2):
  """Checks one case's rows (see the module docstring), adding to `report`.

  Args:
    group: the case's `fuzz_cases.Group` (its batch and dtype are read).
    report: the counts to add to.
    case_id: names the case in the report's lists.
    bit_exact: SPEED's tokens must be greedy's, near-tie or not.
    inputs: [batch, length] BOS-shifted prompts.
    lengths: [batch] prompt lengths.
    limit: [batch] tokens each row may produce.
    eos: [batch] each row's EOS id.
    ref: [batch, length] greedy's sequences without EOS (the reference).
    greedy: [batch, 1, length] greedy's sequences with EOS.
    g_scores: [batch, 1] their scores.
    speed: [batch, 1, length] SPEED's sequences with EOS.
    s_scores: [batch, 1] their scores.
    stats: SPEED's `SpeedStats`.
    fwd_argmax: [batch, length] the uncached forward's argmax over `ref`.
    fwd_top2: [batch, length, 2] its top two logits.
  """
  batch = group.batch
  greedy, speed = greedy[:, 0], speed[:, 0]
  g_scores, s_scores = g_scores[:, 0], s_scores[:, 0]
  ref_rows = [ref[b, lengths[b]:lengths[b] + limit[b]] for b in range(batch)]

  def classify(what, b, position, tol=NEAR_TIE[group.dtype]):
    """Position p's margin (from the uncached forward of the reference)."""
    top = fwd_top2[b, position - 1]
    margin = float(top[0] - top[1])
    if tol is None:
      report.unclassified += 1
      report.ties.append(f'{case_id} {group} row {b}: {what} at position '
                         f'{position}, top-2 margin {margin:.3g} (bf16 '
                         'rounding, not classified)')
      return
    bound = tol * max(1.0, abs(float(top[0])))
    where = (f'{case_id} {group} row {b}: {what} at position {position}, '
             f'top-2 margin {margin:.3g} (near-tie below {bound:.3g})')
    if margin < bound:
      report.near_ties += 1
      report.ties.append(where)
    else:
      report.real_bugs += 1
      report.bugs.append(where)

  report.cases += 1
  report.flushes += int(np.asarray(stats.flushes).sum())
  report.branched_cases += int(getattr(group, 'branches', 0) > 0)
  report.branch_hits += int(np.asarray(stats.branch_hits).sum())
  num_tokens, invalid = np.asarray(stats.num_tokens), np.asarray(stats.invalid)
  for b in range(batch):
    report.rows += 1
    start = lengths[b] + 1                       # first produced position
    # 3. The reference against the uncached forward pass.
    report.forward_tokens += int(limit[b])
    bad = np.flatnonzero(fwd_argmax[b, lengths[b]:lengths[b] + limit[b]] !=
                         ref_rows[b])
    if bad.size:   # counted, and SPEED is still compared with greedy
      classify('greedy != uncached forward', b, start + bad[0],
               FORWARD_TIE[group.dtype])
    # 1. Greedy with EOS is the reference cut at EOS.
    want = cut(ref_rows[b], limit[b], eos[b])
    got = greedy[b, lengths[b]:]
    if not (np.array_equal(got[:want.size], want) and
            not got[want.size:].any()):
      diff = np.flatnonzero(np.append(got[:want.size] != want, True))[0]
      # The reference's own program: the same arithmetic, so no tolerance.
      classify('greedy with EOS != reference cut at EOS', b, start + diff,
               0.0)
      continue
    # 2. SPEED against greedy.
    report.tokens_compared += want.size
    mine = speed[b, lengths[b]:]
    if not np.array_equal(mine, got):
      report.speed_mismatches += 1
      # Both on the kernel: no tolerance (a zero one makes any margin a bug).
      classify('SPEED != greedy', b, start + np.flatnonzero(mine != got)[0],
               0.0 if bit_exact else NEAR_TIE[group.dtype])
      continue
    problems = []
    if not (np.array_equal(speed[b, :lengths[b]], inputs[b, 1:start]) and
            np.array_equal(greedy[b, :lengths[b]], inputs[b, 1:start])):
      problems.append('prompt overwritten')
    if num_tokens[b] != want.size or invalid[b]:
      problems.append(f'stats num_tokens {num_tokens[b]} (want {want.size}), '
                      f'invalid {invalid[b]}')
    if group.dtype == 'float32' and not np.isclose(
        s_scores[b], g_scores[b], rtol=SCORE_RTOL, atol=SCORE_RTOL):
      problems.append(f'score {s_scores[b]} != greedy {g_scores[b]}')
    if problems:
      report.real_bugs += 1
      report.bugs.append(f'{case_id} {group} row {b}: ' + '; '.join(problems))
    elif not bad.size:
      report.exact_rows += 1
