"""Data sources of the SPEED tasks that fail with a "how to prepare" message.

Two sources:

* `PreparedTfdsSource`: a `seqio.TfdsDataSource` that only reads prepared
  TFDS data (it never starts a download in the middle of a training job) and
  turns TFDS's "data not found" errors into a `DatasetNotPreparedError` that
  names the task, the dataset and the command that prepares it.
* `ParagraphPairSource`: paragraph-aligned translation pairs from files the
  user provides (TFDS `para_crawl` is sentence-level only).
"""

import os
from typing import Mapping, Optional, Sequence, Tuple

from absl import logging
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.core import constants as tfds_constants

__all__ = ['PreparedTfdsSource', 'ParagraphPairSource',
           'DatasetNotPreparedError', 'PARAGRAPH_DIR_ENV_VAR']

PARAGRAPH_DIR_ENV_VAR = 'T5X_SPEED_PARACRAWL_PARAGRAPH_DIR'

# What TFDS raises when a dataset, version or its files are absent from the
# data directory (checked against tensorflow-datasets 4.9):
# * AssertionError: `as_dataset` before `download_and_prepare`, or a version
#   that is neither in the code nor on disk;
# * KeyError: `info.splits[...]` of a dataset that was never generated;
# * DatasetNotFoundError: a name TFDS does not know;
# * FileNotFoundError / tf NotFoundError: a partially deleted dataset.
_TFDS_MISSING_DATA_ERRORS = (
    AssertionError,
    KeyError,
    FileNotFoundError,
    tfds.core.DatasetNotFoundError,
    tf.errors.NotFoundError,
)


class DatasetNotPreparedError(FileNotFoundError):
  """A task's data is not where it is looked for; the message says how to fix.

  A subclass of `FileNotFoundError`, so generic handlers of missing files
  catch it too.
  """


class PreparedTfdsSource(seqio.TfdsDataSource):
  """`seqio.TfdsDataSource` over already prepared TFDS data only.

  Reading goes through `builder.as_dataset` (seqio's `read_only=True`), so a
  missing dataset is an immediate, explained error instead of a download and
  generation run started by the first training step.

  Example:

    source = PreparedTfdsSource('cnn_dailymail:3.4.0', task_name='my_task',
                                splits=['validation'], tfds_data_dir='/empty')
    source.get_dataset('validation')
    # DatasetNotPreparedError: Dataset 'cnn_dailymail:3.4.0' for task
    # 'my_task' is not prepared under '/empty'. Prepare it with
    # `tfds build cnn_dailymail:3.4.0 --data_dir=/empty`, ...
  """

  def __init__(self,
               tfds_name: str,
               *,
               task_name: str,
               splits: Sequence[str],
               tfds_data_dir: Optional[str] = None,
               prepare_note: str = ''):
    """Constructor.

    Args:
      tfds_name: TFDS name with config and version, e.g. 'cnn_dailymail:3.4.0'.
      task_name: the task reading this source, named in error messages.
      splits: the splits the task exposes. Given explicitly so that
        registering the task does not read the dataset's metadata.
      tfds_data_dir: TFDS data directory; None uses seqio's override or the
        TFDS default (environment variable TFDS_DATA_DIR, else
        ~/tensorflow_datasets).
      prepare_note: extra preparation advice appended to error messages.
    """
    super().__init__(tfds_name=tfds_name, tfds_data_dir=tfds_data_dir,
                     splits=list(splits), read_only=True)
    self._task_name = task_name
    self._prepare_note = prepare_note

  def _not_prepared(self, error: Exception) -> DatasetNotPreparedError:
    name = self.tfds_dataset.name
    data_dir = self.tfds_dataset.data_dir or tfds_constants.DATA_DIR
    message = (
        f"Dataset '{name}' for task '{self._task_name}' is not prepared under "
        f"'{data_dir}'. Prepare it with `tfds build {name} "
        f"--data_dir={data_dir}`{self._prepare_note}, or point TFDS at a "
        'directory that already holds it (environment variable TFDS_DATA_DIR, '
        "T5X's --tfds_data_dir, or seqio.set_tfds_data_dir_override). "
        f'TFDS said: {type(error).__name__}: {error}')
    return DatasetNotPreparedError(message)

  def _check_split(self, split: str) -> None:
    # Checked first: TFDS's KeyError for an unknown split would otherwise
    # read as "not prepared".
    if split not in self.splits:
      raise ValueError(f"Task '{self._task_name}' has no split '{split}'; it "
                       f'has {list(self.splits)}.')

  def get_dataset(self, split=tfds.Split.TRAIN, *args,
                  **kwargs) -> tf.data.Dataset:
    self._check_split(split)
    try:
      return super().get_dataset(split, *args, **kwargs)
    except _TFDS_MISSING_DATA_ERRORS as e:
      raise self._not_prepared(e) from e

  def num_input_examples(self, split: str) -> Optional[int]:
    self._check_split(split)
    try:
      return super().num_input_examples(split)
    except _TFDS_MISSING_DATA_ERRORS as e:
      raise self._not_prepared(e) from e

  def list_shards(self, split: str) -> Sequence[str]:
    self._check_split(split)
    try:
      return super().list_shards(split)
    except _TFDS_MISSING_DATA_ERRORS as e:
      raise self._not_prepared(e) from e


def _numbered_lines(path: tf.Tensor) -> tf.data.Dataset:
  """(path, 1-based line number, line) of each line of a text file."""
  lines = tf.data.TextLineDataset(path).enumerate(start=1)
  return lines.map(lambda number, line: (path, number, line))


def _parse_tsv_pairs(lines: tf.data.Dataset, keys: Tuple[str, str]):
  """{keys[0]: text, keys[1]: text} of `_numbered_lines` with one tab each.

  A line with another number of fields fails iteration with a
  `tf.errors.InvalidArgumentError` naming the file and the line, instead of
  `tf.io.decode_csv`'s "Expect 2 fields but have 1 in record 0".

  Args:
    lines: (path, line number, line) of every line, e.g. `_numbered_lines`
      of each file, interleaved. Empty lines are skipped.
    keys: names of the two columns.

  Returns:
    A dataset of the pairs.
  """
  lines = lines.filter(lambda path, number, line: tf.strings.length(line) > 0)
  layout = '<TAB>'.join(keys)

  def parse(path, number, line):
    # No quote handling: quotes are ordinary characters of the text.
    fields = tf.strings.split(line, '\t')
    count = tf.size(fields)
    # Built for every line (cheap next to tokenizing it): tf.debugging.Assert
    # takes its message as tensors, and this one needs the path and number.
    # No quotes in it: Assert prints them backslash-escaped.
    message = tf.strings.join([
        'Malformed line ', tf.strings.as_string(number),
        ' of paragraph TSV file ', path, ': expected 2 tab-separated fields (',
        layout, '), found ', tf.strings.as_string(count),
        '. Texts cannot contain tabs or newlines; use TFRecord files for '
        'those.'])
    check = tf.debugging.Assert(tf.equal(count, 2), [message])
    with tf.control_dependencies([check]):  # before indexing the fields
      return {key: fields[i] for i, key in enumerate(keys)}

  return lines.map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def _parse_tfexample_pairs(records: tf.data.Dataset, keys: Tuple[str, str]):
  spec = {key: tf.io.FixedLenFeature([], tf.string) for key in keys}
  return records.map(lambda record: tf.io.parse_single_example(record, spec),
                     num_parallel_calls=tf.data.AUTOTUNE)


class ParagraphPairSource(seqio.DataSource):
  """Translation pairs read from a directory of per-split files.

  Each split `<split>` is read from one of
  * `<split>.tsv` (or shards `<split>.tsv-00000-of-00008`, ...): one pair per
    line, `<source text><TAB><target text>`, no header, no quoting. Texts
    cannot contain tabs or newlines;
  * `<split>.tfrecord` (or shards `<split>.tfrecord-*`): `tf.train.Example`s
    with a bytes feature per language, e.g. 'en' and 'de'. Use these when
    paragraphs contain newlines.
  Examples come out as `{source_language: text, target_language: text}`,
  the layout of TFDS translation datasets.

  The directory is looked up when data is read, so that importing the task
  definitions needs no data: the `data_dir` argument if given, else the
  environment variable `T5X_SPEED_PARACRAWL_PARAGRAPH_DIR`.

  Example, with `/data/validation.tsv` holding the line
  `Hello world.<TAB>Hallo Welt.`:

    source = ParagraphPairSource('paracrawl_paragraph/ende', task_name='t',
                                 data_dir='/data')
    next(source.get_dataset('validation', shuffle=False).as_numpy_iterator())
    # {'en': b'Hello world.', 'de': b'Hallo Welt.'}
  """

  def __init__(self,
               dataset_name: str,
               *,
               task_name: str,
               data_dir: Optional[str] = None,
               languages: Tuple[str, str] = ('en', 'de'),
               splits: Sequence[str] = ('train', 'validation', 'test'),
               cycle_length: int = 16,
               block_length: int = 16):
    """Constructor.

    Args:
      dataset_name: name of the data set, for error messages.
      task_name: the task reading this source, for error messages.
      data_dir: directory with the split files; None reads the environment
        variable T5X_SPEED_PARACRAWL_PARAGRAPH_DIR when data is read.
      languages: (source, target) language codes: the TSV columns in order
        and the tf.train.Example feature names.
      splits: the splits the task exposes.
      cycle_length: files read in parallel (`tf.data.Dataset.interleave`).
      block_length: consecutive examples taken from each file.
    """
    super().__init__(splits=splits)
    self._dataset_name = dataset_name
    self._task_name = task_name
    self._data_dir = data_dir
    self._languages = tuple(languages)
    self._cycle_length = cycle_length
    self._block_length = block_length

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def __str__(self):
    return (f'{self.__class__.__name__}({self._dataset_name}, '
            f'data_dir={self._data_dir or "$" + PARAGRAPH_DIR_ENV_VAR})')

  def _expected_files(self, split: str) -> str:
    source, target = self._languages
    return (f"'{split}.tsv' (one '{source}<TAB>{target}' pair per line; "
            f"shards '{split}.tsv-*') or '{split}.tfrecord' (tf.train.Example "
            f"with bytes features '{source}' and '{target}'; shards "
            f"'{split}.tfrecord-*')")

  def _missing(self, problem: str, split: str) -> DatasetNotPreparedError:
    return DatasetNotPreparedError(
        f"Dataset '{self._dataset_name}' for task '{self._task_name}': "
        f'{problem}. Expected {self._expected_files(split)} for split '
        f"'{split}' in a directory set by the environment variable "
        f'{PARAGRAPH_DIR_ENV_VAR} or by '
        't5x_speed.tasks.register_tasks(paragraph_data_dir=...). '
        'See docs/t5x.md, "Paragraph-level Paracrawl".')

  def _split_files(self, split: str) -> Tuple[str, Sequence[str]]:
    """Returns ('tsv' or 'tfrecord', sorted file names) of a split."""
    if split not in self.splits:
      raise ValueError(f"Dataset '{self._dataset_name}' has no split "
                       f"'{split}'; it has {list(self.splits)}.")
    data_dir = self._data_dir or os.environ.get(PARAGRAPH_DIR_ENV_VAR)
    if not data_dir:
      raise self._missing('no data directory is set', split)
    if not tf.io.gfile.isdir(data_dir):
      raise self._missing(f"directory '{data_dir}' does not exist", split)
    found = {
        fmt: sorted(
            tf.io.gfile.glob(os.path.join(data_dir, f'{split}.{fmt}')) +
            tf.io.gfile.glob(os.path.join(data_dir, f'{split}.{fmt}-*')))
        for fmt in ('tsv', 'tfrecord')
    }
    if found['tsv'] and found['tfrecord']:
      raise ValueError(
          f"Dataset '{self._dataset_name}': split '{split}' has both TSV and "
          f"TFRecord files in '{data_dir}'; keep one format: "
          f"{found['tsv'] + found['tfrecord']}")
    for fmt, files in found.items():
      if files:
        return fmt, files
    raise self._missing(f"no files for split '{split}' in '{data_dir}'", split)

  def list_shards(self, split: str) -> Sequence[str]:
    return self._split_files(split)[1]

  def get_dataset(
      self,
      split: str = tfds.Split.TRAIN,
      shuffle: bool = True,
      seed: Optional[int] = None,
      shard_info: Optional[seqio.ShardInfo] = None,
      *,
      sequence_length: Optional[Mapping[str, int]] = None,  # Unused.
      use_cached: bool = False,  # Unused.
      num_epochs: Optional[int] = 1,  # Unused.
  ) -> tf.data.Dataset:
    del sequence_length, use_cached, num_epochs
    fmt, files = self._split_files(split)
    files_ds = tf.data.Dataset.from_tensor_slices(list(files))
    if shard_info:
      if len(files) < shard_info.num_shards:
        # seqio shards examples instead when there are too few files.
        raise ValueError(
            f"Dataset '{self._dataset_name}' split '{split}' has "
            f'{len(files)} files, fewer than {shard_info.num_shards} shards.')
      files_ds = files_ds.shard(shard_info.num_shards, shard_info.index)
    if shuffle:
      files_ds = files_ds.shuffle(len(files), seed=seed)
    if fmt == 'tsv':
      reader, parse = _numbered_lines, _parse_tsv_pairs
    else:
      reader, parse = tf.data.TFRecordDataset, _parse_tfexample_pairs
    logging.info('Reading %s %s from %d %s files.', self._dataset_name, split,
                 len(files), fmt)
    records = files_ds.interleave(
        reader, cycle_length=self._cycle_length,
        block_length=self._block_length, num_parallel_calls=tf.data.AUTOTUNE)
    return parse(records, self._languages)
