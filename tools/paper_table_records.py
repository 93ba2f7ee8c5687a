"""The paper table's runs as records, and the table assembled from them.

Each finished run of `tools.paper_table` writes one self-contained record,
`<records_dir>/<config>_seed<seed>[_agree<λ>].json`: the run, its model's
architecture, the recipe (training and evaluation settings), the digests
of the data and vocabulary, the commit and host it ran on, and everything
measured (validation curve, test quality, exits, int8, SPEED, replay,
latency). The project's records are committed under RECORDS_DIR as each
run finishes, so runs trained on different machines and days form one
table: `assemble` builds the report's results from them, refuses records
of different recipes or data, and names the rows still missing.

Example:
  python -m tools.paper_table_records --out figures/real_data
  python -m tools.paper_table_records --from_results \\
      paper_table_out/paper_table.json --data_dir paper_table_out/data
"""

import argparse
import dataclasses
import glob
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tools import common
from tools import paper_table_report

RECORDS_DIR = os.path.join(os.path.dirname(common.MODELS_DIR), 'runs')
RECORD_VERSION = 1
DATA_FILES = ('train.tsv', 'validation.tsv', 'test.tsv', 'long.tsv',
              'spm.model')
# The rows of the paper's table (config, seed, agreement λ).
TABLE_ROWS = (('12L', 0, 0.0), ('4L', 0, 0.0), ('2L', 0, 0.0),
              ('4x3', 0, 0.0), ('4x3', 1, 0.0), ('2x6', 0, 0.0),
              ('ed4x3', 0, 0.0), ('ed4L', 0, 0.0))
# Settings that say which runs a table trains, not how each run is trained
# or measured.
_RUN_LIST_FIELDS = ('configs', 'seeds', 'sweep_configs', 'exit_agreements')


def record_name(config: str, seed: int, agreement: float) -> str:
  """'4x3_seed1', '4x3_seed0_agree0.1'."""
  return f'{config}_seed{seed}' + (f'_agree{agreement:g}' if agreement
                                   else '')


def recipe_of(settings: Dict[str, Any]) -> Dict[str, Any]:
  """The settings every row of one table shares (`TableSettings` as a
  dict, without the list of runs)."""
  return {k: v for k, v in sorted(settings.items())
          if k not in _RUN_LIST_FIELDS}


def data_digests(data_dir: str) -> Dict[str, str]:
  """sha256 of each data file present of DATA_FILES."""
  out = {}
  for name in DATA_FILES:
    path = os.path.join(data_dir, name)
    if os.path.exists(path):
      out[name] = common.file_digest(path)
  return out


def make_record(row: Dict[str, Any], results: Dict[str, Any],
                model: Dict[str, Any], data: Dict[str, str],
                commit: str) -> Dict[str, Any]:
  """The record of one run: `row` as `tools.paper_table` measured it, in
  the table `results` (its settings, host and latency), `model` its
  architecture (`network.TransformerConfig` as a dict)."""
  name = row['config']
  # Timed with the run, or (tables written before runs were timed each
  # alone) in the table's latency pass.
  latency = row.get('latency_ms_per_token') or {
      k: v for k, v in results.get('latency_ms_per_token', {}).items()
      if k.partition(' ')[2] == name}
  load = row.get('latency_load_average', results.get('latency_load_average'))
  # Dtypes as their names: a record is plain JSON.
  model = json.loads(json.dumps(model, default=str))
  return {
      'record_version': RECORD_VERSION,
      'run': {'config': name, 'seed': row['seed'],
              'exit_agreement': row['exit_agreement']},
      'model': model,
      'encoder_layers': (results.get('encoder_layers')
                         if name.startswith('ed') else None),
      'recipe': recipe_of(results['settings']),
      'trainer': results.get('trainer', 'library'),
      'data': {'gettext': results.get('gettext', True),
               'languages': results.get('languages', ['en', 'fr']),
               'files': data},
      # The code and host that measured the run, and those that trained it.
      'commit': commit,
      'host': {'cpu': results['cpu'], 'cores': results.get('cores'),
               'devices': results.get('devices')},
      'trained_on': row.get('trained_on') or {'commit': commit,
                                              'cpu': results['cpu'],
                                              'devices':
                                                  results.get('devices')},
      'row': {**{k: v for k, v in row.items() if k != 'trained_on'},
              'latency_ms_per_token': latency,
              'latency_load_average': load},
  }


def write_record(record: Dict[str, Any], records_dir: str) -> str:
  """Writes `record` as `<records_dir>/<record_name>.json`; returns the
  path."""
  os.makedirs(records_dir, exist_ok=True)
  run = record['run']
  path = os.path.join(records_dir, record_name(
      run['config'], run['seed'], run['exit_agreement']) + '.json')
  with open(path + '.tmp', 'w') as f:
    json.dump(record, f, indent=1)
  os.replace(path + '.tmp', path)
  return path


def load_records(records_dir: str = RECORDS_DIR) -> List[Dict[str, Any]]:
  """The records in `records_dir`, each with its 'path'; a record of
  another RECORD_VERSION is an error."""
  records = []
  for path in sorted(glob.glob(os.path.join(records_dir, '*.json'))):
    with open(path) as f:
      record = json.load(f)
    if record.get('record_version') != RECORD_VERSION:
      raise ValueError(f'{path}: record version '
                       f'{record.get("record_version")}, not '
                       f'{RECORD_VERSION}.')
    record['path'] = path
    records.append(record)
  return records


def _differences(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
  """The keys whose values differ between `a` and `b`."""
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _where(record: Dict[str, Any]) -> str:
  """The record's file, or its name where it was not read from one."""
  run = record['run']
  return record.get('path') or record_name(run['config'], run['seed'],
                                           run['exit_agreement'])


def assemble(records: Sequence[Dict[str, Any]],
             planned: Sequence[Tuple[str, int, float]] = TABLE_ROWS
             ) -> Dict[str, Any]:
  """The report's results (`paper_table_report`) from `records`.

  Raises ValueError if two records differ in recipe, data, languages or
  trainer; 'missing' lists the `planned` rows without a record.
  """
  if not records:
    raise ValueError('no records to assemble.')
  first = records[0]
  for record in records[1:]:
    for part in ('recipe', 'data', 'trainer'):
      if record[part] != first[part]:
        detail = (_differences(record[part], first[part])
                  if isinstance(record[part], dict) else [part])
        raise ValueError(
            f'{_where(record)} and {_where(first)} differ in {part} '
            f'({", ".join(map(str, detail))}): one table holds one recipe '
            'on one data set.')
  present = {(r['run']['config'], r['run']['seed'],
              r['run']['exit_agreement']) for r in records}
  order = {row: i for i, row in enumerate(planned)}
  records = sorted(records, key=lambda r: order.get(
      (r['run']['config'], r['run']['seed'], r['run']['exit_agreement']),
      len(order)))
  hosts = sorted({r['host']['cpu'] for r in records})
  seeds = sorted({r['run']['seed'] for r in records})
  latency = {}
  for r in records:
    latency.update(r['row'].get('latency_ms_per_token', {}))
  encoder = [r['encoder_layers'] for r in records if r['encoder_layers']]
  return {
      'settings': {**first['recipe'], 'seeds': seeds,
                   'configs': [r['run']['config'] for r in records]},
      'gettext': first['data']['gettext'],
      'languages': first['data']['languages'],
      'data_files': first['data']['files'],
      'trainer': first['trainer'],
      'cpu': ' and '.join(hosts),
      'cores': records[0]['host']['cores'],
      'devices': max(r['host']['devices'] or 1 for r in records),
      'encoder_layers': encoder[0] if encoder else None,
      'planned': len(planned),
      'missing': [record_name(*row) for row in planned
                  if row not in present],
      'records': [{'run': record_name(r['run']['config'], r['run']['seed'],
                                      r['run']['exit_agreement']),
                   'commit': r['commit'], 'host': r['host']['cpu'],
                   'trained_on': r['trained_on']}
                  for r in records],
      'runs': [{k: v for k, v in r['row'].items()
                if not k.startswith('latency')} for r in records],
      'latency_ms_per_token': latency,
      'latency_load_average': max(
          (r['row']['latency_load_average'] for r in records
           if r['row'].get('latency_load_average') is not None),
          default=None),
  }


def records_from_results(results: Dict[str, Any], data_dir: str,
                         commit: str, models: Dict[str, Dict[str, Any]]
                         ) -> List[Dict[str, Any]]:
  """A record per run of a table's results (`paper_table.json`); `models`:
  each config's architecture."""
  data = data_digests(data_dir)
  return [make_record(row, results, models[row['config']], data, commit)
          for row in results['runs']]


def main(argv: Optional[List[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=common.HelpFormatter)
  parser.add_argument('--records_dir', default=RECORDS_DIR)
  parser.add_argument('--out', default=os.path.dirname(RECORDS_DIR),
                      help='where paper_table.{md,json,png} go.')
  parser.add_argument('--from_results', default=None,
                      help='a paper_table.json whose runs become records '
                      '(into --records_dir) before the table is assembled.')
  parser.add_argument('--data_dir', default=None,
                      help='with --from_results: the data it trained on.')
  parser.add_argument('--commit', default=None,
                      help='with --from_results: the commit it ran on '
                      '(default: HEAD).')
  args = parser.parse_args(argv)
  if args.from_results:
    if not args.data_dir:
      parser.error('--from_results needs --data_dir.')
    from tools import paper_table  # pylint: disable=g-import-not-at-top
    with open(args.from_results) as f:
      results = json.load(f)
    settings = paper_table.TableSettings(**{
        k: tuple(v) if isinstance(v, list) else v
        for k, v in results['settings'].items()})
    vocab = results.get('vocab_size') or settings.vocab_size
    models = {row['config']: dataclasses.asdict(paper_table.model_config(
        row['config'], settings, vocab)) for row in results['runs']}
    for record in records_from_results(results, args.data_dir,
                                       args.commit or common.git_commit(), models):
      print('Wrote', write_record(record, args.records_dir))
  results = assemble(load_records(args.records_dir))
  os.makedirs(args.out, exist_ok=True)
  paths = paper_table_report.write(results, args.out)
  print(paper_table_report.markdown(results))
  print('Wrote ' + ', '.join(paths) + '.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
