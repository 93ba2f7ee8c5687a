"""The suite's split into shards (`make test TEST_SHARD=K/N`)."""

import os
import pathlib
import subprocess
import sys

from absl.testing import absltest

import helpers
import sharding

TESTS = pathlib.Path(__file__).resolve().parent


def _modules():
  return sorted(p.name for p in [*TESTS.glob('test_*.py'),
                                 *TESTS.glob('tools/test_*.py')])


class ShardingTest(absltest.TestCase):

  def test_docstring_example(self):
    helpers.assert_doctests(sharding)

  def test_every_module_is_measured_and_named_once(self):
    modules = _modules()
    self.assertLen(set(modules), len(modules))   # names are keys
    missing = set(modules) - set(sharding.MODULE_SECONDS)
    self.assertFalse(missing, f'add their measured seconds: {missing}')
    self.assertFalse(set(sharding.MODULE_SECONDS) - set(modules))
    for group in sharding.TOGETHER:
      self.assertLessEqual(set(group), set(modules))

  def test_every_module_in_exactly_one_shard(self):
    modules = _modules()
    for num_shards in (1, 2, 3, 4):
      shards = sharding.assign(reversed(modules), num_shards)
      self.assertEqual(sorted(shards), modules)
      self.assertEqual(set(shards.values()), set(range(1, num_shards + 1)))
      self.assertEqual(shards, sharding.assign(modules, num_shards))
      for group in sharding.TOGETHER:
        self.assertLen({shards[name] for name in group}, 1, group)
    # Two shards of the measured suite: neither over 52% of its cost.
    shards = sharding.assign(modules, 2)
    cost = [sum(sharding.MODULE_SECONDS[m] for m in modules if shards[m] == k)
            for k in (1, 2)]
    self.assertLess(max(cost) / sum(cost), 0.52, cost)

  def test_assign_by_hand(self):
    cost = {'a': 10, 'b': 6, 'c': 5, 'd': 4, 'x': 3}
    self.assertEqual(sharding.assign('abcd', 2, cost),
                     {'a': 1, 'b': 2, 'c': 2, 'd': 1})
    # An unmeasured module weighs 1 and goes where the least cost is.
    self.assertEqual(sharding.assign('ab?', 2, cost),
                     {'a': 1, 'b': 2, '?': 2})
    self.assertEqual(sharding.assign('a', 3, cost), {'a': 1})

  def test_parse_shard(self):
    self.assertEqual(sharding.parse_shard('2/3'), (2, 3))
    self.assertEqual(sharding.parse_shard(' 1 / 1 '), (1, 1))
    for bad in ('0/2', '3/2', '1', 'a/b', '1/0', '-1/2', ''):
      with self.assertRaisesRegex(ValueError, r'--shard must be K/N'):
        sharding.parse_shard(bad)

  def test_pytest_runs_only_its_shard(self):
    # Collection only (nothing runs): the two shards' tests are disjoint
    # and together every test of these modules; a bad --shard stops pytest
    # with a usage error that names it.
    files = ['test_sharding.py', 'test_decode_params.py']

    def collected(*args):
      proc = subprocess.run(
          [sys.executable, '-m', 'pytest', '-q', '--collect-only',
           '-p', 'no:cacheprovider', *files, *args], cwd=TESTS,
          capture_output=True, text=True, env=dict(
              os.environ, T5X_SPEED_REQUIRE_ALL_TESTS='0'))
      return proc, {line for line in proc.stdout.splitlines()
                    if '::' in line}

    _, every = collected()
    _, first = collected('--shard', '1/2')
    _, second = collected('--shard', '2/2')
    self.assertNotEmpty(first)
    self.assertNotEmpty(second)
    self.assertFalse(first & second)
    self.assertEqual(first | second, every)
    proc, _ = collected('--shard', '3/2')
    self.assertEqual(proc.returncode, 4, proc.stdout + proc.stderr)
    self.assertIn('--shard must be K/N', proc.stderr)


if __name__ == '__main__':
  absltest.main()
