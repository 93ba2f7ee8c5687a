"""The paper table's data: the gettext set or your TSVs, as one seqio task.

`prepare_data` builds the gettext set of a language pair once (English to
the language of the system's catalogs, `tools.gettext_data`) or checks a
directory of your own, and registers TASK over it with the pair's T5
prompt (and its `long` split, where `long.tsv` exists: long outputs, a test
set); `batches` and `test_prompts` read it back.

Example:
  data_dir = prepare_data('paper_table_out', 2000, None, print, ('en', 'de'))
  prompts, lengths, references = test_prompts(8, {'inputs': 64,
                                                   'targets': 64})
"""

import functools
import json
import os
from typing import Dict, Optional, Tuple

import numpy as np
import seqio
import tensorflow as tf

from t5x_speed import tasks
from t5x_speed.tasks import preprocessors
from tools import gettext_data

TASK = 'speed_paper_table_translation'
GETTEXT_LANGUAGES = ('en', 'fr')
LONG = gettext_data.LONG_SPLIT


def check_languages(codes: Tuple[str, ...], where: str) -> Tuple[str, str]:
  """`codes` if they are two different known codes, else an error naming
  `where` they came from."""
  if len(codes) != 2 or codes[0] == codes[1]:
    raise ValueError(f'{where}: expected two different codes, source and '
                     f'target (e.g. en,de), got {",".join(codes)!r}.')
  unknown = [c for c in codes if c not in preprocessors.LANGUAGE_NAMES]
  if unknown:
    raise ValueError(f'{where}: unknown code(s) {unknown}; known: '
                     f'{",".join(sorted(preprocessors.LANGUAGE_NAMES))}.')
  return codes


def parse_languages(text: str) -> Tuple[str, str]:
  """('en', 'de') from `--languages en,de`; a clear error otherwise."""
  return check_languages(tuple(c.strip() for c in text.split(',')),
                         '--languages')


def data_languages(data_dir: Optional[str], languages: Optional[str]
                   ) -> Tuple[str, str]:
  """The (source, target) codes of the table's data: `--languages`, else
  `<data_dir>/languages.json`, else the gettext set's en->fr."""
  if languages is not None:
    return parse_languages(languages)
  if data_dir is None:
    return GETTEXT_LANGUAGES
  found = gettext_data.read_languages(data_dir)
  if found is None:
    raise ValueError(f'--data_dir {data_dir} has no '
                     f'{gettext_data.LANGUAGES_FILE}: pass --languages '
                     'SRC,TGT (e.g. en,de) to name its columns.')
  return check_languages(found, os.path.join(data_dir,
                                            gettext_data.LANGUAGES_FILE))


def prepare_data(out_dir: str, vocab_size: int, data_dir: Optional[str], log,
                 languages: Tuple[str, str] = GETTEXT_LANGUAGES,
                 vocabulary: Optional[str] = None) -> str:
  """The data directory: `data_dir`, or the gettext set of `languages`
  (English to a catalog language) built once into `<out_dir>/data`, its
  vocabulary trained there or copied from `vocabulary`.
  Registers TASK over it with `languages`' prompt."""
  if data_dir is None:
    if languages[0] != 'en':
      raise ValueError(f'--languages {",".join(languages)}: the gettext set '
                       'translates from English (its catalogs\' msgids); '
                       'pass --data_dir for other source languages.')
    data_dir = os.path.join(out_dir, 'data')
    stats = os.path.join(data_dir, 'stats.json')
    built = None
    if os.path.exists(stats):
      with open(stats) as f:
        meta = json.load(f)
      built = (meta.get('vocab_size'), meta['settings'].get('language'),
               meta.get('format'), meta.get('vocabulary'))
    if built != (vocab_size, languages[1], gettext_data.FORMAT,
                 gettext_data.vocabulary_digest(vocabulary)):
      log(f'building the gettext {"->".join(languages)} set')
      counts = gettext_data.build(
          data_dir, gettext_data.Settings(language=languages[1]),
          vocab_size=vocab_size, vocabulary=vocabulary)
      log(f'{counts["kept"]} pairs kept of {counts["read"]} read: '
          f'{counts["train"]} / {counts["validation"]} / {counts["test"]}, '
          f'and {counts[LONG]} long')
  spm = os.path.join(data_dir, 'spm.model')
  for name in ('train.tsv', 'test.tsv', 'spm.model'):
    if not os.path.exists(os.path.join(data_dir, name)):
      raise FileNotFoundError(f'--data_dir {data_dir} has no {name}.')
  splits = gettext_data.SPLITS + (
      (LONG,) if os.path.exists(os.path.join(data_dir, f'{LONG}.tsv')) else ())
  tasks.register_translation_tsv_task(TASK, data_dir, spm,
                                      languages=languages, splits=splits)
  return data_dir


def has_long_split() -> bool:
  """Whether the registered TASK has the long split."""
  return LONG in seqio.get_mixture_or_task(TASK).splits


def batches(split: str, lengths: Dict[str, int], batch_size: int,
            pack: bool, shuffle: bool, seed: int = 0,
            encoder_decoder: bool = False) -> tf.data.Dataset:
  """TASK's `split` as decoder-only batches (`DecoderFeatureConverter`) or
  as an encoder-decoder model's (`EncDecFeatureConverter`); shuffled
  batches repeat forever."""
  task = seqio.get_mixture_or_task(TASK)
  ds = task.get_dataset(lengths, split=split, shuffle=shuffle,
                        seed=seed, num_epochs=None if shuffle else 1)
  converter = (seqio.EncDecFeatureConverter if encoder_decoder
               else seqio.DecoderFeatureConverter)
  ds = converter(pack=pack)(ds, lengths)
  return ds.batch(batch_size, drop_remainder=shuffle).prefetch(2)


def eval_batches(split: str, lengths: Dict[str, int], batch_size: int,
                 count: int, encoder_decoder: bool = False):
  """The first `count` unpacked, unshuffled batches of `split` (`batches`),
  as numpy: read once per registered task, then reused by every evaluation
  (each validation point, the int8 model's)."""
  return _eval_batches(seqio.get_mixture_or_task(TASK), split,
                       tuple(sorted(lengths.items())), batch_size, count,
                       encoder_decoder)


@functools.lru_cache(maxsize=16)
def _eval_batches(task, split, lengths, batch_size, count, encoder_decoder):
  del task  # the cache key: a task registered again is read again
  return tuple(batches(split, dict(lengths), batch_size, pack=False,
                       shuffle=False, encoder_decoder=encoder_decoder
                       ).take(count).as_numpy_iterator())


def test_prompts(count: int, lengths: Dict[str, int], split: str = 'test'):
  """The first `count` examples of `split`: (prompts [count,
  inputs_length] right-padded, lengths [count], reference texts)."""
  task = seqio.get_mixture_or_task(TASK)
  prompts = np.zeros((count, lengths['inputs']), np.int32)
  prompt_lengths, refs = [], []
  for ex in task.get_dataset(lengths, split=split,
                             shuffle=False).take(count).as_numpy_iterator():
    prompts[len(refs), :len(ex['inputs'])] = ex['inputs']
    prompt_lengths.append(len(ex['inputs']))
    refs.append(ex['targets_pretokenized'].decode())
  return prompts[:len(refs)], np.array(prompt_lengths, np.int32), refs
