"""T5X models for parameter-shared decoders with exits.

`SpeedDecoderOnlyModel`, a `t5x.models.DecoderOnlyModel` whose module is a
`network.SpeedTransformer`, and `SpeedEncoderDecoderModel`, a
`t5x.models.EncoderDecoderModel` whose module is an
`encoder_decoder.SpeedEncoderDecoder`. Both:

* `loss_fn` trains every exit with the weighted multi-exit loss (plus, if
  asked, a term training the early exits to agree with the final one) and
  logs per-exit loss, accuracy and consecutive-exit flip rate as CLU metrics;
* `predict_batch_with_aux` prefills one cache per virtual layer (an
  encoder-decoder model encodes its inputs there, once, and caches each
  unique decoder layer's cross-attention keys and values) and calls the
  configured decode fn: SPEED (`decoding.speed_decode`, and SPEED sampling,
  `sampling.speed_sample_decode`) gets the pipelined step (and its
  statistics land in the aux dict), `decoding.greedy_decode` and
  `sampling.sample_decode` the full-depth step, and any other decode fn
  (T5X's `beam_search`, `temperature_sample`, ...) the full-depth step over
  the cache in T5X's form (`steps.to_t5x_cache`), which T5X's beam expansion
  and reordering handle;
* `score_batch` scores with the final exit, or with every exit;
* `write_inferences_with_speed_statistics`, a `t5x.infer` write_fn, also
  writes SPEED's statistics over each written chunk as metrics.

This is the only library module that needs T5X.
"""

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, MutableMapping, Optional, Tuple

from absl import logging
import clu.metrics as clu_metrics
from clu import metric_writers
from flax import core as flax_core
import jax
import jax.numpy as jnp
import numpy as np
from t5x import losses as t5x_losses
from t5x import metrics as metrics_lib
from t5x import models as t5x_models

from t5x_speed import decode_args
from t5x_speed import decoding
from t5x_speed import encoder_decoder
from t5x_speed import losses
from t5x_speed import network
from t5x_speed import results
from t5x_speed import steps
from t5x_speed import quantize

__all__ = ['SpeedDecoderOnlyModel', 'SpeedEncoderDecoderModel',
           'write_inferences_with_speed_statistics']

Array = jax.Array
PyTree = Any


class _SpeedModel:
  """What both models add to T5X's: the exits' loss and metrics, scoring,
  the bound steps and SPEED's statistics in aux (a mixin before the T5X
  base class)."""

  def _init_exits(self, module, exit_weighting, exit_agreement,
                  exit_agreement_target, score_all_exits,
                  speculative_vocab_size, decode_weights):
    """Checks and keeps the exits' and decoding's options (at
    construction, not at the first training step)."""
    quantize.check_decode_weights(decode_weights)
    self._decode_weights = decode_weights
    losses.exit_weights(exit_weighting, module.config.num_repeats)
    self._exit_weighting = exit_weighting
    self._exit_agreement = losses.check_exit_agreement(exit_agreement,
                                                       exit_agreement_target)
    self._exit_agreement_target = exit_agreement_target
    self._score_all_exits = score_all_exits
    self._speculative_vocab_size = decode_args.check_speculative_vocab_size(
        speculative_vocab_size)

  @property
  def config(self) -> network.TransformerConfig:
    return self.module.config

  def loss_fn(self, params: PyTree, batch: Mapping[str, Array],
              dropout_rng: Optional[Array]):
    """L_w = sum_i w_i L_i (+ lambda * mean_i A_i), with T5X's metrics of the
    final exit plus, per exit i, `exit_i/loss`, `exit_i/accuracy`,
    `exit_i/flip_rate` (argmax differs from exit i-1) and, with the
    agreement term on, `exit_i/agreement` (A_i)."""
    exit_logits = self._compute_logits(params, batch, dropout_rng)
    normalizing_factor, weights = (
        t5x_losses.get_loss_normalizing_factor_and_weights(
            self._loss_normalizing_factor, batch))
    targets = batch['decoder_target_tokens']
    loss, z_loss, per_exit, _ = losses.multi_exit_cross_entropy(
        exit_logits, targets, weights, self._exit_weighting,
        self._label_smoothing, self._z_loss, normalizing_factor)
    agreement = None
    if self._exit_agreement and exit_logits.shape[0] > 1:
      agreement = losses.exit_agreement(
          exit_logits, weights, self._exit_agreement_target,
          normalizing_factor)
      loss = loss + self._exit_agreement * jnp.mean(agreement)
    segment_ids = {k[:-len('_segment_ids')]: v for k, v in batch.items()
                   if k.endswith('_segment_ids')}
    if not segment_ids:  # as T5X's: padding masks of the token features
      segment_ids = {k: v != 0 for k, v in batch.items()
                     if k in ('encoder_input_tokens', 'decoder_target_tokens')}
    metrics = self._compute_metrics(
        logits=exit_logits[-1], targets=targets, mask=weights, loss=loss,
        z_loss=z_loss, segment_ids=segment_ids)
    for i, exit_loss in enumerate(per_exit):
      metrics[f'exit_{i + 1}/loss'] = metrics_lib.AveragePerStep(
          total=exit_loss)
    if agreement is not None:
      for i, term in enumerate(agreement):
        metrics[f'exit_{i + 1}/agreement'] = metrics_lib.AveragePerStep(
            total=term)
    for name, (total, count) in losses.exit_statistics(
        exit_logits, targets, weights).items():
      metrics[name] = clu_metrics.Average(total=total, count=count)
    return loss, metrics

  def score_batch(self, params: PyTree, batch: Mapping[str, Array],
                  return_intermediates: bool = False):
    """Log-likelihood of the targets: [batch], or [batch, R] for all exits."""
    targets = batch['decoder_target_tokens']
    weights = batch['decoder_loss_weights']
    if return_intermediates:
      exit_logits, variables = self._compute_logits(
          params, batch, mutable=['intermediates'])
      intermediates = flax_core.unfreeze(variables.get('intermediates', {}))
    else:
      exit_logits = self._compute_logits(params, batch)
    token_scores = weights * jnp.take_along_axis(
        jax.nn.log_softmax(exit_logits), targets[None, ..., None],
        axis=-1)[..., 0]                                       # [R, b, len]
    if self._score_all_exits:
      scores = jnp.moveaxis(token_scores.sum(-1), 0, -1)       # [b, R]
    else:
      scores = token_scores[-1].sum(-1)
    if return_intermediates:
      decoder = intermediates.setdefault('decoder', {})
      decoder['target_tokens'] = (targets,)
      decoder['loss_weights'] = (weights,)
      decoder['token_scores'] = (token_scores[-1],)
      decoder['exit_token_scores'] = (token_scores,)
      return scores, intermediates
    return scores

  def _bound(self, params: PyTree) -> steps.BoundSteps:
    return steps.BoundSteps(self.module, params, self._speculative_vocab_size)

  def _decoding_params(self, params: PyTree) -> PyTree:
    """The weights a prediction decodes with: int8 ones, quantized once per
    batch, where `decode_weights` is 'int8' (`quantize.quantize_int8`)."""
    if self._decode_weights == 'int8':
      return quantize.quantize_int8(params)
    return params

  def _decode(self, decode_fn_kwargs: Mapping[str, Any],
              rng: Optional[Array],
              decoder_params: Optional[MutableMapping[str, Any]],
              num_decodes: int, return_all_decodes: bool
              ) -> Tuple[Array, MutableMapping[str, Array]]:
    """Runs the decode fn with the model's arguments (`decode_fn_kwargs`)
    and the caller's; returns (decodes, aux) as T5X's models do, with a
    pipelined decode fn's `SpeedStats` per example as aux['speed/<field>'].
    """
    decoder_params = dict(decoder_params or {})
    if rng is not None:
      if decoder_params.get('decode_rng') is not None:
        raise ValueError('Got an RNG both as `rng` and as '
                         "decoder_params['decode_rng']; pass only one.")
      decoder_params['decode_rng'] = rng
    decoder_params.setdefault('eos_id', self.output_vocabulary.eos_id or 1)
    result = decoding.decode(self._decode_fn, num_decodes=num_decodes,
                             **decode_fn_kwargs, **decoder_params)
    decodes, scores = result.sequences, result.scores
    if return_all_decodes:
      aux = {'scores': scores}
    else:
      decodes, aux = decodes[:, -1, :], {'scores': scores[:, -1]}
    if result.stats is not None:
      for field in dataclasses.fields(result.stats):
        aux[f'speed/{field.name}'] = getattr(result.stats, field.name)
    return decodes, aux


class SpeedDecoderOnlyModel(_SpeedModel, t5x_models.DecoderOnlyModel):
  """DecoderOnlyModel with shared exits, multi-exit loss and SPEED decoding.

  Args (beyond `t5x.models.DecoderOnlyModel`'s):
    exit_weighting: 'linear' (default), 'uniform', 'final_only' or explicit
      per-exit weights; see `losses.exit_weights`.
    exit_agreement: weight lambda of the agreement term: the training loss
      is L_w + lambda * mean_i A_i over the early exits i < R (see
      `losses.exit_agreement`); 0 (the default) is the paper's loss.
    exit_agreement_target: 'distribution' (A_i = KL from the final exit's
      distribution) or 'argmax' (cross-entropy to the final exit's token).
    score_all_exits: `score_batch` returns [batch, R] scores of every exit
      instead of the final exit's [batch].
    speculative_vocab_size: SPEED's speculative exits score only this many
      first token ids; committed tokens are unaffected (see
      `network.Decoder.speed_step`). None scores the whole vocabulary;
      otherwise an integer >= 1.
    decode_weights: the weights predictions decode with: 'as_given' (the
      parameters' own dtype, the default) or 'int8' (`quantize.quantize_int8`
      of them, quantized at each predicted batch: a quarter of float32's
      bytes per decode step; the int8 model's output, exactly for SPEED and
      greedy alike). Training and scoring use the parameters as given.
  """

  def __init__(self,
               module: network.SpeedTransformer,
               vocabulary,
               optimizer_def,
               decode_fn: Callable[..., Any] = decoding.speed_decode,
               inputs_bidirectional_attention: bool = False,
               feature_converter_cls=None,
               label_smoothing: float = 0.0,
               z_loss: float = 0.0,
               loss_normalizing_factor=None,
               exit_weighting: losses.ExitWeighting = 'linear',
               exit_agreement: float = 0.0,
               exit_agreement_target: str = 'distribution',
               score_all_exits: bool = False,
               speculative_vocab_size: Optional[int] = None,
               decode_weights: str = 'as_given'):
    if (not isinstance(getattr(module, 'config', None),
                       network.TransformerConfig) or
        module.config.is_encoder_decoder):
      raise ValueError('SpeedDecoderOnlyModel needs a network.SpeedTransformer '
                       f'module, got {type(module).__name__}; an encoder-'
                       'decoder model is a SpeedEncoderDecoderModel.')
    self._init_exits(module, exit_weighting, exit_agreement,
                     exit_agreement_target, score_all_exits,
                     speculative_vocab_size, decode_weights)
    super().__init__(
        module=module, vocabulary=vocabulary, optimizer_def=optimizer_def,
        decode_fn=decode_fn,
        inputs_bidirectional_attention=inputs_bidirectional_attention,
        feature_converter_cls=feature_converter_cls,
        label_smoothing=label_smoothing, z_loss=z_loss,
        loss_normalizing_factor=loss_normalizing_factor)

  def _compute_logits(self, params: PyTree, batch: Mapping[str, Array],
                      dropout_rng: Optional[Array] = None,
                      mutable=False, other_variables=None) -> Array:
    """Every exit's logits: [R, batch, length, vocab]."""
    rngs = {'dropout': dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {'params': params, **(other_variables or {})},
        batch['decoder_input_tokens'],
        batch['decoder_target_tokens'],
        decoder_segment_ids=batch.get('decoder_segment_ids', None),
        decoder_positions=batch.get('decoder_positions', None),
        decoder_causal_attention=self._get_decoder_causal_attention(batch),
        rngs=rngs,
        enable_dropout=rngs is not None,
        mutable=mutable)

  def _compute_kv_cache(self, params: PyTree, inputs: Array,
                        causal_attention_mask: Array
                        ) -> Tuple[network.KVCache, Array]:
    """Prefills positions < the prompt length in every virtual layer."""
    inputs_lengths = jnp.sum(inputs[:, 1:] != 0, axis=-1)
    bidirectional = self._get_decoder_causal_attention(
        {'decoder_causal_attention': causal_attention_mask})
    cache = self._bound(params).prefill(inputs, inputs_lengths, bidirectional)
    cache = steps.with_cache_sharding(cache)
    return cache, inputs_lengths

  def predict_batch_with_aux(
      self,
      params: PyTree,
      batch: Mapping[str, Array],
      rng: Optional[Array] = None,
      *,
      return_all_decodes: bool = False,
      num_decodes: int = 1,
      decoder_params: Optional[MutableMapping[str, Any]] = None,
  ) -> Tuple[Array, Mapping[str, Array]]:
    """Decodes the targets after each prompt; SPEED statistics go in aux.

    As `t5x.models.DecoderOnlyModel.predict_batch_with_aux`; the decode fn
    gets the model's steps from `steps.BoundSteps.decode_fn_kwargs` and runs
    through `decoding.decode`. A pipelined decode fn (SPEED, SPEED sampling)
    also gets the pipelined step, the stage count and initial carry, and
    its `SpeedStats` are reported per example as aux['speed/<field>'].
    Decode fns other than ours (e.g.
    `t5x.decoding.beam_search`, `temperature_sample` with `num_decodes > 1`)
    get the cache in T5X's form with `cache_offset=steps.CACHE_OFFSET` and a
    full-depth step that keeps positions in the cache (see `steps`).

    Token ids outside [0, vocab) raise `ValueError` when the batch is
    concrete. Under `jit` (as T5X's binaries run this) our decode fns end
    such examples with no tokens and a NaN score, and SPEED flags them in
    aux['speed/invalid'] (see `decoding`); T5X's own sampler does not check.
    """
    if 'decoder_causal_attention' not in batch:
      raise ValueError(
          'Batch does not have the right format for text generation: '
          '`task_feature_lengths` must have both `inputs` and `targets`.')
    inputs = batch['decoder_input_tokens'] * batch['decoder_causal_attention']
    decode_args.check_token_range(inputs, self.config.vocab_size)
    params = self._decoding_params(params)
    cache, initial_index = self._compute_kv_cache(
        params, inputs, batch['decoder_causal_attention'])
    decodes, aux = self._decode(
        self._bound(params).decode_fn_kwargs(self._decode_fn, inputs, cache,
                                             initial_index),
        rng, decoder_params, num_decodes, return_all_decodes)
    return t5x_models.remove_prefix(decodes, initial_index), aux


class SpeedEncoderDecoderModel(_SpeedModel, t5x_models.EncoderDecoderModel):
  """EncoderDecoderModel with a shared decoder, exits and SPEED decoding.

  Args: those of `t5x.models.EncoderDecoderModel` (SPEED by default, not
  beam search), plus those of `SpeedDecoderOnlyModel` beyond T5X's:
  exit_weighting, exit_agreement, exit_agreement_target, score_all_exits,
  speculative_vocab_size and decode_weights.
  """

  def __init__(self,
               module: encoder_decoder.SpeedEncoderDecoder,
               input_vocabulary,
               output_vocabulary,
               optimizer_def,
               decode_fn: Callable[..., Any] = decoding.speed_decode,
               feature_converter_cls=None,
               label_smoothing: float = 0.0,
               z_loss: float = 0.0,
               loss_normalizing_factor=None,
               default_decoder_params=None,
               exit_weighting: losses.ExitWeighting = 'linear',
               exit_agreement: float = 0.0,
               exit_agreement_target: str = 'distribution',
               score_all_exits: bool = False,
               speculative_vocab_size: Optional[int] = None,
               decode_weights: str = 'as_given'):
    if not isinstance(module, encoder_decoder.SpeedEncoderDecoder):
      raise ValueError('SpeedEncoderDecoderModel needs an encoder_decoder.'
                       'SpeedEncoderDecoder module, got '
                       f'{type(module).__name__}.')
    self._init_exits(module, exit_weighting, exit_agreement,
                     exit_agreement_target, score_all_exits,
                     speculative_vocab_size, decode_weights)
    super().__init__(
        module=module, input_vocabulary=input_vocabulary,
        output_vocabulary=output_vocabulary, optimizer_def=optimizer_def,
        decode_fn=decode_fn, feature_converter_cls=feature_converter_cls,
        label_smoothing=label_smoothing, z_loss=z_loss,
        loss_normalizing_factor=loss_normalizing_factor,
        default_decoder_params=default_decoder_params)

  def _compute_logits(self, params: PyTree, batch: Mapping[str, Array],
                      dropout_rng: Optional[Array] = None,
                      mutable=False, other_variables=None) -> Array:
    """Every exit's logits: [R, batch, length, vocab]."""
    rngs = {'dropout': dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {'params': params, **(other_variables or {})},
        batch['encoder_input_tokens'],
        batch['decoder_input_tokens'],
        batch['decoder_target_tokens'],
        encoder_segment_ids=batch.get('encoder_segment_ids', None),
        decoder_segment_ids=batch.get('decoder_segment_ids', None),
        encoder_positions=batch.get('encoder_positions', None),
        decoder_positions=batch.get('decoder_positions', None),
        rngs=rngs,
        enable_dropout=rngs is not None,
        mutable=mutable)

  def predict_batch_with_aux(
      self,
      params: PyTree,
      batch: Mapping[str, Array],
      rng: Optional[Array] = None,
      decoder_params: Optional[MutableMapping[str, Any]] = None,
      return_all_decodes: Optional[bool] = None,
      num_decodes: Optional[int] = None,
      prompt_with_targets: bool = False,
  ) -> Tuple[Array, Mapping[str, Array]]:
    """Encodes once, decodes the targets; SPEED statistics go in aux.

    As `t5x.models.EncoderDecoderModel.predict_batch_with_aux`: the encoder
    runs once, in the prefill, which also computes each unique decoder
    layer's cross-attention keys and values. The decode fn gets the model's
    steps from `steps.BoundSteps.decode_fn_kwargs`, as
    `SpeedDecoderOnlyModel`'s does: SPEED, greedy and both samplers of this
    package, or T5X's `beam_search` and `temperature_sample` (with
    `num_decodes`), which expand and reorder the cross-attention cache with
    the rest. With `prompt_with_targets` (the decoder prompt:
    `decoder_input_tokens` without EOS), this package's decode fns start
    after the prompt, cached by the prefill; T5X's start from BOS and force
    the prompt's tokens, as T5X's own model runs them (its beam search
    stops by the shortest prompt of a batch).
    """
    if return_all_decodes is None:
      return_all_decodes = self._default_decoder_params.return_all_decodes
    if num_decodes is None:
      num_decodes = self._default_decoder_params.num_decodes
    encoder_input_tokens = batch['encoder_input_tokens']
    decoder_input_tokens = batch['decoder_input_tokens']
    decode_args.check_token_range(encoder_input_tokens, self.config.vocab_size,
                                  name='encoder_input_tokens')
    if prompt_with_targets:
      inputs = decoder_input_tokens * (
          decoder_input_tokens != self.output_vocabulary.eos_id)
      decode_args.check_token_range(inputs, self.config.vocab_size)
    else:
      inputs = jnp.zeros_like(decoder_input_tokens)
    ours = steps.takes_kv_cache(self._decode_fn)
    if prompt_with_targets and ours:
      initial_index, span = jnp.sum(inputs != 0, axis=1), inputs
    else:  # BOS alone: nothing to cache but the encoder's keys and values
      initial_index = jnp.zeros(inputs.shape[:1], jnp.int32)
      span = inputs[:, :1]
    bound = self._bound(self._decoding_params(params))
    cache = bound.prefill(span, initial_index,
                          cache_length=inputs.shape[1],
                          encoder_input_tokens=encoder_input_tokens)
    cache = steps.with_cache_sharding(cache)
    kwargs = bound.decode_fn_kwargs(self._decode_fn, inputs, cache,
                                    initial_index)
    if not ours:
      del kwargs['initial_index']  # as T5X's model calls its decode fns
    return self._decode(kwargs, rng, decoder_params, num_decodes,
                        return_all_decodes)


def write_inferences_with_speed_statistics(
    output_fname: str, inferences, task_ds, mode: str, vocabulary=None, *,
    summary_dir: Optional[str] = None, **kwargs) -> None:
  """T5X's `write_inferences_to_file`, plus SPEED's statistics as metrics.

  A `t5x.infer` write_fn (t5x_speed/gin/runs/infer.gin binds it): after
  writing the predictions of a chunk as T5X does, sums the per-example
  aux['speed/...'] counters of 'predict_with_aux' mode over the chunk
  (`results.SpeedStats.summary`: steps per token, flushes, flip rate per
  stage, occupancy), logs them, appends them with the chunk's file name to
  `summary_dir`/speed_statistics.jsonl and writes them as TensorBoard scalars
  under `summary_dir`/speed_statistics (step: the chunk's number). Nothing
  extra is written for decode fns without statistics.

  Args:
    output_fname, inferences, task_ds, mode, vocabulary, **kwargs: as
      `t5x.infer.write_inferences_to_file`.
    summary_dir: where the statistics go; None only logs them.
  """
  from t5x import infer as t5x_infer  # pylint: disable=g-import-not-at-top
  # T5X's writer indexes every aux value once per example: on jax.Arrays
  # each index is a dispatched op, on NumPy arrays a view.
  predictions, aux = inferences
  inferences = (predictions, jax.tree.map(np.asarray, aux))
  t5x_infer.write_inferences_to_file(output_fname, inferences, task_ds, mode,
                                     vocabulary, **kwargs)
  stats = results.SpeedStats.from_aux(inferences[1]) if mode == (
      'predict_with_aux') else None
  if stats is None:
    return
  summary = {f'speed/{k}': v for k, v in stats.summary().items()}
  logging.info('SPEED statistics of %s: %s', output_fname, summary)
  if summary_dir is None:
    return
  os.makedirs(summary_dir, exist_ok=True)
  path = os.path.join(summary_dir, 'speed_statistics.jsonl')
  chunk = 0
  if os.path.exists(path):
    with open(path) as f:
      chunk = sum(1 for _ in f)
  with open(path, 'a') as f:
    f.write(json.dumps({'file': os.path.basename(output_fname), **summary})
            + '\n')
  writer = metric_writers.create_default_writer(
      os.path.join(summary_dir, 'speed_statistics'), just_logging=False)
  writer.write_scalars(chunk, summary)
  writer.close()
