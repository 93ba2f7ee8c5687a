"""The gettext translation set: reading .mo files, filtering, splitting."""

import collections
import json
import os
import struct
import tempfile

from absl.testing import absltest

from tools import gettext_data
import helpers


def write_mo(path, entries):
  """A GNU .mo file of `entries` ({msgid: msgstr}; bytes or str, NUL joins
  plural forms and \\x04 separates a context)."""
  items = sorted((k.encode() if isinstance(k, str) else k,
                  v.encode() if isinstance(v, str) else v)
                 for k, v in entries.items())
  ids = b''.join(k + b'\0' for k, _ in items)
  strs = b''.join(v + b'\0' for _, v in items)
  start = 7 * 4 + 16 * len(items)
  id_table, str_table, offset = [], [], 0
  for k, _ in items:
    id_table += [len(k), start + offset]
    offset += len(k) + 1
  offset = 0
  for _, v in items:
    str_table += [len(v), start + len(ids) + offset]
    offset += len(v) + 1
  header = struct.pack('Iiiiiii', 0x950412de, 0, len(items), 7 * 4,
                       7 * 4 + 8 * len(items), 0, 0)
  with open(path, 'wb') as f:
    f.write(header + struct.pack(f'{len(id_table)}i', *id_table) +
            struct.pack(f'{len(str_table)}i', *str_table) + ids + strs)


META = 'Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n > 1);\n'


class GettextDataTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = tempfile.mkdtemp()
    self.catalogs = os.path.join(self.root, 'fr', 'LC_MESSAGES')
    os.makedirs(self.catalogs)

  def _settings(self, **kwargs):
    return gettext_data.Settings(locale_dir=self.root, **kwargs)

  def test_reading_and_each_filter(self):
    write_mo(os.path.join(self.catalogs, 'a.mo'), {
        '': META,
        'Cannot open\tthe file\n': 'Impossible d\'ouvrir\nle fichier\xa0',
        'menu\x04Open': 'Ouvrir',                       # context dropped
        '%d file\0%d files': '%d fichier\0%d fichiers',  # singular kept
        '   ': 'rien',                                   # empty
        'A message longer than thirty characters': 'Un message long',  # long
        ('A message longer than sixty characters, which none of the splits '
         'keeps'): 'x',                                  # too long
        '%s: %s (%d)': '%s : %s (%d)',                   # placeholders
        '<b>%s</b>': '<b>%s</b>',                        # placeholders
        'Options': 'options',                            # untranslated
    })
    write_mo(os.path.join(self.catalogs, 'b.mo'), {
        '': META, 'Options': 'Les options',
        'Cannot open the file': 'Autre traduction',      # duplicate
        # Long, but a short pair's English text: a duplicate.
        'Open': 'Ouvrir le fichier dans une autre fenêtre',
    })
    write_mo(os.path.join(self.catalogs, 'iso_639.mo'),
             {'': META, 'French': 'français'})
    write_mo(os.path.join(self.catalogs, 'broken.mo'), {'Été': 'Summer'})
    splits, counts = gettext_data.build_pairs(self._settings(
        max_chars=30, long_max_chars=60))
    kept = sorted(pair for name in gettext_data.SPLITS
                  for pair in splits[name])
    self.assertEqual(kept, [
        ('%d file', '%d fichier'),
        ('Cannot open the file', "Impossible d'ouvrir le fichier"),
        ('Open', 'Ouvrir'),
        ('Options', 'Les options'),
    ])
    self.assertEqual(splits[gettext_data.LONG_SPLIT], [
        ('A message longer than thirty characters', 'Un message long')])
    self.assertEqual(counts, dict(
        catalogs=4, unreadable=1, read=13, kept=4, names_list=1, empty=1,
        too_long=1, placeholders=2, untranslated=1, duplicate=2))

  def test_split_is_deterministic_and_order_free(self):
    entries = {f'message number {i}': f'message numéro {i}'
               for i in range(2000)}
    entries[''] = META
    write_mo(os.path.join(self.catalogs, 'a.mo'), entries)
    first, _ = gettext_data.build_pairs(self._settings())
    # The same texts spread over other catalogs, plus new ones.
    os.remove(os.path.join(self.catalogs, 'a.mo'))
    del entries['']
    items = list(entries.items())
    write_mo(os.path.join(self.catalogs, 'x.mo'), dict(items[1000:], **{'': META}))
    write_mo(os.path.join(self.catalogs, 'y.mo'), dict(
        items[:1000] + [('a new message', 'un nouveau message'), ('', META)]))
    second, _ = gettext_data.build_pairs(self._settings())
    where = lambda splits: {en: name for name, pairs in splits.items()
                            for en, _ in pairs}
    second_where = where(second)
    self.assertEqual(second_where.pop('a new message'),
                     gettext_data.split_of('a new message', self._settings()))
    self.assertEqual(where(first), second_where)
    # Each split in one fixed shuffled order, whatever the catalogs' order.
    train = [en for en, _ in first['train']]
    self.assertEqual(train, sorted(train, key=gettext_data.order_key))
    self.assertNotEqual(train, sorted(train, key=lambda t: int(t.split()[-1])))
    self.assertEqual([en for en, _ in second['train'] if en != 'a new message'],
                     train)
    sizes = collections.Counter(where(first).values())
    self.assertEqual(sum(sizes.values()), 2000)
    # 5% / 5% expected: 100 each, binomial sd about 10.
    for name in ('validation', 'test'):
      self.assertBetween(sizes[name], 60, 140)

  def test_no_catalogs_is_a_clear_error(self):
    with self.assertRaisesRegex(FileNotFoundError, 'LC_MESSAGES/\\*.mo'):
      gettext_data.build_pairs(self._settings())

  def test_docstring_examples(self):
    helpers.assert_doctests(gettext_data)

  def test_system_catalogs_build_a_usable_set(self):
    # The machine's own French catalogs: real text, built at run time.
    out = os.path.join(self.root, 'out')
    counts = gettext_data.build(
        out, vocab_size=1000)
    self.assertGreater(counts['catalogs'], 10)
    self.assertGreater(counts['kept'], 10000)
    self.assertGreater(counts['test'], 300)
    self.assertGreater(counts['long'], 100)
    for name in gettext_data.SPLITS + (gettext_data.LONG_SPLIT,):
      with open(os.path.join(out, f'{name}.tsv'), encoding='utf-8') as f:
        lines = f.read().split('\n')
      self.assertEqual(lines[-1], '')
      self.assertLen(lines[:-1], counts[name])
      self.assertTrue(all(line.count('\t') == 1 for line in lines[:-1]))
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    vocab = spm.SentencePieceProcessor(
        model_file=os.path.join(out, 'spm.model'))
    self.assertEqual((vocab.get_piece_size(), vocab.pad_id(), vocab.eos_id(),
                      vocab.unk_id()), (1000, 0, 1, 2))
    self.assertEqual(vocab.decode(vocab.encode('impossible d\'ouvrir')),
                     'impossible d\'ouvrir')
    # A given vocabulary (a table's, shared by all its runs) is copied, not
    # trained again: SentencePiece's training differs from run to run.
    again = os.path.join(self.root, 'again')
    given = os.path.join(out, 'spm.model')
    self.assertEqual(gettext_data.build(again, vocab_size=1000,
                                        vocabulary=given), counts)
    for name in ('train.tsv', 'test.tsv', 'spm.model'):
      with open(os.path.join(out, name), 'rb') as a, open(
          os.path.join(again, name), 'rb') as b:
        self.assertEqual(a.read(), b.read(), name)
    with open(os.path.join(again, 'stats.json')) as f:
      self.assertEqual(json.load(f)['vocabulary'],
                       gettext_data.vocabulary_digest(given))


if __name__ == '__main__':
  absltest.main()
