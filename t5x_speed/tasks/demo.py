"""The demo task: spell numbers out in English words, generated on the fly.

`speed_demo_numbers` needs no download: each example lists one or two
numbers below 100,000 and asks for them in words, byte by byte, e.g.

  inputs:  "spell: 40723, 15"
  targets: "forty thousand seven hundred twenty-three, fifteen"

Byte-level targets make a realistic mix for early exits: most bytes continue
a word any shallow exit can finish, while word choices need the digits read
correctly, which takes depth. Validation and test numbers are disjoint from
the training numbers.
"""

import numpy as np
import seqio
import tensorflow as tf

from t5x_speed.tasks import metrics

__all__ = ['DEMO_TASK', 'DEMO_SEQUENCE_LENGTH', 'register_demo_task',
           'number_to_words', 'make_examples', 'exact_match', 'is_held_out']

DEMO_TASK = 'speed_demo_numbers'
DEMO_SEQUENCE_LENGTH = {'inputs': 24, 'targets': 112}
MAX_NUMBER = 100_000
SPLIT_SIZES = {'train': 200_000, 'validation': 2_000, 'test': 2_000}

_ONES = ('zero one two three four five six seven eight nine ten eleven twelve '
         'thirteen fourteen fifteen sixteen seventeen eighteen '
         'nineteen').split()
_TENS = ('', '', 'twenty', 'thirty', 'forty', 'fifty', 'sixty', 'seventy',
         'eighty', 'ninety')


def number_to_words(n: int) -> str:
  """English words of 0 <= n < 1,000,000.

  Example:
    >>> number_to_words(40723)
    'forty thousand seven hundred twenty-three'
  """
  if not 0 <= n < 1_000_000:
    raise ValueError(f'n must be in [0, 1000000), got {n}.')

  def below_thousand(m):
    words = []
    if m >= 100:
      words += [_ONES[m // 100], 'hundred']
      m %= 100
    if m >= 20:
      words.append(_TENS[m // 10] + (f'-{_ONES[m % 10]}' if m % 10 else ''))
    elif m:
      words.append(_ONES[m])
    return words

  if n == 0:
    return 'zero'
  words = []
  if n >= 1000:
    words += below_thousand(n // 1000) + ['thousand']
  words += below_thousand(n % 1000)
  return ' '.join(words)


def is_held_out(n: np.ndarray) -> np.ndarray:
  """One number in ten, by a multiplicative hash, is kept out of training."""
  return (np.asarray(n, np.uint64) * np.uint64(2654435761) %
          np.uint64(2**32)) % np.uint64(10) == 0


def make_examples(split: str, size: int, seed: int = 0):
  """(inputs, targets) string lists of `split`, deterministic in `seed`."""
  rng = np.random.RandomState(
      seed + {'train': 0, 'validation': 1, 'test': 2}[split])
  pool = np.arange(MAX_NUMBER)
  pool = pool[is_held_out(pool) != (split == 'train')]
  small = pool[pool < 1000]
  counts = rng.randint(1, 3, size=size)
  # Small numbers are frequent in text: draw about a third below 1000.
  draws = np.where(rng.rand(counts.sum()) < 0.3,
                   small[rng.randint(len(small), size=counts.sum())],
                   pool[rng.randint(len(pool), size=counts.sum())])
  inputs, targets = [], []
  for numbers in np.split(draws, np.cumsum(counts)[:-1]):
    inputs.append('spell: ' + ', '.join(map(str, numbers)))
    targets.append(', '.join(number_to_words(int(n)) for n in numbers))
  return inputs, targets


def _dataset_fn(split: str, shuffle_files: bool, seed=None) -> tf.data.Dataset:
  del shuffle_files, seed  # Generated in memory; seqio shuffles examples.
  inputs, targets = make_examples(split, SPLIT_SIZES[split])
  return tf.data.Dataset.from_tensor_slices({'inputs': inputs,
                                             'targets': targets})


def exact_match(targets, predictions):
  """Percentage of predictions equal to their target."""
  hits = sum(t == p for t, p in zip(targets, predictions))
  return {'exact_match': 100.0 * hits / max(len(targets), 1)}


def register_demo_task(overwrite: bool = True) -> None:
  """Registers `speed_demo_numbers` with a byte vocabulary (259 ids)."""
  vocabulary = seqio.ByteVocabulary()
  if overwrite:
    seqio.TaskRegistry.remove(DEMO_TASK)
  seqio.TaskRegistry.add(
      DEMO_TASK,
      source=seqio.FunctionDataSource(
          _dataset_fn, splits=tuple(SPLIT_SIZES),
          num_input_examples=dict(SPLIT_SIZES)),
      preprocessors=[seqio.preprocessors.tokenize,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={
          'inputs': seqio.Feature(vocabulary, add_eos=True),
          'targets': seqio.Feature(vocabulary, add_eos=True)},
      metric_fns=[metrics.with_speed_statistics(exact_match)])
