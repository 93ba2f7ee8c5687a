r"""Exactness fuzz: SPEED == greedy == an uncached forward pass, on random models.

  python -m tools.fuzz --cases 300 --seed 0 [--dtype float32|bfloat16]
  # A long run in shards (machines or sessions), then their total:
  python -m tools.fuzz --cases 10000 --shard 0/4 --json s0.json ...
  python -m tools.fuzz --merge s0.json s1.json s2.json s3.json

Cases come in groups that share one architecture and one set of shapes, so
that each group compiles its functions once (compilation, not decoding,
dominates on a CPU). A group draws G in 1..4, R in 1..8, a sharing order,
vocabulary 17..1000, width 32..256, batch 1..16 and a buffer of 2..32
positions; each of its cases draws fresh weights, prompts and limits:

* weights: one of four variants, scaling the residual branches (attention
  and MLP outputs) by 4 (`disagree`: every layer moves the prediction, the
  exits disagree and SPEED flushes often), 1 (`plain`), 0.05 (`agree`: the
  exits agree for long runs) or 0 (`identical`: the exits agree everywhere);
* prompts: ragged, lengths in [0, length - 1], with length 0 (decode from
  BOS) and the full buffer (one token left) drawn often; bidirectional
  prefix attention per row;
* `max_decode_steps` and `eos_id` per row: steps in 1..length (often past the
  buffer end); EOS is, per row, a token greedy produces without EOS (so the
  row ends there), a random id, or -1 (never ends).

Per case it runs greedy without EOS (the reference), greedy and SPEED with the
rows' EOS, and the model's uncached full forward pass over the reference, and
checks each row:

1. greedy with EOS is the reference cut after the row's first EOS;
2. SPEED's tokens equal greedy's; in float32 also its scores (relative 1e-3),
   and its statistics (`num_tokens`, no example flagged invalid);
3. at every reference token, the uncached forward's argmax is that token
   (checked apart from 1 and 2: a row can fail 3 and pass 2).

Everything is compiled as `inference.generate` compiles
(`inference.COMPILER_OPTIONS`: bf16 values rounded where the program says);
--xla-excess-precision compiles with XLA's defaults instead, as a jit outside
this package (T5X's) does, where bf16 SPEED can differ from greedy at
near-ties.

Where SPEED's and greedy's programs run every decode-step matmul on the
row-independent kernel (B * R <= `rowmatmul.MAX_ROWS` rows) and each case is
run as `generate` runs it (bfloat16 cases, one at a time, compiled as
generate compiles), SPEED's tokens must equal greedy's: the fuzz has found no
mismatch there (the attention and norms, XLA ops, can still round the last
bits differently), so one is reported as a *real bug*, to be looked at.
Elsewhere (float32 cases are vmapped for speed; B * R > MAX_ROWS runs
SPEED's matmuls through XLA's GEMM; --xla-excess-precision) a float32 token mismatch is a *near-tie* when the
reference's top-2 logit margin at the first differing position (from the
uncached forward) is below the tolerance (`NEAR_TIE[dtype]` times max(1,
|top logit|)): different but valid float rounding. Check 3 has its own
tolerance, `FORWARD_TIE[dtype]`: the uncached forward is another computation
(XLA's GEMM over all positions, attention over the full sequence). In
bfloat16 such mismatches are counted, not classified (see `NEAR_TIE`). Any
other mismatch, or a statistics or score mismatch, is a *real bug*. The run
prints the counts and exits 1 on a real bug.
"""

import argparse
import dataclasses
import functools
import json
import sys
import time
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import inference
from t5x_speed import network
from t5x_speed import rowmatmul
from t5x_speed import steps

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
VARIANTS = (('disagree', 4.0, 0.35), ('plain', 1.0, 0.3),
            ('agree', 0.05, 0.25), ('identical', 0.0, 0.1))
RESIDUAL_OUTPUTS = ('out', 'wo')
# Cache elements (cases x batch x layers x length x width) one vmapped call
# may hold: bounds memory for the largest groups (about 0.5 GB per cache copy
# in float32).
CALL_CELLS = 2**27


@dataclasses.dataclass(frozen=True)
class Group:
  """One architecture and set of shapes: compiled once."""
  g: int
  r: int
  sharing: str
  vocab: int
  width: int
  heads: int
  mlp: int
  batch: int
  length: int
  dtype: str

  def config(self) -> network.TransformerConfig:
    return network.TransformerConfig(
        vocab_size=self.vocab, emb_dim=self.width, num_heads=self.heads,
        head_dim=self.width // self.heads, mlp_dim=self.mlp,
        num_unique_layers=self.g, num_repeats=self.r, sharing=self.sharing,
        dtype=self.dtype, relpos_num_buckets=8, relpos_max_distance=32)


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


def draw_group(rng: np.random.RandomState, dtype: str) -> Group:
  width = 8 * rng.randint(4, 33)                       # 32..256
  heads = int(rng.choice([h for h in (1, 2, 4, 8) if width // h >= 8]))
  return Group(
      g=rng.randint(1, 5), r=rng.randint(1, 9),
      sharing=str(rng.choice(['cycle', 'cycle', 'sequence', 'cycle_rev'])),
      vocab=int(np.exp(rng.uniform(np.log(17), np.log(1001)))),
      width=width, heads=heads, mlp=8 * rng.randint(width // 8, width // 4 + 1),
      batch=rng.randint(1, 17), length=rng.randint(2, 33), dtype=dtype)


class _Compiled:
  """The jitted functions of one group."""

  def __init__(self, group: Group, excess_precision: bool = False):
    self.group = group
    module = network.SpeedTransformer(group.config())
    tokens = jnp.ones((1, 2), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(
        jax.random.PRNGKey(0), tokens, tokens, enable_dropout=False))['params']
    length = group.length

    def draw(key, gain):
      leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
      keys = jax.random.split(key, len(leaves))
      out = []
      for (path, leaf), k in zip(leaves, keys):
        names = [getattr(p, 'key', None) for p in path]
        x = jax.random.normal(k, leaf.shape, leaf.dtype)
        if 'scale' in names:
          x = 1.0 + 0.1 * x
        elif 'kernel' in names:
          x = x / np.sqrt(leaf.shape[0])
          if any(n in RESIDUAL_OUTPUTS for n in names):
            x = x * gain
        out.append(x)
      return jax.tree_util.tree_unflatten(tree, out)

    def causal(lengths, bidir):
      return ((jnp.arange(length) <= lengths[:, None]) &
              bidir[:, None]).astype(jnp.int32)

    def prefill(params, inputs, lengths, bidir):
      return steps.BoundSteps(module, params).prefill(
          inputs, lengths, causal(lengths, bidir))

    def greedy(params, inputs, lengths, bidir, max_steps, eos):
      return decoding.greedy_decode(
          eos_id=eos, max_decode_steps=max_steps,
          **steps.BoundSteps(module, params).decode_fn_kwargs(
              decoding.greedy_decode, inputs,
              prefill(params, inputs, lengths, bidir), lengths))

    def speed(params, inputs, lengths, bidir, max_steps, eos):
      return decoding.speed_decode(
          eos_id=eos, max_decode_steps=max_steps,
          **steps.BoundSteps(module, params).decode_fn_kwargs(
              decoding.speed_decode, inputs,
              prefill(params, inputs, lengths, bidir), lengths))

    def forward(params, sequence, lengths, bidir):
      logits = module.apply({'params': params}, sequence,
                            jnp.ones_like(sequence),
                            decoder_causal_attention=causal(lengths, bidir),
                            enable_dropout=False, all_exits=False)
      return (jnp.argmax(logits, -1).astype(jnp.int32),
              jax.lax.top_k(logits, 2)[0])

    jit = functools.partial(jax.jit, compiler_options=(
        None if excess_precision else inference.COMPILER_OPTIONS))
    # Every function maps over a leading case axis. float32 decodes all the
    # group's cases in one vmapped call, paying the loops' per-step overhead
    # once. bfloat16 decodes them one at a time, each with the program a
    # user runs: under vmap XLA batches the attention's dots differently,
    # which moves bf16 rounding in greedy's program but not in SPEED's.
    one_at_a_time = group.dtype == 'bfloat16'
    self.draw = jit(jax.vmap(draw))
    self.greedy = _map_cases(greedy, jit, one_at_a_time)
    self.speed = _map_cases(speed, jit, one_at_a_time)
    self.forward = jit(jax.vmap(forward))
    # Where every decode-step matmul of both loops runs on the row-independent
    # kernel (SPEED's B*R rows included) in the user's program, SPEED's tokens
    # must be greedy's exactly, near-tie or not.
    self.bit_exact = (one_at_a_time and not excess_precision and
                      rowmatmul.available() and
                      group.batch * group.r <= rowmatmul.MAX_ROWS)


def _map_cases(fn, jit, one_at_a_time: bool):
  """jit(fn) over a leading case axis: vmapped, or by a host loop."""
  if not one_at_a_time:
    return jit(jax.vmap(fn))
  single = jit(fn)

  def mapped(*args):
    count = jax.tree.leaves(args)[0].shape[0]
    outs = [single(*jax.tree.map(lambda x, c=c: x[c], args))
            for c in range(count)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

  return mapped


def _cut(tokens: np.ndarray, limit: int, eos: int) -> np.ndarray:
  """The first `limit` tokens, ending after the first `eos`."""
  tokens = tokens[:limit]
  hits = np.flatnonzero(tokens == eos)
  return tokens[:hits[0] + 1] if hits.size else tokens


def run_cases(compiled: _Compiled, rng: np.random.RandomState,
              report: Report, count: int, first: str):
  """Draws and checks `count` cases of one group, adding to `report`."""
  group = compiled.group
  batch, length, vocab = group.batch, group.length, group.vocab
  names, gains, probs = zip(*VARIANTS)
  variants = rng.choice(len(VARIANTS), size=count, p=probs)
  params = compiled.draw(
      jax.random.split(jax.random.PRNGKey(rng.randint(2**31)), count),
      jnp.asarray(np.array(gains)[variants], jnp.float32))
  # Prompt lengths in [0, length - 1], the ends drawn often.
  kind = rng.choice(3, size=(count, batch), p=(0.15, 0.15, 0.7))
  lengths = np.where(kind == 0, 0, np.where(
      kind == 1, length - 1, rng.randint(0, length, size=(count, batch))))
  inputs = rng.randint(0, vocab, size=(count, batch, length))
  inputs[np.arange(length)[None, None] > lengths[..., None]] = 0
  inputs[..., 0] = 0
  bidir = rng.rand(count, batch) < 0.5
  max_steps = rng.randint(1, length + 1, size=(count, batch))
  args = (params, jnp.asarray(inputs, jnp.int32),
          jnp.asarray(lengths, jnp.int32), jnp.asarray(bidir))
  steps_j = jnp.asarray(max_steps, jnp.int32)

  # The reference: greedy without EOS.
  refs, _ = compiled.greedy(*args, steps_j,
                            jnp.full((count, batch), -1, jnp.int32))
  refs = np.asarray(refs)[:, :, 0]
  limits = np.minimum(length, lengths + max_steps) - lengths  # tokens to produce
  eos = np.empty((count, batch), np.int64)
  for c, b in np.ndindex(count, batch):
    u = rng.rand()
    if u < 0.5:
      eos[c, b] = rng.choice(
          refs[c, b, lengths[c, b]:lengths[c, b] + limits[c, b]])
    elif u < 0.8:
      eos[c, b] = rng.randint(vocab)
    else:
      eos[c, b] = -1
  eos_j = jnp.asarray(eos, jnp.int32)
  greedies, g_scores = compiled.greedy(*args, steps_j, eos_j)
  speeds, s_scores, stats = compiled.speed(*args, steps_j, eos_j)
  sequences = np.concatenate([np.zeros((count, batch, 1), refs.dtype), refs],
                             -1)[..., :length]
  fwd_argmax, fwd_top2 = compiled.forward(params, jnp.asarray(sequences),
                                          *args[2:])
  host = jax.tree.map(np.asarray, (greedies, g_scores, speeds, s_scores,
                                   stats, fwd_argmax, fwd_top2))
  for c in range(count):
    case = jax.tree.map(lambda x, c=c: x[c], host)
    _check_case(group, report, f'{first}+{c} {names[variants[c]]}',
                compiled.bit_exact, inputs[c], lengths[c], limits[c], eos[c],
                refs[c], *case)


def _check_case(group, report, case_id, bit_exact, inputs, lengths, limit,
                eos, ref, greedy, g_scores, speed, s_scores, stats,
                fwd_argmax, fwd_top2):
  """Checks one case's rows (see the module docstring), adding to `report`."""
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
    want = _cut(ref_rows[b], limit[b], eos[b])
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


def plan(cases: int, seed: int, cases_per_group: int, dtype: str,
         shard: int = 0, num_shards: int = 1
         ) -> List[Tuple[int, Group, int, np.random.RandomState]]:
  """The groups that `shard` of `num_shards` runs: (index, group, cases, rng).

  Group i holds cases [i * cases_per_group, ...) and draws everything (its
  architecture here, then its cases from the returned rng in `run_cases`)
  from RandomState([seed, i]), so a run split into shards (group i goes to
  shard i mod num_shards), on one machine or several, checks exactly the
  cases of the unsplit run.
  """
  out = []
  for i in range(shard, -(-cases // cases_per_group), num_shards):
    rng = np.random.RandomState([seed, i])
    out.append((i, draw_group(rng, dtype),
                min(cases_per_group, cases - i * cases_per_group), rng))
  return out


def run(cases: int, seed: int = 0, dtype: str = 'float32',
        cases_per_group: int = 25, log=None, shard: int = 0,
        num_shards: int = 1, excess_precision: bool = False) -> Report:
  """Runs `cases` fuzz cases (or one shard's groups); returns the `Report`.

  `excess_precision`: compile with XLA's default precision (see above).
  """
  if dtype not in NEAR_TIE:
    raise ValueError(f'dtype must be one of {sorted(NEAR_TIE)}, got {dtype!r}.')
  if cases < 1 or cases_per_group < 1:
    raise ValueError('cases and cases_per_group must be >= 1, got '
                     f'{cases} and {cases_per_group}.')
  if not 0 <= shard < num_shards:
    raise ValueError(f'shard must be in [0, num_shards), got {shard} of '
                     f'{num_shards}.')
  report = Report(dtype=dtype, tolerance=NEAR_TIE[dtype])
  start = time.time()
  for index, group, count, rng in plan(cases, seed, cases_per_group, dtype,
                                       shard, num_shards):
    compiled = _Compiled(group, excess_precision)
    report.groups += 1
    per_case = group.batch * group.g * group.r * group.length * group.width
    chunk = max(1, CALL_CELLS // per_case)
    for first in range(0, count, chunk):
      run_cases(compiled, rng, report, min(chunk, count - first),
                f'seed {seed} group {index} case {first}')
    if log:
      log(f'[{time.time() - start:6.0f} s] group {index}: {report.cases} '
          f'cases, near-ties {report.near_ties}, real bugs '
          f'{report.real_bugs}, SPEED != greedy {report.speed_mismatches}  '
          f'({group})')
  report.seconds = time.time() - start
  return report


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


def _shard(text: str) -> Tuple[int, int]:
  try:
    k, n = (int(v) for v in text.split('/'))
  except ValueError:
    raise argparse.ArgumentTypeError(f'--shard wants K/N, got {text!r}')
  if not 0 <= k < n:
    raise argparse.ArgumentTypeError(f'--shard K/N needs 0 <= K < N, got {text}')
  return k, n


def save(path: str, report: Report, **run_settings):
  """Writes a run's (or shard's) settings and counts for `merge_files`."""
  with open(path, 'w') as f:
    json.dump({'run': run_settings, 'report': dataclasses.asdict(report)}, f,
              indent=1)


def merge_files(paths: List[str]) -> Report:
  """Merges the `--json` files of every shard of one run, checking they are."""
  runs, reports = [], []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    runs.append(data['run'])
    reports.append(Report(**data['report']))
  same = {k: v for k, v in runs[0].items() if k != 'shard'}
  for path, r in zip(paths, runs):
    if {k: v for k, v in r.items() if k != 'shard'} != same:
      raise ValueError(f'{path} is from another run: {r} vs {runs[0]}')
  shards = sorted(r['shard'] for r in runs)
  if shards != list(range(same['num_shards'])):
    raise ValueError(f'shards {shards} are not each of 0..'
                     f'{same["num_shards"] - 1} exactly once.')
  return merge(reports)


def _print(report: Report):
  for line in report.ties[:20]:
    print('near-tie:' if report.tolerance is not None else 'rounding:', line)
  for line in report.bugs[:50]:
    print('REAL BUG:', line)
  print(report.summary())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m tools.fuzz',
      description='Fuzz SPEED == greedy == uncached forward on random models.',
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--cases', type=int, default=300,
                      help='number of cases (each a batch of rows)')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of every draw: a run is reproducible')
  parser.add_argument('--dtype', default='float32', choices=sorted(NEAR_TIE),
                      help='activation dtype of the random models')
  parser.add_argument('--cases-per-group', type=int, default=25,
                      help='cases sharing one architecture (one compile)')
  parser.add_argument('--shard', type=_shard, default='0/1', metavar='K/N',
                      help='run only groups i with i mod N == K (0-based); '
                      'the N shards together are the whole run')
  parser.add_argument('--json', metavar='PATH',
                      help='also write the run settings and counts here '
                      "(with --merge: the merged run's)")
  parser.add_argument('--merge', nargs='+', metavar='JSON',
                      help='print the summary of a sharded run from its '
                      "shards' --json files (runs nothing)")
  parser.add_argument('--xla-excess-precision', action='store_true',
                      help="compile with XLA's default precision (bf16 values "
                      'may stay float32), not inference.COMPILER_OPTIONS')
  parser.add_argument('--quiet', action='store_true',
                      help='print only the summary')
  args = parser.parse_args(argv)
  if args.merge:
    report = merge_files(args.merge)
    if args.json:   # the whole run's settings and counts
      with open(args.merge[0]) as f:
        settings = json.load(f)['run']
      del settings['shard']
      save(args.json, report, **settings)
  else:
    log = None if args.quiet else (lambda m: print(m, flush=True))
    shard, num_shards = args.shard
    report = run(args.cases, args.seed, args.dtype, args.cases_per_group, log,
                 shard, num_shards, args.xla_excess_precision)
    if args.json:
      save(args.json, report, seed=args.seed, cases=args.cases,
           dtype=args.dtype, cases_per_group=args.cases_per_group,
           shard=shard, num_shards=num_shards,
           xla_excess_precision=args.xla_excess_precision)
  _print(report)
  return 1 if report.real_bugs else 0


if __name__ == '__main__':
  sys.exit(main())
