"""The demo model: a small shared decoder trained on `speed_demo_numbers`.

Shared by `tools.demo` (the main job) and the benches' replay
(`tools.replay`): builds the model, trains it with the weighted early-exit
loss (optax, no T5X), saves and reloads its parameters, and reads held-out
prompts, all through seqio. seqio and TensorFlow load on first use of the
task, so that a replay of saved schedules (`tools.bench --records`) runs
where neither is installed.
"""

import dataclasses
import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import network
from tools import common
from tools import trainer

# `t5x_speed.tasks.DEMO_TASK` and `DEMO_SEQUENCE_LENGTH`, which import
# TensorFlow (tests/tools/test_demo.py checks they agree).
TASK = 'speed_demo_numbers'
LENGTHS = {'inputs': 24, 'targets': 112}
VOCAB_SIZE = 384  # the byte vocabulary's 259 ids, rounded up to 128


@dataclasses.dataclass(frozen=True)
class DemoSettings:
  """What the demo model is: architecture and training recipe."""

  num_unique_layers: int = 2
  num_repeats: int = 3
  width: int = 64
  # On this task many small steps learn more per example than few large
  # ones: four packed sequences per step reach the exits' consistency of
  # sixteen with about half the computation.
  steps: int = 1200
  batch_size: int = 4
  learning_rate: float = 5e-3
  seed: int = 0

  def config(self, num_repeats: Optional[int] = None
             ) -> network.TransformerConfig:
    return network.TransformerConfig(
        vocab_size=VOCAB_SIZE, emb_dim=self.width, num_heads=4,
        head_dim=self.width // 4, mlp_dim=2 * self.width,
        num_unique_layers=self.num_unique_layers,
        num_repeats=num_repeats or self.num_repeats, dtype='float32')

  @property
  def name(self) -> str:
    """Names the saved model: every setting that changes it."""
    return (f'numbers_{self.num_unique_layers}x{self.num_repeats}_w'
            f'{self.width}_s{self.steps}_b{self.batch_size}_lr'
            f'{self.learning_rate:g}_seed{self.seed}')


# The demo models whose SPEED schedules the benches replay (`tools.replay`):
# their recipe is fixed, so that a bench's replayed schedules stay those of
# its recorded results whatever the demo's defaults.
REPLAY_STEPS = 600
REPLAY_BATCH_SIZE = 16
REPLAY_LEARNING_RATE = 5e-3


def replay_settings(repeats: int, steps: int = REPLAY_STEPS) -> DemoSettings:
  """The replayed demo model with `repeats` stages: max(6 // repeats, 1)
  unique layers, trained `steps` steps."""
  return DemoSettings(num_unique_layers=max(6 // repeats, 1),
                      num_repeats=repeats, steps=steps,
                      batch_size=REPLAY_BATCH_SIZE,
                      learning_rate=REPLAY_LEARNING_RATE)


def wide_config(g: int, r: int, width: int, dtype: str = 'float32',
                vocab_size: int = VOCAB_SIZE) -> network.TransformerConfig:
  """A GxR model at `width` (64-wide heads, MLP 8/3 of the width), for
  replaying a demo model's schedule at T5-Base width (768); the demo's
  vocabulary by default."""
  return network.TransformerConfig(
      vocab_size=vocab_size, emb_dim=width, num_heads=max(width // 64, 1),
      head_dim=min(64, width), mlp_dim=width * 8 // 3 // 64 * 64 or width,
      num_unique_layers=g, num_repeats=r, dtype=dtype)


def parse_gxr(text: str) -> Tuple[int, int]:
  """'2x3' -> (2, 3)."""
  try:
    g, r = (int(x) for x in text.lower().split('x'))
  except ValueError:
    raise ValueError(f'config must look like GxR, e.g. 2x3; got {text!r}.'
                     ) from None
  if g < 1 or r < 1:
    raise ValueError(f'config {text!r}: G and R must be >= 1.')
  return g, r


def task():
  """The registered demo task (imports seqio and `t5x_speed.tasks`)."""
  import seqio  # pylint: disable=g-import-not-at-top
  import t5x_speed.tasks  # pylint: disable=g-import-not-at-top,unused-import
  return seqio.get_mixture_or_task(TASK)


def _batches(split: str, batch_size: int, pack: bool, shuffle: bool,
             seed: int):
  import seqio  # pylint: disable=g-import-not-at-top
  ds = task().get_dataset(LENGTHS, split=split, shuffle=shuffle, seed=seed)
  ds = seqio.DecoderFeatureConverter(pack=pack)(ds, LENGTHS)
  return ds.batch(batch_size, drop_remainder=True).prefetch(2)


def train(settings: DemoSettings, progress_bar: bool = True
          ) -> Tuple[Any, List[Dict]]:
  """Trains the demo model; returns (params, history of logged metrics).

  `progress_bar`: show the steps, losses and flip rates on stderr.
  """
  module = network.SpeedTransformer(settings.config())
  batches = _batches('train', settings.batch_size, pack=True, shuffle=True,
                     seed=settings.seed).as_numpy_iterator()
  return trainer.train(module, batches, trainer.Recipe(
      steps=settings.steps, learning_rate=settings.learning_rate,
      seed=settings.seed), progress_bar)


def load_or_train(settings: DemoSettings, out_dir: str, retrain: bool = False,
                  log=print, progress_bar: bool = True) -> Tuple[Any, Dict]:
  """Parameters from `out_dir` if saved with the same settings, else trains.

  Returns (params, metadata with the training history and time, and
  'loaded': whether the parameters were reloaded).
  """
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, settings.name + '.msgpack')
  meta_path = os.path.join(out_dir, settings.name + '.json')
  module = network.SpeedTransformer(settings.config())
  template = jax.eval_shape(lambda: module.init(
      jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
      jnp.ones((1, 4), jnp.int32), enable_dropout=False)['params'])
  if not retrain and os.path.exists(path) and os.path.exists(meta_path):
    with open(path, 'rb') as f:
      # On the device once: NumPy leaves would be copied there on every
      # decode call.
      params = jax.device_put(flax.serialization.from_bytes(template,
                                                            f.read()))
    with open(meta_path) as f:
      meta = json.load(f)
    log(f'Loaded the trained model from {path} (trained before with the '
        'same settings; delete it to train again).')
    return params, {**meta, 'loaded': True}
  log(f'Training {settings.num_unique_layers}x{settings.num_repeats} model '
      f'(width {settings.width}) for {settings.steps} steps on {TASK}...')
  start = time.time()
  params, history = train(settings, progress_bar)
  meta = {'settings': dataclasses.asdict(settings), 'history': history,
          'train_seconds': time.time() - start}
  with open(path, 'wb') as f:
    f.write(flax.serialization.to_bytes(params))
  with open(meta_path, 'w') as f:
    json.dump(meta, f, indent=1)
  log(f'Saved parameters to {path}.')
  return params, {**meta, 'loaded': False}


def held_out(count: int, split: str = 'validation', min_numbers: int = 1,
             max_numbers: int = 2):
  """Held-out (prompt tokens, target text) pairs of `min..max_numbers`.

  Returns (prompts [count, P] right-padded, lengths [count], targets).
  """
  demo_task = task()
  vocab = demo_task.output_features['targets'].vocabulary
  prompts, targets = [], []
  examples = demo_task.get_dataset(LENGTHS, split=split, shuffle=False)
  for ex in examples.as_numpy_iterator():
    text = ex['inputs_pretokenized'].decode()
    numbers = text.count(',') + 1
    if min_numbers <= numbers <= max_numbers:
      prompts.append(ex['inputs'])
      targets.append(vocab.decode(ex['targets'].tolist()))
    if len(prompts) == count:
      break
  width = max(len(p) for p in prompts)
  padded = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  return padded, np.array([len(p) for p in prompts], np.int32), targets


def exact_match(produced, targets: List[str]) -> float:
  """The share of decoded rows (token ids, EOS-terminated) whose text is
  the target's."""
  vocab = task().output_features['targets'].vocabulary
  texts = [vocab.decode(common.tokens_until_eos(row)) for row in produced]
  return float(np.mean([p == t for p, t in zip(texts, targets)]))


def exit_consistency(settings: DemoSettings, params, examples: int = 256
                     ) -> Dict[str, np.ndarray]:
  """`trainer.exit_consistency` over `examples` held-out examples."""
  batches = _batches('validation', 32, pack=False, shuffle=False, seed=0)
  return trainer.exit_consistency(
      network.SpeedTransformer(settings.config()), params,
      batches.take(max(examples // 32, 1)).as_numpy_iterator())
