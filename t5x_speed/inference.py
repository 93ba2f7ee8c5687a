"""Decoding without T5X: `generate` from prompts (and, for an
encoder-decoder model, from encoder inputs).

The step functions and decode-fn arguments come from `steps.BoundSteps`, as
in the T5X model (models.py), and the result is a `Generation`, a view of
the decode fn's `DecodeResult` with each example's produced tokens.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from t5x_speed import network
  >>> cfg = network.TransformerConfig(vocab_size=16, emb_dim=8, num_heads=2,
  ...     head_dim=4, mlp_dim=16, num_unique_layers=2, num_repeats=3)
  >>> module = network.SpeedTransformer(cfg)
  >>> tokens = jnp.ones((1, 4), jnp.int32)
  >>> params = module.init(jax.random.PRNGKey(0), tokens, tokens,
  ...                      enable_dropout=False)['params']
  >>> prompts = jnp.array([[3, 4, 5], [6, 7, 0]])
  >>> speed = generate(module, params, prompts, jnp.array([3, 2]),
  ...                  max_decode_steps=6, method='speed', eos_id=1)
  >>> greedy = generate(module, params, prompts, jnp.array([3, 2]),
  ...                   max_decode_steps=6, method='greedy', eos_id=1)
  >>> bool((speed.tokens == greedy.tokens).all()), speed.tokens.shape
  (True, (2, 6))
  >>> speed.pipelined, greedy.stats is None
  (True, True)
"""

import functools
import operator
from typing import Any, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import cpu
from t5x_speed import decode_args
from t5x_speed import decoding
from t5x_speed import network
from t5x_speed import sampling
from t5x_speed import speed_loop
from t5x_speed import steps
from t5x_speed.results import DecodeResult
from t5x_speed.results import SpeedSchedule
from t5x_speed.results import SpeedStats

__all__ = ['generate', 'Generation', 'check_finite', 'prepare',
           'build_inputs', 'METHODS', 'COMPILER_OPTIONS']

Array = jax.Array
# How `generate` compiles. XLA's default lets it keep a bfloat16 value in
# float32 wherever that is convenient (a fused chain of ops, a convert pair
# it folds), and where it does so depends on the program, so greedy's one-row
# graph and SPEED's R-row graph round bf16 activations at different places
# and can disagree at near-ties even with the row-independent kernel.
# Rounding every bf16 value as the program says keeps the two programs'
# roundings alike (tools/fuzz.py checks bf16 SPEED against greedy). float32
# is unaffected. A jit outside this package (T5X's) gets the same with
# XLA_FLAGS=--xla_allow_excess_precision=false.
COMPILER_OPTIONS = {'xla_allow_excess_precision': False}
DECODE_FNS = {'speed': decoding.speed_decode, 'greedy': decoding.greedy_decode,
              'speed_sample': sampling.speed_sample_decode,
              'sample': sampling.sample_decode}
METHODS = tuple(DECODE_FNS)
SAMPLING_METHODS = ('speed_sample', 'sample')
SPEED_METHODS = ('speed', 'speed_sample')


def check_finite(params: Any, name: str = 'params'):
  """Raises ValueError naming the leaves of `params` that hold NaN or inf.

  Decoding does not check (it would cost a pass over the weights per call):
  non-finite weights give NaN logits, whose argmax is token 0, so the output
  is token 0 repeated with NaN scores. Call this once after loading.
  """
  bad = [jax.tree_util.keystr(path) for path, x in
         jax.tree_util.tree_flatten_with_path(params)[0]
         if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and
         not bool(jnp.all(jnp.isfinite(x)))]
  if bad:
    raise ValueError(f'{name} hold non-finite values (NaN or inf) in '
                     f'{len(bad)} leaves: {", ".join(bad[:5])}'
                     f'{" ..." if len(bad) > 5 else ""}.')


@flax.struct.dataclass
class Generation:
  """What `generate` returns: a view of the decode fn's `DecodeResult`
  (`t5x_speed.results`) with each example's produced tokens.

  Attributes:
    tokens: [batch, max_decode_steps] produced tokens; from position
      `lengths` on, 0 (which is also a token id: read `lengths`).
    lengths: [batch] int32 tokens produced, EOS included.
    scores: [batch] log-probability of the produced tokens (final exit; for
      the sampling methods under the tempered, filtered distribution).
    stats: `SpeedStats` from the SPEED methods ('speed', 'speed_sample');
      None from 'greedy' and 'sample'.
    schedule: `SpeedSchedule` when recorded, else None.
    pipelined: static: from the SPEED methods, True where SPEED's pipeline
      decoded the batch and False where the batch took more rows (batch x
      R) than `max_speculative_rows` and greedy's full-depth step decoded
      it (the same tokens, no exits evaluated); None from the others.
  """

  tokens: Array
  lengths: Array
  scores: Array
  stats: Optional[SpeedStats] = None
  schedule: Optional[SpeedSchedule] = None
  pipelined: Optional[bool] = flax.struct.field(pytree_node=False,
                                                default=None)

  @classmethod
  def from_result(cls, result: DecodeResult, prompt_lengths: Array,
                  max_decode_steps: int) -> 'Generation':
    """The produced tokens of a one-decode `result` of T5X inputs made by
    `build_inputs`."""
    # decodes[:, 0, k] is position k+1; generation starts at prompt_length+1.
    tokens = jax.vmap(lambda row, start: jax.lax.dynamic_slice(
        row, (start,), (max_decode_steps,)))(result.sequences[:, 0],
                                             prompt_lengths)
    return cls(tokens=tokens, lengths=result.lengths[:, 0],
               scores=result.scores[:, 0], stats=result.stats,
               schedule=result.schedule, pipelined=result.pipelined)


def build_inputs(prompts: Array, prompt_lengths: Array,
                 max_decode_steps: int) -> Array:
  """[batch, P] right-padded prompts -> [batch, 1 + P + steps] T5X inputs."""
  batch, width = prompts.shape
  keep = jnp.arange(width) < prompt_lengths[:, None]
  return jnp.concatenate([
      jnp.zeros((batch, 1), jnp.int32),
      jnp.where(keep, prompts, 0).astype(jnp.int32),
      jnp.zeros((batch, max_decode_steps), jnp.int32)], axis=1)


def prepare(bound: steps.BoundSteps, prompts: Array, prompt_lengths: Array,
            max_decode_steps: int, bidirectional: bool = False,
            encoder_input_tokens: Optional[Array] = None
            ) -> Tuple[Array, network.KVCache]:
  """T5X-style decode inputs [batch, 1 + P + steps] and their prefilled cache.

  Only BOS + prompt are cached (or attended bidirectionally), so only that
  span goes through the prefill; an encoder-decoder model's
  `encoder_input_tokens` are encoded there.

  Raises:
    ValueError: `bidirectional` for an encoder-decoder model.
  """
  steps.check_causal_attention(bound.config, bidirectional or None,
                               'bidirectional')
  inputs = build_inputs(prompts, prompt_lengths, max_decode_steps)
  span = inputs[:, :prompts.shape[1] + 1]
  causal = (steps.prefix_attention(prompt_lengths, span.shape[1])
            if bidirectional else None)
  cache = bound.prefill(span, prompt_lengths, causal,
                        cache_length=inputs.shape[1],
                        encoder_input_tokens=encoder_input_tokens)
  return inputs, cache


@functools.partial(jax.jit, static_argnames=(
    'module', 'max_decode_steps', 'method', 'eos_id', 'bidirectional',
    'record_schedule', 'speculative_vocab_size', 'topk',
    'max_speculative_rows', 'require_pipeline', 'speed_branches'),
                   compiler_options=COMPILER_OPTIONS)
def _generate(module, params, prompts, prompt_lengths, temperature, topp,
              rng, encoder_input_tokens, *, max_decode_steps, method, eos_id,
              bidirectional, record_schedule, speculative_vocab_size, topk,
              max_speculative_rows, require_pipeline,
              speed_branches) -> Generation:
  bound = steps.BoundSteps(module, params, speculative_vocab_size)
  inputs, cache = prepare(bound, prompts, prompt_lengths, max_decode_steps,
                          bidirectional, encoder_input_tokens)
  decode_fn = DECODE_FNS[method]
  method_args = {}
  if method in SAMPLING_METHODS:
    method_args = dict(
        decode_rng=jax.random.PRNGKey(0) if rng is None else rng,
        temperature=temperature, topk=topk, topp=topp)
  if method in SPEED_METHODS:
    method_args.update(max_speculative_rows=max_speculative_rows,
                       require_pipeline=require_pipeline,
                       record_schedule=record_schedule,
                       speed_branches=speed_branches)
  result = decode_fn(
      **bound.decode_fn_kwargs(decode_fn, inputs, cache, prompt_lengths),
      eos_id=eos_id, max_decode_steps=max_decode_steps, **method_args)
  return Generation.from_result(result, prompt_lengths, max_decode_steps)


def _check_encoder_inputs(module: Any, tokens: Optional[Array]
                          ) -> Optional[np.ndarray]:
  """`generate`'s encoder_input_tokens on the host, checked against the
  model: required by an encoder-decoder model, refused by a decoder-only
  one."""
  steps.check_encoder_inputs(module.config, tokens)
  if tokens is None:
    return None
  if isinstance(tokens, jax.core.Tracer):
    raise ValueError('generate checks encoder_input_tokens on the host: call '
                     'it with a concrete array, outside jax.jit.')
  tokens = _host_array('encoder_input_tokens', tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError('encoder_input_tokens must be [batch, enc_len] integers, '
                     f'got shape {tokens.shape} and dtype {tokens.dtype}.')
  decode_args.check_token_range(tokens, module.config.vocab_size,
                                name='encoder_input_tokens')
  return tokens


def _host_array(name: str, x: Any) -> np.ndarray:
  """`x` as a NumPy array; a ragged nested list raises naming `name`."""
  try:
    return np.asarray(x)
  except ValueError as e:
    raise ValueError(
        f'{name} must be a rectangular array, got rows of different lengths '
        f'({e}). Right-pad the prompts with 0 to one length P and give each '
        'prompt\'s length in prompt_lengths.') from e


def generate(module: Any, params: Any, prompts: Optional[Array] = None,
             prompt_lengths: Optional[Array] = None, *,
             encoder_input_tokens: Optional[Array] = None,
             max_decode_steps: int,
             method: str = 'speed', eos_id: int = 1,
             bidirectional: bool = False,
             record_schedule: bool = False,
             speculative_vocab_size: Optional[int] = None,
             max_speculative_rows: Any = 'auto',
             require_pipeline: bool = False,
             speed_branches: Any = 'auto',
             check_params: bool = False,
             temperature: Optional[float] = None,
             topk: Optional[int] = None,
             topp: Optional[float] = None,
             rng: Optional[Array] = None) -> Generation:
  """Greedy, SPEED or sampled generation from right-padded prompts (jitted).

  Every argument is checked on the host before tracing (so this takes
  concrete arrays, not tracers).

  Args:
    module: the network: a `network.SpeedTransformer` or an
      `encoder_decoder.SpeedEncoderDecoder`.
    params: its parameters.
    prompts: [batch, P] integer token ids in [0, vocab), zeros after each
      prompt (the padding is not checked); the decoder's, for an
      encoder-decoder model, where None means none (decoding from BOS).
    prompt_lengths: [batch] integer prompt lengths in [0, P] (0 decodes from
      BOS alone); None with `prompts` None.
    encoder_input_tokens: an encoder-decoder model's inputs, [batch,
      enc_len] integer ids in [0, vocab), 0 for padding; None for a
      decoder-only model.
    max_decode_steps: tokens to produce at most per example, an integer >= 1.
    method: 'speed', 'greedy', 'speed_sample' (exact SPEED sampling) or
      'sample' (its sequential equivalent, `sampling.sample_decode`).
    eos_id: end-of-sequence id, an integer; one outside [0, vocab) never ends
      an example (e.g. -1 disables EOS).
    bidirectional: prefix-LM attention over BOS + prompt during prefill
      (decoder-only models).
    record_schedule: SPEED methods only: keep SPEED's per-step schedule.
    speculative_vocab_size: SPEED methods only: None, or an integer >= 1:
      SPEED's speculative exits score only this many first token ids (see
      `network.Decoder.speed_step`).
    max_speculative_rows: SPEED methods only: 'auto' (8 rows on CPU), None
      (no limit) or the most rows (batch x R) a pipelined step takes;
      beyond it they decode with the full-depth step, the same tokens, and
      the result's `pipelined` is False (`decoding.speed_decode`).
    require_pipeline: SPEED methods only: raise instead of decoding with
      the full-depth step where the batch exceeds `max_speculative_rows`.
    speed_branches: SPEED methods only: candidate branches per example,
      'auto' or an integer >= 0 (`decoding.speed_decode`).
    check_params: first check that `params` are finite (`check_finite`), a
      pass over the weights; non-finite weights otherwise give token 0
      repeated with NaN scores.
    temperature: sampling methods only: temperature >= 0 (0: greedy); None
      means 1.
    topk: sampling methods only: sample among the topk most likely tokens
      (None or 0: all).
    topp: sampling methods only: sample among the smallest set of most
      likely tokens of mass >= topp (None or 0: off); at most one of topk
      and topp.
    rng: sampling methods only: the PRNG key, raw (`jax.random.PRNGKey`) or
      typed (`jax.random.key`); None means PRNGKey(0).

  Returns:
    A `Generation`; for sampling methods `scores` are the log-probabilities
    under the tempered, filtered distribution (T5X's convention).

  Raises:
    ValueError: an argument outside the range above, naming it; also a
      setting that `method` does not use, changed from its default
      (sampling settings to a greedy method, SPEED settings to 'greedy' or
      'sample'), and `bidirectional` for an encoder-decoder model.
  """
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')
  _check_method_settings(method, dict(
      temperature=temperature, topk=topk, topp=topp, rng=rng), dict(
          record_schedule=record_schedule,
          speculative_vocab_size=speculative_vocab_size,
          max_speculative_rows=max_speculative_rows,
          require_pipeline=require_pipeline, speed_branches=speed_branches))
  decode_args.check_prng_key('rng', rng)
  steps.check_causal_attention(module.config, bidirectional or None,
                               'bidirectional')
  encoder_input_tokens = _check_encoder_inputs(module, encoder_input_tokens)
  if prompts is None and prompt_lengths is None and (
      encoder_input_tokens is not None):
    batch = encoder_input_tokens.shape[0]
    prompts = np.zeros((batch, 0), np.int32)
    prompt_lengths = np.zeros((batch,), np.int32)
  if any(isinstance(x, jax.core.Tracer) for x in (prompts, prompt_lengths)):
    raise ValueError(
        'generate checks prompts and prompt_lengths on the host and jits '
        'itself: call it with concrete arrays, outside jax.jit (inside jit, '
        'use decoding.speed_decode / greedy_decode, which flag bad traced '
        'inputs as invalid examples).')
  prompts = _host_array('prompts', prompts)
  prompt_lengths = _host_array('prompt_lengths', prompt_lengths)
  for name, x in (('prompts', prompts), ('prompt_lengths', prompt_lengths)):
    if not np.issubdtype(x.dtype, np.integer):
      raise ValueError(f'{name} must hold integers, got dtype {x.dtype}.')
  if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
    raise ValueError(f'prompts must be [batch, P] and prompt_lengths [batch], '
                     f'got {prompts.shape} and {prompt_lengths.shape}.')
  if prompts.shape[0] == 0:
    raise ValueError('prompts is empty (batch 0): nothing to decode.')
  if (encoder_input_tokens is not None and
      encoder_input_tokens.shape[0] != prompts.shape[0]):
    raise ValueError(
        f'encoder_input_tokens hold {encoder_input_tokens.shape[0]} '
        f'examples and prompts {prompts.shape[0]}.')
  if prompt_lengths.min() < 0 or prompt_lengths.max() > prompts.shape[1]:
    raise ValueError(f'prompt_lengths {prompt_lengths.tolist()} must lie in '
                     f'[0, {prompts.shape[1]}] (P = prompts.shape[1]).')
  max_decode_steps = decode_args.check_int('max_decode_steps',
                                           max_decode_steps, 1)
  if isinstance(eos_id, (bool, np.bool_)) or not isinstance(
      eos_id, (int, np.integer)):
    raise ValueError(f'eos_id must be an integer, got {eos_id!r}.')
  speculative_vocab_size = decode_args.check_speculative_vocab_size(
      speculative_vocab_size)
  for name, flag in (('bidirectional', bidirectional),
                     ('record_schedule', record_schedule),
                     ('require_pipeline', require_pipeline),
                     ('check_params', check_params)):
    decode_args.check_bool(name, flag)
  decode_args.check_token_range(prompts, module.config.vocab_size,
                                prompt_lengths, name='prompts')
  if check_params:
    check_finite(params)
  if method in SAMPLING_METHODS:
    topp = 0.0 if topp is None else topp
    temperature, topk, _ = sampling.check_settings(
        'generate', 1, 1.0 if temperature is None else temperature,
        0 if topk is None else topk, topp)
    temperature, topp = temperature[0], jnp.asarray(topp, jnp.float32)
  else:  # A greedy method takes no sampling argument (refused above).
    temperature = topp = rng = None
    topk = 0
  max_speculative_rows, require_pipeline = _pipeline_settings(
      method, prompts.shape[0] * module.config.num_repeats,
      max_speculative_rows, require_pipeline, record_schedule)
  if method in SPEED_METHODS:
    # Resolved here, so that 'auto' and the integer it picks share one
    # compiled program.
    speed_branches = cpu.dispatch.speed_branches(
        speed_branches, prompts.shape[0], module.config.num_repeats,
        module.config.dtype)
  else:
    speed_branches = 0
  # NumPy inputs go to the jitted call as they are: a jnp conversion here
  # would be one more dispatch per array, on every call.
  return _generate(module, params, np.asarray(prompts, np.int32),
                   np.asarray(prompt_lengths, np.int32), temperature, topp,
                   rng, (None if encoder_input_tokens is None else
                         np.asarray(encoder_input_tokens, np.int32)),
                   max_decode_steps=max_decode_steps, method=method, topk=topk,
                   eos_id=operator.index(eos_id), bidirectional=bidirectional,
                   record_schedule=record_schedule,
                   speculative_vocab_size=speculative_vocab_size,
                   max_speculative_rows=max_speculative_rows,
                   require_pipeline=require_pipeline,
                   speed_branches=speed_branches)


def _pipeline_settings(method: str, rows: int, max_speculative_rows: Any,
                       require_pipeline: bool, record_schedule: bool):
  """(max_speculative_rows, require_pipeline) as `_generate` is keyed on:
  (None, False) wherever the decode runs no pipeline choice (a method
  without one, or a SPEED batch of `rows` rows that pipelines anyway), so
  that 'auto', None and a limit above `rows` share one compiled program."""
  limit = cpu.dispatch.max_speculative_rows(max_speculative_rows)
  if method not in SPEED_METHODS or speed_loop.within_limit(
      rows, limit, record_schedule):
    return None, False
  return limit, require_pipeline


# What each setting of `generate` is when left unset.
_DEFAULTS = dict(temperature=None, topk=None, topp=None, rng=None,
                 record_schedule=False, speculative_vocab_size=None,
                 max_speculative_rows='auto', require_pipeline=False,
                 speed_branches='auto')


def _check_method_settings(method: str, sampling_settings: dict,
                           speed_settings: dict) -> None:
  """Raises ValueError where a setting that `method` does not use is given
  (differs from its default)."""
  for settings, used, what in (
      (sampling_settings, SAMPLING_METHODS, 'sampling'),
      (speed_settings, SPEED_METHODS, 'SPEED')):
    given = {k: v for k, v in settings.items()
             if not _is_default(v, _DEFAULTS[k])}
    if method not in used and given:
      names = ', '.join(f'{k}={v!r}' for k, v in given.items())
      raise ValueError(
          f'generate(method={method!r}) does not use {names}: '
          f'{", ".join(settings)} are settings of the {what} methods '
          f'{used}. Leave them unset, or choose one of those methods.')


def _is_default(value: Any, default: Any) -> bool:
  if default is None:
    return value is None
  return isinstance(value, type(default)) and value == default
