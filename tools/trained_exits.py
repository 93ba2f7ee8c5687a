"""A trained model's SPEED schedules, for the bench's replay (`tools.bench
--exits trained`, its default).

The committed real-data model (`tools.demo_real`'s MODELS_DIR: the 4x3
that learned gettext en->fr) decodes held-out prompts with SPEED while its
schedule is recorded: the test split's (short outputs, median 15 tokens)
and the long split's (multi-sentence outputs, median 106 tokens, a split no
model trained on). What the model learned on those prompts (BLEU against
their references, a few outputs) goes with the records, so that a speed
measured on its exits sits beside its quality.

Imported only where schedules are recorded: it needs seqio, TensorFlow and
this machine's gettext catalogs (replaying saved `--records` needs none).
"""

import functools
from typing import Any, Dict, List, NamedTuple, Tuple

import numpy as np

from t5x_speed.tasks import metrics
from tools import common
from tools import demo_real
from tools import paper_table_data
from tools import replay

LENGTHS = ('short', 'long')
# Prompts per row group: the test split's 16 (as the demo's), and 4 of the
# long split (each decodes ~100 tokens), or one batch where that is larger.
PROMPTS = {'short': 16, 'long': 4}


class Source(NamedTuple):
  """A committed model and what the bench records from it."""
  committed: demo_real.Committed
  module: Any
  params: Any

  @property
  def name(self) -> str:
    return self.committed.manifest['shared']

  def describe(self) -> str:
    entry = self.committed.manifest['models'][self.name]
    return (f'the committed {self.name} trained on gettext en->fr (test BLEU '
            f'{entry["test_bleu"]:.1f}, width '
            f'{entry["config"]["emb_dim"]})')


@functools.lru_cache(maxsize=None)
def source(models_dir: str, out: str) -> Source:
  """The committed shared model in `models_dir`, its data rebuilt into
  `<out>/data` (`demo_real.load_committed`)."""
  committed = demo_real.load_committed(models_dir, out)
  return Source(committed, *committed.model())


def prompt_count(length: str, batch: int) -> int:
  """Prompts of a row group: PROMPTS[length], or one batch if larger."""
  return max(PROMPTS[length], batch)


def held_out(src: Source, length: str, count: int
             ) -> Tuple[np.ndarray, np.ndarray, List[str], int]:
  """(prompts, lengths, references, max_decode_steps) of the first `count`
  test prompts ('short') or long-split prompts ('long')."""
  table = src.committed.settings
  if length == 'short':
    prompts = paper_table_data.test_prompts(count, table.lengths)
    return (*prompts, table.targets_length)
  prompts = paper_table_data.test_prompts(count, table.long_lengths,
                                          paper_table_data.LONG)
  return (*prompts, table.long_length)


def record_group(src: Source, length: str, batch: int, branches: int = 0
                 ) -> List[Dict[str, Any]]:
  """The model's SPEED schedules (with `branches` candidate branches) on a
  row group's prompts in batches of `batch`; the first record also holds
  what the model learned on them."""
  if length not in LENGTHS:
    raise ValueError(f'length must be one of {LENGTHS}, got {length!r}.')
  count = prompt_count(length, batch)
  if count % batch:
    raise ValueError(f'batch size {batch} must divide the {count} {length} '
                     'prompts.')
  prompts, lengths, refs, steps = held_out(src, length, count)
  recs = [replay.record((src.module, src.params), prompts[i:i + batch],
                        lengths[i:i + batch], steps, branches)
          for i in range(0, count, batch)]
  vocab = src.committed.vocab
  texts = [vocab.decode(common.tokens_until_eos(row))
           for rec in recs for row in rec['produced']]
  recs[0]['learned'] = {
      'model': src.describe(), **metrics.bleu_and_chrf(refs, texts),
      'examples': [{'reference': r, 'prediction': t}
                   for r, t in zip(refs[:2], texts[:2])]}
  return recs
