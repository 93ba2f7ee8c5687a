"""Shared pieces of the seqio task tests: mocked TFDS data, paragraph files
and a SentencePiece model written here, and a base class registering the
tasks with them."""

import os
import pathlib
import random
import shutil
import tempfile

from absl.testing import parameterized
import sentencepiece as spm
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

import t5x_speed.tasks as speed_tasks


REPO = pathlib.Path(__file__).resolve().parents[1]
LENGTHS = {'inputs': 512, 'targets': 512}
TRANSLATE_PROMPT = b'translate English to German: '
SUMMARIZE_PROMPT = b'summarize: '
EOS = 1
VOCAB_SIZE = 200
# task name -> (split read from the mock, prompt of the inputs or None).
TFDS_TASKS = {
    'speed_c4_prefix_lm': ('train', None),
    'speed_c4_span_corruption': ('train', None),
    'speed_wmt_ende': ('validation', TRANSLATE_PROMPT),
    'speed_paracrawl_ende': ('train', TRANSLATE_PROMPT),
    'speed_cnn_dailymail': ('validation', SUMMARIZE_PROMPT),
    'speed_wikilingua_en': ('validation', SUMMARIZE_PROMPT),
}
TFDS_NAMES = {
    'speed_c4_prefix_lm': 'c4/en:3.1.0',
    'speed_c4_span_corruption': 'c4/en:3.1.0',
    'speed_wmt_ende': 'wmt_t2t_translate/de-en:1.0.0',
    'speed_paracrawl_ende': 'para_crawl/ende:1.2.0',
    'speed_cnn_dailymail': 'cnn_dailymail:3.4.0',
    'speed_wikilingua_en': 'gem/wiki_lingua_english_en:1.1.0',
}
MIXTURES = {
    'speed_pretrain': {'speed_c4_prefix_lm'},
    'speed_translation_ende': {'speed_wmt_ende',
                               'speed_paracrawl_paragraph_ende'},
    'speed_summarization': {'speed_cnn_dailymail', 'speed_wikilingua_en'},
    'speed_finetune_all': {'speed_wmt_ende', 'speed_paracrawl_paragraph_ende',
                           'speed_cnn_dailymail', 'speed_wikilingua_en'},
}
PARAGRAPH_PAIRS = {
    'train': [('The house is small.', 'Das Haus ist klein.'),
              ('Good morning. How are you?', 'Guten Morgen. Wie geht es?')],
    'validation': [('Hello world.', 'Hallo Welt.'),
                   ('The cat sleeps.', 'Die Katze schläft.')],
}
# Unrelated to English or German, only long.
LONG_TEXT = ' '.join(['alpha beta gamma delta'] * 400)


def mock_tfds():
  # No dataset_info files offline: features come from the builders' code.
  return tfds.testing.mock_data(num_examples=3,
                                policy=tfds.testing.MockPolicy.USE_CODE)


def train_sentencepiece(directory):
  rng = random.Random(0)
  letters = 'abcdefghijklmnopqrstuvwxyzäöüß'
  words = [''.join(rng.choice(letters) for _ in range(rng.randint(1, 8)))
           for _ in range(400)]
  lines = [' '.join(rng.choice(words) for _ in range(rng.randint(5, 20)))
           for _ in range(2000)]
  lines += [a + ' ' + b for pairs in PARAGRAPH_PAIRS.values()
            for a, b in pairs]
  prefix = os.path.join(directory, 'test_spm')
  # T5's special ids: 0 pad, 1 EOS, 2 unknown.
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_prefix=prefix,
      vocab_size=VOCAB_SIZE, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      minloglevel=2)
  return prefix + '.model'


def write_paragraph_files(directory):
  for split, pairs in PARAGRAPH_PAIRS.items():
    with open(os.path.join(directory, f'{split}.tsv'), 'w') as f:
      f.writelines(f'{en}\t{de}\n' for en, de in pairs)
  # The test split as TFRecord shards, one with a pair too long for 512.
  test_pairs = [('Short one.', 'Kurz.'), (LONG_TEXT, LONG_TEXT)]
  for shard, (en, de) in enumerate(test_pairs):
    name = f'test.tfrecord-{shard:05d}-of-00002'
    with tf.io.TFRecordWriter(os.path.join(directory, name)) as writer:
      example = tf.train.Example(features=tf.train.Features(feature={
          lang: tf.train.Feature(
              bytes_list=tf.train.BytesList(value=[text.encode()]))
          for lang, text in (('en', en), ('de', de))}))
      writer.write(example.SerializeToString())


def dataset(name, split):
  # Seeded, so that iterating twice gives the same examples. No in-memory
  # cache: deciding on it asks TFDS for split sizes, which mocks lack.
  return seqio.get_mixture_or_task(name).get_dataset(
      LENGTHS, split=split, shuffle=False, seed=0, try_in_mem_cache=False)


def convert(ds):
  return seqio.DecoderFeatureConverter(pack=False)(ds, LENGTHS)


class TasksTestBase(parameterized.TestCase):
  """Registers the tasks with the test vocabulary and paragraph files."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.data_dir = tempfile.mkdtemp()
    cls.vocab_path = train_sentencepiece(cls.data_dir)
    cls.paragraph_dir = os.path.join(cls.data_dir, 'paragraphs')
    os.makedirs(cls.paragraph_dir)
    write_paragraph_files(cls.paragraph_dir)
    cls.vocab = seqio.SentencePieceVocabulary(cls.vocab_path)

  @classmethod
  def tearDownClass(cls):
    # Leave the registries as `import t5x_speed.tasks` made them.
    speed_tasks.register_tasks()
    shutil.rmtree(cls.data_dir)
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    speed_tasks.register_tasks(vocabulary=self.vocab_path,
                               paragraph_data_dir=self.paragraph_dir)
