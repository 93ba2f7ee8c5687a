"""Training-schedule helpers for finetuning from a pretrained checkpoint.

T5X's learning-rate functions see the global step, which a finetuning run
restores from its initial checkpoint (524,288 after the paper's pretraining).
A warmup written as `constant * linear_warmup` would then be over before the
first finetuning step; `step_offset = checkpoint_step(path)` makes it count
from the restored step instead. An optax optimizer started from a fresh
state counts its own steps: `warmup_cosine` (gin/runs/finetune_agree.gin,
the tools' trainer) schedules its rate from them.
"""

import os
import re
from typing import Dict

import optax

__all__ = ['checkpoint_step', 'total_steps', 'warmup_cosine',
           'warmup_cosine_settings']

_CHECKPOINT_DIR = re.compile(r'^checkpoint_(\d+)$')


def checkpoint_step(checkpoint_path: str) -> int:
  """The training step of a T5X checkpoint, from its `checkpoint_<step>` name.

  Args:
    checkpoint_path: a T5X checkpoint directory (T5X names them
      `checkpoint_<step>`), optionally with a trailing slash.

  Returns:
    The step, e.g.

    >>> checkpoint_step('/tmp/speed_4x3/checkpoint_524288')
    524288

  Raises:
    ValueError: if the path is not a single `checkpoint_<step>` directory.
  """
  if not isinstance(checkpoint_path, (str, os.PathLike)):
    raise ValueError(
        'checkpoint_step needs one checkpoint path (INITIAL_CHECKPOINT_PATH), '
        f'got {checkpoint_path!r}; bind the learning-rate step_offset '
        'yourself, e.g. --gin.utils.create_learning_rate_scheduler.'
        'step_offset=524288.')
  name = os.path.basename(os.path.normpath(os.fspath(checkpoint_path)))
  match = _CHECKPOINT_DIR.match(name)
  if not match:
    raise ValueError(
        f'Cannot tell the step of checkpoint {str(checkpoint_path)!r}: T5X '
        "names checkpoints 'checkpoint_<step>'. Point INITIAL_CHECKPOINT_PATH "
        'at such a directory, or bind the step the warmup should count from: '
        '--gin.utils.create_learning_rate_scheduler.step_offset=<step>.')
  return int(match.group(1))


def total_steps(checkpoint_path: str, finetune_steps: int) -> int:
  """The step a finetuning run ends at: the checkpoint's step plus
  `finetune_steps`.

  Unlike T5X's `relative_steps` (counted from whatever checkpoint a restarted
  job resumes from), this total stays the same when a preempted run restarts
  from its own latest checkpoint.

  Args:
    checkpoint_path: the pretrained `checkpoint_<step>` directory the run
      starts from (INITIAL_CHECKPOINT_PATH).
    finetune_steps: how many steps to finetune, > 0.

  Returns:
    The total, e.g. `total_steps('/ckpt/checkpoint_524288', 262144)` is
    786432.
  """
  if isinstance(finetune_steps, bool) or not isinstance(finetune_steps, int) \
      or finetune_steps <= 0:
    raise ValueError(f'finetune_steps must be a positive int, got '
                     f'{finetune_steps!r}.')
  return checkpoint_step(checkpoint_path) + finetune_steps


def warmup_cosine_settings(learning_rate: float, steps: int
                           ) -> Dict[str, float]:
  """`optax.warmup_cosine_decay_schedule`'s arguments for `steps` steps
  peaking at `learning_rate`: a linear warmup from 0 over the first tenth,
  then cosine decay to a twentieth of the peak at the last step.

  >>> warmup_cosine_settings(1e-3, 300)  # doctest: +NORMALIZE_WHITESPACE
  {'init_value': 0.0, 'peak_value': 0.001, 'warmup_steps': 30,
   'decay_steps': 300, 'end_value': 5e-05}
  """
  return {'init_value': 0.0, 'peak_value': learning_rate,
          'warmup_steps': max(steps // 10, 1), 'decay_steps': steps,
          'end_value': learning_rate / 20}


def warmup_cosine(learning_rate: float, steps: int) -> optax.Schedule:
  """The optax schedule of `warmup_cosine_settings`."""
  return optax.warmup_cosine_decay_schedule(
      **warmup_cosine_settings(learning_rate, steps))
