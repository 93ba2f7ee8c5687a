"""Text preprocessors of the finetuning tasks: T5's prompts and key mapping."""

from typing import Mapping

import seqio
import tensorflow as tf

__all__ = ['translate', 'summarize', 'translation_prompt', 'LANGUAGE_NAMES',
           'SUMMARIZE_PROMPT']

# T5's prompts name languages in English; T5 itself was trained on en, de,
# fr and ro, the others are for models trained from scratch.
LANGUAGE_NAMES = {
    'cs': 'Czech', 'da': 'Danish', 'de': 'German', 'en': 'English',
    'es': 'Spanish', 'fi': 'Finnish', 'fr': 'French', 'it': 'Italian',
    'ja': 'Japanese', 'nl': 'Dutch', 'pl': 'Polish', 'pt': 'Portuguese',
    'ro': 'Romanian', 'ru': 'Russian', 'sv': 'Swedish', 'uk': 'Ukrainian',
    'zh': 'Chinese'}
SUMMARIZE_PROMPT = 'summarize: '


def translation_prompt(source_language: str, target_language: str) -> str:
  """T5's translation prompt.

  >>> translation_prompt('en', 'de')
  'translate English to German: '

  Args:
    source_language: language code of the source text, a key of
      `LANGUAGE_NAMES`.
    target_language: language code of the target text.

  Returns:
    The prompt, ending in ': '.
  """
  for code in (source_language, target_language):
    if code not in LANGUAGE_NAMES:
      raise ValueError(f"Unknown language code '{code}'; known: "
                       f'{sorted(LANGUAGE_NAMES)}.')
  return (f'translate {LANGUAGE_NAMES[source_language]} to '
          f'{LANGUAGE_NAMES[target_language]}: ')


def translate(dataset: tf.data.Dataset, source_language: str,
              target_language: str) -> tf.data.Dataset:
  """Maps `{src: text, tgt: text}` pairs to prompted `inputs`/`targets`.

  Example: `{'en': 'Hello.', 'de': 'Hallo.'}` with ('en', 'de') becomes
  `{'inputs': 'translate English to German: Hello.', 'targets': 'Hallo.'}`.
  Other features are dropped.

  Args:
    dataset: examples with string features named by the language codes.
    source_language: code of the source language, e.g. 'en'.
    target_language: code of the target language, e.g. 'de'.

  Returns:
    The dataset of text-to-text examples.
  """
  prompt = translation_prompt(source_language, target_language)

  @seqio.map_over_dataset
  def to_text2text(x: Mapping[str, tf.Tensor]):
    return {
        'inputs': tf.strings.join([prompt, x[source_language]]),
        'targets': x[target_language],
    }

  return to_text2text(dataset)


def summarize(dataset: tf.data.Dataset, article_key: str,
              summary_key: str) -> tf.data.Dataset:
  """Maps `{article_key: text, summary_key: text}` to prompted pairs.

  Example: `{'article': 'A long text.', 'highlights': 'Short.'}` becomes
  `{'inputs': 'summarize: A long text.', 'targets': 'Short.'}`.
  Other features are dropped.

  Args:
    dataset: examples with string features `article_key` and `summary_key`.
    article_key: the feature to summarise.
    summary_key: the reference summary.

  Returns:
    The dataset of text-to-text examples.
  """

  @seqio.map_over_dataset
  def to_text2text(x: Mapping[str, tf.Tensor]):
    return {
        'inputs': tf.strings.join([SUMMARIZE_PROMPT, x[article_key]]),
        'targets': x[summary_key],
    }

  return to_text2text(dataset)
