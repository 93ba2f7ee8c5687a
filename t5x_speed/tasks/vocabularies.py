"""The SentencePiece vocabulary of the SPEED tasks and models.

T5's model file lives on GCS. Offline, seqio's `SentencePieceVocabulary`
fails on first use with a cloud-metadata error from deep inside TensorFlow;
`SentencePieceVocabulary` here fails with `VocabularyNotReadableError`
instead, which names the file and the two settings that replace it: the
environment variable T5X_SPEED_VOCAB (read by `t5x_speed.tasks`) and the gin
macro SENTENCEPIECE_MODEL (set in t5x_speed/gin/common/speed_model.gin).
"""

import os

import seqio
import tensorflow as tf

__all__ = ['SentencePieceVocabulary', 'VocabularyNotReadableError',
           'vocabulary_path', 'DEFAULT_VOCAB_PATH', 'VOCAB_ENV_VAR']

DEFAULT_VOCAB_PATH = (
    'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model')
VOCAB_ENV_VAR = 'T5X_SPEED_VOCAB'
GIN_MACRO = 'SENTENCEPIECE_MODEL'

# What reading the model file raises: TF's file system errors (NotFound,
# FailedPrecondition for an unreachable GCS or a directory, PermissionDenied,
# ...) and Python's for local files.
_READ_ERRORS = (tf.errors.OpError, OSError)


class VocabularyNotReadableError(FileNotFoundError):
  """The SentencePiece model file cannot be read; the message says what to do.

  A subclass of `FileNotFoundError`, so generic handlers of missing files
  catch it too.
  """


def vocabulary_path() -> str:
  """The model file in $T5X_SPEED_VOCAB if set, else T5's on GCS.

  Read when called: t5x_speed/gin/common/speed_model.gin calls it when the
  model's vocabulary is built, `t5x_speed.tasks` when the package is
  imported.
  """
  return os.environ.get(VOCAB_ENV_VAR) or DEFAULT_VOCAB_PATH


def _short_reason(error: Exception) -> str:
  # TF's messages go on with a tab-indented second line repeating the path.
  message = str(error).strip().splitlines()
  return f'{type(error).__name__}: {message[0] if message else "no details"}'


def not_readable_message(path: str, error: Exception) -> str:
  """The message of `VocabularyNotReadableError` for `path`."""
  where = ('Offline or without GCS access, set'
           if path.startswith('gs://') else 'Set')
  return (
      f"Cannot read the SentencePiece model '{path}' ({_short_reason(error)})."
      f' {where} {VOCAB_ENV_VAR}=/path/spm.model (a local SentencePiece '
      'model file) before importing t5x_speed.tasks; in T5X the gin macro '
      f'{GIN_MACRO} follows it by default, or pass '
      f'--gin.{GIN_MACRO}="\'/path/spm.model\'" with the same file (the '
      "model's and the tasks' vocabularies must match).")


class SentencePieceVocabulary(seqio.SentencePieceVocabulary):
  """`seqio.SentencePieceVocabulary` whose unreadable file is a clear error.

  Like seqio's, the file is read on first use (encoding, decoding, the
  vocabulary size), not on construction. It adds no state, so it compares
  equal to a seqio vocabulary of the same file and settings, which T5X
  checks between the model and the tasks.

  Example:

    vocab = SentencePieceVocabulary('/absent/spm.model')
    vocab.encode('Hello')
    # VocabularyNotReadableError: Cannot read the SentencePiece model
    # '/absent/spm.model' (NotFoundError: ...). Set T5X_SPEED_VOCAB=...
  """

  def _model_context(self):
    # Every use of the file (tokenizer, sp_model, vocab_size, TF ops) goes
    # through here; seqio caches successful loads only, so a fixed file is
    # picked up on the next use.
    try:
      return super()._model_context()
    except _READ_ERRORS as e:
      raise VocabularyNotReadableError(
          not_readable_message(self.sentencepiece_model_file, e)) from e
