"""The tasks' data and vocabulary: missing datasets, the SentencePiece model
setting, and the model gin file's vocabulary; offline."""

import importlib.util
import os
import re
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import gin
import seqio
import tensorflow as tf

import t5x_speed.tasks as speed_tasks
from t5x_speed.tasks import sources
from t5x_speed.tasks import vocabularies

from tasks_helpers import (REPO, LENGTHS, EOS, VOCAB_SIZE, TFDS_TASKS,
                            TFDS_NAMES, dataset, TasksTestBase)


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
    with self.assertRaises(sources.DatasetNotPreparedError) as caught:
      task.get_dataset(LENGTHS, split='train')
    message = str(caught.exception)
    self.assertIn(f"Dataset '{TFDS_NAMES[name]}' for task '{name}' is not "
                  f"prepared under '{empty}'", message)
    self.assertIn(f'tfds build {TFDS_NAMES[name]} --data_dir={empty}',
                  message)
    self.assertIn('TFDS_DATA_DIR', message)
    with self.assertRaises(sources.DatasetNotPreparedError):
      task.num_input_examples('train')

  def test_unknown_split_is_not_reported_as_missing_data(self):
    task = seqio.get_mixture_or_task('speed_paracrawl_ende')
    with self.assertRaisesRegex(ValueError, "no split 'validation'"):
      task.source.get_dataset('validation')

  def _paragraph_error(self, split='train'):
    task = seqio.get_mixture_or_task('speed_paracrawl_paragraph_ende')
    with self.assertRaises(sources.DatasetNotPreparedError) as caught:
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
      os.environ.pop(sources.PARAGRAPH_DIR_ENV_VAR, None)
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
      list(dataset('speed_paracrawl_paragraph_ende',
                    'train').as_numpy_iterator())

  def test_paragraph_tsv_extra_tab(self):
    directory = self._directory_with({'validation.tsv': 'a\tb\tc\n'})
    speed_tasks.register_tasks(vocabulary=self.vocab,
                               paragraph_data_dir=directory)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r'Malformed line 1 of paragraph TSV file .*'
                                r'validation\.tsv: .* found 3\.'):
      list(dataset('speed_paracrawl_paragraph_ende',
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
      with self.assertRaises(vocabularies.VocabularyNotReadableError) as caught:
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
      dataset('speed_paracrawl_paragraph_ende', 'validation')
    self._assert_explained(str(caught.exception), missing)

  def test_default_gs_vocabulary_offline(self):
    with mock.patch.dict(os.environ):
      os.environ.pop(vocabularies.VOCAB_ENV_VAR, None)
      vocab = speed_tasks.registry.default_vocabulary()
    self.assertIsInstance(vocab, vocabularies.SentencePieceVocabulary)
    try:
      vocab.encode('Hello')
    except vocabularies.VocabularyNotReadableError as e:
      self._assert_explained(str(e), vocabularies.DEFAULT_VOCAB_PATH)
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
      os.environ.pop(vocabularies.VOCAB_ENV_VAR, None)
      self.assertEqual(vocabularies.vocabulary_path(),
                       vocabularies.DEFAULT_VOCAB_PATH)
    with mock.patch.dict(os.environ,
                         {vocabularies.VOCAB_ENV_VAR: self.vocab_path}):
      self.assertEqual(vocabularies.vocabulary_path(), self.vocab_path)


@absltest.skipUnless(importlib.util.find_spec('t5x'), 'needs T5X')
class ModelVocabularyGinTest(TasksTestBase):
  """The decoder-only models' VOCABULARY (gin/models/decoder_only/__init__.gin)
  follows the tasks' setting."""

  def tearDown(self):
    gin.clear_config()
    super().tearDown()

  def _vocabulary(self, *bindings):
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        [str(REPO / 't5x_speed' / 'gin' / 'models' / 'decoder_only' /
             '__init__.gin')],
        ['NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3', 'DROPOUT_RATE = 0.0',
         *bindings])
    vocabulary = gin.query_parameter('VOCABULARY/macro.value')
    return vocabulary.scoped_configurable_fn()

  def test_follows_env_var(self):
    with mock.patch.dict(os.environ,
                         {vocabularies.VOCAB_ENV_VAR: self.vocab_path}):
      vocab = self._vocabulary()
      self.assertEqual(vocab, speed_tasks.registry.default_vocabulary())
    self.assertIsInstance(vocab, vocabularies.SentencePieceVocabulary)
    self.assertEqual(vocab.vocab_size, VOCAB_SIZE)

  def test_flag_overrides_env_var(self):
    other = os.path.join(self.data_dir, 'other.model')
    shutil.copy(self.vocab_path, other)
    with mock.patch.dict(os.environ,
                         {vocabularies.VOCAB_ENV_VAR: self.vocab_path}):
      vocab = self._vocabulary(f"SENTENCEPIECE_MODEL = '{other}'")
    self.assertEqual(vocab.sentencepiece_model_file, other)

  def test_default_offline_is_explained(self):
    with mock.patch.dict(os.environ):
      os.environ.pop(vocabularies.VOCAB_ENV_VAR, None)
      vocab = self._vocabulary()
    self.assertEqual(vocab.sentencepiece_model_file,
                     vocabularies.DEFAULT_VOCAB_PATH)
    try:
      vocab.decode([5, 6])
    except vocabularies.VocabularyNotReadableError as e:
      self.assertIn('SENTENCEPIECE_MODEL', str(e))
    else:
      self.skipTest('GCS is reachable: T5\'s vocabulary was read.')
