"""Definitions of the SPEED tasks and mixtures, and their registration.

Examples have `inputs` (the prompt and source text, or a document's
beginning) and `targets`, both SentencePiece tokens ending in EOS, as T5
makes them, so every task serves both model families: T5X feeds them to a
decoder-only model (`SpeedDecoderOnlyModel`) through
`seqio.DecoderFeatureConverter`, which concatenates the two as a prefix LM
attending bidirectionally over `inputs`, and to an encoder-decoder model
(`SpeedEncoderDecoderModel`) through `seqio.EncDecFeatureConverter`, inputs
to the encoder and targets to the decoder; each model class names its
converter.
"""

import functools
from typing import Dict, Optional, Sequence, Tuple, Union

import seqio

from t5x_speed.tasks import demo
from t5x_speed.tasks import metrics
from t5x_speed.tasks import objectives
from t5x_speed.tasks import preprocessors
from t5x_speed.tasks import sources
from t5x_speed.tasks import vocabularies

__all__ = ['register_tasks', 'register_translation_tsv_task',
           'default_vocabulary', 'output_features', 'TASKS', 'MIXTURES',
           'FINETUNING_TASKS', 'SEQUENCE_LENGTH', 'C4_PREFIX_LM',
           'C4_SPAN_CORRUPTION', 'WMT_ENDE', 'PARACRAWL_ENDE',
           'PARACRAWL_PARAGRAPH_ENDE', 'CNN_DAILYMAIL', 'WIKILINGUA_EN']

DEFAULT_VOCAB_PATH = vocabularies.DEFAULT_VOCAB_PATH
VOCAB_ENV_VAR = vocabularies.VOCAB_ENV_VAR
PARAGRAPH_DIR_ENV_VAR = sources.PARAGRAPH_DIR_ENV_VAR

# Feature lengths of the paper's pretraining and finetuning runs.
SEQUENCE_LENGTH = {'inputs': 512, 'targets': 512}

C4_PREFIX_LM = 'speed_c4_prefix_lm'
C4_SPAN_CORRUPTION = 'speed_c4_span_corruption'
WMT_ENDE = 'speed_wmt_ende'
PARACRAWL_ENDE = 'speed_paracrawl_ende'
PARACRAWL_PARAGRAPH_ENDE = 'speed_paracrawl_paragraph_ende'
CNN_DAILYMAIL = 'speed_cnn_dailymail'
WIKILINGUA_EN = 'speed_wikilingua_en'

TASKS = (C4_PREFIX_LM, C4_SPAN_CORRUPTION, WMT_ENDE, PARACRAWL_ENDE,
         PARACRAWL_PARAGRAPH_ENDE, CNN_DAILYMAIL, WIKILINGUA_EN)
FINETUNING_TASKS = (WMT_ENDE, PARACRAWL_PARAGRAPH_ENDE, CNN_DAILYMAIL,
                    WIKILINGUA_EN)

# Mixture name -> its tasks. Tasks are mixed at equal rates: T5's
# example-count rates need the size of every split, which the user's
# paragraph files do not declare.
MIXTURES = {
    'speed_pretrain': (C4_PREFIX_LM,),
    'speed_translation_ende': (WMT_ENDE, PARACRAWL_PARAGRAPH_ENDE),
    'speed_summarization': (CNN_DAILYMAIL, WIKILINGUA_EN),
    'speed_finetune_all': FINETUNING_TASKS,
}

# TFDS sources, pinned to the versions the installed TFDS builds. T5 used
# c4/en:2.2.0 / 3.0.1; 3.1.0 is the version `tfds build c4/en` makes now.
C4_TFDS = 'c4/en:3.1.0'
WMT_TFDS = 'wmt_t2t_translate/de-en:1.0.0'
PARACRAWL_TFDS = 'para_crawl/ende:1.2.0'
CNN_DAILYMAIL_TFDS = 'cnn_dailymail:3.4.0'
WIKILINGUA_TFDS = 'gem/wiki_lingua_english_en:1.1.0'
PARACRAWL_PARAGRAPH_NAME = 'paracrawl_paragraph/ende'

_C4_NOTE = (' (C4 is generated from Common Crawl with Apache Beam: install '
            'apache-beam and see https://www.tensorflow.org/datasets/catalog/c4'
            ' and https://www.tensorflow.org/datasets/beam_datasets)')
_SPLITS = ('train', 'validation', 'test')

VocabularyOrPath = Union[seqio.Vocabulary, str]


def default_vocabulary() -> vocabularies.SentencePieceVocabulary:
  """T5's SentencePiece vocabulary, or the model file in $T5X_SPEED_VOCAB.

  The model file is read on first use, not here; if it cannot be read then
  (e.g. T5's gs:// file offline), first use raises
  `VocabularyNotReadableError` naming T5X_SPEED_VOCAB and the gin macro
  SENTENCEPIECE_MODEL.

  Returns:
    The vocabulary (no extra ids: T5's model already holds its 100 sentinels).
  """
  return vocabularies.SentencePieceVocabulary(vocabularies.vocabulary_path())


def output_features(
    vocabulary: seqio.Vocabulary) -> Dict[str, seqio.Feature]:
  """`inputs` and `targets` features, both ending in EOS as T5 does."""
  return {
      'inputs': seqio.Feature(vocabulary=vocabulary, add_eos=True),
      'targets': seqio.Feature(vocabulary=vocabulary, add_eos=True),
  }


def _c4_tasks(features, tfds_data_dir):
  """{name: Task kwargs} of the C4 pretraining tasks."""
  objective = {
      C4_PREFIX_LM: objectives.prefix_lm,
      C4_SPAN_CORRUPTION: objectives.span_corruption,
  }
  return {
      name: dict(
          source=sources.PreparedTfdsSource(
              C4_TFDS, task_name=name, splits=('train', 'validation'),
              tfds_data_dir=tfds_data_dir, prepare_note=_C4_NOTE),
          preprocessors=[
              functools.partial(seqio.preprocessors.rekey,
                                key_map={'targets': 'text'}),
              # The objectives drop the text, so there is no point in caching
              # a copy of it.
              functools.partial(seqio.preprocessors.tokenize,
                                copy_pretokenized=False),
              seqio.CacheDatasetPlaceholder(),
              objective_fn,
              seqio.preprocessors.append_eos_after_trim,
          ],
          output_features=features,
          metric_fns=[],
      ) for name, objective_fn in objective.items()
  }


def _finetuning_tasks(features, paragraph_data_dir, tfds_data_dir):
  """{name: Task kwargs} of the translation and summarisation tasks."""

  def tfds_source(tfds_name, task_name, splits=_SPLITS):
    return sources.PreparedTfdsSource(tfds_name, task_name=task_name,
                                      splits=splits,
                                      tfds_data_dir=tfds_data_dir)

  def task(source, text_preprocessor, metric_fn):
    return dict(
        source=source,
        preprocessors=[
            text_preprocessor,
            seqio.preprocessors.tokenize,
            seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features=features,
        metric_fns=[metrics.with_speed_statistics(metric_fn)],
    )

  en_to_de = functools.partial(preprocessors.translate, source_language='en',
                               target_language='de')
  return {
      WMT_ENDE: task(tfds_source(WMT_TFDS, WMT_ENDE), en_to_de, metrics.bleu),
      # TFDS para_crawl has a train split only.
      PARACRAWL_ENDE: task(
          tfds_source(PARACRAWL_TFDS, PARACRAWL_ENDE, splits=('train',)),
          en_to_de, metrics.bleu),
      PARACRAWL_PARAGRAPH_ENDE: task(
          sources.ParagraphPairSource(
              PARACRAWL_PARAGRAPH_NAME, task_name=PARACRAWL_PARAGRAPH_ENDE,
              data_dir=paragraph_data_dir, languages=('en', 'de'),
              splits=_SPLITS),
          en_to_de, metrics.bleu),
      CNN_DAILYMAIL: task(
          tfds_source(CNN_DAILYMAIL_TFDS, CNN_DAILYMAIL),
          functools.partial(preprocessors.summarize, article_key='article',
                            summary_key='highlights'),
          metrics.rouge),
      WIKILINGUA_EN: task(
          tfds_source(WIKILINGUA_TFDS, WIKILINGUA_EN),
          functools.partial(preprocessors.summarize, article_key='source',
                            summary_key='target'),
          metrics.rouge),
  }


def register_translation_tsv_task(
    name: str,
    data_dir: str,
    vocabulary: VocabularyOrPath,
    languages: Tuple[str, str] = ('en', 'fr'),
    overwrite: bool = True,
    splits: Sequence[str] = _SPLITS) -> seqio.Task:
  """Registers a translation task over your own `<split>.tsv` files.

  The files are those of `sources.ParagraphPairSource` (`train.tsv`,
  `validation.tsv`, `test.tsv`, one `source<TAB>target` pair per line, or
  TFRecord shards), read from `data_dir` when data is read. Examples get
  T5's prompt for `languages` (`translate English to French: ...`), and
  predictions are scored with BLEU and chrF, plus SPEED's statistics where
  the model returns them.

  Example (the gettext set of `python -m tools.gettext_data`):

    register_translation_tsv_task('gettext_enfr', '/tmp/gettext_enfr',
                                  '/tmp/gettext_enfr/spm.model',
                                  languages=('en', 'fr'))
    # python -m t5x.train ... --gin.MIXTURE_OR_TASK_NAME="'gettext_enfr'"
    # (import the module that calls this with --gin.MIXTURE_OR_TASK_MODULE)

  Args:
    name: the task name.
    data_dir: the directory of the split files.
    vocabulary: a seqio vocabulary or a SentencePiece model path.
    languages: (source, target) language codes, keys of
      `preprocessors.LANGUAGE_NAMES`: the TSV columns in order.
    overwrite: replace a task of the same name.
    splits: the split names, each read from its `<split>.tsv` (or shards).

  Returns:
    The registered task.
  """
  preprocessors.translation_prompt(*languages)  # fails on unknown codes
  if isinstance(vocabulary, str):
    vocabulary = vocabularies.SentencePieceVocabulary(vocabulary)
  if overwrite:
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=sources.ParagraphPairSource(
          name, task_name=name, data_dir=data_dir, languages=languages,
          splits=tuple(splits)),
      preprocessors=[
          functools.partial(preprocessors.translate,
                            source_language=languages[0],
                            target_language=languages[1]),
          seqio.preprocessors.tokenize,
          seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features=output_features(vocabulary),
      metric_fns=[metrics.with_speed_statistics(metrics.bleu_and_chrf)])


def register_tasks(vocabulary: Optional[VocabularyOrPath] = None,
                   paragraph_data_dir: Optional[str] = None,
                   tfds_data_dir: Optional[str] = None,
                   overwrite: bool = True) -> None:
  """(Re)registers every SPEED task and mixture in seqio's registries.

  Importing `t5x_speed.tasks` calls this with the defaults. Call it again to
  switch vocabulary or data locations, e.g.

    register_tasks(vocabulary='/data/spm/my.model',
                   paragraph_data_dir='/data/paracrawl_paragraphs')

  Mixtures hold the Task objects they were built with, so mixtures of your
  own that contain these tasks must be registered again afterwards.

  Args:
    vocabulary: a seqio vocabulary or the path of a SentencePiece model
      (read on first use), for both features; None is
      `default_vocabulary()` ($T5X_SPEED_VOCAB, else T5's model).
    paragraph_data_dir: directory of the paragraph-level Paracrawl files;
      None reads $T5X_SPEED_PARACRAWL_PARAGRAPH_DIR when the data is read.
    tfds_data_dir: TFDS data directory of the TFDS tasks; None uses seqio's
      override or TFDS's default ($TFDS_DATA_DIR, else ~/tensorflow_datasets).
    overwrite: replace tasks and mixtures of the same names; if False,
      registering a name twice raises seqio's ValueError.
  """
  if vocabulary is None:
    vocabulary = default_vocabulary()
  elif isinstance(vocabulary, str):
    vocabulary = vocabularies.SentencePieceVocabulary(vocabulary)
  features = output_features(vocabulary)
  tasks = {
      **_c4_tasks(features, tfds_data_dir),
      **_finetuning_tasks(features, paragraph_data_dir, tfds_data_dir),
  }
  assert set(tasks) == set(TASKS), sorted(tasks)
  for name in TASKS:
    if overwrite:
      seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(name, **tasks[name])
  # After the tasks: a mixture looks its tasks up when it is built.
  for name, task_names in MIXTURES.items():
    if overwrite:
      seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add(name, list(task_names), default_rate=1.0)
  # The demo task has its own byte vocabulary and generated data.
  demo.register_demo_task(overwrite=overwrite)
