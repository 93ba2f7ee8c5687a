"""Exits trained to agree: a short fine-tune of a trained SPEED model that
aims to lower its flips, and what it did.

    python -m tools.finetune_agree [--route model|adapters]
        [--exit_agreement 1] [--target argmax] [--learning_rate 3e-4]
        [--steps 300] [--rank 16] [--models_dir figures/real_data/models]
        [--out agree_out]

Starts from a model the paper table exported (`tools.demo_real`'s
MODELS_DIR by default: the committed 4x3), rebuilds the data it was trained
on, fine-tunes it for `--steps` steps of the table's training batches with
AdamW from a fresh state (the trainer's schedule: warmup over a tenth of the
steps, cosine decay to a twentieth of `--learning_rate`) on the paper's loss
plus λ times the exits' agreement term (`losses.exit_agreement`, target
'argmax' or 'distribution'), by one of two routes:

  model     every parameter trains. The term reaches the final exit through
            the shared layers, so quality may move: watch the final exit's
            loss and BLEU against the control (λ = 0, same steps and rate).
  adapters  exit adapters of rank `--rank` (`t5x_speed.exit_adapters`) are
            added to the early exits and train alone; every other parameter
            is frozen, so the final exit, and with it the output of greedy
            and SPEED, stays bit for bit the original model's.

It then measures the result (`measure`): test BLEU / chrF, each exit's
teacher-forced loss, accuracy and flip rate, SPEED's loop steps per token on
test and long-split prompts and the steps its flips cost, and writes
`<out>/runs/<setting>/{params.msgpack,record.json}`; a rerun reuses them.
`tools.agreement_sweep` runs a grid of settings with this and reports the
trade-off. Under stock `t5x.train` the same fine-tune is
`t5x_speed/gin/runs/finetune_agree.gin`.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, Optional, Tuple

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

# pylint: disable=g-import-not-at-top
from t5x_speed import exit_adapters
from t5x_speed import losses
from t5x_speed import network
from tools import common
from tools import demo_real
from tools import paper_table_data
from tools import paper_table_eval
from tools import paper_table_train
from tools import trainer
# pylint: enable=g-import-not-at-top

ROUTES = ('model', 'adapters')


@dataclasses.dataclass(frozen=True)
class Setting:
  """One fine-tune: how it trains (see the module docstring).

  Attributes:
    route: 'model' (every parameter trains) or 'adapters' (exit adapters
      alone).
    exit_agreement: λ of the agreement term; 0 with route 'model' is the
      control.
    target: the term's target, 'argmax' or 'distribution'.
    learning_rate: AdamW's peak rate.
    steps: fine-tuning steps of the table's batch size.
    rank: the adapters' rank (route 'adapters'; 0: per-exit scales only).
    seed: the shuffle of the training batches.
  """

  route: str = 'model'
  exit_agreement: float = 1.0
  target: str = 'argmax'
  learning_rate: float = 3e-4
  steps: int = 300
  rank: int = 16
  seed: int = 1

  def __post_init__(self):
    if self.route not in ROUTES:
      raise ValueError(f'route must be one of {ROUTES}, got {self.route!r}.')
    losses.check_exit_agreement(self.exit_agreement, self.target)
    exit_adapters.check_exit_adapter_rank(self.rank, 'rank')
    if self.route == 'adapters' and not self.exit_agreement:
      raise ValueError('route adapters needs exit_agreement > 0: the '
                       'adapters train on the agreement term.')
    if self.steps < 1 or self.learning_rate <= 0:
      raise ValueError('steps must be >= 1 and learning_rate > 0, got '
                       f'{self.steps} and {self.learning_rate}.')

  @property
  def name(self) -> str:
    """A readable, unique directory name, e.g. 'adapters16_argmax1_lr1e-03
    _300steps_seed1'."""
    route = (f'adapters{self.rank}' if self.route == 'adapters' else
             'model')
    term = (f'{self.target}{self.exit_agreement:g}' if self.exit_agreement
            else 'control')
    return (f'{route}_{term}_lr{self.learning_rate:.0e}_{self.steps}steps_'
            f'seed{self.seed}')

  @property
  def adapter_rank(self) -> Optional[int]:
    return self.rank if self.route == 'adapters' else None


def finetune(committed: demo_real.Committed, setting: Setting,
             quiet: bool = False) -> Tuple[Any, Any, Dict[str, Any]]:
  """(module, params, {'history', 'train_seconds'}) of `setting` applied to
  the committed shared model."""
  base, params = committed.model()
  config = dataclasses.replace(base.config,
                               exit_adapter_rank=setting.adapter_rank)
  module = paper_table_train.module_of(config)
  table = committed.settings
  batches = paper_table_data.batches(
      'train', table.lengths, table.batch_size, pack=True, shuffle=True,
      seed=setting.seed).as_numpy_iterator()
  recipe = trainer.Recipe(
      steps=setting.steps, learning_rate=setting.learning_rate,
      exit_agreement=setting.exit_agreement,
      exit_agreement_target=setting.target)
  start = time.perf_counter()
  params, history = trainer.train(
      module, batches, recipe, progress_bar=not quiet, desc=setting.name,
      init_params=params,
      trainable=(exit_adapters.is_adapter_param
                 if setting.route == 'adapters' else None))
  return module, params, {'history': history,
                          'train_seconds': time.perf_counter() - start}


def steps_lost_per_token(speed: Dict[str, Any], sequences: int,
                         stages: int) -> float:
  """Loop steps per token that flushes cost: a sequence of n tokens takes
  n + R - 1 steps without a flush (the pipeline's fill), so the rest of
  SPEED's steps are the flips'.

  >>> steps_lost_per_token({'steps_per_token': 1.5, 'tokens': 40}, 4, 3)
  0.3
  """
  fill = (stages - 1) * sequences / speed['tokens']
  return round(speed['steps_per_token'] - 1 - fill, 12)


def measure(module, params, committed: demo_real.Committed,
            test_examples: Optional[int] = None,
            long_examples: Optional[int] = None) -> Dict[str, Any]:
  """What a fine-tune did: test BLEU / chrF and SPEED's statistics (SPEED
  checked equal to greedy), each exit's teacher-forced loss, accuracy and
  flip rate on the test split, and SPEED on the long split; the table's
  sizes unless given."""
  table = committed.settings
  stages = module.config.num_repeats
  test = paper_table_data.test_prompts(test_examples or table.test_examples,
                                       table.lengths)
  out = paper_table_eval.decode_quality(module, params, *test,
                                        committed.vocab, table.targets_length)
  out['speed']['steps_lost_per_token'] = steps_lost_per_token(
      out['speed'], len(test[0]), stages)
  out['consistency'] = paper_table_eval.teacher_forced(
      module, params, 'test', table.consistency_examples, table.lengths)
  if paper_table_data.has_long_split():
    long = paper_table_data.test_prompts(
        long_examples or table.long_examples, table.long_lengths,
        paper_table_data.LONG)
    out['long'] = paper_table_eval.decode_quality(
        module, params, *long, committed.vocab, table.long_length)
    out['long']['speed']['steps_lost_per_token'] = steps_lost_per_token(
        out['long']['speed'], len(long[0]), stages)
  return out


def replay(module, params, committed: demo_real.Committed,
           xla_twins: bool = True) -> Dict[str, Any]:
  """SPEED's schedules on the table's replay prompts (test and long)
  replayed at its replay width (T5-Base), against the best greedy and the
  unshared G-layer model there (`paper_table_eval.replay_speedup`; without
  `xla_twins`, on the kernels' path alone)."""
  table = committed.settings
  out = {}
  for split, count, length, lengths in (
      ('test', table.latency_prompts, table.targets_length, table.lengths),
      (paper_table_data.LONG, table.long_replay_prompts, table.long_length,
       table.long_lengths)):
    prompts, prompt_lengths, _ = paper_table_data.test_prompts(
        count, lengths, split)
    out[split] = paper_table_eval.replay_speedup(
        module, params, prompts, prompt_lengths, length, table.replay_width,
        table.repeats, xla_twins)
  return out


def run_dir(out: str, setting: Setting) -> str:
  return os.path.join(out, 'runs', setting.name)


def load_run(out: str, setting: Setting):
  """(module, params, record) of a run kept in `out`, or None."""
  path = run_dir(out, setting)
  if not os.path.exists(os.path.join(path, 'record.json')):
    return None
  with open(os.path.join(path, 'record.json')) as f:
    record = json.load(f)
  config = demo_real.from_json(network.TransformerConfig, record['config'])
  return (paper_table_train.module_of(config), paper_table_train.load_params(
      os.path.join(path, 'params.msgpack')), record)


def save_run(out: str, setting: Setting, module, params,
             record: Dict[str, Any]) -> None:
  """Parameters first, the record last: a run is complete once its record
  exists."""
  path = run_dir(out, setting)
  os.makedirs(path, exist_ok=True)
  paper_table_train.save_params(os.path.join(path, 'params.msgpack'), params)
  record = {'setting': dataclasses.asdict(setting), 'name': setting.name,
            'config': json.loads(json.dumps(dataclasses.asdict(
                module.config), default=str)), **record}
  with open(os.path.join(path, 'record.json.tmp'), 'w') as f:
    json.dump(record, f, indent=1)
  os.replace(os.path.join(path, 'record.json.tmp'),
             os.path.join(path, 'record.json'))


def run_setting(committed: demo_real.Committed, setting: Setting, out: str,
                progress: common.Progress) -> Dict[str, Any]:
  """The record of `setting`: read back from `out`, or fine-tuned, measured
  and kept there."""
  kept = load_run(out, setting)
  if kept is not None:
    progress.log(f'{setting.name}: fine-tuned earlier')
    return kept[2]
  progress.log(f'{setting.name}: fine-tuning {setting.steps} steps')
  module, params, record = finetune(committed, setting, progress.quiet)
  progress.log(f'{setting.name}: measuring')
  record['measures'] = measure(module, params, committed)
  save_run(out, setting, module, params, record)
  return load_run(out, setting)[2]


def summary_line(record: Dict[str, Any]) -> str:
  """One line of what a run gave."""
  m = record['measures']
  flips = ' / '.join(f'{100 * f:.1f}%'
                     for f in m['consistency']['flip_rate'][1:])
  return (f'{record["name"]}: test BLEU {m["bleu"]:.1f}, final-exit loss '
          f'{m["consistency"]["loss"][-1]:.3f}, flips {flips}, steps per '
          f'token {m["speed"]["steps_per_token"]:.3f} (long '
          f'{m.get("long", m)["speed"]["steps_per_token"]:.3f}), SPEED == '
          f'greedy: {m["speed"]["identical_to_greedy"]}')


def _flags(argv):
  defaults = Setting()
  parser = argparse.ArgumentParser(prog='python -m tools.finetune_agree',
                                   description=__doc__,
                                   formatter_class=common.HelpFormatter)
  parser.add_argument('--route', default=defaults.route, choices=ROUTES)
  parser.add_argument('--exit_agreement', type=float,
                      default=defaults.exit_agreement,
                      help='λ of the agreement term (0: the control).')
  parser.add_argument('--target', default=defaults.target,
                      choices=losses.AGREEMENT_TARGETS)
  parser.add_argument('--learning_rate', type=float,
                      default=defaults.learning_rate)
  parser.add_argument('--steps', type=int, default=defaults.steps)
  parser.add_argument('--rank', type=int, default=defaults.rank,
                      help='the exit adapters\' rank (route adapters).')
  parser.add_argument('--seed', type=int, default=defaults.seed,
                      help='shuffle of the training batches.')
  parser.add_argument('--models_dir', default=demo_real.MODELS_DIR)
  parser.add_argument('--out', default='agree_out')
  common.add_quiet_flag(parser)
  args = parser.parse_args(argv)
  try:
    setting = Setting(args.route, args.exit_agreement, args.target,
                      args.learning_rate, args.steps, args.rank, args.seed)
  except ValueError as e:
    parser.error(str(e))
  return args, setting


def main(argv=None) -> int:
  args, setting = _flags(sys.argv[1:] if argv is None else argv)
  progress = common.Progress('finetune-agree', 0, quiet=args.quiet)
  committed = demo_real.load_committed(args.models_dir, args.out)
  record = run_setting(committed, setting, args.out, progress)
  print(summary_line(record))
  print(f'Kept in {run_dir(args.out, setting)}.')
  return 0 if record['measures']['speed']['identical_to_greedy'] else 1


if __name__ == '__main__':
  sys.exit(main())
