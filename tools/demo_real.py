"""SPEED on models that learned real text, in one command (`make demo-real`).

    python -m tools.demo_real [--prompts 16] [--out demo_real_out]

1. reads the committed model of the paper table (MODELS_DIR: the shared
   4x3, its SentencePiece vocabulary and a manifest with its recipe,
   quality, data hashes and commit);
2. rebuilds the gettext English->French test and long splits from this
   machine's catalogs (`tools.gettext_data`; nothing is downloaded) and says
   whether the catalogs are those the models were trained on (the hash of
   the rebuilt training split against the manifest's); it runs either way;
3. decodes held-out test sentences with greedy and SPEED on the 4x3 and
   checks the outputs identical; reports BLEU on them, sample
   translations, the exits' flip rates and SPEED's loop steps per token;
4. times decoding at batch 1 at the trained width, SPEED against greedy;
5. replays the 4x3's SPEED schedules on a T5-Base-width 4x3 (768 wide,
   vocabulary 32128; `tools.replay`) against greedy there and against
   greedy on its first repetition (what an unshared 4-layer model costs,
   decoding the same tokens), for short outputs and for the long split's,
   on the CPU kernels' path (--xla_baseline: also XLA's, the faster of the
   two counting; `make bench` times both);
6. writes results.json to --out and exits 1 if any output differs.

`--export OUT_DIR` writes the model from the paper table's runs in OUT_DIR
(`make paper-table`, at the table's default settings) into --models_dir.
"""

import time

_START = time.perf_counter()  # the wall time includes the imports

# pylint: disable=g-import-not-at-top,g-bad-import-order
import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, Optional

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

import seqio

from t5x_speed import network
from t5x_speed.cpu import build
from tools import common
from tools import gettext_data
from tools import paper_table
from tools import paper_table_data
from tools import paper_table_eval
from tools import paper_table_train
# pylint: enable=g-import-not-at-top,g-bad-import-order

MODELS_DIR = common.MODELS_DIR


def from_json(cls, fields: Dict[str, Any]):
  """A settings dataclass from its `dataclasses.asdict` read back from
  JSON (whose lists were tuples)."""
  return cls(**{k: tuple(v) if isinstance(v, list) else v
                for k, v in fields.items()})


_digest = common.file_digest


def export(out_dir: str, models_dir: str = MODELS_DIR,
           settings: paper_table.TableSettings = paper_table.TableSettings(),
           shared: str = '4x3', data_dir: Optional[str] = None
           ) -> Dict[str, Any]:
  """Copies the table's `shared` run (first seed, paper loss) from
  `out_dir` into `models_dir` with the vocabulary and a manifest; the
  table's data is `data_dir`, by default its own gettext set."""
  data_dir = data_dir or os.path.join(out_dir, 'data')
  with open(os.path.join(out_dir, 'paper_table.json')) as f:
    table = {(r['config'], r['seed'], r['exit_agreement']): r
             for r in json.load(f)['runs']}
  os.makedirs(models_dir, exist_ok=True)
  manifest = {
      'settings': dataclasses.asdict(settings), 'shared': shared,
      'commit': subprocess.run(['git', 'rev-parse', 'HEAD'], text=True,
                               capture_output=True).stdout.strip(),
      'data': {'train.tsv': _digest(os.path.join(data_dir, 'train.tsv')),
               'spm.model': _digest(os.path.join(data_dir, 'spm.model')),
               'gettext': dataclasses.asdict(gettext_data.Settings())},
      'models': {}}
  shutil.copy(os.path.join(data_dir, 'spm.model'),
              os.path.join(models_dir, 'spm.model'))
  vocab_size = seqio.SentencePieceVocabulary(
      os.path.join(data_dir, 'spm.model')).vocab_size
  config = paper_table.model_config(shared, settings, vocab_size)
  key = paper_table_train.run_key(
      shared, config, paper_table.recipe(settings, settings.seeds[0]),
      'library', settings.batch_size, settings.lengths, data_dir)
  path = os.path.join(models_dir, f'{shared}.msgpack')
  shutil.copy(os.path.join(out_dir, 'runs', key, 'params.msgpack'), path)
  row = table[(shared, settings.seeds[0], 0.0)]
  manifest['models'][shared] = {
      'config': json.loads(json.dumps(dataclasses.asdict(config),
                                      default=str)), 'run': key,
      'sha256': _digest(path),
      'validation_loss': row['validation'][-1]['loss'][-1],
      'test_bleu': row['bleu'], 'test_chrf': row['chrf']}
  with open(os.path.join(models_dir, 'manifest.json'), 'w') as f:
    json.dump(manifest, f, indent=1)
  return manifest


def rebuild_data(data_dir: str, models_dir: str, manifest: Dict[str, Any]
                 ) -> bool:
  """Writes the gettext splits of this machine's catalogs and the models'
  vocabulary into `data_dir`; True if its training split is the one the
  models were trained on."""
  os.makedirs(data_dir, exist_ok=True)
  splits, _ = gettext_data.build_pairs(
      from_json(gettext_data.Settings, manifest['data']['gettext']))
  for name, pairs in splits.items():
    gettext_data.write_split(data_dir, name, pairs)
  shutil.copy(os.path.join(models_dir, 'spm.model'),
              os.path.join(data_dir, 'spm.model'))
  return _digest(os.path.join(data_dir, 'train.tsv')) == manifest['data'][
      'train.tsv']


@dataclasses.dataclass(frozen=True)
class Committed:
  """The committed models with the data they were trained on, rebuilt.

  Attributes:
    models_dir: where the models and their manifest are.
    manifest: the manifest (`export`).
    settings: the paper table's settings the models were trained with.
    vocab: their SentencePiece vocabulary.
    same_data: whether this machine's catalogs gave the training split the
      models were trained on.
  """

  models_dir: str
  manifest: Dict[str, Any]
  settings: paper_table.TableSettings
  vocab: Any
  same_data: bool

  def model(self, name: Optional[str] = None):
    """(module, params) of the model `name` of the manifest (default: the
    shared model the table exported)."""
    name = name or self.manifest['shared']
    config = from_json(network.TransformerConfig,
                        self.manifest['models'][name]['config'])
    params = paper_table_train.load_params(
        os.path.join(self.models_dir, f'{name}.msgpack'))
    return paper_table_train.module_of(config), params


def load_committed(models_dir: str, out: str) -> Committed:
  """Reads the manifest in `models_dir`, rebuilds the data into
  `<out>/data` and registers the table's task over it."""
  with open(os.path.join(models_dir, 'manifest.json')) as f:
    manifest = json.load(f)
  settings = from_json(paper_table.TableSettings, manifest['settings'])
  data_dir = os.path.join(out, 'data')
  same_data = rebuild_data(data_dir, models_dir, manifest)
  paper_table_data.prepare_data(out, settings.vocab_size, data_dir,
                                lambda _: None)
  vocab = seqio.get_mixture_or_task(paper_table_data.TASK).output_features[
      'targets'].vocabulary
  return Committed(models_dir, manifest, settings, vocab, same_data)


def run(args) -> Dict[str, Any]:
  """The demo's measurements (see the module docstring)."""
  committed = load_committed(args.models_dir, args.out)
  manifest, settings, vocab = (committed.manifest, committed.settings,
                               committed.vocab)
  same_data = committed.same_data
  shared = manifest['shared']
  module, params = committed.model()
  short = paper_table_data.test_prompts(args.prompts, settings.lengths)
  long = paper_table_data.test_prompts(args.long_prompts,
                                       settings.long_lengths,
                                       paper_table_data.LONG)
  results = {'same_data': same_data, 'manifest': manifest,
             'cpu': common.cpu_model(),
             'quality': paper_table_eval.decode_quality(
                 module, params, *short, vocab, settings.targets_length)}
  prompts, lengths, _ = short
  timed = slice(0, args.timed_prompts)
  (results['latency_ms_per_token'],
   results['latency_load_average']) = paper_table_eval.latency(
      {f'greedy {shared}': (module, params, 'greedy'),
       f'SPEED {shared}': (module, params, 'speed')},
      prompts[timed], lengths[timed], settings.targets_length, args.repeats)
  # On a CPU with the kernels built, XLA's dot is the slower path in every
  # bench row: the demo times it only when asked (or when it is the only
  # path); `make bench` times both.
  xla_twins = args.xla_baseline or not build.available()
  results['replay_paths'] = ('kernel and XLA' if xla_twins and
                             build.available() else
                             'kernel' if build.available() else 'XLA')
  results['replay'] = {'short': paper_table_eval.replay_speedup(
      module, params, prompts[timed], lengths[timed],
      settings.targets_length, args.replay_width, args.repeats, xla_twins)}
  results['long'] = paper_table_eval.decode_quality(
      module, params, *long, vocab, settings.long_length)
  results['replay']['long'] = paper_table_eval.replay_speedup(
      module, params, long[0][:1], long[1][:1], settings.long_length,
      args.replay_width, args.repeats, xla_twins)
  results['wall_seconds'] = time.perf_counter() - _START
  return results


def report(results: Dict[str, Any]) -> str:
  """The demo's printout."""
  q, lat, rp = results['quality'], results['latency_ms_per_token'], results[
      'replay']
  sp = q['speed']
  manifest = results['manifest']
  shared = manifest['shared']
  model = manifest['models'][shared]
  lines = [
      f'Model: {shared} trained on gettext en->fr (test BLEU '
      f'{model["test_bleu"]:.1f}, chrF {model["test_chrf"]:.1f}; '
      'manifest.json).',
      'Data: ' + ('the catalogs the model was trained on.'
                  if results['same_data'] else
                  'these catalogs differ from those the model was trained '
                  'on; held-out sentences may have been seen in training.'),
      f'{len(results["quality"]["examples"])} of the translations:']
  lines += [f'  {e["prediction"]!r}  (reference {e["reference"]!r})'
            for e in q['examples']]
  lines += [
      f'SPEED == greedy on {shared}: {sp["identical_to_greedy"]} (short), '
      f'{results["long"]["speed"]["identical_to_greedy"]} (long); '
      f'BLEU {q["bleu"]:.1f} on these prompts.',
      'Flip rate per stage (2..R): ' + ', '.join(
          f'{100 * v:.1f}%' for v in sp['flip_rate'].values()) +
      f'; SPEED loop steps per token {sp["steps_per_token"]:.2f} '
      f'(long outputs {results["long"]["speed"]["steps_per_token"]:.2f}).',
      'Batch 1, width {}, ms/token: '.format(
          results['manifest']['settings']['width']) + ', '.join(
              f'{k} {v:.2f}' for k, v in lat.items()) +
      f' (one-minute load average {results["latency_load_average"]:.1f}: '
      'timings beside other work are not the model\'s).',
      f'Replayed at width {rp["short"]["width"]}'
      f'{" (T5-Base)" if rp["short"]["width"] == 768 else ""}: SPEED '
      f'{rp["short"]["speedup"]:.2f}x the best greedy (long output: '
      f'{rp["long"]["speedup"]:.2f}x), at {rp["short"]["vs_shallow"]:.2f}x '
      'the latency of greedy on an unshared model of its G layers '
      f'({rp["long"]["vs_shallow"]:.2f}x long), the baselines timed on the '
      f'{results.get("replay_paths", "kernel and XLA")} path; identical: '
      f'{rp["short"]["identical"] and rp["long"]["identical"]}.',
      f'Wall time {results["wall_seconds"]:.0f} s on {results["cpu"]}.']
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m tools.demo_real', description=__doc__,
      formatter_class=common.HelpFormatter)
  parser.add_argument('--out', default='demo_real_out')
  parser.add_argument('--models_dir', default=MODELS_DIR,
                      help='the models and their manifest.')
  parser.add_argument('--prompts', type=int, default=64,
                      help='held-out test sentences decoded.')
  parser.add_argument('--long_prompts', type=int, default=4,
                      help='long-split sentences decoded.')
  parser.add_argument('--timed_prompts', type=int, default=8,
                      help='of them, those timed and replayed at batch 1.')
  parser.add_argument('--repeats', type=int, default=2,
                      help='timed passes of every method (after a warm-up); '
                      'the best counts.')
  parser.add_argument('--replay_width', type=int, default=768)
  parser.add_argument('--xla_baseline', action='store_true',
                      help='also time the replay\'s greedy baselines with '
                      'XLA\'s dot (slower than the kernels on every CPU '
                      'measured; timed anyway where they are not built).')
  parser.add_argument('--export', metavar='OUT_DIR', default=None,
                      help='write the models from a paper table out_dir.')
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.export:
    print(json.dumps(export(args.export, args.models_dir), indent=1))
    return 0
  os.makedirs(args.out, exist_ok=True)
  results = run(args)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  print(report(results))
  exact = (results['quality']['speed']['identical_to_greedy'] and
           results['long']['speed']['identical_to_greedy'] and
           all(r['identical'] for r in results['replay'].values()))
  if not exact:
    print('ERROR: SPEED and greedy outputs differ.', file=sys.stderr)
  return 0 if exact else 1


if __name__ == '__main__':
  sys.exit(main())
