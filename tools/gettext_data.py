"""A real English->French translation set from the system's gettext catalogs.

The `fr/LC_MESSAGES/*.mo` files of the locale directory hold human
translations of the installed programs' messages (`msgid` English, `msgstr`
French). This builds them into train / validation / test TSVs, one
`english<TAB>french` pair per line, the format of the paragraph task's
`ParagraphPairSource`, and a SentencePiece vocabulary trained on the train
split. Nothing is downloaded and nothing built here is committed.

Filtering, in this order (each pair counted under the first rule it fails):
* `names_list`: catalogs of names (`iso_*`: languages, countries, scripts),
  not sentences;
* `empty`: either side empty after whitespace is collapsed (tabs and
  newlines become spaces, so that a pair is one TSV line);
* `too_long`: either side over `long_max_chars` characters (a pair over
  `max_chars` but within `long_max_chars` that passes the other rules goes
  to the `long` split, unless its English text is also a shorter pair's);
* `placeholders`: the English side is mostly format placeholders
  (`%s`, `%(name)d`, `{0}`, `$VAR`, `<tag>`): fewer than 3 letters, or
  fewer letters than half its other characters, once they are removed;
* `untranslated`: the French side equals the English one (ignoring case);
* `duplicate`: an English text already kept (catalogs are read in file-name
  order, so the first catalog's translation wins).

The split is a hash of the English text: deterministic, independent of the
order and number of catalogs, and a text never lands in two splits. Each
split is written in the order of another part of that hash, a fixed
shuffle: read in catalog order, a reader with a small shuffle buffer
(seqio's holds 1,000 examples) would train on one program's messages after
another's, and its validation loss would swing with the epoch. The
`long` split (multi-sentence help texts and descriptions) is a test set of
long outputs: no model trained on the others has seen its pairs.

Example:
  python -m tools.gettext_data --out_dir /tmp/gettext_enfr
  # writes train.tsv, validation.tsv, test.tsv, long.tsv, spm.model,
  # stats.json and languages.json ({"source": "en", "target": "fr"})
"""

import argparse
import dataclasses
import gettext
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from absl import logging

from tools import common

DEFAULT_LOCALE_DIR = '/usr/share/locale'
# Raised when a change to the build changes the files it writes, so that
# sets built before are rebuilt (`stats.json` records it).
FORMAT = 2
SPLITS = ('train', 'validation', 'test')
LONG_SPLIT = 'long'
LANGUAGES_FILE = 'languages.json'
FILTERS = ('names_list', 'empty', 'too_long', 'placeholders', 'untranslated',
           'duplicate')

_PLACEHOLDER = re.compile(
    r"%(\([^)]*\))?[-+ #0']*(\*|\d+\$?)?(\.(\*|\d+))?"
    r'(hh|h|ll|l|L|q|j|z|t|I64)?[diouxXeEfFgGaAcspnm%]'  # printf / Python
    r'|%<PRI\w+>'                                         # C99 macros
    r'|\{[^{}]*\}'                                        # format fields
    r'|\$\{?\w+\}?'                                       # shell variables
    r'|<[^<>]*>')                                         # markup tags


@dataclasses.dataclass(frozen=True)
class Settings:
  locale_dir: str = DEFAULT_LOCALE_DIR
  language: str = 'fr'
  max_chars: int = 200
  long_max_chars: int = 1000
  validation_fraction: float = 0.05
  test_fraction: float = 0.05
  exclude_catalogs: Tuple[str, ...] = ('iso_*',)


def catalog_files(settings: Settings) -> List[str]:
  """The `<language>/LC_MESSAGES/*.mo` files, sorted by name."""
  pattern = os.path.join(settings.locale_dir, settings.language,
                         'LC_MESSAGES', '*.mo')
  return sorted(glob.glob(pattern), key=os.path.basename)


def read_catalog(path: str) -> Iterator[Tuple[str, str]]:
  """(msgid, msgstr) pairs of one .mo file: singular forms, no context, no
  header entry, in the file's order."""
  with open(path, 'rb') as f:
    catalog = gettext.GNUTranslations(f)._catalog  # pylint: disable=protected-access
  for key, value in catalog.items():
    if isinstance(key, tuple):  # plural forms: (msgid, n)
      if key[1] != 0:
        continue
      key = key[0]
    key = key.split('\x04', 1)[-1]  # 'context\x04msgid'
    if key:
      yield key, value


def clean(text: str) -> str:
  """Whitespace (tabs, newlines, no-break spaces) collapsed to single
  spaces; ends stripped.

  >>> clean(' Fichier\\xa0: %s\\n')
  'Fichier : %s'
  """
  return ' '.join(text.split())


def mostly_placeholders(text: str) -> bool:
  """Whether `text` is mostly format placeholders (see the module doc).

  >>> mostly_placeholders('%s: %s'), mostly_placeholders('Cannot open %s')
  (True, False)
  """
  rest = _PLACEHOLDER.sub('', text)
  letters = sum(c.isalpha() for c in rest)
  others = sum(not c.isalpha() and not c.isspace() for c in rest)
  return letters < 3 or letters < others / 2


def split_of(english: str, settings: Settings) -> str:
  """The split of a pair, from a hash of its English text."""
  digest = hashlib.sha256(english.encode('utf-8')).digest()
  u = int.from_bytes(digest[:8], 'big') / 2.0**64
  if u < settings.test_fraction:
    return 'test'
  if u < settings.test_fraction + settings.validation_fraction:
    return 'validation'
  return 'train'


def build_pairs(settings: Settings
                ) -> Tuple[Dict[str, List[Tuple[str, str]]], Dict[str, int]]:
  """Reads, filters and splits the catalogs' pairs.

  Returns:
    ({split: [(english, french), ...]}, counts): each split (SPLITS and
    LONG_SPLIT) in its fixed shuffled order (`order_key`); counts of
    `catalogs` (of them `unreadable`, skipped with a warning), pairs `read`,
    `kept` (in SPLITS) and each filter's drops.
  """
  files = catalog_files(settings)
  if not files:
    raise FileNotFoundError(
        f'No gettext catalogs in {settings.locale_dir}/{settings.language}/'
        'LC_MESSAGES/*.mo: install translated packages (Debian: their '
        f'`locales` / `*-l10n` data) or pass --locale_dir.')
  counts = dict(catalogs=len(files), unreadable=0, read=0, kept=0,
                **{f: 0 for f in FILTERS})
  splits = {name: [] for name in SPLITS}
  long_pairs = []
  # Long pairs keep their own duplicate check, so that the short splits
  # are those of the length filter alone.
  seen, seen_long = set(), set()
  for path in files:
    names_list = any(fnmatch.fnmatch(os.path.basename(path), pattern)
                     for pattern in settings.exclude_catalogs)
    try:
      pairs = list(read_catalog(path))
    except (OSError, UnicodeDecodeError, ValueError) as e:
      logging.warning('Skipping the unreadable catalog %s: %s', path, e)
      counts['unreadable'] += 1
      continue
    for msgid, msgstr in pairs:
      counts['read'] += 1
      english, french = clean(msgid), clean(msgstr)
      is_long = max(len(english), len(french)) > settings.max_chars
      if names_list:
        reason = 'names_list'
      elif not english or not french:
        reason = 'empty'
      elif max(len(english), len(french)) > settings.long_max_chars:
        reason = 'too_long'
      elif mostly_placeholders(english):
        reason = 'placeholders'
      elif english.casefold() == french.casefold():
        reason = 'untranslated'
      elif english in (seen_long if is_long else seen):
        reason = 'duplicate'
      else:
        reason = None
      if reason:
        counts[reason] += 1
      elif is_long:
        seen_long.add(english)
        long_pairs.append((english, french))
      else:
        seen.add(english)
        counts['kept'] += 1
        splits[split_of(english, settings)].append((english, french))
  splits[LONG_SPLIT] = [p for p in long_pairs if p[0] not in seen]
  counts['duplicate'] += len(long_pairs) - len(splits[LONG_SPLIT])
  for pairs in splits.values():
    pairs.sort(key=lambda pair: order_key(pair[0]))
  return splits, counts


def order_key(english: str) -> bytes:
  """A pair's place in its split: bytes of the English text's hash that
  `split_of` does not read, so that the order is a fixed shuffle."""
  return hashlib.sha256(english.encode('utf-8')).digest()[8:16]


def train_vocabulary(out_dir: str, lines: Sequence[str],
                     vocab_size: int) -> str:
  """A T5-style SentencePiece model (pad 0, EOS 1, UNK 2, no BOS) trained
  on `lines`; returns the path of `<out_dir>/spm.model`."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  text = os.path.join(out_dir, 'spm_train.txt')
  with open(text, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  prefix = os.path.join(out_dir, 'spm')
  spm.SentencePieceTrainer.train(
      input=text, model_prefix=prefix, vocab_size=vocab_size, pad_id=0,
      eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
      model_type='unigram', input_sentence_size=200000,
      shuffle_input_sentence=False, minloglevel=2)
  os.remove(text)
  return prefix + '.model'


def build(out_dir: str, settings: Settings = Settings(),
          vocab_size: int = 4000, vocabulary: Optional[str] = None
          ) -> Dict[str, int]:
  """Writes `<split>.tsv` (SPLITS and LONG_SPLIT), `spm.model` and
  `stats.json` into `out_dir`. The vocabulary is trained on the train
  split, or copied from `vocabulary` (an spm.model of `vocab_size`
  pieces): SentencePiece's training is not reproducible from run to run,
  and a table's runs must share one vocabulary.

  Returns:
    The counts of `build_pairs`, plus each split's size.
  """
  splits, counts = build_pairs(settings)
  os.makedirs(out_dir, exist_ok=True)
  for name, pairs in splits.items():
    counts[name] = len(pairs)
    write_split(out_dir, name, pairs)
  if vocabulary is None:
    train_vocabulary(out_dir,
                     [text for pair in splits['train'] for text in pair],
                     vocab_size)
  else:
    shutil.copy(vocabulary, os.path.join(out_dir, 'spm.model'))
  with open(os.path.join(out_dir, 'stats.json'), 'w') as f:
    json.dump(dict(settings=dataclasses.asdict(settings), format=FORMAT,
                   vocab_size=vocab_size, counts=counts,
                   vocabulary=vocabulary_digest(vocabulary)), f, indent=1)
  write_languages(out_dir, ('en', settings.language))
  return counts


def vocabulary_digest(vocabulary: Optional[str]) -> Optional[str]:
  """sha256 of a given vocabulary file; None for one trained here."""
  return None if vocabulary is None else common.file_digest(vocabulary)


def write_split(out_dir: str, name: str, pairs) -> None:
  """Writes `<out_dir>/<name>.tsv`, one `english<TAB>french` per line."""
  with open(os.path.join(out_dir, f'{name}.tsv'), 'w', encoding='utf-8') as f:
    f.writelines(f'{en}\t{fr}\n' for en, fr in pairs)


def write_languages(data_dir: str, languages: Tuple[str, str]) -> None:
  """Writes `<data_dir>/languages.json`: the TSV columns' language codes,
  which `tools.paper_table --data_dir` reads."""
  with open(os.path.join(data_dir, LANGUAGES_FILE), 'w') as f:
    json.dump({'source': languages[0], 'target': languages[1]}, f)


def read_languages(data_dir: str) -> Optional[Tuple[str, str]]:
  """(source, target) of `<data_dir>/languages.json`, or None without one."""
  path = os.path.join(data_dir, LANGUAGES_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    meta = json.load(f)
  if set(meta) != {'source', 'target'}:
    raise ValueError(f'{path}: expected {{"source": code, "target": code}}, '
                     f'got {meta}.')
  return meta['source'], meta['target']


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=common.HelpFormatter)
  parser.add_argument('--out_dir', required=True,
                      help='where the TSVs, spm.model and stats.json go.')
  parser.add_argument('--locale_dir', default=DEFAULT_LOCALE_DIR,
                      help='the locale directory holding <language>/'
                      'LC_MESSAGES/*.mo.')
  parser.add_argument('--language', default='fr',
                      help='the catalogs\' language (the target side).')
  parser.add_argument('--max_chars', type=int, default=Settings.max_chars,
                      help='longest text kept, per side.')
  parser.add_argument('--vocab_size', type=int, default=4000,
                      help='SentencePiece vocabulary size.')
  args = parser.parse_args(argv)
  counts = build(args.out_dir, Settings(
      locale_dir=args.locale_dir, language=args.language,
      max_chars=args.max_chars), vocab_size=args.vocab_size)
  print(json.dumps(counts))


if __name__ == '__main__':
  main()
