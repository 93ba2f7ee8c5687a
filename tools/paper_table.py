"""The paper's comparison in miniature, on real data (`make paper-table`).

Builds the gettext English->French set (`tools.gettext_data`) unless given
one, then trains, with the same recipe, seed and steps, the configurations
of the paper's table at a CPU width (128): unshared 12, 4 and 2 layers and
shared 4x3 and 2x6, with the tools' trainer (`tools.trainer`) or, with
`--trainer t5x`, stock `t5x.train` (the same parameters either way;
`tools.paper_table_train`). Trained runs are kept under `<out_dir>/runs`,
so a rerun retrains only what changed. For each run it reports
* test BLEU and chrF of greedy decoding (SPEED's tokens on the shared
  models, checked identical to greedy's);
* each exit's teacher-forced accuracy and flip rate on the test split;
* SPEED's loop steps per token and flushes while decoding the test prompts;
and, on the test prompts one at a time (batch 1):
* decode latency of SPEED on each shared model against greedy on it and on
  the unshared models;
* the same SPEED schedules replayed at T5-Base width (768, vocabulary
  32128, float32), against the best greedy there (the faster of the few-row
  kernel and XLA's dot): the speedup at real flip rates where weights
  dominate.
Beyond the paper, the shared models are trained again with the exits'
agreement term at each weight of `--exit_agreements` (a sweep of λ), over
`--seeds`, next to the paper's loss over the same seeds: the trade-off
between flips and quality.

Results go to `<out_dir>/paper_table.{md,json,png}`; progress to stderr.
`--data_dir` points the same runner at your own translation TSVs
(`train.tsv`, `validation.tsv`, `test.tsv` and a SentencePiece `spm.model`;
see `tasks.register_translation_tsv_task`); `--languages SRC,TGT` names
their columns' languages (or a `languages.json` beside them does, as
`tools.gettext_data` writes it), and the prompt follows. Without
`--data_dir`, `--languages en,de` builds the set from the German catalogs.

Example:
  python -m tools.paper_table --out_dir paper_table_out
  python -m tools.paper_table --trainer t5x --configs 2x3 --exit_agreements 0
  python -m tools.paper_table --data_dir my_ende --languages en,de
  python -m tools.paper_table --tiny --out_dir /tmp/t   # seconds: a smoke run
"""

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import seqio

from t5x_speed import network
from t5x_speed import quantize
from tools import common
from tools import demo_model
from tools import paper_table_data
from tools import paper_table_eval
from tools import paper_table_records
from tools import paper_table_report
from tools import paper_table_train
from tools import trainer

# name: (unique layers G, repetitions R). The paper's table compares 12L,
# 4L and 2L with 4x3 and 2x6 (and 4x4, 2x8); the smaller ones are quick.
# The ed* models are encoder-decoders: one encoder (ENCODER_LAYERS) with a
# shared 4x3 decoder or an unshared 4-layer one.
CONFIGS = {'12L': (12, 1), '8L': (8, 1), '6L': (6, 1), '4L': (4, 1),
           '3L': (3, 1), '2L': (2, 1), '4x3': (4, 3), '2x6': (2, 6),
           '4x4': (4, 4), '2x8': (2, 8), '2x3': (2, 3), '3x2': (3, 2),
           'ed4x3': (4, 3), 'ed4L': (4, 1), 'ed2x3': (2, 3), 'ed2L': (2, 1)}
ENCODER_LAYERS = 4
GETTEXT = paper_table_data.GETTEXT_LANGUAGES


@dataclasses.dataclass(frozen=True)
class TableSettings:
  """The scale of the table: one recipe for every configuration."""

  configs: Tuple[str, ...] = ('12L', '4L', '2L', '4x3', '2x6')
  width: int = 128
  # Where the unshared 4L and 2L reach their validation plateau (3,000 steps
  # leave 4L and 4x3 improving by over 3%).
  steps: int = 6000
  batch_size: int = 32
  learning_rate: float = 3e-3
  inputs_length: int = 64
  targets_length: int = 64
  vocab_size: int = 2000
  seeds: Tuple[int, ...] = (0, 1)
  # The shared configurations trained at every seed and agreement weight
  # (the others at the first seed, with the paper's loss).
  sweep_configs: Tuple[str, ...] = ('4x3',)
  exit_agreements: Tuple[float, ...] = (0.1, 1.0)   # the λ swept
  exit_agreement_target: str = 'distribution'
  test_examples: int = 400      # BLEU, chrF and SPEED's statistics
  # Points of each run's validation curve (checkpoints kept), on this many
  # validation examples; the plateau is judged on the last 20% of steps.
  curve_points: int = 10
  validation_examples: int = 512
  consistency_examples: int = 1024
  latency_prompts: int = 12
  repeats: int = 3
  replay_width: int = 768
  # The learning curve: validation prompts decoded at every checkpoint.
  curve_examples: int = 128
  # The long split (inputs and targets up to `long_length` tokens): BLEU,
  # chrF and SPEED's statistics on `long_examples`, the replay on the first
  # `long_replay_prompts`.
  long_length: int = 256
  long_examples: int = 200
  long_replay_prompts: int = 4

  @property
  def lengths(self) -> Dict[str, int]:
    return {'inputs': self.inputs_length, 'targets': self.targets_length}

  @property
  def long_lengths(self) -> Dict[str, int]:
    return {'inputs': self.long_length, 'targets': self.long_length}


TINY = TableSettings(configs=('2L', '2x3', 'ed2x3'), sweep_configs=('2x3',),
                     width=32, steps=3, batch_size=4, inputs_length=24,
                     targets_length=24, vocab_size=300,
                     seeds=(0,), exit_agreements=(1.0,), test_examples=8,
                     curve_points=3, validation_examples=8,
                     consistency_examples=8, latency_prompts=2, repeats=1,
                     replay_width=64, curve_examples=8, long_length=24,
                     long_examples=8, long_replay_prompts=1)


def table_vocabulary(settings: TableSettings,
                     languages: Tuple[str, str]) -> Optional[str]:
  """The committed vocabulary of the project's table (en->fr, 2,000
  pieces), which every run of that table shares wherever it trains; None
  (trained with the data) for any other set."""
  path = os.path.join(common.MODELS_DIR, 'spm.model')
  if (tuple(languages) == GETTEXT and settings.vocab_size == 2000 and
      os.path.exists(path)):
    return path
  return None


def model_config(name: str, settings: TableSettings,
                 vocab_size: int) -> network.TransformerConfig:
  g, r = CONFIGS[name]
  config = demo_model.wide_config(g, r, settings.width, vocab_size=vocab_size)
  if name.startswith('ed'):
    config = dataclasses.replace(config, num_encoder_layers=ENCODER_LAYERS)
  return config


def recipe(settings: TableSettings, seed: int,
           agreement: float = 0.0) -> trainer.Recipe:
  """The training recipe of the run (`seed`, `agreement`) of the table."""
  return trainer.Recipe(
      steps=settings.steps, learning_rate=settings.learning_rate, seed=seed,
      exit_agreement=agreement,
      exit_agreement_target=settings.exit_agreement_target)


def runs_of(settings: TableSettings) -> List[Tuple[str, int, float]]:
  """(config, seed, agreement) of every training run: each configuration
  at the first seed; the shared ones of `sweep_configs` at every seed, with
  the paper's loss and with each agreement weight."""
  runs = [(name, settings.seeds[0], 0.0) for name in settings.configs]
  for name in settings.configs:
    if CONFIGS[name][1] > 1 and name in settings.sweep_configs:
      runs += [(name, seed, 0.0) for seed in settings.seeds[1:]]
      runs += [(name, seed, agreement)
               for agreement in settings.exit_agreements if agreement
               for seed in settings.seeds]
  return runs


def train_run(name: str, seed: int, agreement: float, settings: TableSettings,
              vocab_size: int, out_dir: str, data_dir: str,
              trainer_kind: str, progress: common.Progress, quiet: bool,
              languages: Tuple[str, str] = GETTEXT):
  """(module, params, training record) of one run (`paper_table_train`)."""
  config = model_config(name, settings, vocab_size)

  def batches(skip):
    return paper_table_data.batches(
        'train', settings.lengths, settings.batch_size, pack=True,
        shuffle=True, seed=seed, encoder_decoder=config.is_encoder_decoder
    ).skip(skip).as_numpy_iterator()
  return paper_table_train.trained_run(
      name, config, recipe(settings, seed, agreement), trainer_kind, out_dir,
      data_dir,
      paper_table_data.TASK, batches, settings.lengths, settings.batch_size,
      progress, quiet, languages,
      functools.partial(validation_point,
                        paper_table_train.module_of(config),
                        settings=settings),
      max(settings.steps // settings.curve_points, 1))


def validation_point(module, params, settings: TableSettings
                     ) -> Dict[str, List[float]]:
  """One point of a run's validation curve, on the first validation
  examples."""
  return paper_table_eval.teacher_forced(
      module, params, 'validation', settings.validation_examples,
      settings.lengths)


def plateau(validation: List[Dict[str, Any]], steps: int,
            tail: float = 0.2, threshold: float = 0.01
            ) -> Optional[Dict[str, Any]]:
  """Whether a run reached its validation plateau: the final exit's
  validation loss improved by less than `threshold` (relative) over the
  last `tail` of the steps. None without a point at or before that.

  >>> points = [{'step': s, 'loss': [9.0, l]} for s, l in
  ...           [(50, 4.0), (80, 3.02), (100, 3.0)]]
  >>> plateau(points, 100)  # doctest: +ELLIPSIS
  {'from_step': 80, 'improvement': 0.0066..., 'reached': True}
  """
  start = [p for p in validation if p['step'] <= steps * (1 - tail)]
  if not start or validation[-1]['step'] != steps:
    return None
  before, last = start[-1]['loss'][-1], validation[-1]['loss'][-1]
  improvement = (before - last) / before
  return {'from_step': start[-1]['step'], 'improvement': improvement,
          'reached': bool(improvement < threshold)}


def run(settings: TableSettings, out_dir: str, data_dir: Optional[str] = None,
        quiet: bool = False, trainer_kind: str = 'library',
        languages: Tuple[str, str] = GETTEXT,
        on_run: Optional[Callable[[Dict[str, Any]], None]] = None,
        records_dir: Optional[str] = None) -> Dict[str, Any]:
  """Builds the data, trains (with the `trainer_kind` trainer, or reads
  back runs trained earlier), evaluates and times; returns the results.
  `on_run(results)` sees the results after each run (the runs so far);
  each finished run's record (`paper_table_records`) goes to
  `records_dir`."""
  runs = runs_of(settings)
  progress = common.Progress('paper-table', total=len(runs), quiet=quiet)
  gettext = data_dir is None
  data_dir = paper_table_data.prepare_data(
      out_dir, settings.vocab_size, data_dir, progress.log, languages,
      table_vocabulary(settings, languages) if gettext else None)
  vocab = seqio.get_mixture_or_task(paper_table_data.TASK).output_features[
      'targets'].vocabulary
  data = {'test': paper_table_data.test_prompts(settings.test_examples,
                                                settings.lengths),
          'validation': paper_table_data.test_prompts(
              settings.curve_examples, settings.lengths, 'validation')}
  if paper_table_data.has_long_split():
    data['long'] = paper_table_data.test_prompts(
        settings.long_examples, settings.long_lengths, paper_table_data.LONG)
  results = {'settings': dataclasses.asdict(settings), 'data_dir': data_dir,
             'gettext': gettext, 'languages': list(languages),
             'cpu': common.cpu_model(), 'cores': os.cpu_count(),
             'devices': len(trainer.data_parallel_devices(
                 settings.batch_size)),
             'trainer': trainer_kind, 'encoder_layers': ENCODER_LAYERS,
             'planned': len(runs), 'runs': []}
  data_files = paper_table_records.data_digests(data_dir)
  commit = common.git_commit()
  prompts, lengths, _ = data['test']
  fast = slice(0, settings.latency_prompts)
  for name, seed, agreement in runs:
    module, params, record = train_run(
        name, seed, agreement, settings, vocab.vocab_size, out_dir, data_dir,
        trainer_kind, progress, quiet, languages)
    label = paper_table_train.run_label(name, seed, agreement)
    progress.log(f'evaluating {label}')
    validation = record.get('validation', [])
    row = {'config': name, 'seed': seed, 'exit_agreement': agreement,
           'train_seconds': record['train_seconds'],
           # Positions of the packed sequences (prompt and target) trained
           # on per second.
           'train_positions_per_second': (
               settings.steps * settings.batch_size *
               sum(settings.lengths.values()) / record['train_seconds']),
           'validation': validation,
           'plateau': plateau(validation, settings.steps),
           'trained_earlier': record['cached'],
           # Runs trained before records said where: unknown.
           'trained_on': record.get('trained_on'),
           'final_train': record['history'][-1],
           **measure(module, params, record, settings, data, vocab)}
    if seed == settings.seeds[0] and not agreement:
      progress.log(f'timing {label} at batch 1 on '
                   f'{settings.latency_prompts} test prompts')
      models = {f'greedy {name}': (module, params, 'greedy')}
      if module.config.num_repeats > 1:
        models[f'SPEED {name}'] = (module, params, 'speed')
      (row['latency_ms_per_token'],
       row['latency_load_average']) = paper_table_eval.latency(
           models, prompts[fast], lengths[fast], settings.targets_length,
           settings.repeats)
    results['runs'].append(row)
    if records_dir is not None:
      paper_table_records.write_record(paper_table_records.make_record(
          row, results, dataclasses.asdict(module.config), data_files,
          commit), records_dir)
    if on_run is not None:
      on_run(results)
    progress.advance()
  results['latency_ms_per_token'] = {
      k: v for row in results['runs']
      for k, v in row.get('latency_ms_per_token', {}).items()}
  results['latency_load_average'] = max(
      (row['latency_load_average'] for row in results['runs']
       if 'latency_load_average' in row), default=None)
  results['wall_seconds'] = progress.elapsed()
  return results


def measure(module, params, record: Dict[str, Any], settings: TableSettings,
            data: Dict[str, Any], vocab) -> Dict[str, Any]:
  """What the table reports of one trained model: test quality and SPEED's
  statistics, teacher-forced exits, the same with int8 weights, the
  learning curve from the run's
  checkpoints (on validation prompts), the Base-width replay, and the same
  on the long split where there is one."""
  shared = module.config.num_repeats > 1

  def replayed(split, count, length):
    prompts, lengths, _ = data[split]
    return paper_table_eval.replay_speedup(
        module, params, prompts[:count], lengths[:count], length,
        settings.replay_width, settings.repeats)
  row = paper_table_eval.decode_quality(module, params, *data['test'], vocab,
                                        settings.targets_length)
  row['consistency'] = paper_table_eval.teacher_forced(
      module, params, 'test', settings.consistency_examples, settings.lengths)
  # The same model with int8 weights (`quantize.quantize_int8`): what the
  # quantization costs in quality, and SPEED == greedy on it.
  int8 = quantize.quantize_int8(params)
  row['int8'] = paper_table_eval.decode_quality(
      module, int8, *data['test'], vocab, settings.targets_length)
  row['int8']['consistency'] = paper_table_eval.teacher_forced(
      module, int8, 'test', settings.consistency_examples, settings.lengths)
  row['curve'] = paper_table_eval.curve(
      module, record['run_dir'], [p['step'] for p in record['validation']],
      *data['validation'], vocab, settings.targets_length)
  if shared:
    row['replay'] = replayed('test', settings.latency_prompts,
                             settings.targets_length)
  if 'long' in data:
    row['long'] = paper_table_eval.decode_quality(
        module, params, *data['long'], vocab, settings.long_length)
    if shared:
      row['long']['replay'] = replayed('long', settings.long_replay_prompts,
                                       settings.long_length)
  return row


def _flags(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=common.HelpFormatter)
  defaults = TableSettings()
  parser.add_argument('--out_dir', default='paper_table_out',
                      help='where the data, results and plot go.')
  parser.add_argument('--data_dir', default=None,
                      help='your own translation TSVs and spm.model instead '
                      'of the gettext set.')
  parser.add_argument('--languages', default=None,
                      help='SRC,TGT: the language codes of the data\'s '
                      'columns, which the prompt names (default: '
                      '<data_dir>/languages.json; without --data_dir en,fr, '
                      'and en,TGT builds the gettext set of TGT).')
  parser.add_argument('--configs', default=','.join(defaults.configs),
                      help=f'comma-separated, of {sorted(CONFIGS)}.')
  parser.add_argument('--sweep_configs',
                      default=','.join(defaults.sweep_configs),
                      help='the shared configs trained at every seed and '
                      'agreement weight.')
  for field in ('width', 'steps', 'batch_size', 'test_examples',
                'latency_prompts', 'repeats', 'replay_width', 'curve_points'):
    parser.add_argument(f'--{field}', type=int,
                        default=getattr(defaults, field))
  parser.add_argument('--learning_rate', type=float,
                      default=defaults.learning_rate)
  parser.add_argument('--seeds', default=','.join(map(str, defaults.seeds)),
                      help='comma-separated training seeds.')
  parser.add_argument('--exit_agreements',
                      default=','.join(f'{a:g}' for a in
                                       defaults.exit_agreements),
                      help='comma-separated lambdas of the agreement runs; '
                      '0 alone skips them.')
  parser.add_argument('--exit_agreement_target',
                      default=defaults.exit_agreement_target,
                      choices=('distribution', 'argmax'))
  parser.add_argument('--tiny', action='store_true',
                      help='a smoke run at toy size (its figures mean '
                      'nothing); other size flags are ignored.')
  parser.add_argument('--trainer', default='library',
                      choices=paper_table_train.TRAINERS,
                      help="the tools' optax trainer, or stock t5x.train "
                      '(T5X installed): the same recipe and results.')
  parser.add_argument('--records_dir', default=None,
                      help='where each finished run\'s record goes '
                      '(default: <out_dir>/records; the project\'s table: '
                      f'{os.path.relpath(paper_table_records.RECORDS_DIR)}'
                      ', assembled by tools.paper_table_records).')
  common.add_quiet_flag(parser)
  args = parser.parse_args(argv)
  configs = tuple(c for c in args.configs.split(',') if c)
  sweep_configs = tuple(c for c in args.sweep_configs.split(',') if c)
  for flag, names in (('--configs', configs),
                      ('--sweep_configs', sweep_configs)):
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
      parser.error(f'{flag}: unknown {unknown}; choose from '
                   f'{sorted(CONFIGS)}.')
  unswept = [c for c in sweep_configs
             if c not in configs or CONFIGS[c][1] == 1]
  if unswept and not args.tiny:
    parser.error(f'--sweep_configs: {unswept} are not shared configs of '
                 f'--configs {args.configs}.')
  try:
    args.languages = paper_table_data.data_languages(args.data_dir,
                                                     args.languages)
  except ValueError as e:
    parser.error(str(e))
  if args.tiny:
    settings = TINY
  else:
    settings = dataclasses.replace(
        defaults, configs=configs, sweep_configs=sweep_configs,
        seeds=tuple(int(s) for s in args.seeds.split(',')),
        learning_rate=args.learning_rate,
        exit_agreements=tuple(float(a) for a in
                              args.exit_agreements.split(',') if a),
        exit_agreement_target=args.exit_agreement_target,
        **{f: getattr(args, f) for f in (
            'width', 'steps', 'batch_size', 'test_examples',
            'latency_prompts', 'repeats', 'replay_width', 'curve_points')})
  return args, settings


def main(argv=None) -> int:
  args, settings = _flags(sys.argv[1:] if argv is None else argv)
  # Training steps run data parallel over the cores (`trainer.train`).
  common.use_cores_as_devices()
  os.makedirs(args.out_dir, exist_ok=True)
  # Each finished run is reported at once: a long table shows its first
  # runs while the next ones train.
  results = run(settings, args.out_dir, args.data_dir, args.quiet,
                args.trainer, args.languages,
                lambda partial: paper_table_report.write(partial,
                                                         args.out_dir),
                args.records_dir or os.path.join(args.out_dir, 'records'))
  paths = paper_table_report.write(results, args.out_dir)
  print(paper_table_report.markdown(results))
  print('Wrote ' + ', '.join(paths) + '.')
  exact = all(row.get('speed', {}).get('identical_to_greedy', True) and
              row.get('replay', {}).get('identical', True) and
              row.get('long', {}).get('replay', {}).get('identical', True) and
              row.get('long', {}).get('speed', {}).get('identical_to_greedy',
                                                       True)
              for row in results['runs'])
  if not exact:
    print('ERROR: SPEED and greedy outputs differ.', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
