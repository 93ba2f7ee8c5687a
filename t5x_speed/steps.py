"""A model's steps, as every decode fn takes them (decoder-only
`network.SpeedTransformer` or `encoder_decoder.SpeedEncoderDecoder`).

`BoundSteps` is the one place that turns a module and its parameters into a
decode fn's arguments: the prefill, the full-depth step, SPEED's pipelined
step with its stage count and initial carry, and the cache in the form the
decode fn expects (`decode_fn_kwargs`). `models.SpeedDecoderOnlyModel`,
`inference.generate`, the benchmark, the fuzz runner and the tests all go
through it.

What a decode fn gets follows what it declares (`decoding.decode_fn_spec`):
a pipelined one (`decoding.speed_decode`, `sampling.speed_sample_decode`)
also gets SPEED's pipelined step, its stage count and initial carry.

The cache: `network.KVCache` keeps, per pass position j, keys and values of
shape [R, batch, heads, length, head_dim] (stage first, so SPEED's attention
reads each stage's cache without a transpose). Decode fns declaring
`kv_cache` (`decoding.greedy_decode`, `decoding.speed_decode` and the
samplers of `sampling`) take it as is, with `cache_offset=CACHE_OFFSET` (1),
the batch axis of its leaves, where the samplers repeat it for
`num_decodes > 1`; they pass each example's position in
`DecodingState.cur_index`.

Decode fns that declare nothing, T5X's (`t5x.decoding.beam_search`,
`temperature_sample` with `num_decodes > 1`), instead reshape and reorder
every cache leaf with `cache_map`, `flat_batch_beam_expand` and
`cache_gather_beams`, which need a nested dict whose leaves hold the batch on
axis `cache_offset`, and they keep positions in the cache (`beam_search`
passes its scalar loop counter as `cur_index`). `to_t5x_cache` gives them the
same arrays, unmoved, as

  {'layers_j': {'cached_key': keys[j], 'cached_value': values[j]}, ...,
   'cache_index': [1, batch] next position of each example}

with the batch on axis 1, the layout of a scanned T5X model's cache, so they
run with `cache_offset=CACHE_OFFSET` (1). An encoder-decoder model's cache
adds 'cross_key' and 'cross_value' to 'layers_u' (unique layer u's) and
'cross_bias', batch on axis 1 too, so that beam search expands and reorders
them with the rest. `t5x_tokens_to_logits` wraps a
full-depth step to read positions from, and advance, 'cache_index'.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from t5x_speed import network
  >>> kv = network.KVCache(keys=(jnp.zeros((3, 2, 4, 8, 5)),),
  ...                      values=(jnp.zeros((3, 2, 4, 8, 5)),))
  >>> t5x_cache = to_t5x_cache(kv, jnp.array([3, 1]))
  >>> t5x_cache['cache_index'].shape, t5x_cache['layers_0']['cached_key'].shape
  ((1, 2), (3, 2, 4, 8, 5))
  >>> from_t5x_cache(t5x_cache)[1].tolist()
  [3, 1]
"""

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import cpu
from t5x_speed import decode_args
from t5x_speed import decoding
from t5x_speed import encoder_decoder
from t5x_speed import layers
from t5x_speed import network

__all__ = ['BoundSteps', 'to_t5x_cache', 'from_t5x_cache',
           't5x_tokens_to_logits', 'with_cache_sharding', 'prefix_attention',
           'check_encoder_inputs', 'check_causal_attention', 'uses_pipeline',
           'takes_kv_cache', 'CACHE_OFFSET', 'CACHE_AXES']

Array = jax.Array
# (tokens [B], positions [B], cache) -> (logits [B, vocab], cache)
DecodeStepFn = Callable[[Array, Array, network.KVCache],
                        Tuple[Array, network.KVCache]]

# Axis of the batch in every leaf of the T5X-style cache.
CACHE_OFFSET = 1
# Logical axes of a `KVCache` leaf, [R, batch, heads, length, head_dim], for
# T5X's partitioning rules (all in
# `t5x.partitioning.standard_logical_axis_rules`).
CACHE_AXES = ('layers', 'batch', 'heads', 'length', 'kv')
# Of `KVCache.cross_bias`, [1, batch, enc_len].
CROSS_BIAS_AXES = ('layers', 'batch', 'length')
INDEX = 'cache_index'
CROSS_BIAS = 'cross_bias'


def to_t5x_cache(cache: network.KVCache, index: Array) -> Dict[str, Any]:
  """The arrays of `cache` as a T5X-style cache dict (nothing is copied).

  Args:
    cache: the `KVCache`.
    index: the next position of each example, [batch] (the prompt lengths
      after a prefill), or an index already in T5X form (any shape whose
      size is the batch: beam search adds a beam axis to it).

  Returns:
    {'layers_j': {'cached_key', 'cached_value'}, 'cache_index'}, plus an
    encoder-decoder model's 'cross_key' and 'cross_value' in 'layers_u' and
    'cross_bias'; every leaf holds the batch on axis `CACHE_OFFSET`.
  """
  index = jnp.asarray(index, jnp.int32)
  if index.ndim == 1:
    index = index[None]
  out: Dict[str, Any] = {
      f'layers_{j}': {'cached_key': k, 'cached_value': v}
      for j, (k, v) in enumerate(zip(cache.keys, cache.values))}
  # Both number G: pass position j's self-attention caches and unique layer
  # u's cross-attention ones share the key 'layers_{j or u}' (other layers
  # under a non-cyclic sharing order); only the round trip reads them.
  for u, (k, v) in enumerate(zip(cache.cross_keys, cache.cross_values)):
    out[f'layers_{u}'].update(cross_key=k, cross_value=v)
  if cache.cross_bias is not None:
    out[CROSS_BIAS] = cache.cross_bias
  out[INDEX] = index
  return out


def with_cache_sharding(cache: network.KVCache) -> network.KVCache:
  """`cache` with T5X's logical-axis sharding constraint on every leaf
  (`CACHE_AXES`, `CROSS_BIAS_AXES`)."""
  return jax.tree.map(lambda x: layers.with_sharding_constraint(
      x, CACHE_AXES if x.ndim == len(CACHE_AXES) else CROSS_BIAS_AXES), cache)


def from_t5x_cache(cache: Dict[str, Any]) -> Tuple[network.KVCache, Array]:
  """Inverse of `to_t5x_cache`: (`KVCache`, positions [flat batch]).

  The positions are 'cache_index' flattened, batch-major, as
  `t5x.decoding.flatten_beam_dim` flattens batch and beams.
  """
  names = sorted((k for k in cache if k.startswith('layers_')),
                 key=lambda name: int(name.rsplit('_', 1)[1]))
  kv = network.KVCache(
      keys=tuple(cache[name]['cached_key'] for name in names),
      values=tuple(cache[name]['cached_value'] for name in names),
      cross_keys=tuple(cache[name]['cross_key'] for name in names
                       if 'cross_key' in cache[name]),
      cross_values=tuple(cache[name]['cross_value'] for name in names
                         if 'cross_value' in cache[name]),
      cross_bias=cache.get(CROSS_BIAS))
  return kv, jnp.reshape(cache[INDEX], (-1,))


def t5x_tokens_to_logits(decode_step: DecodeStepFn):
  """A T5X `tokens_to_logits` over the T5X-style cache.

  Args:
    decode_step: a full-depth step, (tokens [B], positions [B], `KVCache`) ->
      (final-exit logits [B, vocab], `KVCache`), e.g.
      `SpeedTransformer.decode_step` bound to parameters. A position at or
      beyond the cache length writes nothing.

  Returns:
    `DecodingState -> (logits, cache)` that runs `state.cur_token` at the
    positions in the cache's 'cache_index' (ignoring `state.cur_index`,
    which `beam_search` sets to its loop counter) and advances it by one,
    keeping its shape. An index of one position per example serves all of
    its decodes (T5X's decode fns called without an initial_index).
  """

  def tokens_to_logits(state) -> Tuple[Array, Dict[str, Any]]:
    kv, positions = from_t5x_cache(state.cache)
    tokens = state.cur_token[:, 0]
    if positions.shape != tokens.shape:
      if tokens.shape[0] % positions.shape[0]:
        raise ValueError(
            f"The cache's {INDEX} holds {positions.shape[0]} positions for "
            f'{tokens.shape[0]} tokens: expand or reorder the cache with '
            f'cache_offset={CACHE_OFFSET}.')
      # Called without an initial_index, T5X's decode fns start every
      # example at BOS, step all of its decodes together and leave the index
      # unexpanded (T5X's own caches hold one scalar index): each example's
      # position is that of all its decodes.
      positions = jnp.repeat(positions, tokens.shape[0] // positions.shape[0])
    logits, kv = decode_step(tokens, positions, kv)
    return logits, to_t5x_cache(kv, state.cache[INDEX] + 1)

  return tokens_to_logits


def check_encoder_inputs(config: network.TransformerConfig,
                         encoder_input_tokens: Optional[Array]) -> None:
  """Raises ValueError unless `encoder_input_tokens` are given exactly for
  an encoder-decoder model."""
  if config.is_encoder_decoder != (encoder_input_tokens is not None):
    raise ValueError(
        'encoder_input_tokens are required by an encoder-decoder model and '
        'meaningless for a decoder-only one; got num_encoder_layers='
        f'{config.num_encoder_layers} and encoder_input_tokens '
        f'{"None" if encoder_input_tokens is None else "given"}.')


def check_causal_attention(config: network.TransformerConfig,
                           causal_attention: Any,
                           name: str = 'causal_attention') -> None:
  """Raises ValueError, naming `name`, where a prefix-LM region (prompts
  attending bidirectionally) is asked of an encoder-decoder model, whose
  decoder attends causally (T5's); every decode starts through here
  (`BoundSteps.prefill`, `inference.prepare`, `inference.generate`)."""
  given = not (causal_attention is None or (
      isinstance(causal_attention, (bool, np.bool_)) and not causal_attention))
  if config.is_encoder_decoder and given:
    raise ValueError(
        f'{name}: a prefix-LM region (bidirectional attention over the '
        'prompt) is for decoder-only models; an encoder-decoder model\'s '
        'decoder attends causally, and its inputs go to the encoder '
        '(encoder_input_tokens).')


def uses_pipeline(decode_fn: Callable[..., Any]) -> bool:
  """Whether `decode_fn` declares that it takes SPEED's pipelined step."""
  spec = decoding.decode_fn_spec(decode_fn)
  return spec is not None and spec.pipelined


def takes_kv_cache(decode_fn: Callable[..., Any]) -> bool:
  """Whether `decode_fn` declares that it takes the `network.KVCache`.

  Others (T5X's) get the cache as `to_t5x_cache` makes it. Partials and
  wrappers (gin's) are looked through (`decoding.decode_fn_spec`).
  """
  spec = decoding.decode_fn_spec(decode_fn)
  return spec is not None and spec.kv_cache


def prefix_attention(initial_index: Array, length: int) -> Array:
  """[batch, length] prefix-LM region: BOS and the prompt, positions <=
  initial_index, attend to each other (T5X's
  `inputs_bidirectional_attention`)."""
  return (jnp.arange(length) <= initial_index[:, None]).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class BoundSteps:
  """A `SpeedTransformer` or `encoder_decoder.SpeedEncoderDecoder` bound to
  its parameters, as decode fns call it.

  Attributes:
    module: the network.
    params: its parameters.
    speculative_vocab_size: None, or an integer >= 1: SPEED's speculative
      exits score only this many first token ids (see
      `network.Decoder.speed_step`).
    numerics: how the decode steps compute (`t5x_speed.cpu.DecodeNumerics`);
      None (the default) resolves the module's config once, at
      construction (`network.step_numerics`), and keeps the result here.

  Example (greedy and SPEED from the same prefill):
    >>> import jax, jax.numpy as jnp
    >>> from t5x_speed import decoding, network
    >>> cfg = network.TransformerConfig(vocab_size=16, emb_dim=8, num_heads=2,
    ...     head_dim=4, mlp_dim=16, num_unique_layers=2, num_repeats=3)
    >>> module = network.SpeedTransformer(cfg)
    >>> tokens = jnp.ones((1, 4), jnp.int32)
    >>> params = module.init(jax.random.PRNGKey(0), tokens, tokens,
    ...                      enable_dropout=False)['params']
    >>> bound = BoundSteps(module, params)
    >>> inputs = jnp.array([[0, 3, 4, 0, 0, 0, 0]])   # BOS, prompt, room
    >>> lengths = jnp.array([2])
    >>> cache = bound.prefill(inputs, lengths)
    >>> results = {
    ...     fn.__name__: decoding.decode(
    ...         fn, **bound.decode_fn_kwargs(fn, inputs, cache, lengths),
    ...         eos_id=1)
    ...     for fn in (decoding.greedy_decode, decoding.speed_decode)}
    >>> bool((results['greedy_decode'].sequences ==
    ...       results['speed_decode'].sequences).all())
    True
    >>> sorted(bound.decode_fn_kwargs(decoding.speed_decode, inputs, cache,
    ...                               lengths))  # doctest: +NORMALIZE_WHITESPACE
    ['cache', 'cache_offset', 'initial_carry', 'initial_index', 'inputs',
     'num_stages', 'pipeline_step_fn', 'tokens_to_logits']
  """

  module: Union[network.SpeedTransformer,
                encoder_decoder.SpeedEncoderDecoder]
  params: Any
  speculative_vocab_size: Optional[int] = None
  numerics: Optional[cpu.DecodeNumerics] = None

  def __post_init__(self):
    decode_args.check_speculative_vocab_size(self.speculative_vocab_size)
    if self.numerics is None:
      object.__setattr__(self, 'numerics',
                         network.step_numerics(self.module.config))
    elif not isinstance(self.numerics, cpu.DecodeNumerics):
      raise ValueError('numerics must be a t5x_speed.cpu.DecodeNumerics or '
                       f'None, got {self.numerics!r}.')

  @property
  def config(self) -> network.TransformerConfig:
    return self.module.config

  def _apply(self, *args, method: str, **kwargs):
    return self.module.apply({'params': self.params}, *args, method=method,
                             **kwargs)

  def prefill(self, inputs: Array, initial_index: Array,
              causal_attention: Optional[Array] = None,
              cache_length: Optional[int] = None,
              encoder_input_tokens: Optional[Array] = None) -> network.KVCache:
    """Caches positions < initial_index of BOS-shifted `inputs` [batch, L].

    `causal_attention`: optional [batch, L] prefix-LM region attending
    bidirectionally (`prefix_attention`, or T5X's decoder_causal_attention).
    `cache_length` (>= L) sizes the cache, so `inputs` need only span the
    prompts. `encoder_input_tokens` [batch, enc_len]: an encoder-decoder
    model's inputs (0: padding), encoded here once; the cache then holds
    what the decoder attends to in them (such a model takes no
    `causal_attention`: its decoder attends causally).
    """
    check_encoder_inputs(self.config, encoder_input_tokens)
    check_causal_attention(self.config, causal_attention)
    kwargs = ({} if encoder_input_tokens is None else
              dict(encoder_input_tokens=encoder_input_tokens))
    return self._apply(inputs, initial_index, causal_attention, cache_length,
                       method='prefill', **kwargs)[1]

  def decode_step(self, tokens: Array, positions: Array,
                  cache: network.KVCache) -> Tuple[Array, network.KVCache]:
    """Full depth: (tokens [B], positions [B], cache) -> (logits [B, V],
    cache)."""
    return self._apply(tokens, positions, cache, self.numerics,
                       method='decode_step')

  def tokens_to_logits(self, state) -> Tuple[Array, network.KVCache]:
    """`decode_step` at each example's `cur_index` (our decode fns)."""
    return self.decode_step(state.cur_token[:, 0], state.cur_index,
                            state.cache)

  def pipeline_step(self, tokens: Array, carry: Array, positions: Array,
                    cache: network.KVCache):
    """SPEED's step (`speed_loop.PipelineStepFn`), see `Decoder.speed_step`."""
    return self._apply(tokens, carry, positions, cache,
                       self.speculative_vocab_size, self.numerics,
                       method='speed_step')

  def initial_carry(self, batch: int) -> Array:
    """Hidden states entering stages 1..R-1 of an empty pipeline:
    zeros [batch, R-1, emb]."""
    return jnp.zeros((batch, self.config.num_repeats - 1,
                      self.config.emb_dim), self.config.dtype)

  def decode_fn_kwargs(self, decode_fn: Callable[..., Any], inputs: Array,
                       cache: network.KVCache,
                       initial_index: Array) -> Dict[str, Any]:
    """The model's arguments for `decode_fn`, after a prefill.

    Args:
      decode_fn: a decode fn of this package (it declares what it takes,
        `decoding.decode_fn_spec`), or any of T5X's.
      inputs: [batch, length] BOS-shifted prompts.
      cache: the prefilled `KVCache`.
      initial_index: [batch] prompt lengths.

    Returns:
      inputs, cache, initial_index, tokens_to_logits and cache_offset in the
      form `decode_fn` takes them; for a pipelined decode fn (SPEED) also
      pipeline_step_fn, num_stages and initial_carry. The caller adds
      eos_id, limits and sampling parameters.
    """
    kwargs = dict(inputs=inputs, cache=cache, initial_index=initial_index,
                  tokens_to_logits=self.tokens_to_logits,
                  cache_offset=CACHE_OFFSET)
    spec = decoding.decode_fn_spec(decode_fn)
    if spec is not None and spec.pipelined:
      kwargs.update(pipeline_step_fn=self.pipeline_step,
                    num_stages=self.config.num_repeats,
                    initial_carry=self.initial_carry(inputs.shape[0]))
    if spec is None or not spec.kv_cache:
      kwargs.update(cache=to_t5x_cache(cache, initial_index),
                    tokens_to_logits=t5x_tokens_to_logits(self.decode_step),
                    cache_offset=CACHE_OFFSET)
    return kwargs
