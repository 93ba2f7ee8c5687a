"""The seqio tasks and mixtures: registration and feature conversion; offline.

TFDS sources are mocked (`tfds.testing.mock_data`), the paragraph task reads
files written here, and a SentencePiece model trained here replaces T5's.
"""

import os
import subprocess
import sys
from unittest import mock

from absl.testing import parameterized
import numpy as np
import seqio

import t5x_speed.tasks as speed_tasks
from t5x_speed.tasks import metrics

from tasks_helpers import (TRANSLATE_PROMPT, EOS, TFDS_TASKS, TFDS_NAMES,
                            MIXTURES, PARAGRAPH_PAIRS, LONG_TEXT, mock_tfds,
                            dataset, convert, TasksTestBase)


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
      os.environ.pop(speed_tasks.vocabularies.VOCAB_ENV_VAR, None)
      self.assertEqual(
          speed_tasks.registry.default_vocabulary().sentencepiece_model_file,
          'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model')
    with mock.patch.dict(
        os.environ, {speed_tasks.vocabularies.VOCAB_ENV_VAR: self.vocab_path}):
      self.assertEqual(
          speed_tasks.registry.default_vocabulary().sentencepiece_model_file,
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
    with mock_tfds():
      ds = dataset(name, split)
      examples = list(ds.as_numpy_iterator())
      converted = list(convert(ds).as_numpy_iterator())
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
    ds = dataset('speed_paracrawl_paragraph_ende', split)
    examples = list(ds.as_numpy_iterator())
    self._check_converted(examples, list(convert(ds).as_numpy_iterator()))
    self.assertEqual(
        [(ex['inputs_pretokenized'], ex['targets_pretokenized'])
         for ex in examples],
        [(TRANSLATE_PROMPT + en.encode(), de.encode())
         for en, de in PARAGRAPH_PAIRS[split]])

  def test_paragraph_task_tfrecord_truncates_to_512(self):
    ds = dataset('speed_paracrawl_paragraph_ende', 'test')
    examples = sorted(ds.as_numpy_iterator(), key=lambda ex: len(ex['inputs']))
    self._check_converted(examples, list(convert(ds).as_numpy_iterator()))
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
        os.environ,
        {speed_tasks.sources.PARAGRAPH_DIR_ENV_VAR: self.paragraph_dir}):
      examples = list(dataset('speed_paracrawl_paragraph_ende',
                               'validation').as_numpy_iterator())
    self.assertEqual(examples[0]['targets_pretokenized'], b'Hallo Welt.')

  def test_translation_tsv_task_of_your_own(self):
    task = speed_tasks.register_translation_tsv_task(
        'test_tsv_ende', self.paragraph_dir, self.vocab_path,
        languages=('en', 'de'))
    self.addCleanup(seqio.TaskRegistry.remove, 'test_tsv_ende')
    self.assertIs(seqio.get_mixture_or_task('test_tsv_ende'), task)
    examples = list(dataset('test_tsv_ende', 'train').as_numpy_iterator())
    self._check_converted(examples,
                          list(convert(dataset('test_tsv_ende', 'train'))
                               .as_numpy_iterator()))
    self.assertEqual(
        [(ex['inputs_pretokenized'], ex['targets_pretokenized'])
         for ex in examples],
        [(TRANSLATE_PROMPT + en.encode(), de.encode())
         for en, de in PARAGRAPH_PAIRS['train']])
    (metric_fn,) = task.predict_with_aux_metric_fns
    sentence = 'Die Katze schläft auf der Matte.'
    scores = metric_fn([sentence], [sentence], {})
    self.assertAlmostEqual(scores['bleu'], 100.0, places=6)
    self.assertAlmostEqual(scores['chrf'], 100.0, places=6)
    self.assertIs(metric_fn.metric_fn, metrics.bleu_and_chrf)
    speed_tasks.register_translation_tsv_task('test_tsv_ende',
                                              self.paragraph_dir, self.vocab)
    self.assertEqual(
        next(dataset('test_tsv_ende', 'validation').as_numpy_iterator())[
            'inputs_pretokenized'],
        b'translate English to French: Hello world.')
    with self.assertRaisesRegex(ValueError, "Unknown language code 'xx'"):
      speed_tasks.register_translation_tsv_task(
          'test_tsv_ende', self.paragraph_dir, self.vocab, ('en', 'xx'))

  @parameterized.parameters(*MIXTURES)
  def test_mixture(self, name):
    with mock_tfds():
      ds = dataset(name, 'train').take(12)
      examples = list(ds.as_numpy_iterator())
      converted = list(convert(ds).as_numpy_iterator())
    self.assertLen(examples, 12)
    self._check_converted(examples, converted)
