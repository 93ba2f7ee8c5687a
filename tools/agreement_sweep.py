"""The agreement sweep: which short fine-tune lowers a trained model's flips,
and what it costs in quality (docs/real_data.md).

    python -m tools.agreement_sweep [--out agree_out] [--replay]
                                    [--settings 0,3] [--steps N] [--quiet]

Fine-tunes the committed 4x3 (`tools.demo_real`'s models) with every
setting of SWEEP (`tools.finetune_agree`: the whole model with the agreement
term at several λ, targets and rates, its control without the term, and
exit adapters of several ranks trained alone), measures each and the
original model alike, and writes `<out>/agreement_sweep.{json,md,png}`:
test BLEU / chrF, the final exit's loss, each exit's accuracy and flip rate
(teacher-forced), SPEED's loop steps per token and the steps its flushes
cost, on test and long-split prompts, and the trade-off plot (steps lost to
flips against BLEU). The reference of a whole-model setting is the control,
that of an adapter setting the original model (its output is unchanged).
Runs are kept in `<out>/runs/`; a rerun only adds what is missing.

`--replay` adds each run's SPEED schedules replayed at T5-Base width
(`finetune_agree.replay`): timings, so run it with nothing else on the
machine, after the fine-tunes.
"""

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

# pylint: disable=g-import-not-at-top
from t5x_speed.cpu import build
from tools import common
from tools import demo_real
from tools import finetune_agree
from tools import paper_table_data
from tools.finetune_agree import Setting
# pylint: enable=g-import-not-at-top

CONTROL = Setting('model', 0.0, 'argmax', 3e-4)
SWEEP = (
    CONTROL,
    Setting('model', 0.3, 'argmax', 3e-4),
    Setting('model', 1.0, 'argmax', 3e-4),
    Setting('model', 3.0, 'argmax', 1e-4),
    Setting('model', 1.0, 'distribution', 3e-4),
    Setting('adapters', 1.0, 'argmax', 1e-3, rank=0),
    Setting('adapters', 1.0, 'argmax', 1e-3, rank=16),
    Setting('adapters', 1.0, 'distribution', 1e-3, rank=16),
    Setting('adapters', 10.0, 'argmax', 3e-3, rank=128),
)
ORIGINAL = 'original'
# A setting is worth adopting where it cuts the steps lost to flips by this
# share at test BLEU within BLEU_TOLERANCE of its reference.
TARGET_CUT = 0.3
BLEU_TOLERANCE = 0.5


def original_record(committed: demo_real.Committed, out: str
                    ) -> Dict[str, Any]:
  """The committed model's own measures, kept in `<out>/runs/original`."""
  path = os.path.join(out, 'runs', ORIGINAL, 'record.json')
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  module, params = committed.model()
  record = {'name': ORIGINAL, 'setting': None,
            'measures': finetune_agree.measure(module, params, committed)}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(record, f, indent=1)
  return record


def add_replay(committed: demo_real.Committed, out: str,
               setting: Optional[Setting]) -> None:
  """Adds the Base-width replay to a kept run's record (the original model's
  for `setting` None), unless it has one."""
  if setting is None:
    path = os.path.join(out, 'runs', ORIGINAL, 'record.json')
    module, params = committed.model()
  else:
    module, params, _ = finetune_agree.load_run(out, setting)
    path = os.path.join(finetune_agree.run_dir(out, setting), 'record.json')
  with open(path) as f:
    record = json.load(f)
  if 'replay' in record:
    return
  # The kernels' path alone where they are built (XLA's dot is the slower
  # path on every CPU the bench measured): the runs differ in their
  # schedules, not in their numerics.
  record['replay'] = finetune_agree.replay(module, params, committed,
                                           xla_twins=not build.available())
  with open(path + '.tmp', 'w') as f:
    json.dump(record, f, indent=1)
  os.replace(path + '.tmp', path)


def _reference(record, records) -> Dict[str, Any]:
  """The record a run is judged against: the control for whole-model runs,
  the original model for adapters and for the control itself."""
  setting = record['setting']
  if setting and setting['route'] == 'model' and setting['exit_agreement']:
    return records.get(CONTROL.name, records[ORIGINAL])
  return records[ORIGINAL]


def judge(records: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
  """Per run: its cut of the steps lost to flips (short outputs) and its
  BLEU change, against its reference (`_reference`), and whether it meets
  the adoption bar (TARGET_CUT at BLEU within BLEU_TOLERANCE)."""
  out = {}
  for name, record in records.items():
    ref = _reference(record, records)['measures']
    m = record['measures']
    lost, ref_lost = (x['speed']['steps_lost_per_token'] for x in (m, ref))
    cut = 1 - lost / ref_lost
    bleu = m['bleu'] - ref['bleu']
    out[name] = {'cut': cut, 'bleu_change': bleu,
                 'adopt': bool(cut >= TARGET_CUT and bleu >= -BLEU_TOLERANCE)}
  return out


def _pct(values) -> str:
  return ' / '.join(f'{100 * v:.1f}' for v in values)


def _replayed(record, split) -> str:
  rp = record.get('replay', {}).get(split)
  if not rp:
    return '-'
  return f'{rp["speedup"]:.2f}x ({rp["vs_shallow"]:.2f}x)'


def markdown(results: Dict[str, Any]) -> str:
  """The sweep's table and conditions."""
  records, verdicts = results['records'], results['verdicts']
  lines = [
      '| run | test BLEU / chrF | final-exit loss | exit accuracy % | '
      'flips % (stage 2 / 3) | steps / token (long) | steps lost to flips '
      '/ token (long) | cut vs reference | BLEU vs reference | Base-width '
      'SPEED vs best greedy (vs 4L) | long |',
      '|' + ' --- |' * 11]
  for name, record in records.items():
    m, v = record['measures'], verdicts[name]
    c, long = m['consistency'], m.get('long', {}).get('speed', {})
    lines.append(
        f'| {name} | {m["bleu"]:.1f} / {m["chrf"]:.1f} | {c["loss"][-1]:.3f} '
        f'| {_pct(c["accuracy"])} | {_pct(c["flip_rate"][1:])} | '
        f'{m["speed"]["steps_per_token"]:.3f} '
        f'({long.get("steps_per_token", float("nan")):.3f}) | '
        f'{m["speed"]["steps_lost_per_token"]:.3f} '
        f'({long.get("steps_lost_per_token", float("nan")):.3f}) | '
        f'{100 * v["cut"]:+.0f}% | {v["bleu_change"]:+.1f} | '
        f'{_replayed(record, "test")} | '
        f'{_replayed(record, paper_table_data.LONG)} |')
  best = results['recommended']
  lines += ['', results['conditions'], '',
            f'Recommended: {best}' if best else
            f'No setting cuts the steps lost to flips by '
            f'{100 * TARGET_CUT:.0f}% at test BLEU within {BLEU_TOLERANCE} '
            'of its reference.']
  return '\n'.join(lines)


def recommended(records, verdicts) -> Optional[str]:
  """The run with the largest cut among those within the BLEU tolerance
  of their reference and cutting at all; None if none does."""
  fit = [n for n, v in verdicts.items() if n != ORIGINAL and v['cut'] > 0 and
         v['bleu_change'] >= -BLEU_TOLERANCE]
  return max(fit, key=lambda n: verdicts[n]['cut'], default=None)


def plot(results: Dict[str, Any], path: str) -> None:
  """Steps lost to flips per token against test BLEU, one point a run, on
  test prompts and on the long split."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
  for ax, split in zip(axes, ('test', 'long')):
    for name, record in results['records'].items():
      m, setting = record['measures'], record['setting']
      speed = (m if split == 'test' else m.get('long', {})).get('speed')
      if speed is None:
        continue
      style = ('ks' if setting is None else
               'o' if setting['route'] == 'model' else '^')
      ax.plot(speed['steps_lost_per_token'], m['bleu'], style, label=name)
    ax.set_xlabel(f'SPEED loop steps lost to flips per token ({split} '
                  'prompts)')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('test BLEU')
  axes[1].legend(fontsize=7, loc='best')
  fig.suptitle('Exits trained to agree: steps lost to flips vs quality '
               '(circles: whole model, triangles: exit adapters)')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def conditions(committed: demo_real.Committed, settings: List[Setting]
               ) -> str:
  table = committed.settings
  steps = sorted({s.steps for s in settings})
  shared = committed.manifest['shared']
  return (f'From the committed {shared} (width {table.width}, test BLEU '
          f'{committed.manifest["models"][shared]["test_bleu"]:.1f}), '
          f'{"/".join(map(str, steps))} fine-tuning steps of '
          f'{table.batch_size} packed sequences, AdamW from a fresh state, '
          f'float32, on {common.cpu_model()}. Test BLEU / chrF and SPEED on '
          f'the first {table.test_examples} test pairs, long split on '
          f'{table.long_examples}; teacher-forced exits on '
          f'{table.consistency_examples} test examples; steps lost to flips '
          '= SPEED\'s loop steps - tokens - (R - 1) per sequence. Replay: '
          f'batch 1, {table.latency_prompts} test and '
          f'{table.long_replay_prompts} long prompts at width '
          f'{table.replay_width}, best of {table.repeats} passes, greedy '
          'and the G-layer model on the '
          f'{"kernel" if build.available() else "XLA"} path.' +
          ('' if committed.same_data else
           ' The catalogs differ from those the model was trained on.'))


def report(committed, out: str, settings: List[Setting]) -> Dict[str, Any]:
  """Collects the kept records, judges them, writes the report files."""
  records = {ORIGINAL: original_record(committed, out)}
  for setting in settings:
    kept = finetune_agree.load_run(out, setting)
    if kept is not None:
      records[setting.name] = kept[2]
  verdicts = judge(records)
  results = {'records': records, 'verdicts': verdicts,
             'recommended': recommended(records, verdicts),
             'conditions': conditions(committed, settings),
             'cpu': common.cpu_model(),
             'sweep': [dataclasses.asdict(s) for s in settings]}
  with open(os.path.join(out, 'agreement_sweep.json'), 'w') as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out, 'agreement_sweep.md'), 'w') as f:
    f.write(markdown(results) + '\n')
  plot(results, os.path.join(out, 'agreement_sweep.png'))
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m tools.agreement_sweep',
                                   description=__doc__,
                                   formatter_class=common.HelpFormatter)
  parser.add_argument('--out', default='agree_out')
  parser.add_argument('--models_dir', default=demo_real.MODELS_DIR)
  parser.add_argument('--settings', default='',
                      help='comma-separated indices into SWEEP (default: '
                      'all).')
  parser.add_argument('--steps', type=int, default=0,
                      help='fine-tuning steps of every setting instead of '
                      'its own (0: its own; a smoke run).')
  parser.add_argument('--replay', action='store_true',
                      help='add the Base-width replay to every kept run '
                      '(timings: nothing else running).')
  common.add_quiet_flag(parser)
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  settings = ([SWEEP[int(i)] for i in args.settings.split(',')]
              if args.settings else list(SWEEP))
  if args.steps:
    settings = [dataclasses.replace(s, steps=args.steps) for s in settings]
  progress = common.Progress('agreement-sweep', len(settings) + 1,
                             quiet=args.quiet)
  committed = demo_real.load_committed(args.models_dir, args.out)
  progress.log('measuring the original model')
  original_record(committed, args.out)
  progress.advance()
  for setting in settings:
    record = finetune_agree.run_setting(committed, setting, args.out,
                                        progress)
    print(finetune_agree.summary_line(record), flush=True)
    progress.advance()
  if args.replay:
    for setting in [None] + settings:
      progress.log(f'replaying {setting.name if setting else ORIGINAL} at '
                   'Base width')
      add_replay(committed, args.out, setting)
  results = report(committed, args.out, settings)
  print(markdown(results))
  exact = all(r['measures']['speed']['identical_to_greedy'] and r[
      'measures'].get('long', r['measures'])['speed']['identical_to_greedy']
              for r in results['records'].values())
  return 0 if exact else 1


if __name__ == '__main__':
  sys.exit(main())
