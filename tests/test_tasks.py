"""Tests of the seqio tasks, preprocessors and metrics; offline.

TFDS sources are mocked (`tfds.testing.mock_data`), the paragraph task reads
files written here, and a SentencePiece model trained here replaces T5's.
"""

import doctest
import importlib.util
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import gin
import numpy as np
import sentencepiece as spm
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

import t5x_speed.tasks as speed_tasks
from t5x_speed.tasks import metrics
from t5x_speed.tasks import objectives
from t5x_speed.tasks import preprocessors
from t5x_speed.tasks import vocabularies

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


def _mock_tfds():
  # No dataset_info files offline: features come from the builders' code.
  return tfds.testing.mock_data(num_examples=3,
                                policy=tfds.testing.MockPolicy.USE_CODE)


def _train_sentencepiece(directory):
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


def _write_paragraph_files(directory):
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


def _dataset(name, split):
  # Seeded, so that iterating twice gives the same examples. No in-memory
  # cache: deciding on it asks TFDS for split sizes, which mocks lack.
  return seqio.get_mixture_or_task(name).get_dataset(
      LENGTHS, split=split, shuffle=False, seed=0, try_in_mem_cache=False)


def _convert(ds):
  return seqio.DecoderFeatureConverter(pack=False)(ds, LENGTHS)


class TasksTestBase(parameterized.TestCase):
  """Registers the tasks with the test vocabulary and paragraph files."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.data_dir = tempfile.mkdtemp()
    cls.vocab_path = _train_sentencepiece(cls.data_dir)
    cls.paragraph_dir = os.path.join(cls.data_dir, 'paragraphs')
    os.makedirs(cls.paragraph_dir)
    _write_paragraph_files(cls.paragraph_dir)
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


class RegistrationTest(TasksTestBase):

  def test_names(self):
    self.assertEqual(set(speed_tasks.TASKS), set(TFDS_TASKS) |
                     {'speed_paracrawl_paragraph_ende'})
    for name in speed_tasks.TASKS:
      self.assertIn(name, seqio.TaskRegistry.names())
    for name, task_names in MIXTURES.items():
      mixture = seqio.get_mixture_or_task(name)
      self.assertIsInstance(mixture, seqio.Mixture)
      self.assertEqual({t.name for t in mixture.tasks}, task_names)

  def test_output_features_and_metrics(self):
    for name in speed_tasks.TASKS:
      task = seqio.get_mixture_or_task(name)
      self.assertEqual(set(task.output_features), {'inputs', 'targets'})
      for feature in task.output_features.values():
        self.assertTrue(feature.add_eos)
        self.assertEqual(feature.vocabulary.sentencepiece_model_file,
                         self.vocab_path)
    aux = {'speed/num_steps': [6], 'speed/num_tokens': [3],
           'speed/occupied_slots': [9], 'speed/flushes': [[0, 1]],
           'speed/stage_evaluations': [[6, 5]], 'speed/stage_flips': [[0, 1]],
           'speed/invalid': [0]}
    for names, metric in ((('speed_wmt_ende', 'speed_paracrawl_ende',
                            'speed_paracrawl_paragraph_ende'), metrics.bleu),
                          (('speed_cnn_dailymail', 'speed_wikilingua_en'),
                           metrics.rouge)):
      for name in names:
        # One predict-with-aux metric: a single decode gives the task metric
        # and SPEED's statistics.
        task = seqio.get_mixture_or_task(name)
        self.assertEmpty(task.predict_metric_fns)
        (metric_fn,) = task.predict_with_aux_metric_fns
        self.assertIs(metric_fn.metric_fn, metric)
        got = metric_fn(['a b c d'], ['a b c d'], aux)
        self.assertAlmostEqual(got[metric.__name__ if metric is metrics.bleu
                                   else 'rouge1'], 100.0)
        self.assertEqual(got['speed/steps_per_token'], 2.0)
        self.assertEqual(got['speed/flip_rate/stage_2'], 0.2)
        self.assertEqual(metric_fn(['a'], ['a'], {}).keys(),
                         metric(['a'], ['a']).keys())

  def test_tfds_names_and_splits(self):
    for name, tfds_name in TFDS_NAMES.items():
      source = seqio.get_mixture_or_task(name).source
      self.assertEqual(source.tfds_dataset.name, tfds_name)
    self.assertEqual(
        tuple(seqio.get_mixture_or_task('speed_paracrawl_ende').splits),
        ('train',))

  def test_default_vocabulary(self):
    with mock.patch.dict(os.environ):
      os.environ.pop(speed_tasks.VOCAB_ENV_VAR, None)
      self.assertEqual(
          speed_tasks.default_vocabulary().sentencepiece_model_file,
          'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model')
    with mock.patch.dict(os.environ,
                         {speed_tasks.VOCAB_ENV_VAR: self.vocab_path}):
      self.assertEqual(
          speed_tasks.default_vocabulary().sentencepiece_model_file,
          self.vocab_path)

  def test_vocab_env_var_read_on_import_without_io(self):
    # A fresh interpreter: the variable is read when the package is imported,
    # and importing reads neither the (absent) model file nor any dataset.
    missing_model = os.path.join(self.data_dir, 'absent', 'spm.model')
    code = ('import seqio, t5x_speed.tasks; '
            "task = seqio.get_mixture_or_task('speed_wmt_ende'); "
            "print(task.output_features['targets'].vocabulary"
            '.sentencepiece_model_file)')
    env = dict(os.environ, T5X_SPEED_VOCAB=missing_model,
               TF_CPP_MIN_LOG_LEVEL='3')
    result = subprocess.run([sys.executable, '-c', code], env=env,
                            capture_output=True, text=True, check=False,
                            cwd=os.path.dirname(__file__))
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip().splitlines()[-1], missing_model)

  def test_reregistration_refreshes_mixtures(self):
    speed_tasks.register_tasks(vocabulary=self.vocab)
    task = seqio.get_mixture_or_task('speed_wmt_ende')
    mixture = seqio.get_mixture_or_task('speed_translation_ende')
    self.assertIn(task, mixture.tasks)
    self.assertIs(task.output_features['inputs'].vocabulary, self.vocab)

  def test_no_overwrite_refuses_duplicates(self):
    with self.assertRaisesRegex(ValueError, 'speed_c4_prefix_lm'):
      speed_tasks.register_tasks(vocabulary=self.vocab, overwrite=False)


class DecoderFeatureConverterTest(TasksTestBase):

  def _check_converted(self, examples, converted):
    self.assertNotEmpty(examples)
    self.assertLen(converted, len(examples))
    for ex, out in zip(examples, converted):
      self.assertEqual(set(out), {'decoder_target_tokens',
                                  'decoder_input_tokens',
                                  'decoder_loss_weights',
                                  'decoder_causal_attention'})
      for value in out.values():
        self.assertEqual(value.shape, (1024,))
        self.assertEqual(value.dtype, np.int32)
      inputs, targets = ex['inputs'], ex['targets']
      n_in, n_tgt = len(inputs), len(targets)
      self.assertBetween(n_in, 1, 512)
      self.assertBetween(n_tgt, 2, 512)
      self.assertEqual(inputs[-1], EOS)
      self.assertEqual(targets[-1], EOS)
      expected = np.zeros(1024, np.int32)
      expected[:n_in + n_tgt] = np.concatenate([inputs, targets])
      np.testing.assert_array_equal(out['decoder_target_tokens'], expected)
      np.testing.assert_array_equal(out['decoder_input_tokens'],
                                    np.concatenate([[0], expected[:-1]]))
      positions = np.arange(1024)
      # Loss on the targets only; positions up to the first target (whose
      # input is the prefix's EOS) attend to the whole prefix.
      np.testing.assert_array_equal(
          out['decoder_loss_weights'],
          (positions >= n_in) & (positions < n_in + n_tgt))
      np.testing.assert_array_equal(out['decoder_causal_attention'],
                                    positions <= n_in)

  @parameterized.parameters(*TFDS_TASKS)
  def test_tfds_task(self, name):
    split, prompt = TFDS_TASKS[name]
    with _mock_tfds():
      ds = _dataset(name, split)
      examples = list(ds.as_numpy_iterator())
      converted = list(_convert(ds).as_numpy_iterator())
    self._check_converted(examples, converted)
    for ex in examples:
      if prompt is None:
        self.assertEqual(set(ex), {'inputs', 'targets'})
      else:
        self.assertEqual(set(ex), {'inputs', 'targets', 'inputs_pretokenized',
                                   'targets_pretokenized'})
        self.assertTrue(ex['inputs_pretokenized'].startswith(prompt))
        np.testing.assert_array_equal(
            ex['inputs'][:-1],
            self.vocab.encode(ex['inputs_pretokenized'].decode()))
        np.testing.assert_array_equal(
            ex['targets'][:-1],
            self.vocab.encode(ex['targets_pretokenized'].decode()))

  @parameterized.parameters('train', 'validation')
  def test_paragraph_task_tsv(self, split):
    ds = _dataset('speed_paracrawl_paragraph_ende', split)
    examples = list(ds.as_numpy_iterator())
    self._check_converted(examples, list(_convert(ds).as_numpy_iterator()))
    self.assertEqual(
        [(ex['inputs_pretokenized'], ex['targets_pretokenized'])
         for ex in examples],
        [(TRANSLATE_PROMPT + en.encode(), de.encode())
         for en, de in PARAGRAPH_PAIRS[split]])

  def test_paragraph_task_tfrecord_truncates_to_512(self):
    ds = _dataset('speed_paracrawl_paragraph_ende', 'test')
    examples = sorted(ds.as_numpy_iterator(), key=lambda ex: len(ex['inputs']))
    self._check_converted(examples, list(_convert(ds).as_numpy_iterator()))
    short, long = examples
    self.assertEqual(short['targets_pretokenized'], b'Kurz.')
    self.assertEqual(long['inputs_pretokenized'],
                     TRANSLATE_PROMPT + LONG_TEXT.encode())
    for key in ('inputs', 'targets'):
      self.assertLen(long[key], 512)
      self.assertEqual(long[key][-1], EOS)
      full = self.vocab.encode(long[f'{key}_pretokenized'].decode())
      self.assertGreater(len(full), 511)
      np.testing.assert_array_equal(long[key][:-1], full[:511])

  def test_paragraph_dir_from_env_var(self):
    speed_tasks.register_tasks(vocabulary=self.vocab)
    # Set after registration: the directory is looked up when data is read.
    with mock.patch.dict(
        os.environ, {speed_tasks.PARAGRAPH_DIR_ENV_VAR: self.paragraph_dir}):
      examples = list(_dataset('speed_paracrawl_paragraph_ende',
                               'validation').as_numpy_iterator())
    self.assertEqual(examples[0]['targets_pretokenized'], b'Hallo Welt.')

  @parameterized.parameters(*MIXTURES)
  def test_mixture(self, name):
    with _mock_tfds():
      ds = _dataset(name, 'train').take(12)
      examples = list(ds.as_numpy_iterator())
      converted = list(_convert(ds).as_numpy_iterator())
    self.assertLen(examples, 12)
    self._check_converted(examples, converted)


class MissingDataTest(TasksTestBase):

  def _directory_with(self, files=None):
    directory = tempfile.mkdtemp(dir=self.data_dir)
    for name, content in (files or {}).items():
      with open(os.path.join(directory, name), 'w') as f:
        f.write(content)
    return directory

  @parameterized.parameters(*TFDS_TASKS)
  def test_tfds_not_prepared(self, name):
    empty = self._directory_with()
    speed_tasks.register_tasks(vocabulary=self.vocab, tfds_data_dir=empty)
    task = seqio.get_mixture_or_task(name)
    with self.assertRaises(speed_tasks.DatasetNotPreparedError) as caught:
      task.get_dataset(LENGTHS, split='train')
    message = str(caught.exception)
    self.assertIn(f"Dataset '{TFDS_NAMES[name]}' for task '{name}' is not "
                  f"prepared under '{empty}'", message)
    self.assertIn(f'tfds build {TFDS_NAMES[name]} --data_dir={empty}',
                  message)
    self.assertIn('TFDS_DATA_DIR', message)
    with self.assertRaises(speed_tasks.DatasetNotPreparedError):
      task.num_input_examples('train')

  def test_unknown_split_is_not_reported_as_missing_data(self):
    task = seqio.get_mixture_or_task('speed_paracrawl_ende')
    with self.assertRaisesRegex(ValueError, "no split 'validation'"):
      task.source.get_dataset('validation')

  def _paragraph_error(self, split='train'):
    task = seqio.get_mixture_or_task('speed_paracrawl_paragraph_ende')
    with self.assertRaises(speed_tasks.DatasetNotPreparedError) as caught:
      task.get_dataset(LENGTHS, split=split)
    message = str(caught.exception)
    self.assertIn("Dataset 'paracrawl_paragraph/ende' for task "
                  "'speed_paracrawl_paragraph_ende'", message)
    self.assertIn(f"'{split}.tsv'", message)
    self.assertIn(f"'{split}.tfrecord'", message)
    self.assertIn('T5X_SPEED_PARACRAWL_PARAGRAPH_DIR', message)
    return message

  def test_paragraph_directory_absent(self):
    absent = os.path.join(self.data_dir, 'absent')
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=absent)
    self.assertIn(f"directory '{absent}' does not exist",
                  self._paragraph_error())

  def test_paragraph_split_absent(self):
    directory = self._directory_with({'train.tsv': 'a\tb\n'})
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=directory)
    self.assertIn("no files for split 'validation'",
                  self._paragraph_error('validation'))

  def test_paragraph_directory_unset(self):
    speed_tasks.register_tasks(vocabulary=self.vocab)
    with mock.patch.dict(os.environ):
      os.environ.pop(speed_tasks.PARAGRAPH_DIR_ENV_VAR, None)
      self.assertIn('no data directory is set', self._paragraph_error())

  def test_paragraph_split_in_two_formats(self):
    directory = self._directory_with({'train.tsv': 'a\tb\n',
                                      'train.tfrecord': ''})
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=directory)
    task = seqio.get_mixture_or_task('speed_paracrawl_paragraph_ende')
    with self.assertRaisesRegex(ValueError, 'both TSV and TFRecord'):
      task.get_dataset(LENGTHS, split='train')


  def test_paragraph_tsv_malformed_line_names_file_and_line(self):
    # Line 2 is empty (skipped, but counted), line 3 has no tab.
    directory = self._directory_with({
        'train.tsv': 'Hello.\tHallo.\n\nno tab here\nLast.\tLetzte.\n'})
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=directory)
    task = seqio.get_mixture_or_task('speed_paracrawl_paragraph_ende')
    source = task.source.get_dataset('train', shuffle=False)
    iterator = source.as_numpy_iterator()
    self.assertEqual(next(iterator), {'en': b'Hello.', 'de': b'Hallo.'})
    expected = re.escape(
        f'Malformed line 3 of paragraph TSV file '
        f'{os.path.join(directory, "train.tsv")}: expected 2 tab-separated '
        'fields (en<TAB>de), found 1.')
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, expected):
      next(iterator)
    # The same error through the task's whole (tokenizing) pipeline.
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, expected):
      list(_dataset('speed_paracrawl_paragraph_ende',
                    'train').as_numpy_iterator())

  def test_paragraph_tsv_extra_tab(self):
    directory = self._directory_with({'validation.tsv': 'a\tb\tc\n'})
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=directory)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r'Malformed line 1 of paragraph TSV file .*'
                                r'validation\.tsv: .* found 3\.'):
      list(_dataset('speed_paracrawl_paragraph_ende',
                    'validation').as_numpy_iterator())

  def test_paragraph_tsv_empty_fields_are_kept(self):
    directory = self._directory_with({'test.tsv': 'Only English.\t\n'})
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=directory)
    task = seqio.get_mixture_or_task('speed_paracrawl_paragraph_ende')
    self.assertEqual(
        list(task.source.get_dataset('test', shuffle=False)
             .as_numpy_iterator()),
        [{'en': b'Only English.', 'de': b''}])


class VocabularyTest(TasksTestBase):
  """The vocabulary's file is read on first use; unreadable is explained."""

  def _assert_explained(self, message, path):
    self.assertIn(f"Cannot read the SentencePiece model '{path}'", message)
    self.assertIn('T5X_SPEED_VOCAB=/path/spm.model', message)
    self.assertIn("--gin.SENTENCEPIECE_MODEL=\"'/path/spm.model'\"", message)

  def test_missing_local_file_on_first_use(self):
    missing = os.path.join(self.data_dir, 'absent', 'spm.model')
    for use in (lambda v: v.encode('Hello'), lambda v: v.decode([5, 6]),
                lambda v: v.vocab_size, lambda v: v.encode_tf('Hello')):
      vocab = vocabularies.SentencePieceVocabulary(missing)  # reads nothing
      with self.assertRaises(speed_tasks.VocabularyNotReadableError) as caught:
        use(vocab)
      self._assert_explained(str(caught.exception), missing)
      self.assertIn('NotFoundError', str(caught.exception))
      self.assertIsInstance(caught.exception, FileNotFoundError)

  def test_missing_file_through_a_task(self):
    missing = os.path.join(self.data_dir, 'absent', 'spm.model')
    speed_tasks.register_tasks(vocabulary=missing,
                               paragraph_data_dir=self.paragraph_dir)
    # Tokenizing is traced by tf.data, whose AutoGraph re-raises the error
    # with its message as a StagingError.
    with self.assertRaises(Exception) as caught:
      _dataset('speed_paracrawl_paragraph_ende', 'validation')
    self._assert_explained(str(caught.exception), missing)

  def test_default_gs_vocabulary_offline(self):
    with mock.patch.dict(os.environ):
      os.environ.pop(speed_tasks.VOCAB_ENV_VAR, None)
      vocab = speed_tasks.default_vocabulary()
    self.assertIsInstance(vocab, vocabularies.SentencePieceVocabulary)
    try:
      vocab.encode('Hello')
    except speed_tasks.VocabularyNotReadableError as e:
      self._assert_explained(str(e), speed_tasks.DEFAULT_VOCAB_PATH)
      self.assertIn('Offline or without GCS access', str(e))
    else:
      self.skipTest('GCS is reachable: T5\'s vocabulary was read.')

  def test_valid_model(self):
    vocab = vocabularies.SentencePieceVocabulary(self.vocab_path)
    self.assertEqual(vocab.vocab_size, VOCAB_SIZE)
    self.assertEqual(vocab.eos_id, EOS)
    text = 'das haus ist klein'  # only characters the test model covers
    ids = vocab.encode(text)
    self.assertNotEmpty(ids)
    self.assertEqual(vocab.decode(ids), text)
    self.assertEqual(vocab.encode_tf(tf.constant(text)).numpy()
                     .tolist(), ids)
    # T5X checks the model's vocabulary against the tasks' with ==.
    plain = seqio.SentencePieceVocabulary(self.vocab_path)
    self.assertEqual(vocab, plain)
    self.assertEqual(plain, vocab)
    task = seqio.get_mixture_or_task('speed_wmt_ende')
    self.assertIsInstance(task.output_features['inputs'].vocabulary,
                          vocabularies.SentencePieceVocabulary)

  def test_vocabulary_path(self):
    with mock.patch.dict(os.environ):
      os.environ.pop(speed_tasks.VOCAB_ENV_VAR, None)
      self.assertEqual(speed_tasks.vocabulary_path(),
                       speed_tasks.DEFAULT_VOCAB_PATH)
    with mock.patch.dict(os.environ,
                         {speed_tasks.VOCAB_ENV_VAR: self.vocab_path}):
      self.assertEqual(speed_tasks.vocabulary_path(), self.vocab_path)


@absltest.skipUnless(importlib.util.find_spec('t5x'), 'needs T5X')
class ModelVocabularyGinTest(TasksTestBase):
  """gin/models/decoder_only.gin's VOCABULARY follows the tasks' setting."""

  def tearDown(self):
    gin.clear_config()
    super().tearDown()

  def _vocabulary(self, *bindings):
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO))
    gin.parse_config_files_and_bindings(
        [str(REPO / 'gin' / 'models' / 'decoder_only.gin')],
        ['NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3', 'DROPOUT_RATE = 0.0',
         *bindings])
    vocabulary = gin.query_parameter('VOCABULARY/macro.value')
    return vocabulary.scoped_configurable_fn()

  def test_follows_env_var(self):
    with mock.patch.dict(os.environ,
                         {speed_tasks.VOCAB_ENV_VAR: self.vocab_path}):
      vocab = self._vocabulary()
      self.assertEqual(vocab, speed_tasks.default_vocabulary())
    self.assertIsInstance(vocab, vocabularies.SentencePieceVocabulary)
    self.assertEqual(vocab.vocab_size, VOCAB_SIZE)

  def test_flag_overrides_env_var(self):
    other = os.path.join(self.data_dir, 'other.model')
    shutil.copy(self.vocab_path, other)
    with mock.patch.dict(os.environ,
                         {speed_tasks.VOCAB_ENV_VAR: self.vocab_path}):
      vocab = self._vocabulary(f"SENTENCEPIECE_MODEL = '{other}'")
    self.assertEqual(vocab.sentencepiece_model_file, other)

  def test_default_offline_is_explained(self):
    with mock.patch.dict(os.environ):
      os.environ.pop(speed_tasks.VOCAB_ENV_VAR, None)
      vocab = self._vocabulary()
    self.assertEqual(vocab.sentencepiece_model_file,
                     speed_tasks.DEFAULT_VOCAB_PATH)
    try:
      vocab.decode([5, 6])
    except speed_tasks.VocabularyNotReadableError as e:
      self.assertIn('SENTENCEPIECE_MODEL', str(e))
    else:
      self.skipTest('GCS is reachable: T5\'s vocabulary was read.')


class PreprocessorsTest(parameterized.TestCase):

  def _run(self, preprocessor, example, **kwargs):
    ds = tf.data.Dataset.from_tensors(example)
    return next(preprocessor(ds, **kwargs).as_numpy_iterator())

  def test_translate(self):
    out = self._run(preprocessors.translate,
                    {'en': 'That is good.', 'de': 'Das ist gut.', 'id': '7'},
                    source_language='en', target_language='de')
    self.assertEqual(out, {'inputs': b'translate English to German: '
                                     b'That is good.',
                           'targets': b'Das ist gut.'})

  def test_unknown_language(self):
    with self.assertRaisesRegex(ValueError, "'fr'"):
      preprocessors.translation_prompt('en', 'fr')

  @parameterized.parameters(('article', 'highlights'), ('source', 'target'))
  def test_summarize(self, article_key, summary_key):
    out = self._run(preprocessors.summarize,
                    {article_key: 'A long text.', summary_key: 'Short.',
                     'id': 'x'},
                    article_key=article_key, summary_key=summary_key)
    self.assertEqual(out, {'inputs': b'summarize: A long text.',
                           'targets': b'Short.'})

  def test_doctests(self):
    for module in (preprocessors, objectives, metrics):
      result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
      self.assertGreater(result.attempted, 0, module.__name__)
      self.assertEqual(result.failed, 0, module.__name__)


class _TestVocabulary(seqio.vocabularies.PassThroughVocabulary):
  """Token ids as they are; `VOCAB_SIZE` ids, EOS 1."""

  def __init__(self):
    super().__init__(size=VOCAB_SIZE, eos_id=EOS)


def _token_dataset(documents):
  return tf.data.Dataset.from_generator(
      lambda: ({'targets': np.asarray(d, np.int32)} for d in documents),
      output_signature={'targets': tf.TensorSpec([None], tf.int32)})


class ObjectivesTest(parameterized.TestCase):

  features = {name: seqio.Feature(_TestVocabulary(), add_eos=True)
              for name in ('inputs', 'targets')}

  def _run(self, preprocessor, documents, lengths=None):
    with seqio.map_seed_manager(1):
      ds = preprocessor(_token_dataset(documents),
                        sequence_length=lengths or LENGTHS,
                        output_features=self.features)
      return list(ds.as_numpy_iterator())

  def test_split_tokens(self):
    out = objectives.split_tokens(_token_dataset([[5, 6, 7], [], [8]]), 2)
    self.assertEqual([x['targets'].tolist() for x in out.as_numpy_iterator()],
                     [[5, 6], [7], [8]])

  def test_select_random_chunk(self):
    document = list(range(3, 13))
    with seqio.map_seed_manager(3):
      chunks = objectives.select_random_chunk(
          _token_dataset([document] * 40 + [[]]), max_tokens=4)
      chunks = [x['targets'].tolist() for x in chunks.as_numpy_iterator()]
    self.assertLen(chunks, 40)
    self.assertEqual({tuple(c) for c in chunks},
                     {(3, 4, 5, 6), (7, 8, 9, 10), (11, 12)})

  def test_prefix_lm_cuts_documents_into_prefix_and_rest(self):
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, VOCAB_SIZE, n) for n in (1500, 40, 511, 1)]
    examples = self._run(objectives.prefix_lm, documents)
    # Pieces of 511 tokens (512 less EOS), split in two.
    self.assertEqual([len(x['inputs']) + len(x['targets']) for x in examples],
                     [511, 511, 478, 40, 511, 1])
    np.testing.assert_array_equal(
        np.concatenate([np.concatenate([x['inputs'], x['targets']])
                        for x in examples]),
        np.concatenate(documents))
    for x in examples[:-1]:
      self.assertNotEmpty(x['inputs'])
      self.assertNotEmpty(x['targets'])

  def test_prefix_lengths_are_uniform(self):
    examples = self._run(objectives.prefix_lm, [list(range(3, 13))] * 500,
                         lengths={'inputs': 11, 'targets': 11})
    counts = np.bincount([len(x['inputs']) for x in examples], minlength=11)
    self.assertEqual(counts[0], 0)
    self.assertEqual(counts[10], 0)
    # 500 draws over 9 lengths: about 56 each.
    self.assertTrue(np.all(counts[1:10] > 25), counts)

  def test_span_corruption_lengths(self):
    self.assertEqual(objectives.span_corruption_lengths(512), (568, 114))
    # 21 tokens: 3 noise in 1 span; inputs 18 + 1 sentinel + EOS = 20;
    # targets 3 + 1 sentinel + EOS = 5. 22 tokens would make 21 inputs.
    self.assertEqual(objectives.span_corruption_lengths(20), (21, 5))

  @parameterized.parameters(10, 100, 568)
  def test_noise_mask(self, length):
    seeds = tf.constant([[1, 2], [3, 4]], tf.int64)
    mask = objectives.random_spans_noise_mask(
        tf.constant(length), 0.15, 3.0, tf.unstack(seeds)).numpy()
    num_noise = max(1, round(length * 0.15))
    self.assertEqual(mask.shape, (length,))
    self.assertEqual(mask.sum(), num_noise)
    self.assertFalse(mask[0])
    span_starts = mask & ~np.concatenate([[False], mask[:-1]])
    self.assertEqual(span_starts.sum(), max(1, round(num_noise / 3)))

  def test_span_corruption_restores_documents(self):
    rng = np.random.default_rng(0)
    # Tokens below the sentinels (the last ids), so that sentinels are
    # recognisable.
    documents = [rng.integers(3, 150, n) for n in (1000, 1000, 1000)]
    examples = self._run(objectives.span_corruption, documents)
    self.assertLen(examples, 6)  # 3000 tokens: 5 pieces of 568 and 160.
    restored = []
    for x in examples:
      hidden, sentinel = {}, None
      for token in x['targets']:
        if token >= 150:
          sentinel = token
          hidden[sentinel] = []
        else:
          hidden[sentinel].append(token)
      for token in x['inputs']:
        restored.extend(hidden[token] if token >= 150 else [token])
    np.testing.assert_array_equal(restored, np.concatenate(documents))
    # A full piece corrupts into exactly 511 + EOS inputs, 113 + EOS targets.
    for x in examples[:5]:
      self.assertLen(x['inputs'], 511)
      self.assertLen(x['targets'], 113)
      self.assertEqual(x['inputs'].max(), VOCAB_SIZE - 1)

  def test_span_corruption_needs_long_enough_targets(self):
    with self.assertRaisesRegex(ValueError, '114'):
      self._run(objectives.span_corruption, [[5, 6]],
                lengths={'inputs': 512, 'targets': 100})


class MetricsTest(absltest.TestCase):

  def test_identical_strings_score_100(self):
    texts = ['Das Haus ist klein.', 'Guten Morgen, wie geht es Ihnen?',
             'the cat sat on the mat']
    self.assertAlmostEqual(metrics.bleu(texts, texts)['bleu'], 100.0)
    self.assertEqual(metrics.rouge(texts, texts),
                     {'rouge1': 100.0, 'rouge2': 100.0, 'rougeLsum': 100.0})

  def test_bleu_hand_computed(self):
    # n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths: no brevity penalty.
    score = metrics.bleu(['the cat sat on a mat'], ['the cat sat on the mat'])
    self.assertAlmostEqual(score['bleu'], 100 * (1 / 12) ** 0.25, places=6)

  def test_bleu_brevity_penalty(self):
    # All n-grams match; hypothesis 4 tokens, reference 6: BP = exp(1 - 6/4).
    score = metrics.bleu(['a b c d e f'], ['a b c d'])
    self.assertAlmostEqual(score['bleu'], 100 * np.exp(1 - 6 / 4), places=6)

  def test_rouge_hand_computed(self):
    # rouge1: P 3/3, R 3/6; rouge2: P 2/2, R 2/5; LCS = 3 unigrams.
    scores = metrics.rouge(['the cat sat on the mat'], ['the cat sat'])
    self.assertAlmostEqual(scores['rouge1'], 200 / 3)
    self.assertAlmostEqual(scores['rouge2'], 400 / 7)
    self.assertAlmostEqual(scores['rougeLsum'], 200 / 3)

  def test_rouge_lsum_splits_sentences_at_periods(self):
    # Sentence by sentence, each reference sentence is found whole; as one
    # sentence the longest common subsequence is half of it.
    scores = metrics.rouge(['a b . c d'], ['c d . a b'])
    self.assertAlmostEqual(scores['rougeLsum'], 100.0)
    self.assertAlmostEqual(scores['rouge1'], 100.0)
    self.assertAlmostEqual(scores['rouge2'], 100 * 2 / 3)


if __name__ == '__main__':
  absltest.main()
