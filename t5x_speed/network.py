"""Parameter-shared decoder-only Transformer with an exit after each repetition.

The network is T5X's decoder-only Base (t5x/examples/decoder_only) with its
`num_layers` layers replaced by G unique layers applied R times, and the final
norm + classifier applied after every repetition (the exits). With R = 1 it is
T5X's network, parameter for parameter.

Decoding uses an explicit `KVCache` holding one cache per *virtual* layer
(R*G of them), written at absolute positions. Three cached calls exist:

* `prefill`: a prefix through all stages, cached, with the exits' logits at
  the last prefix position;
* `decode_step`: one token per example through all G*R virtual layers (greedy);
* `speed_step`: R slots per example, slot s holding a token at stage s (its
  own position, -1 when empty; stage s > 0 continues from the hidden state the
  token reached in the previous step), all run through the G shared layers in
  one pass over B*R rows; slot s reads and writes the caches of stage s only.

`Decoder` is also `encoder_decoder.SpeedEncoderDecoder`'s decoder, whose
layers attend to the encoder's output (its keys and values cached by the
prefill): both steps, and every decode fn, serve both model families.

Example:
  >>> import jax, jax.numpy as jnp
  >>> cfg = TransformerConfig(vocab_size=16, emb_dim=8, num_heads=2,
  ...     head_dim=4, mlp_dim=16, num_unique_layers=2, num_repeats=3)
  >>> model = SpeedTransformer(cfg)
  >>> tokens = jnp.array([[3, 5, 7, 9]])
  >>> params = model.init(jax.random.PRNGKey(0), tokens, tokens,
  ...                     enable_dropout=False)['params']
  >>> model.apply({'params': params}, tokens, tokens,
  ...             enable_dropout=False).shape  # [exits, batch, length, vocab]
  (3, 1, 4, 16)
"""

from typing import Any, Dict, List, Optional, Tuple, Union

import flax
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import blocks
from t5x_speed import cpu
from t5x_speed import exit_adapters
from t5x_speed import layers
# Gin binds the architecture as `network.TransformerConfig`.
from t5x_speed.config import TransformerConfig
from t5x_speed.layers import make_attention_mask

__all__ = ['SpeedTransformer', 'Decoder', 'KVCache', 'TransformerConfig',
           'make_attention_mask', 'step_numerics']

Array = jax.Array


def step_numerics(config: TransformerConfig) -> cpu.DecodeNumerics:
  """How a decode step of a model with `config` computes on the platform
  JAX runs on: its `decode_matmul` and `kernel_threads` resolved by
  `t5x_speed.cpu.dispatch.decode_numerics`."""
  return cpu.dispatch.decode_numerics(config.decode_matmul,
                                      config.kernel_threads)


@flax.struct.dataclass
class KVCache:
  """Keys and values of every virtual layer, indexed by absolute position.

  Virtual layer v = r*G + j (repetition r, pass position j) owns entry [r] of
  `keys[j]` and `values[j]`: R*G caches in all, one per virtual layer.

  An encoder-decoder model's cache also holds, computed once by the
  prefill, each unique layer's keys and values of the encoder's output.

  Attributes:
    keys: G arrays of shape [R, batch, heads, length, head_dim].
    values: G arrays of shape [R, batch, heads, length, head_dim].
    cross_keys: () for a decoder-only model, else G arrays (unique layer u's
      at [u]) of shape [1, batch, heads, enc_len, head_dim].
    cross_values: like `cross_keys`.
    cross_bias: None, or [1, batch, enc_len]: 0 on the encoder's tokens,
      `layers.NEG_INF` on its padding.
  """

  keys: Tuple[Array, ...]
  values: Tuple[Array, ...]
  cross_keys: Tuple[Array, ...] = ()
  cross_values: Tuple[Array, ...] = ()
  cross_bias: Optional[Array] = None

  @property
  def length(self) -> int:
    return self.keys[0].shape[3]


class Decoder(nn.Module):
  """G unique layers applied R times, with a shared exit after each repetition.

  In an encoder-decoder model (`TransformerConfig.is_encoder_decoder`) every
  layer also attends to the encoder's output, and the token embedding is the
  parent's (`shared_embedding`), as in T5X's T5.
  """

  config: TransformerConfig
  shared_embedding: Optional[layers.Embed] = None

  def setup(self):
    cfg = self.config
    if self.shared_embedding is None:
      self.token_embedder = layers.Embed(cfg.vocab_size, cfg.emb_dim,
                                         cfg.dtype)
    self.relpos_bias = layers.RelativePositionBias(
        cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads,
        cfg.dtype)
    # A list attribute names its members layers_0 .. layers_{G-1}, as T5X.
    self.layers = [blocks.DecoderLayer(cfg)
                   for _ in range(cfg.num_unique_layers)]
    self.decoder_norm = layers.RMSNorm(dtype=cfg.dtype)
    if cfg.exit_adapter_rank is not None:
      self.exit_adapters = exit_adapters.ExitAdapters(
          cfg.num_repeats, cfg.exit_adapter_rank, cfg.dtype)
    if not cfg.logits_via_embedding:
      self.logits_dense = layers.Dense((cfg.vocab_size,), dtype=jnp.float32,
                                       kernel_axes=('embed', 'vocab'))
    self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

  # -- shared pieces ---------------------------------------------------------

  @property
  def embedder(self) -> layers.Embed:
    """The token embedding (and tied classifier): the parent's if shared."""
    if self.shared_embedding is not None:
      return self.shared_embedding
    return self.token_embedder

  def _layer(self, virtual_layer: int) -> blocks.DecoderLayer:
    return self.layers[self.config.layer_order[virtual_layer]]

  def _embed(self, tokens: Array, deterministic: bool,
             numerics: layers.Numerics = None) -> Array:
    x = self.dropout(self.embedder(tokens.astype(jnp.int32), numerics),
                     deterministic=deterministic)
    return x.astype(self.config.dtype)

  def _check_encoded(self, encoded: Optional[Array], method: str) -> None:
    if (encoded is not None) != self.config.is_encoder_decoder:
      raise ValueError(
          f'Decoder.{method}: `encoded` (the encoder\'s output) is required '
          'by an encoder-decoder model (num_encoder_layers > 0) and '
          f'meaningless otherwise; got num_encoder_layers='
          f'{self.config.num_encoder_layers} and encoded '
          f'{None if encoded is None else encoded.shape}.')

  def _sequence_cross(self, encoded: Optional[Array],
                      mask: Optional[Array]) -> Optional[Tuple[Any, Array]]:
    """Each unique layer's keys and values of `encoded` [batch, enc_len,
    emb] and the bias of `mask` [batch, 1, q_len or 1, enc_len] (nonzero:
    attend), or None for a decoder-only model."""
    if encoded is None:
      return None
    kvs = tuple(layer.cross_kv(encoded.astype(self.config.dtype))
                for layer in self.layers)
    bias = jnp.where(mask, 0.0, layers.NEG_INF).astype(self.config.dtype)
    return kvs, bias

  def _layer_cross(self, cross, virtual_layer: int):
    """A virtual layer's `blocks.SequenceCross` from `_sequence_cross`."""
    if cross is None:
      return None
    kvs, bias = cross
    return (*kvs[self.config.layer_order[virtual_layer]], bias)

  def _step_cross(self, cache: KVCache, unique_layer: int, slots: int):
    """Unique layer u's `blocks.StepCross` from the cache for a step of
    `slots` slots, or None for a decoder-only model."""
    if not cache.cross_keys:
      return None
    batch, enc_len = cache.cross_bias.shape[1:]
    bias = jnp.broadcast_to(cache.cross_bias[0][:, None, None, :],
                            (batch, slots, self.config.num_heads, enc_len))
    return (cache.cross_keys[unique_layer], cache.cross_values[unique_layer],
            bias)

  def exit_logits(self, x: Array, deterministic: bool = True,
                  vocab_limit: Optional[int] = None,
                  numerics: layers.Numerics = None,
                  exit_index: Union[None, int, str, Tuple[int, ...]] = None
                  ) -> Array:
    """The shared classifier: final norm + (tied) logits, [..., vocab] f32.

    With `vocab_limit` only the first `vocab_limit` token ids are scored;
    `numerics`: a decode step's (None: XLA's dot). `exit_index`: which exit
    `x` feeds, for the early exits' adapters (`exit_adapters`): 0..R-1,
    'slots' (x [..., S, emb] holds exit s in slot s), a tuple of each slot's
    exit, or None for the final exit; without adapters every exit computes
    alike.
    """
    y = self.decoder_norm(x, numerics)
    if self.config.exit_adapter_rank is not None and exit_index is not None:
      y = self.exit_adapters(y, exit_index)
    y = self.dropout(y, deterministic=deterministic)
    if self.config.logits_via_embedding:
      # T5X's 1/sqrt(emb) of tied logits, as the float32 multiply XLA makes
      # of its division by jnp.sqrt(emb); the kernel applies it as it stores.
      scale = np.float32(1) / np.sqrt(np.float32(y.shape[-1]))
      return self.embedder.attend(y, vocab_limit, scale=float(scale),
                                  numerics=numerics)
    logits = self.logits_dense(y, numerics)
    return logits if vocab_limit is None else logits[..., :vocab_limit]

  def _step_bias(self, positions: Array, length: int) -> Array:
    """[batch, slots] -> [batch, slots, heads, length] bias for cached steps.

    Each row masks the keys after its *own* position.
    """
    visible = jnp.arange(length) <= positions[..., None]        # [b, s, len]
    mask_bias = jnp.where(visible, 0.0,
                          layers.NEG_INF).astype(self.config.dtype)
    return self.relpos_bias.at(positions, length) + mask_bias[:, :, None, :]

  # -- training / scoring ----------------------------------------------------

  def __call__(self, decoder_input_tokens: Array,
               decoder_target_tokens: Array,
               decoder_segment_ids: Optional[Array] = None,
               decoder_positions: Optional[Array] = None,
               decoder_causal_attention: Optional[Array] = None, *,
               encoded: Optional[Array] = None,
               encoder_decoder_mask: Optional[Array] = None,
               enable_dropout: bool = True, all_exits: bool = True,
               exit_positions: Optional[Array] = None) -> Array:
    """Teacher-forced logits of every exit.

    Args:
      decoder_input_tokens: [batch, length] int tokens (shifted targets).
      decoder_target_tokens: [batch, length]; zeros mark padding.
      decoder_segment_ids: optional [batch, length] packing segments.
      decoder_positions: unused, as in T5X (relative bias needs no positions).
      decoder_causal_attention: optional [batch, length], 1 on a prefix-LM's
        inputs, which then attend bidirectionally.
      encoded: an encoder-decoder model's encoder output [batch, enc_len,
        emb]; None for a decoder-only model.
      encoder_decoder_mask: with `encoded`, [batch, 1, length, enc_len],
        nonzero where a decoder position may attend to an encoder position.
      enable_dropout: training mode.
      all_exits: return every exit, else only the last.
      exit_positions: optional [batch, K]: the exits score only these
        positions of each row (a loss's targets); None scores all.

    Returns:
      [R, batch, length, vocab] float32 logits (K for length with
      `exit_positions`), exit r after repetition r+1; no R if not all_exits.
    """
    del decoder_positions
    self._check_encoded(encoded, '__call__')
    cfg = self.config
    deterministic = not enable_dropout
    cross = self._sequence_cross(encoded, encoder_decoder_mask)
    length = decoder_input_tokens.shape[-1]
    mask = make_attention_mask(decoder_target_tokens, decoder_causal_attention,
                               decoder_segment_ids)
    bias = (jnp.where(mask, 0.0, layers.NEG_INF).astype(cfg.dtype) +
            self.relpos_bias.full(length))
    x = self._embed(decoder_input_tokens, deterministic)
    exits = []
    for r in range(cfg.num_repeats):
      for j in range(cfg.num_unique_layers):
        v = r * cfg.num_unique_layers + j
        x, _, _ = self._layer(v)(x, bias, deterministic,
                                 self._layer_cross(cross, v))
        x = layers.with_sharding_constraint(x, ('batch', 'length', 'embed'))
      if all_exits or r == cfg.num_repeats - 1:
        y = x if exit_positions is None else jnp.take_along_axis(
            x, exit_positions[..., None], axis=1)
        exits.append(self.exit_logits(y, deterministic, exit_index=r))
    return jnp.stack(exits) if all_exits else exits[-1]

  # -- cached decoding -------------------------------------------------------

  def prefill(self, tokens: Array, prefill_lengths: Array,
              decoder_causal_attention: Optional[Array] = None,
              cache_length: Optional[int] = None,
              encoded: Optional[Array] = None,
              encoder_mask: Optional[Array] = None) -> Tuple[Array, KVCache]:
    """Caches positions [0, prefill_lengths) of `tokens` in every stage.

    Args:
      tokens: [batch, length] decoder input tokens (BOS-shifted prefix).
      prefill_lengths: [batch] how many positions to cache per example.
      decoder_causal_attention: optional [batch, length] prefix-LM region that
        attends bidirectionally (T5X's `inputs_bidirectional_attention`).
      cache_length: cache size, >= length; defaults to length.
      encoded: an encoder-decoder model's encoder output [batch, enc_len,
        emb]; its keys and values are computed here, once, and cached.
      encoder_mask: with `encoded`, [batch, enc_len], nonzero on the
        encoder's tokens (0 on its padding).

    Returns:
      Every exit's logits at position prefill_lengths - 1, [batch, R, vocab]
      (meaningless where prefill_lengths is 0), and the new `KVCache`.
    """
    self._check_encoded(encoded, 'prefill')
    cfg = self.config
    batch, length = tokens.shape
    cache_length = cache_length or length
    cross = (None if encoded is None else self._sequence_cross(
        encoded, encoder_mask.astype(bool)[:, None, None, :]))
    if cache_length < length:
      raise ValueError(f'cache_length {cache_length} < tokens length {length}')
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    if decoder_causal_attention is not None:
      bidir = decoder_causal_attention.astype(bool)
      mask = mask | (bidir[:, :, None] & bidir[:, None, :])
    bias = (jnp.where(mask, 0.0, layers.NEG_INF).astype(cfg.dtype)[:, None] +
            self.relpos_bias.full(length))
    keep = (jnp.arange(cache_length) < prefill_lengths[:, None])[:, None, :,
                                                                  None]
    pad = ((0, 0), (0, 0), (0, cache_length - length), (0, 0))
    # [batch, length, heads, d] -> cached [batch, heads, cache_length, d].
    to_cache = lambda x: jnp.where(keep, jnp.pad(jnp.swapaxes(x, 1, 2), pad), 0)
    last = jnp.maximum(prefill_lengths - 1, 0)[:, None, None]      # [b, 1, 1]
    x = self._embed(tokens, deterministic=True)
    keys: List[List[Array]] = [[] for _ in range(cfg.num_unique_layers)]
    values: List[List[Array]] = [[] for _ in range(cfg.num_unique_layers)]
    exits = []
    for r in range(cfg.num_repeats):
      for j in range(cfg.num_unique_layers):
        v_layer = r * cfg.num_unique_layers + j
        x, k, v = self._layer(v_layer)(x, bias, True,
                                       self._layer_cross(cross, v_layer))
        keys[j].append(to_cache(k))
        values[j].append(to_cache(v))
      exits.append(self.exit_logits(
          jnp.take_along_axis(x, last, axis=1)[:, 0], exit_index=r))
    cache = KVCache(keys=tuple(jnp.stack(k) for k in keys),
                    values=tuple(jnp.stack(v) for v in values))
    if cross is not None:
      # [batch, enc_len, heads, d] -> [1, batch, heads, enc_len, d].
      as_cache = lambda x: jnp.swapaxes(x, 1, 2)[None]
      cache = cache.replace(
          cross_keys=tuple(as_cache(k) for k, _ in cross[0]),
          cross_values=tuple(as_cache(v) for _, v in cross[0]),
          cross_bias=cross[1][:, 0, 0][None])
    return jnp.stack(exits, axis=1), cache

  def decode_step(self, tokens: Array, positions: Array, cache: KVCache,
                  numerics: layers.Numerics = None) -> Tuple[Array, KVCache]:
    """One token per example through all G*R virtual layers.

    Args:
      tokens: [batch] int tokens.
      positions: [batch] absolute positions; -1 (or >= cache length) writes
        nothing, for finished examples (a position >= cache length attends
        to every position, without bias, as in T5X).
      cache: the `KVCache`.
      numerics: how the step computes (`t5x_speed.cpu.DecodeNumerics`);
        None is XLA's ops.

    Returns:
      Final-exit logits [batch, vocab] and the updated cache.
    """
    cfg = self.config
    keys, values = list(cache.keys), list(cache.values)
    positions = positions[:, None]                                # [b, 1]
    # A position past the cache (T5X's beam search and sampler keep stepping
    # examples that reached the end) writes nothing and, as in T5X, attends
    # to the whole cache without relative-position bias.
    bias = jnp.where((positions < cache.length)[:, :, None, None],
                     self._step_bias(positions, cache.length), 0)
    x = self._embed(tokens[:, None], True, numerics)              # [b, 1, emb]
    for r in range(cfg.num_repeats):
      for j in range(cfg.num_unique_layers):
        u = cfg.layer_order[r * cfg.num_unique_layers + j]
        x, keys[j], values[j] = self.layers[u].step(
            x, positions, bias, keys[j], values[j], stages=(r,),
            cross=self._step_cross(cache, u, 1), numerics=numerics)
    logits = self.exit_logits(x[:, 0], numerics=numerics)
    return logits, cache.replace(keys=tuple(keys), values=tuple(values))

  def stage_groups(self, j: int) -> Dict[int, Tuple[int, ...]]:
    """Unique layer -> stages that use it at pass position j (static)."""
    cfg = self.config
    groups: Dict[int, Tuple[int, ...]] = {}
    for r in range(cfg.num_repeats):
      u = cfg.layer_order[r * cfg.num_unique_layers + j]
      groups[u] = groups.get(u, ()) + (r,)
    return groups

  def speed_step(self, tokens: Array, carry: Array, positions: Array,
                 cache: KVCache, speculative_vocab_size: Optional[int] = None,
                 numerics: layers.Numerics = None
                 ) -> Tuple[Array, Array, KVCache]:
    """One SPEED pipeline step: slot s holds a token at stage (repetition) s.

    Stage 0 starts from the embedding of `tokens`; stage s > 0 continues from
    the hidden state its token reached one step earlier, in slot s-1. All R
    slots then run through the G shared layers in one pass of B*R rows, each
    reading and writing only its own stage's caches.

    With K candidate branches (`tokens` [batch, 1+K]), slots R..R+K-1 run
    tokens[:, 1:] at stage 0 too, each on a cache of its own: the cache then
    holds R+K stages, stage R+k being branch k's copy of stage 0's
    (`speed_branches.add_branch_stages`).

    Args:
      tokens: [batch] tokens entering stage 0, or [batch, 1+K]: that token
        and K branch tokens.
      carry: [batch, R-1, emb] hidden states entering stages 1..R-1, i.e. the
        previous step's returned `hidden[:, :R-1]`.
      positions: [batch, R+K] absolute position of each slot's token, -1 for
        an empty slot (which then writes nothing).
      cache: the `KVCache`.
      speculative_vocab_size: if set, the speculative exits (every slot but
        R-1) score only the first that many ids (SentencePiece lists its most
        frequent pieces first), the others -inf; slot R-1 scores the
        whole vocabulary, so outputs are unchanged and a token outside the
        shortlist can only cost a flush (where R rows cost about R one-row
        matmuls, as on XLA:CPU, this halves the classifier).
      numerics: how the step computes (`t5x_speed.cpu.DecodeNumerics`);
        None is XLA's ops.

    Returns:
      Each slot's exit logits [batch, R+K, vocab] (slot s < R: exit after
      repetition s+1; branch slots: the first exit), each slot's hidden
      state [batch, R+K, emb], and the updated cache.
    """
    cfg = self.config
    stages = cfg.num_repeats
    keys, values = list(cache.keys), list(cache.values)
    tokens = tokens.reshape(tokens.shape[0], -1)
    branches = tokens.shape[1] - 1
    slots = stages + branches
    bias = self._step_bias(positions, cache.length)   # [b, R+K, h, len]
    embedded = self._embed(tokens, True, numerics)    # [b, 1+K, emb]
    x = jnp.concatenate([embedded[:, :1], carry.astype(cfg.dtype)] + (
        [embedded[:, 1:]] if branches else []), axis=1)   # [b, R+K, emb]
    # The stage whose weights each slot runs; every slot has its own cache.
    slot_stages = tuple(range(stages)) + (0,) * branches
    for j in range(cfg.num_unique_layers):
      groups = self.stage_groups(j)
      if len(groups) == 1:  # CYCLE: one weight load serves every stage.
        u = next(iter(groups))
        x, keys[j], values[j] = self.layers[u].step(
            x, positions, bias, keys[j], values[j],
            stages=tuple(range(slots)),
            cross=self._step_cross(cache, u, slots), numerics=numerics)
        continue
      y = x
      for u, group in groups.items():
        rows = tuple(s for s in range(slots) if slot_stages[s] in group)
        idx = np.asarray(rows)
        out, keys[j], values[j] = self.layers[u].step(
            x[:, idx], positions[:, idx], bias[:, idx], keys[j], values[j],
            stages=rows, cross=self._step_cross(cache, u, len(rows)),
            numerics=numerics)
        y = y.at[:, idx].set(out)
      x = y
    cache = cache.replace(keys=tuple(keys), values=tuple(values))
    short, vocab = speculative_vocab_size, cfg.vocab_size
    if short is not None and short >= vocab:
      short = None
    if not branches:
      exits = 'slots'
      if short is None:
        return (self.exit_logits(x, numerics=numerics, exit_index=exits), x,
                cache)
      speculative = self.exit_logits(x[:, :-1], vocab_limit=short,
                                     numerics=numerics, exit_index=exits)
      final = self.exit_logits(x[:, -1:], numerics=numerics)
      return jnp.concatenate([jnp.pad(
          speculative, ((0, 0), (0, 0), (0, vocab - short)),
          constant_values=-jnp.inf), final], axis=1), x, cache
    if short is None:
      return (self.exit_logits(x, numerics=numerics, exit_index=slot_stages),
              x, cache)
    # Every slot but the final stage's is speculative.
    spec = tuple(s for s in range(slots) if s != stages - 1)
    speculative = jnp.pad(self.exit_logits(
        x[:, np.asarray(spec)], vocab_limit=short, numerics=numerics,
        exit_index=tuple(slot_stages[s] for s in spec)),
                          ((0, 0), (0, 0), (0, vocab - short)),
                          constant_values=-jnp.inf)       # [b, R+K-1, vocab]
    final = self.exit_logits(x[:, stages - 1:stages], numerics=numerics)
    return jnp.concatenate([speculative[:, :stages - 1], final,
                            speculative[:, stages - 1:]], axis=1), x, cache


class SpeedTransformer(nn.Module):
  """Outer "decoder/" name scope, as T5X's DecoderWrapper; the model module."""

  config: TransformerConfig

  def setup(self):
    if self.config.is_encoder_decoder:
      raise ValueError('SpeedTransformer is decoder-only; a config with '
                       'num_encoder_layers > 0 is an encoder_decoder.'
                       'SpeedEncoderDecoder.')
    self.decoder = Decoder(self.config)

  def __call__(self, *args, **kwargs):
    return self.decoder(*args, **kwargs)

  def prefill(self, *args, **kwargs):
    return self.decoder.prefill(*args, **kwargs)

  def decode_step(self, tokens: Array, positions: Array, cache: KVCache,
                  numerics: layers.Numerics = None) -> Tuple[Array, KVCache]:
    """`Decoder.decode_step`; `numerics` defaults to `step_numerics`'s."""
    return self.decoder.decode_step(tokens, positions, cache,
                                    numerics or step_numerics(self.config))

  def speed_step(self, tokens: Array, carry: Array, positions: Array,
                 cache: KVCache, speculative_vocab_size: Optional[int] = None,
                 numerics: layers.Numerics = None
                 ) -> Tuple[Array, Array, KVCache]:
    """`Decoder.speed_step`; `numerics` defaults to `step_numerics`'s."""
    return self.decoder.speed_step(tokens, carry, positions, cache,
                                   speculative_vocab_size,
                                   numerics or step_numerics(self.config))
