"""Evaluation metrics of the finetuning tasks, computed as T5 computes them.

seqio calls each with the targets and predictions of a split, as strings.
`with_speed_statistics` adds SPEED's decoding statistics from the model's
aux outputs, so that `t5x.eval` and training's inference evaluation log
them next to the task metric.
"""

from typing import Any, Callable, Dict, Mapping, Sequence

import sacrebleu

from t5x_speed import results

__all__ = ['bleu', 'chrf', 'bleu_and_chrf', 'rouge', 'speed_statistics',
           'with_speed_statistics']

ROUGE_KEYS = ('rouge1', 'rouge2', 'rougeLsum')


def _check_aligned(targets: Sequence[str], predictions: Sequence[str]):
  if len(targets) != len(predictions):
    raise ValueError(f'{len(targets)} targets but {len(predictions)} '
                     'predictions.')


def bleu(targets: Sequence[str], predictions: Sequence[str],
         tokenizer: str = 'intl') -> Dict[str, float]:
  """Corpus BLEU of sacrebleu with the settings of T5's `bleu` metric.

  One reference per prediction; exponential smoothing, case-sensitive,
  sacrebleu's international tokenisation, all four n-gram orders.

  Example: n-gram precisions 5/6, 3/5, 2/4 and 1/3 and no brevity penalty
  give 100 * (1/12) ** (1/4):

  >>> targets = ['the cat sat on a mat']
  >>> predictions = ['the cat sat on the mat']
  >>> bleu(targets, predictions)  # doctest: +ELLIPSIS
  {'bleu': 53.72...}

  Args:
    targets: reference translations.
    predictions: model translations, aligned with `targets`.
    tokenizer: sacrebleu tokenizer name.

  Returns:
    {'bleu': score in [0, 100]}.
  """
  _check_aligned(targets, predictions)
  score = sacrebleu.corpus_bleu(
      list(predictions), [list(targets)],
      smooth_method='exp',
      smooth_value=0.0,
      force=False,
      lowercase=False,
      tokenize=tokenizer,
      use_effective_order=False)
  return {'bleu': float(score.score)}


def chrf(targets: Sequence[str], predictions: Sequence[str]
         ) -> Dict[str, float]:
  """Corpus chrF of sacrebleu (chrF2: character 6-grams, beta 2).

  >>> chrf(['the cat sat'], ['the cat sat'])
  {'chrf': 100.0}

  Args:
    targets: reference translations.
    predictions: model translations, aligned with `targets`.

  Returns:
    {'chrf': score in [0, 100]}.
  """
  _check_aligned(targets, predictions)
  score = sacrebleu.corpus_chrf(list(predictions), [list(targets)])
  return {'chrf': float(score.score)}


def bleu_and_chrf(targets: Sequence[str], predictions: Sequence[str]
                  ) -> Dict[str, float]:
  """`bleu` and `chrf` in one metric fn (one decode serves both)."""
  return {**bleu(targets, predictions), **chrf(targets, predictions)}


def _prepare_summary(summary: str) -> str:
  # rougeLsum scores sentence by sentence, splitting on newlines; T5 puts
  # one after each " . " so that space-tokenised summaries split too.
  return summary.replace(' . ', ' .\n')


def rouge(targets: Sequence[str],
          predictions: Sequence[str],
          score_keys: Sequence[str] = ROUGE_KEYS) -> Dict[str, float]:
  """F-measures of ROUGE-1, ROUGE-2 and ROUGE-Lsum, as T5's `rouge` metric.

  Per-example F-measures of `rouge_score` (no stemming) are aggregated with
  its bootstrap aggregator (mid estimate) and scaled to [0, 100].

  Example: unigram precision 3/3 and recall 3/6, bigram 2/2 and 2/5, and
  the longest common subsequence is the 3 unigrams:

  >>> rouge(['the cat sat on the mat'], ['the cat sat'])  # doctest: +ELLIPSIS
  {'rouge1': 66.66..., 'rouge2': 57.14..., 'rougeLsum': 66.66...}

  Args:
    targets: reference summaries.
    predictions: model summaries, aligned with `targets`.
    score_keys: `rouge_score` types to report.

  Returns:
    {score key: F-measure in [0, 100]}.
  """
  _check_aligned(targets, predictions)
  if not targets:
    raise ValueError('ROUGE needs at least one example.')
  # Imported here: rouge_score loads nltk, scipy and matplotlib, which would
  # otherwise slow the start of every T5X binary that registers the tasks.
  from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top
  from rouge_score import scoring  # pylint: disable=g-import-not-at-top
  scorer = rouge_scorer.RougeScorer(rouge_types=list(score_keys))
  aggregator = scoring.BootstrapAggregator()
  for target, prediction in zip(targets, predictions):
    aggregator.add_scores(scorer.score(target=_prepare_summary(target),
                                       prediction=_prepare_summary(prediction)))
  result = aggregator.aggregate()
  return {key: float(result[key].mid.fmeasure * 100) for key in score_keys}


MetricFn = Callable[[Sequence[str], Sequence[str]], Dict[str, float]]


def speed_statistics(aux_values: Mapping[str, Any]) -> Dict[str, float]:
  """SPEED's statistics over a split, from its per-example aux values.

  `SpeedDecoderOnlyModel.predict_batch_with_aux` writes each example's
  `speed/<field>` counters; this sums them over the split:
  speed/steps_per_token, speed/flushes (with speed/flushes/stage_r), the
  flip rate of each stage's exit against the previous stage's
  (speed/flip_rate/stage_r), speed/occupancy, speed/tokens,
  speed/invalid_examples, speed/pipelined_examples, and with candidate
  branches speed/branches (K), speed/branch_hits (flips absorbed without a
  flush) and speed/rows_per_step (R + K). Empty for decode fns without
  statistics (greedy).

  Example (two examples of a 2-stage model):

  >>> aux = {'speed/num_steps': [5, 4], 'speed/num_tokens': [4, 3],
  ...        'speed/occupied_slots': [8, 6], 'speed/flushes': [[0, 1], [0, 0]],
  ...        'speed/stage_evaluations': [[5, 4], [4, 3]],
  ...        'speed/stage_flips': [[0, 1], [0, 0]], 'speed/invalid': [0, 0]}
  >>> stats = speed_statistics(aux)
  >>> stats['speed/steps_per_token'], stats['speed/flip_rate/stage_2']
  (1.2857142857142858, 0.14285714285714285)
  >>> speed_statistics({'scores': [0.0]})
  {}
  """
  stats = results.SpeedStats.from_aux(aux_values)
  if stats is None:
    return {}
  return {f'speed/{k}': v for k, v in stats.summary().items()}


def with_speed_statistics(metric_fn: MetricFn):
  """`metric_fn` as a seqio predict-with-aux metric adding `speed_statistics`.

  One decode serves both: seqio runs the model's `predict_batch_with_aux`
  for metric fns taking (targets, predictions, aux_values).
  """

  def metric_with_speed_statistics(targets, predictions, aux_values):
    return {**metric_fn(targets, predictions), **speed_statistics(aux_values)}

  # Not functools.wraps: seqio reads the signature, which must stay this one.
  metric_with_speed_statistics.__name__ = metric_fn.__name__
  metric_with_speed_statistics.metric_fn = metric_fn
  return metric_with_speed_statistics
