"""Tests of the bench's command line and table; the bench itself is not run."""

import os
import subprocess
import sys

from absl.testing import absltest

from t5x_speed import bench

META = {'machine': 'test machine, 2 cores', 'jax': '0.0', 'backend': 'cpu',
        'bandwidth_gb_s': 10.0}


def _row(tokens_per_second, speed=False, **extra):
  """A `bench_case` method row with round numbers."""
  return {
      'seconds': 1.0, 'tokens': 100, 'tokens_per_second': tokens_per_second,
      'ms_per_token_per_sequence': 10.0, 'replay_consistent': True,
      'loop_steps': 100, 'steps_per_token': 1.1 if speed else 1.0,
      'rows_free_ideal_speedup': 3 / 1.1 if speed else None,
      'weight_bytes_per_token': 1e6, 'bytes_per_token': 2e6,
      'bandwidth_bound_fraction': 0.5,
      'vs_greedy_same_model': tokens_per_second / 50.0,
      'bytes_ideal_speedup': 1.0, **extra}


def _result(methods):
  return {'config': '4x3', 'batch': 1, 'length': 'short',
          'replay': {'flushes': 2, 'tokens': 100, 'steps_per_token': 1.1,
                     'flip_rate': {'flip_rate/stage_2': 0.02}},
          'methods': methods}


def _table_rows(table):
  """{method: {column: cell}} of the markdown table."""
  lines = [l for l in table.splitlines() if l.startswith('|')]
  header = [c.strip() for c in lines[0].strip('|').split('|')]
  rows = {}
  for line in lines[2:]:
    cells = dict(zip(header, (c.strip() for c in line.strip('|').split('|'))))
    rows[cells['method']] = cells
  return rows


class FlagsTest(absltest.TestCase):

  def test_every_flag_has_help_and_default(self):
    parser = bench._parser()  # pylint: disable=protected-access
    # Help text as printed, with line wrapping undone.
    text = ' '.join(parser.format_help().split())
    actions = parser._actions  # pylint: disable=protected-access
    flags = [a for a in actions if a.dest != 'help']
    self.assertLen(flags, 11)
    for action in flags:
      self.assertTrue(action.help, action.dest)
      self.assertIn(f'(default: {action.default})', text, action.dest)
    self.assertIn('(default: 4x3,2x6)', text)
    self.assertIn('(default: False)', text)

  def test_help_command(self):
    result = subprocess.run(
        [sys.executable, '-m', 't5x_speed.bench', '--help'],
        capture_output=True, text=True, check=False,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    self.assertEqual(result.returncode, 0, result.stderr)
    text = ' '.join(result.stdout.split())
    for flag in ('--configs', '--batch_sizes', '--lengths', '--repeats',
                 '--speculative_vocab', '--out', '--demo_out', '--quick'):
      self.assertIn(flag, text)
    self.assertEqual(text.count('(default: '), 11)
    # The module docstring keeps its layout.
    self.assertIn('\n  speed_short   speed_decode', result.stdout)


class MarkdownTest(absltest.TestCase):

  def test_quick_mode_has_no_nan(self):
    # --quick runs greedy and SPEED only: no G-layer baseline to compare with.
    table = bench._markdown(  # pylint: disable=protected-access
        [_result({'greedy': _row(50.0), 'speed': _row(60.0, speed=True)})],
        META)
    self.assertNotIn('nan', table.lower())
    rows = _table_rows(table)
    self.assertEqual(set(rows), {'greedy', 'speed'})
    self.assertEqual(rows['speed']['vs G-layer'], '–')
    self.assertEqual(rows['greedy']['vs G-layer'], '–')
    self.assertEqual(rows['speed']['vs greedy'], '1.20x')
    self.assertEqual(rows['speed']['rows-free ideal'], '2.73x')
    self.assertEqual(rows['greedy']['rows-free ideal'], '–')

  def test_full_mode_compares_with_g_layer_model(self):
    methods = {'greedy': _row(50.0, vs_unshared_g_layers=0.5),
               'speed': _row(60.0, speed=True, vs_unshared_g_layers=0.6),
               'greedy_g': _row(100.0, vs_unshared_g_layers=1.0)}
    # pylint: disable-next=protected-access
    table = bench._markdown([_result(methods)], META)
    rows = _table_rows(table)
    self.assertEqual({m: r['vs G-layer'] for m, r in rows.items()},
                     {'greedy': '0.50x', 'speed': '0.60x',
                      'greedy_g': '1.00x'})


if __name__ == '__main__':
  absltest.main()
