"""CI's slice of the exactness fuzz (`make fuzz` runs as many cases as asked).

The slice: 200 float32 cases in 2 groups (architectures), drawn from a fixed
seed, must have no real-bug mismatch and no near-tie either (float32 near-ties
are rare enough that one would deserve a look); 40 bfloat16 cases must have
SPEED == greedy in every row, compiled as `generate` compiles and with XLA's
default precision. Encoder-decoder models get the same: 100
float32 cases in 2 groups (random encoders, encoder lengths and padding) and
20 bfloat16 cases on the kernel path. 25 float32 cases of int8-quantized
decoder-only models likewise. Exit adapters sit on one float32 group, the
int8 group and the encoder-decoder bf16 group; SPEED runs candidate
branches (1 to 3) in every group but one encoder-decoder float32 group, and
branches absorb flips in each slice. The runner itself must catch a broken
SPEED and tell a near-tie from a real bug.
"""

import dataclasses
import functools
import json
import os
import shutil
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import results
from tools import fuzz
from tools import fuzz_cases
from tools import fuzz_check

TINY = fuzz_cases.Group(g=1, r=3, sharing='cycle', vocab=17, width=32,
                        heads=2, mlp=32, batch=3, length=8, dtype='float32')
# The CI slice's run (`fuzz.plan` arguments).
SLICE = dict(cases=200, seed=0, cases_per_group=100, dtype='float32')
BF16 = fuzz_cases.Group(g=2, r=3, sharing='cycle', vocab=97, width=96,
                        heads=2, mlp=128, batch=8, length=12, dtype='bfloat16',
                        branches=2)
ENCDEC_SLICE = dict(cases=100, seed=0, cases_per_group=50, dtype='float32',
                    family='encoder_decoder')
ENCDEC_BF16 = fuzz_cases.Group(g=2, r=2, sharing='cycle', vocab=61, width=64,
                               heads=2, mlp=96, batch=3, length=10,
                               dtype='bfloat16', encoder_layers=2,
                               encoder_length=9, exit_adapter_rank=2,
                               branches=1)


class FuzzSliceTest(absltest.TestCase):

  def test_ci_slice(self):
    report = fuzz.run(**SLICE, log=print)
    print(report.summary())
    self.assertEqual(report.cases, 200)
    self.assertEqual(report.groups, 2)
    self.assertEqual(report.real_bugs, 0, report.bugs[:10])
    self.assertEqual(report.near_ties, 0, report.ties[:10])
    self.assertEqual(report.exact_rows, report.rows)
    # The slice exercises what it claims: flushes happen, tokens compared,
    # exit adapters on one of its groups.
    self.assertGreater(report.flushes, 0)
    self.assertGreater(report.tokens_compared, 1000)
    self.assertEqual([g.exit_adapter_rank for _, g, _, _ in
                      fuzz.plan(**SLICE)], [None, 4])
    self.assertEqual([g.branches for _, g, _, _ in fuzz.plan(**SLICE)],
                     [3, 3])
    self.assertEqual(report.branched_cases, 200)
    self.assertGreater(report.branch_hits, 0)
    # --json writes what --merge reads back (a one-shard run).
    path = os.path.join(tempfile.mkdtemp(), 'slice.json')
    self.addCleanup(os.remove, path)
    fuzz.save(path, report, **SLICE, shard=0, num_shards=1)
    self.assertEqual(fuzz.merge_files([path]), report)

  def test_bf16_speed_is_greedy_as_generate_compiles(self):
    # With the row-independent kernels (weight products, attention, norms),
    # bf16 SPEED's tokens are greedy's compiled as `inference.generate`
    # compiles, and on these cases under XLA's default precision too: before
    # the norms were kernel calls, that compile differed in 5 of the 320
    # rows. (That the check sees a difference: test_catches_a_broken_speed.)
    for excess_precision in (False, True):
      report = fuzz_check.Report('bfloat16', fuzz_check.NEAR_TIE['bfloat16'])
      fuzz_cases.run_cases(fuzz_cases.Compiled(BF16, excess_precision),
                           np.random.RandomState(7), report, count=40,
                           first='bf16')
      self.assertEqual(report.rows, 320)
      self.assertGreater(report.tokens_compared, 800)
      self.assertEqual(report.speed_mismatches, 0, excess_precision)

  def test_int8_slice(self):
    report = fuzz.run(cases=25, seed=2, cases_per_group=25, dtype='float32',
                      weights='int8', log=print)
    print(report.summary())
    self.assertEqual((report.cases, report.groups), (25, 1))
    (_, group, _, _), = fuzz.plan(cases=25, seed=2, cases_per_group=25,
                                  dtype='float32')
    self.assertEqual(group.exit_adapter_rank, 8)   # int8 beside adapters
    self.assertEqual(group.branches, 3)            # and branches
    self.assertGreater(report.branch_hits, 0)
    self.assertEqual(report.real_bugs, 0, report.bugs[:10])
    self.assertEqual(report.near_ties, 0, report.ties[:10])
    self.assertEqual(report.exact_rows, report.rows)
    self.assertGreater(report.flushes, 0)

  def test_encoder_decoder_slice(self):
    report = fuzz.run(**ENCDEC_SLICE, log=print)
    print(report.summary())
    self.assertEqual((report.cases, report.groups), (100, 2))
    self.assertEqual(report.real_bugs, 0, report.bugs[:10])
    self.assertEqual(report.near_ties, 0, report.ties[:10])
    self.assertEqual(report.exact_rows, report.rows)
    self.assertGreater(report.flushes, 0)
    self.assertGreater(report.forward_tokens, 500)
    groups = [g for _, g, _, _ in fuzz.plan(**ENCDEC_SLICE)]
    self.assertTrue(all(g.encoder_layers > 0 and g.encoder_length > 0
                        for g in groups))
    self.assertEqual([g.branches for g in groups], [2, 0])
    self.assertGreater(report.branch_hits, 0)
    # bfloat16 on the kernel path: SPEED's tokens are greedy's.
    compiled = fuzz_cases.Compiled(ENCDEC_BF16)
    self.assertTrue(compiled.bit_exact)
    report = fuzz_check.Report('bfloat16', fuzz_check.NEAR_TIE['bfloat16'])
    fuzz_cases.run_cases(compiled, np.random.RandomState(8), report, count=20,
                         first='encdec bf16')
    self.assertEqual(report.rows, 60)
    self.assertEqual(report.speed_mismatches, 0)
    self.assertEqual(report.real_bugs, 0, report.bugs[:10])

  def test_catches_a_broken_speed(self):
    real = decoding.speed_decode

    @functools.wraps(real)  # declared as SPEED, like the real one
    def off_by_one(**kwargs):
      result = decoding.decode(real, **kwargs)
      # Change the last position's token of every row: a real bug wherever
      # that token was produced and the margin there is not a near-tie.
      return result.replace(sequences=result.sequences.at[:, :, -1].add(1))

    # One of the CI slice's groups with its cases per call: greedy and the
    # forward pass are then the slice's programs, which JAX's compilation
    # cache compiles once for both tests.
    _, group, count, _ = fuzz.plan(**SLICE)[1]
    decoding.speed_decode = off_by_one
    try:
      report = fuzz_check.Report('float32', fuzz_check.NEAR_TIE['float32'])
      fuzz_cases.run_cases(fuzz_cases.Compiled(group),
                           np.random.RandomState(0), report, count=count,
                           first='broken')
    finally:
      decoding.speed_decode = real
    self.assertGreater(report.real_bugs, 0)
    self.assertIn('SPEED != greedy', report.bugs[0])

  def test_shards_partition_the_run(self):
    whole = fuzz.plan(1050, seed=3, cases_per_group=100, dtype='float32')
    self.assertEqual([i for i, *_ in whole], list(range(11)))
    self.assertEqual(sum(c for _, _, c, _ in whole), 1050)
    shards = [fuzz.plan(1050, 3, 100, 'float32', k, 3) for k in range(3)]
    self.assertEqual(sorted(i for s in shards for i, *_ in s), list(range(11)))
    by_index = {i: (g, c, rng.randint(2**31)) for i, g, c, rng in whole}
    for shard in shards:
      for i, g, c, rng in shard:   # same architecture, cases and case draws
        self.assertEqual((g, c, rng.randint(2**31)), by_index[i])
    self.assertNotEqual(whole[0][1], whole[1][1])
    with self.assertRaisesRegex(ValueError, 'shard must be in'):
      fuzz.run(10, shard=2, num_shards=2)

  def test_merge_checks_the_shards(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp)
    run = dict(seed=1, cases=20, dtype='float32', cases_per_group=5,
               num_shards=2)

    def write(name, shard, **changes):
      report = fuzz_check.Report('float32', 1e-4, cases=10, groups=2,
                                 rows=30, near_ties=shard,
                                 bugs=[f'b{shard}'])
      path = os.path.join(tmp, name)
      with open(path, 'w') as f:
        json.dump({'run': {**run, 'shard': shard, **changes},
                   'report': dataclasses.asdict(report)}, f)
      return path

    a, b = write('a', 0), write('b', 1)
    total = fuzz.merge_files([a, b])
    self.assertEqual((total.cases, total.groups, total.rows, total.near_ties,
                      total.bugs), (20, 4, 60, 1, ['b0', 'b1']))
    with self.assertRaisesRegex(ValueError, 'not each of 0..1'):
      fuzz.merge_files([a, a])
    with self.assertRaisesRegex(ValueError, 'from another run'):
      fuzz.merge_files([a, write('c', 1, seed=2)])
    merged = os.path.join(tmp, 'merged.json')
    self.assertEqual(fuzz.main(['--merge', a, b, '--json', merged]), 0)
    with open(merged) as f:
      data = json.load(f)
    self.assertEqual(data['run'], run)
    self.assertEqual(fuzz_check.Report(**data['report']), total)

  def test_near_tie_classification(self):
    case = dict(inputs=np.zeros((1, 4), np.int64), lengths=np.array([0]),
                limit=np.array([3]), eos=np.array([-1]),
                ref=np.array([[5, 6, 7, 0]]))
    group = fuzz_cases.Group(**{**TINY.__dict__, 'batch': 1, 'length': 4})
    stats = results.SpeedStats.zeros(1, 3).replace(
        num_tokens=jnp.array([3]))
    stats = jax.tree.map(np.asarray, stats)

    def check(margin, bit_exact):
      report = fuzz_check.Report('float32', 1e-4)
      top2 = np.array([[[2.0, 2.0 - margin]] * 4])
      speed = np.array([[[5, 6, 8, 0]]])          # differs at position 3
      fuzz_check.check_case(group, report, 'hand', bit_exact, **case,
                       greedy=np.array([[[5, 6, 7, 0]]]),
                       g_scores=np.zeros((1, 1)), speed=speed,
                       s_scores=np.zeros((1, 1)), stats=stats,
                       fwd_argmax=np.array([[5, 6, 7, 0]]), fwd_top2=top2)
      self.assertEqual(report.speed_mismatches, 1)
      return report

    tie = check(1e-6, bit_exact=False)
    self.assertEqual((tie.near_ties, tie.real_bugs), (1, 0))
    self.assertIn('position 3', tie.ties[0])
    self.assertEqual(check(0.5, bit_exact=False).real_bugs, 1)
    # Where both loops run on the row-independent kernel, a tie is no excuse.
    self.assertEqual(check(1e-6, bit_exact=True).real_bugs, 1)


if __name__ == '__main__':
  absltest.main()
