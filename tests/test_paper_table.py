"""`make paper-table` at a toy size: the whole pipeline runs and reports."""

import doctest
import json
import os
import tempfile

from absl.testing import absltest

from tools import common
from tools import paper_table


class PaperTableTest(absltest.TestCase):

  def test_runs_of_the_table(self):
    settings = paper_table.TableSettings(configs=('2L', '6L', '2x3'),
                                         seeds=(0, 1), exit_agreement=0.5)
    self.assertEqual(paper_table.runs_of(settings), [
        ('2L', 0, 0.0), ('6L', 0, 0.0), ('2x3', 0, 0.0), ('2x3', 1, 0.0),
        ('2x3', 0, 0.5), ('2x3', 1, 0.5)])
    no_agreement = paper_table.TableSettings(configs=('3x2',), seeds=(4,),
                                             exit_agreement=0.0)
    self.assertEqual(paper_table.runs_of(no_agreement), [('3x2', 4, 0.0)])

  def test_decoded_row_helpers(self):
    # tools.common's examples: text before EOS, tokens produced with EOS.
    result = doctest.testmod(common)
    self.assertGreaterEqual(result.attempted, 2)
    self.assertEqual(result.failed, 0)
    self.assertEqual(common.produced_count([[1, 0], [0, 0, 0]]), 4)

  def test_bad_flags_and_data_dir(self):
    with self.assertRaises(SystemExit):
      paper_table.main(['--configs', '2L,5x5', '--out_dir', '/tmp/unused'])
    with self.assertRaisesRegex(FileNotFoundError, 'has no train.tsv'):
      paper_table.prepare_data('/tmp/unused', paper_table.TINY,
                               tempfile.mkdtemp(), print)

  def test_tiny_run_writes_the_table(self):
    out = tempfile.mkdtemp()
    self.assertEqual(paper_table.main(['--tiny', '--quiet', '--out_dir', out]),
                     0)
    with open(os.path.join(out, 'paper_table.json')) as f:
      results = json.load(f)
    self.assertTrue(os.path.getsize(os.path.join(out, 'paper_table.png')))
    runs = [(r['config'], r['seed'], r['exit_agreement'])
            for r in results['runs']]
    self.assertEqual(runs, [('2L', 0, 0.0), ('2x3', 0, 0.0), ('2x3', 0, 1.0)])
    for row in results['runs']:
      self.assertBetween(row['bleu'], 0.0, 100.0)
      self.assertBetween(row['chrf'], 0.0, 100.0)
      r = paper_table.CONFIGS[row['config']][1]
      self.assertLen(row['consistency']['flip_rate'], r)
      self.assertEqual(row['final_train']['step'], 3)
      if r > 1:
        self.assertTrue(row['speed']['identical_to_greedy'])
        self.assertTrue(row['replay']['identical'])
        self.assertGreaterEqual(row['speed']['steps_per_token'], 1.0)
        self.assertGreater(row['replay']['speedup'], 0.0)
        self.assertEqual(row['replay']['width'], 64)
    self.assertIn('exit_1/agreement', results['runs'][2]['final_train'])
    self.assertNotIn('exit_1/agreement', results['runs'][1]['final_train'])
    self.assertCountEqual(results['latency_ms_per_token'],
                          ['greedy 2L', 'greedy 2x3', 'SPEED 2x3'])
    with open(os.path.join(out, 'paper_table.md')) as f:
      text = f.read()
    self.assertIn('Width 32 (64-wide heads), 3 steps of 4 packed', text)
    self.assertIn('| 2x3 | agreement λ=1 | 1 |', text)
    with open(os.path.join(out, 'data', 'stats.json')) as f:
      self.assertGreater(json.load(f)['counts']['kept'], 10000)


if __name__ == '__main__':
  absltest.main()
