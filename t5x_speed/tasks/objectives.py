"""Self-supervised C4 objectives as token preprocessors: prefix LM and spans.

Both follow the T5 recipes (Raffel et al., 2019: `prefix_lm` and
`span_corruption` of `t5.data.preprocessors`) and run after tokenisation on
examples whose `targets` feature holds one whole tokenised document. They
return examples with `inputs` and `targets` token features and no EOS; the
task appends EOS afterwards (`seqio.preprocessors.append_eos_after_trim`), and
the lengths computed here leave room for it.
"""

from typing import Mapping, Tuple

import seqio
import tensorflow as tf

__all__ = ['prefix_lm', 'span_corruption', 'span_corruption_lengths',
           'split_prefix', 'split_tokens', 'concat_documents',
           'select_random_chunk', 'random_spans_noise_mask',
           'replace_spans_with_sentinels']

# At most this many tokens are kept per document (one random aligned chunk)
# before splitting: bounds the work spent on, and the weight of, a single
# huge document. T5's value.
MAX_DOCUMENT_TOKENS = 65536
# Span corruption concatenates this many documents before cutting segments,
# so that segments are full-length rather than padded document tails. T5's
# value.
_CONCAT_DOCUMENTS = 128


def select_random_chunk(dataset: tf.data.Dataset,
                        max_tokens: int = MAX_DOCUMENT_TOKENS,
                        feature_key: str = 'targets') -> tf.data.Dataset:
  """Keeps one random chunk of at most `max_tokens` tokens per document.

  Chunks are aligned at multiples of `max_tokens` and picked uniformly, so
  every token of a document is kept with the same probability. Empty
  documents are dropped, and so are all features but `feature_key`.

  Args:
    dataset: examples with a 1-D token feature `feature_key`.
    max_tokens: the chunk length.
    feature_key: the feature to cut.

  Returns:
    The dataset of chunks.
  """

  @seqio.map_over_dataset(num_seeds=1)
  def chunk(x, seed):
    tokens = x[feature_key]
    num_chunks = (tf.size(tokens) + max_tokens - 1) // max_tokens
    index = tf.random.stateless_uniform([], seed=seed, maxval=num_chunks,
                                        dtype=tf.int32)
    return {feature_key: tokens[index * max_tokens:(index + 1) * max_tokens]}

  return chunk(dataset.filter(lambda x: tf.size(x[feature_key]) > 0))


def concat_documents(dataset: tf.data.Dataset,
                     num_documents: int = _CONCAT_DOCUMENTS,
                     feature_key: str = 'targets') -> tf.data.Dataset:
  """Concatenates the tokens of every `num_documents` consecutive documents."""
  dataset = dataset.map(lambda x: {feature_key: x[feature_key]})
  dataset = dataset.ragged_batch(num_documents)
  return dataset.map(lambda x: {feature_key: x[feature_key].flat_values})


def split_tokens(dataset: tf.data.Dataset,
                 max_tokens: int,
                 feature_key: str = 'targets') -> tf.data.Dataset:
  """Cuts each token sequence into consecutive pieces of `max_tokens` tokens.

  The last piece of a sequence may be shorter; other features are dropped.

  Example: with `max_tokens=2`, `{'targets': [5, 6, 7]}` becomes
  `{'targets': [5, 6]}` and `{'targets': [7]}`.

  Args:
    dataset: examples with a 1-D token feature `feature_key`.
    max_tokens: the piece length.
    feature_key: the feature to cut.

  Returns:
    The dataset of pieces, in order.
  """

  def pieces(x):
    tokens = x[feature_key]
    starts = tf.data.Dataset.range(0, tf.size(tokens, tf.int64), max_tokens)
    return starts.map(lambda s: {feature_key: tokens[s:s + max_tokens]})

  dataset = dataset.filter(lambda x: tf.size(x[feature_key]) > 0)
  return dataset.flat_map(pieces)


def _check_sequence_length(sequence_length, name: str) -> None:
  if not sequence_length or not sequence_length.get('inputs'):
    raise ValueError(f'{name} needs sequence_length["inputs"] to cut documents'
                     f' to size; got sequence_length={sequence_length}.')


def split_prefix(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Splits each `targets` sequence at a random point into inputs and targets.

  The prefix length is uniform in [1, n - 1] for a sequence of n >= 2 tokens,
  so that both sides are non-empty (a 1-token sequence becomes an empty prefix
  and a 1-token target). This is T5's `random_prefix_noise_mask` with its
  default noise density 0.5.

  Args:
    dataset: examples with a 1-D token feature `targets`.

  Returns:
    Examples `{'inputs': prefix, 'targets': rest}`.
  """

  @seqio.map_over_dataset(num_seeds=1)
  def split(x, seed):
    tokens = x['targets']
    max_prefix = tf.size(tokens) - 1
    min_prefix = tf.minimum(1, max_prefix)
    prefix = tf.random.stateless_uniform([], seed=seed, minval=min_prefix,
                                         maxval=max_prefix + 1, dtype=tf.int32)
    return {'inputs': tokens[:prefix], 'targets': tokens[prefix:]}

  return split(dataset)


def prefix_lm(dataset: tf.data.Dataset,
              sequence_length: Mapping[str, int],
              output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
  """T5's prefix LM objective: a document piece split into prefix and rest.

  A random chunk of each document is cut into pieces that fit `inputs`
  (less one token for EOS when inputs get one), and each piece is split at a
  random point (`split_prefix`). As in T5, the prefix and its continuation
  together fit the `inputs` length.

  Args:
    dataset: tokenised documents in `targets`.
    sequence_length: feature lengths; 'inputs' sets the piece length.
    output_features: the task's features; their `add_eos` is respected.

  Returns:
    Examples with `inputs` and `targets` token features.
  """
  _check_sequence_length(sequence_length, 'prefix_lm')
  eos_length = int(output_features['inputs'].add_eos)
  max_tokens = sequence_length['inputs'] - eos_length
  dataset = select_random_chunk(dataset)
  dataset = split_tokens(dataset, max_tokens)
  return split_prefix(dataset)


def span_corruption_lengths(inputs_length: int,
                            noise_density: float = 0.15,
                            mean_noise_span_length: float = 3.0
                           ) -> Tuple[int, int]:
  """Raw and target lengths of span corruption that exactly fill the inputs.

  Corrupting n raw tokens yields inputs with the non-noise tokens, one
  sentinel per noise span and EOS, and targets with the noise tokens, one
  sentinel per span and EOS. Returns the largest n whose inputs fit
  `inputs_length`, and the targets length it gives (T5's
  `random_spans_helper` with one sentinel per span on each side, without its
  adjustment for noise density 0.5).

  >>> span_corruption_lengths(512)
  (568, 114)

  Args:
    inputs_length: the inputs feature length, EOS included.
    noise_density: fraction of raw tokens that are noise.
    mean_noise_span_length: mean length of a noise span.

  Returns:
    (raw tokens per example, targets length).
  """

  def encoded_lengths(num_tokens):
    num_noise = int(round(num_tokens * noise_density))
    num_spans = int(round(num_noise / mean_noise_span_length))
    return (num_tokens - num_noise + num_spans + 1, num_noise + num_spans + 1)

  num_tokens = inputs_length - 1
  while encoded_lengths(num_tokens + 1)[0] <= inputs_length:
    num_tokens += 1
  return num_tokens, encoded_lengths(num_tokens)[1]


def _random_partition(total, num_parts, seed):
  """Random lengths >= 1 of `num_parts` parts that sum to `total`."""
  cuts = tf.random.experimental.stateless_shuffle(tf.range(1, total), seed)
  cuts = tf.sort(cuts[:num_parts - 1])
  bounds = tf.concat([[0], cuts, [total]], axis=0)
  return bounds[1:] - bounds[:-1]


def random_spans_noise_mask(length, noise_density: float,
                            mean_noise_span_length: float, seeds):
  """Boolean mask of `length` tokens with about `noise_density` noise in spans.

  The sequence alternates non-noise and noise spans, starting with non-noise;
  both kinds have random lengths, the noise spans `mean_noise_span_length`
  long on average. There is always at least one noise and one non-noise token
  (for `length` >= 2).

  Args:
    length: int32 scalar, the number of tokens.
    noise_density: fraction of noise tokens.
    mean_noise_span_length: mean length of a noise span.
    seeds: two stateless seeds (shape [2, 2]).

  Returns:
    A bool tensor of shape [length], True at noise tokens.
  """
  full_length = length
  # Build the mask for at least 2 tokens so both kinds exist, then cut.
  length = tf.maximum(length, 2)
  num_noise = tf.cast(tf.round(tf.cast(length, tf.float32) * noise_density),
                      tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_nonnoise = length - num_noise
  num_spans = tf.cast(
      tf.round(tf.cast(num_noise, tf.float32) / mean_noise_span_length),
      tf.int32)
  # Every span of either kind needs a token.
  num_spans = tf.clip_by_value(num_spans, 1, tf.minimum(num_noise,
                                                        num_nonnoise))
  noise_lengths = _random_partition(num_noise, num_spans, seeds[0])
  nonnoise_lengths = _random_partition(num_nonnoise, num_spans, seeds[1])
  span_lengths = tf.reshape(tf.stack([nonnoise_lengths, noise_lengths], 1),
                            [-1])
  span_is_noise = tf.tile([False, True], [num_spans])
  return tf.repeat(span_is_noise, span_lengths)[:full_length]


def replace_spans_with_sentinels(tokens, mask, first_sentinel_id: int):
  """Replaces each run of masked tokens by one sentinel id.

  Sentinels count down from `first_sentinel_id`, T5's convention of using the
  last ids of the vocabulary (its `<extra_id_0>`, `<extra_id_1>`, ...).

  >>> replace_spans_with_sentinels(
  ...     tf.constant([5, 6, 7, 8, 9]),
  ...     tf.constant([False, True, True, False, True]), 99).numpy().tolist()
  [5, 99, 8, 98]

  Args:
    tokens: 1-D int tensor.
    mask: 1-D bool tensor of the same length; True marks tokens to replace.
    first_sentinel_id: the sentinel of the first run.

  Returns:
    The tokens with every masked run replaced by its sentinel.
  """
  after_masked = tf.concat([[False], mask[:-1]], axis=0)
  run_starts = tf.logical_and(mask, tf.logical_not(after_masked))
  sentinels = first_sentinel_id + 1 - tf.cumsum(tf.cast(run_starts,
                                                        tokens.dtype))
  tokens = tf.where(run_starts, sentinels, tokens)
  return tf.boolean_mask(tokens,
                         tf.logical_not(tf.logical_and(mask, after_masked)))


def span_corruption(dataset: tf.data.Dataset,
                    sequence_length: Mapping[str, int],
                    output_features: Mapping[str, seqio.Feature],
                    noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0) -> tf.data.Dataset:
  """T5's span corruption: noise spans become sentinels, targets restore them.

  Documents are chunked, concatenated and cut into pieces sized so that the
  corrupted inputs fill `sequence_length['inputs']` (EOS included). In each
  piece, random spans covering `noise_density` of the tokens are replaced by
  one sentinel each in `inputs`; `targets` lists each sentinel followed by
  the tokens it hides.

  Args:
    dataset: tokenised documents in `targets`.
    sequence_length: feature lengths; 'targets' must hold the targets that
      `span_corruption_lengths` predicts.
    output_features: the task's features; sentinels are the last ids of the
      targets vocabulary.
    noise_density: fraction of tokens hidden.
    mean_noise_span_length: mean length of a hidden span.

  Returns:
    Examples with `inputs` and `targets` token features.

  Raises:
    ValueError: when the targets length is too short.
  """
  _check_sequence_length(sequence_length, 'span_corruption')
  num_tokens, targets_length = span_corruption_lengths(
      sequence_length['inputs'], noise_density, mean_noise_span_length)
  max_targets = sequence_length.get('targets')
  if max_targets is not None and max_targets < targets_length:
    raise ValueError(
        f'Span corruption with inputs length {sequence_length["inputs"]} '
        f'makes targets of {targets_length} tokens, more than the targets '
        f'length {max_targets}.')
  first_sentinel_id = output_features['targets'].vocabulary.vocab_size - 1

  @seqio.map_over_dataset(num_seeds=2)
  def corrupt(x, seeds):
    tokens = x['targets']
    noise = random_spans_noise_mask(tf.size(tokens), noise_density,
                                    mean_noise_span_length, seeds)
    return {
        'inputs': replace_spans_with_sentinels(tokens, noise,
                                               first_sentinel_id),
        'targets': replace_spans_with_sentinels(tokens, tf.logical_not(noise),
                                                first_sentinel_id),
    }

  dataset = select_random_chunk(dataset)
  dataset = concat_documents(dataset)
  dataset = split_tokens(dataset, num_tokens)
  return corrupt(dataset)
