"""The paper table's run records (`tools.paper_table_records`): the
committed table is assembled from the committed records; a table refuses
records of another recipe or data set and names its missing rows; the
depth and seed sections compute what they say."""

import copy
import json
import os
import tempfile

from absl.testing import absltest

from tools import paper_table_records as records
from tools import paper_table_report

FIGURES = os.path.dirname(records.RECORDS_DIR)


def _record(config, seed=0, bleu=30.0, loss=1.5, flips=(0.0,), **changes):
  """A minimal record: what the report reads of a row."""
  validation = [{'step': 10, 'loss': [loss], 'flip_rate': list(flips)}]
  row = {'config': config, 'seed': seed, 'exit_agreement': 0.0,
         'bleu': bleu, 'chrf': bleu + 10, 'validation': validation,
         'plateau': None, 'train_positions_per_second': 1000.0,
         'consistency': {'accuracy': [0.5] * len(flips),
                         'flip_rate': list(flips),
                         'loss': [loss] * len(flips)},
         'latency_ms_per_token': {f'greedy {config}': 1.0}}
  record = {'record_version': records.RECORD_VERSION,
            'run': {'config': config, 'seed': seed, 'exit_agreement': 0.0},
            'model': {}, 'encoder_layers': None,
            'recipe': {'steps': 10, 'width': 32, 'batch_size': 4,
                       'inputs_length': 8, 'targets_length': 8,
                       'learning_rate': 0.003, 'vocab_size': 300,
                       'test_examples': 8, 'consistency_examples': 8,
                       'latency_prompts': 1, 'repeats': 1,
                       'replay_width': 64, 'validation_examples': 8,
                       'curve_examples': 8},
            'trainer': 'library',
            'data': {'gettext': True, 'languages': ['en', 'fr'],
                     'files': {'train.tsv': 'a', 'spm.model': 'b'}},
            'commit': 'c' * 40, 'host': {'cpu': 'CPU', 'cores': 2,
                                         'devices': 2},
            'trained_on': {'commit': 'd' * 40, 'cpu': 'CPU', 'devices': 2},
            'row': row}
  for key, value in changes.items():
    record[key] = value
  return record


def _written(recs):
  out = tempfile.mkdtemp()
  for r in recs:
    records.write_record(r, out)
  return records.load_records(out)


class RecordsTest(absltest.TestCase):

  def test_committed_table_is_assembled_from_the_committed_records(self):
    committed = records.load_records()
    self.assertGreaterEqual(len(committed), 3)
    results = records.assemble(committed)
    with open(os.path.join(FIGURES, 'paper_table.json')) as f:
      self.assertEqual(json.load(f), json.loads(json.dumps(results)))
    with open(os.path.join(FIGURES, 'paper_table.md')) as f:
      self.assertEqual(f.read(), paper_table_report.markdown(results) + '\n')
    for record in committed:
      self.assertLen(record['commit'].split('+')[0], 40)
      self.assertLen(record['trained_on']['commit'].split('+')[0], 40)
      self.assertCountEqual(record['data']['files'], records.DATA_FILES)

  def test_assemble_refuses_other_recipes_and_data_and_names_missing(self):
    recs = _written([_record('4L'), _record('4x3', flips=(0.0, 0.1, 0.05))])
    results = records.assemble(recs)
    self.assertEqual([r['config'] for r in results['runs']], ['4L', '4x3'])
    self.assertEqual(results['missing'], [
        '12L_seed0', '2L_seed0', '4x3_seed1', '2x6_seed0', 'ed4x3_seed0',
        'ed4L_seed0'])
    self.assertEqual(results['latency_ms_per_token'],
                     {'greedy 4L': 1.0, 'greedy 4x3': 1.0})
    text = paper_table_report.markdown(results)
    self.assertIn('Missing rows: 12L_seed0, 2L_seed0, 4x3_seed1', text)
    self.assertIn('| 4x3_seed0 | dddddddddd, CPU, 2 | cccccccccc, CPU |',
                  text)
    steps = _record('12L')
    steps['recipe'] = {**steps['recipe'], 'steps': 20}
    with self.assertRaisesRegex(ValueError, r'differ in recipe \(steps\)'):
      records.assemble(_written([_record('4L'), steps]))
    data = _record('12L')
    data['data'] = copy.deepcopy(data['data'])
    data['data']['files']['spm.model'] = 'other'
    with self.assertRaisesRegex(ValueError, 'differ in data'):
      records.assemble(_written([_record('4L'), data]))
    t5x = _record('12L', trainer='t5x')
    with self.assertRaisesRegex(ValueError, 'differ in trainer'):
      records.assemble([_record('4L'), t5x])     # records not from files
    with self.assertRaisesRegex(ValueError, 'no records'):
      records.assemble([])

  def test_depth_and_seed_sections(self):
    recs = _written([
        _record('12L', bleu=40.0, loss=1.4), _record('4L', bleu=30.0),
        _record('4x3', bleu=36.0, loss=1.46, flips=(0.0, 0.1, 0.06)),
        _record('4x3', seed=1, bleu=34.0, loss=1.48,
                flips=(0.0, 0.12, 0.08))])
    text = paper_table_report.markdown(records.assemble(recs))
    # BLEU: (36 - 30) / (40 - 30); loss: (1.46 - 1.5) / (1.4 - 1.5).
    self.assertIn('test BLEU: 4L 30.00, 4x3 36.00, 12L 40.00: the 4x3 '
                  'closes 60% of the 4L -> 12L gap', text)
    self.assertIn('closes 40% of the 4L -> 12L gap', text)
    self.assertIn('| 4x3 | 0, 1 | 36.0, 34.0 | 35.0 | 1.460, 1.480 | '
                  '8.0, 10.0 |', text)
    self.assertNotIn('| 12L | 0 |', text.split('### Seeds')[1])

  def test_record_name(self):
    self.assertEqual(records.record_name('4x3', 1, 0.0), '4x3_seed1')
    self.assertEqual(records.record_name('4x3', 0, 0.1), '4x3_seed0_agree0.1')


if __name__ == '__main__':
  absltest.main()
