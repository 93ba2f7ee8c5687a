"""Decoding a `SpeedTransformer` without T5X: prefill, step functions, generate.

The T5X model (models.py) wires the same step functions into T5X; this module
serves the tests, the demo and the benchmark.

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
"""

import functools
import operator
from typing import Any, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import network

Array = jax.Array
METHODS = ('speed', 'greedy')


def _integer(name: str, value: Any, low: int) -> int:
  """`value` as a Python int >= `low`; bools, floats and arrays are refused."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise ValueError(f'{name} must be an integer >= {low}, got {value!r}.')
  value = operator.index(value)
  if value < low:
    raise ValueError(f'{name} must be an integer >= {low}, got {value}.')
  return value


def check_speculative_vocab_size(value: Optional[int]) -> Optional[int]:
  """None, or an integer >= 1 (>= the vocabulary size scores all of it).

  Raises:
    ValueError: otherwise (0 would leave the speculative exits nothing).
  """
  return None if value is None else _integer('speculative_vocab_size', value,
                                             1)


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


def step_fns(module: network.SpeedTransformer, params: Any,
             speculative_vocab_size: Optional[int] = None):
  """(tokens_to_logits, pipeline_step_fn) of `module` with `params`.

  `speculative_vocab_size`: see `network.Decoder.speed_step`; None or >= 1.
  """
  speculative_vocab_size = check_speculative_vocab_size(speculative_vocab_size)

  def tokens_to_logits(state: decoding.DecodingState) -> Tuple[Array, Any]:
    return module.apply({'params': params}, state.cur_token[:, 0],
                        state.cur_index, state.cache, method='decode_step')

  def pipeline_step_fn(tokens, carry, positions, cache):
    return module.apply({'params': params}, tokens, carry, positions, cache,
                        speculative_vocab_size, method='speed_step')

  return tokens_to_logits, pipeline_step_fn


def initial_carry(config: network.TransformerConfig, batch: int) -> Array:
  """Zero hidden states entering stages 1..R-1: [batch, R-1, emb]."""
  return jnp.zeros((batch, config.num_repeats - 1, config.emb_dim),
                   config.dtype)


def prefill(module: network.SpeedTransformer, params: Any, inputs: Array,
            initial_index: Array, bidirectional: bool = False,
            cache_length: Optional[int] = None) -> network.KVCache:
  """Caches positions < initial_index of BOS-shifted `inputs` [batch, length].

  With `bidirectional`, positions <= initial_index (BOS and the prompt) attend
  to each other, as T5X's `inputs_bidirectional_attention`. `cache_length`
  (>= length) sizes the cache, so that `inputs` need only span the prompts.
  """
  causal = None
  if bidirectional:
    causal = (jnp.arange(inputs.shape[1]) <= initial_index[:, None]).astype(
        jnp.int32)
  _, cache = module.apply({'params': params}, inputs, initial_index, causal,
                          cache_length, method='prefill')
  return cache


@flax.struct.dataclass
class Generation:
  """Result of `generate`.

  Attributes:
    tokens: [batch, max_decode_steps] produced tokens, zeros after EOS.
    scores: [batch] log-probability of the produced tokens (final exit).
    stats: `decoding.SpeedStats` for SPEED, else None.
    schedule: `decoding.SpeedSchedule` when recorded, else None.
  """

  tokens: Array
  scores: Array
  stats: Optional[decoding.SpeedStats] = None
  schedule: Optional[decoding.SpeedSchedule] = None


def build_inputs(prompts: Array, prompt_lengths: Array,
                 max_decode_steps: int) -> Array:
  """[batch, P] right-padded prompts -> [batch, 1 + P + steps] T5X inputs."""
  batch, width = prompts.shape
  keep = jnp.arange(width) < prompt_lengths[:, None]
  return jnp.concatenate([
      jnp.zeros((batch, 1), jnp.int32),
      jnp.where(keep, prompts, 0).astype(jnp.int32),
      jnp.zeros((batch, max_decode_steps), jnp.int32)], axis=1)


def prepare(module: network.SpeedTransformer, params: Any, prompts: Array,
            prompt_lengths: Array, max_decode_steps: int,
            bidirectional: bool = False) -> Tuple[Array, network.KVCache]:
  """T5X-style decode inputs [batch, 1 + P + steps] and their prefilled cache.

  Only BOS + prompt are cached (or attended bidirectionally), so only that
  span goes through the prefill.
  """
  inputs = build_inputs(prompts, prompt_lengths, max_decode_steps)
  cache = prefill(module, params, inputs[:, :prompts.shape[1] + 1],
                  prompt_lengths, bidirectional, cache_length=inputs.shape[1])
  return inputs, cache


def produced_tokens(decodes: Array, prompt_lengths: Array,
                    max_decode_steps: int) -> Array:
  """[batch, 1, length] decodes -> [batch, max_decode_steps] new tokens."""
  # decodes[:, 0, k] is position k+1; generation starts at prompt_length+1.
  return jax.vmap(lambda row, start: jax.lax.dynamic_slice(
      row, (start,), (max_decode_steps,)))(decodes[:, 0], prompt_lengths)


@functools.partial(jax.jit, static_argnames=(
    'module', 'max_decode_steps', 'method', 'eos_id', 'bidirectional',
    'record_schedule', 'speculative_vocab_size'))
def _generate(module, params, prompts, prompt_lengths, *, max_decode_steps,
              method, eos_id, bidirectional, record_schedule,
              speculative_vocab_size) -> Generation:
  inputs, cache = prepare(module, params, prompts, prompt_lengths,
                          max_decode_steps, bidirectional)
  tokens_to_logits, pipeline_step_fn = step_fns(module, params,
                                                speculative_vocab_size)
  kwargs = dict(inputs=inputs, cache=cache, eos_id=eos_id,
                initial_index=prompt_lengths, max_decode_steps=max_decode_steps)
  stats = schedule = None
  if method == 'greedy':
    decodes, scores = decoding.greedy_decode(
        tokens_to_logits=tokens_to_logits, **kwargs)
  else:
    out = decoding.speed_decode(
        pipeline_step_fn=pipeline_step_fn,
        initial_carry=initial_carry(module.config, inputs.shape[0]),
        return_stats=True, record_schedule=record_schedule, **kwargs)
    decodes, scores, stats = out[:3]
    schedule = out[3] if record_schedule else None
  return Generation(produced_tokens(decodes, prompt_lengths, max_decode_steps),
                    scores[:, 0], stats, schedule)


def generate(module: network.SpeedTransformer, params: Any, prompts: Array,
             prompt_lengths: Array, *, max_decode_steps: int,
             method: str = 'speed', eos_id: int = 1,
             bidirectional: bool = False,
             record_schedule: bool = False,
             speculative_vocab_size: Optional[int] = None,
             check_params: bool = False) -> Generation:
  """Greedy or SPEED generation from right-padded prompts (jitted).

  Every argument is checked on the host before tracing (so this takes
  concrete arrays, not tracers).

  Args:
    module: the network.
    params: its parameters.
    prompts: [batch, P] integer token ids in [0, vocab), zeros after each
      prompt (the padding is not checked).
    prompt_lengths: [batch] integer prompt lengths in [0, P] (0 decodes from
      BOS alone).
    max_decode_steps: tokens to produce at most per example, an integer >= 1.
    method: 'speed' or 'greedy'.
    eos_id: end-of-sequence id, an integer; one outside [0, vocab) never ends
      an example (e.g. -1 disables EOS).
    bidirectional: prefix-LM attention over BOS + prompt during prefill.
    record_schedule: keep SPEED's per-step schedule.
    speculative_vocab_size: None, or an integer >= 1: SPEED's speculative
      exits score only this many first token ids (see
      `network.Decoder.speed_step`).
    check_params: first check that `params` are finite (`check_finite`), a
      pass over the weights; non-finite weights otherwise give token 0
      repeated with NaN scores.

  Returns:
    A `Generation`.

  Raises:
    ValueError: an argument outside the range above, naming it.
  """
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')
  if any(isinstance(x, jax.core.Tracer) for x in (prompts, prompt_lengths)):
    raise ValueError(
        'generate checks prompts and prompt_lengths on the host and jits '
        'itself: call it with concrete arrays, outside jax.jit (inside jit, '
        'use decoding.speed_decode / greedy_decode, which flag bad traced '
        'inputs as invalid examples).')
  prompts, prompt_lengths = np.asarray(prompts), np.asarray(prompt_lengths)
  for name, x in (('prompts', prompts), ('prompt_lengths', prompt_lengths)):
    if not np.issubdtype(x.dtype, np.integer):
      raise ValueError(f'{name} must hold integers, got dtype {x.dtype}.')
  if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
    raise ValueError(f'prompts must be [batch, P] and prompt_lengths [batch], '
                     f'got {prompts.shape} and {prompt_lengths.shape}.')
  if prompts.shape[0] == 0:
    raise ValueError('prompts is empty (batch 0): nothing to decode.')
  if prompt_lengths.min() < 0 or prompt_lengths.max() > prompts.shape[1]:
    raise ValueError(f'prompt_lengths {prompt_lengths.tolist()} must lie in '
                     f'[0, {prompts.shape[1]}] (P = prompts.shape[1]).')
  max_decode_steps = _integer('max_decode_steps', max_decode_steps, 1)
  if isinstance(eos_id, (bool, np.bool_)) or not isinstance(
      eos_id, (int, np.integer)):
    raise ValueError(f'eos_id must be an integer, got {eos_id!r}.')
  speculative_vocab_size = check_speculative_vocab_size(speculative_vocab_size)
  decoding.check_token_range(prompts, module.config.vocab_size,
                             prompt_lengths)
  if check_params:
    check_finite(params)
  return _generate(module, params, jnp.asarray(prompts, jnp.int32),
                   jnp.asarray(prompt_lengths, jnp.int32),
                   max_decode_steps=max_decode_steps, method=method,
                   eos_id=operator.index(eos_id), bidirectional=bidirectional,
                   record_schedule=record_schedule,
                   speculative_vocab_size=speculative_vocab_size)
