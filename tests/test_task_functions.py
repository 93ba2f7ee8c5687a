"""The tasks' preprocessors, pretraining objectives and metrics."""

import doctest

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import seqio
import tensorflow as tf

from t5x_speed.tasks import metrics
from t5x_speed.tasks import objectives
from t5x_speed.tasks import preprocessors

import helpers
from tasks_helpers import (LENGTHS, EOS, VOCAB_SIZE)


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
    with self.assertRaisesRegex(ValueError, "'xx'"):
      preprocessors.translation_prompt('en', 'xx')
    self.assertEqual(preprocessors.translation_prompt('en', 'fr'),
                     'translate English to French: ')

  @parameterized.parameters(('article', 'highlights'), ('source', 'target'))
  def test_summarize(self, article_key, summary_key):
    out = self._run(preprocessors.summarize,
                    {article_key: 'A long text.', summary_key: 'Short.',
                     'id': 'x'},
                    article_key=article_key, summary_key=summary_key)
    self.assertEqual(out, {'inputs': b'summarize: A long text.',
                           'targets': b'Short.'})

  def test_doctests(self):
    helpers.assert_doctests(preprocessors, objectives, metrics,
                            optionflags=doctest.ELLIPSIS)


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
