"""Encoder-decoder Transformer: T5 1.1's encoder and a GxR shared decoder.

The network is T5X's T5 1.1 (t5x/examples/t5/network.py) with its decoder
replaced by `network.Decoder`: G unique layers applied R times, each also
attending to the encoder's output, with the final norm + classifier after
every repetition (the exits). The encoder has its own depth
(`TransformerConfig.num_encoder_layers`), unshared unless
`num_encoder_repeats` > 1. With R = 1 and an unshared encoder it is T5X's
network, parameter for parameter (the token embedding shared by both stacks
at the top level, `logits_dense` unless the classifier is tied).

Decoding encodes once: `prefill` runs the encoder, computes every unique
decoder layer's cross-attention keys and values (G sets, whatever R) and
keeps them in the `network.KVCache` beside the self-attention caches, so
`decode_step` and `speed_step` (and every decode fn) are the decoder-only
model's.

Example:
  >>> import jax, jax.numpy as jnp
  >>> cfg = TransformerConfig(vocab_size=16, emb_dim=8, num_heads=2,
  ...     head_dim=4, mlp_dim=16, num_unique_layers=2, num_repeats=3,
  ...     num_encoder_layers=2)
  >>> model = SpeedEncoderDecoder(cfg)
  >>> inputs, targets = jnp.array([[3, 5, 7, 0]]), jnp.array([[4, 6, 1]])
  >>> params = model.init(jax.random.PRNGKey(0), inputs, targets, targets,
  ...                     enable_dropout=False)['params']
  >>> sorted(params)
  ['decoder', 'encoder', 'token_embedder']
  >>> model.apply({'params': params}, inputs, targets, targets,
  ...             enable_dropout=False).shape  # [exits, batch, length, vocab]
  (3, 1, 3, 16)
"""

from typing import Optional, Tuple

from flax import linen as nn
import jax
import jax.numpy as jnp

from t5x_speed import blocks
from t5x_speed import layers
from t5x_speed import network
from t5x_speed.config import TransformerConfig

__all__ = ['SpeedEncoderDecoder', 'Encoder', 'pair_mask']

Array = jax.Array


def pair_mask(query_tokens: Array, key_tokens: Array,
              query_segments: Optional[Array] = None,
              key_segments: Optional[Array] = None) -> Array:
  """[batch, 1, q_len, k_len] mask, as T5X's `make_attention_mask` of the
  tokens' padding (token 0), combined with equal segments where the key
  segments are given (T5X's rule for packed encoder-decoder examples)."""
  mask = (query_tokens > 0)[:, :, None] & (key_tokens > 0)[:, None, :]
  if key_segments is not None:
    if query_segments is None:
      raise ValueError('encoder_segment_ids (packed inputs) need '
                       'decoder_segment_ids (packed targets) too.')
    mask &= query_segments[:, :, None] == key_segments[:, None, :]
  return mask[:, None]


class Encoder(nn.Module):
  """T5 1.1's encoder: `num_encoder_layers` unique layers applied
  `num_encoder_repeats` times, cyclically, then a final norm."""

  config: TransformerConfig
  shared_embedding: layers.Embed

  def setup(self):
    cfg = self.config
    self.relpos_bias = layers.RelativePositionBias(
        cfg.relpos_num_buckets, cfg.relpos_max_distance, cfg.num_heads,
        cfg.dtype, bidirectional=True)
    self.layers = [blocks.EncoderLayer(cfg)
                   for _ in range(cfg.num_encoder_layers)]
    self.encoder_norm = layers.RMSNorm(dtype=cfg.dtype)
    self.embedding_dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    self.output_dropout = nn.Dropout(cfg.dropout_rate)

  def __call__(self, tokens: Array, mask: Array, deterministic: bool
               ) -> Array:
    """[batch, length] tokens and their [batch, 1, length, length] mask ->
    the encoded sequence [batch, length, emb]."""
    cfg = self.config
    bias = (jnp.where(mask, 0.0, layers.NEG_INF).astype(cfg.dtype) +
            self.relpos_bias.full(tokens.shape[-1]))
    x = self.shared_embedding(tokens.astype(jnp.int32))
    x = self.embedding_dropout(x, deterministic=deterministic).astype(
        cfg.dtype)
    for _ in range(cfg.num_encoder_repeats):
      for layer in self.layers:
        x = layer(x, bias, deterministic)
        x = layers.with_sharding_constraint(x, ('batch', 'length', 'embed'))
    x = self.encoder_norm(x)
    return self.output_dropout(x, deterministic=deterministic)


class SpeedEncoderDecoder(nn.Module):
  """The encoder-decoder model module (T5X's `Transformer` names)."""

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    if not cfg.is_encoder_decoder:
      raise ValueError('SpeedEncoderDecoder needs TransformerConfig.'
                       'num_encoder_layers >= 1, got '
                       f'{cfg.num_encoder_layers}.')
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype)
    self.encoder = Encoder(cfg, shared_embedding=self.token_embedder)
    self.decoder = network.Decoder(cfg, shared_embedding=self.token_embedder)

  def encode(self, encoder_input_tokens: Array,
             encoder_segment_ids: Optional[Array] = None, *,
             enable_dropout: bool = True) -> Array:
    """[batch, enc_len] tokens (0: padding) -> [batch, enc_len, emb]."""
    if encoder_input_tokens.ndim != 2:
      raise ValueError('encoder_input_tokens must be [batch, length], got '
                       f'shape {encoder_input_tokens.shape}.')
    mask = pair_mask(encoder_input_tokens, encoder_input_tokens,
                     encoder_segment_ids, encoder_segment_ids)
    return self.encoder(encoder_input_tokens, mask, not enable_dropout)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None,
               encoder_positions: Optional[Array] = None,
               decoder_positions: Optional[Array] = None, *,
               enable_dropout: bool = True, all_exits: bool = True,
               decode: bool = False,
               max_decode_length: Optional[int] = None,
               exit_positions: Optional[Array] = None) -> Array:
    """Teacher-forced logits of every exit, T5X's `Transformer.__call__`
    arguments (positions unused: the biases are relative; `decode` and
    `max_decode_length` only as T5X's model passes them at initialisation:
    cached decoding is `prefill`, `decode_step` and `speed_step`);
    `exit_positions` as `network.Decoder.__call__`'s.

    Returns:
      [R, batch, length, vocab] float32 logits, exit r after repetition r+1
      (K for length with `exit_positions`); no R if not all_exits.
    """
    del encoder_positions, max_decode_length
    if decode:
      raise ValueError('SpeedEncoderDecoder decodes through prefill, '
                       'decode_step and speed_step, not decode=True.')
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids,
                          enable_dropout=enable_dropout)
    cross_mask = pair_mask(decoder_target_tokens, encoder_input_tokens,
                           decoder_segment_ids, encoder_segment_ids)
    return self.decoder(decoder_input_tokens, decoder_target_tokens,
                        decoder_segment_ids, decoder_positions,
                        encoded=encoded, encoder_decoder_mask=cross_mask,
                        enable_dropout=enable_dropout, all_exits=all_exits,
                        exit_positions=exit_positions)

  def prefill(self, tokens: Array, prefill_lengths: Array,
              decoder_causal_attention: Optional[Array] = None,
              cache_length: Optional[int] = None, *,
              encoder_input_tokens: Array) -> Tuple[Array, network.KVCache]:
    """Encodes `encoder_input_tokens` [batch, enc_len] once, then caches the
    decoder's positions [0, prefill_lengths) of `tokens` (BOS and any
    decoder prompt) with the encoder's keys and values
    (`network.Decoder.prefill`)."""
    encoded = self.encode(encoder_input_tokens, enable_dropout=False)
    return self.decoder.prefill(tokens, prefill_lengths,
                                decoder_causal_attention, cache_length,
                                encoded=encoded,
                                encoder_mask=encoder_input_tokens > 0)

  def decode_step(self, tokens: Array, positions: Array,
                  cache: network.KVCache, numerics: layers.Numerics = None
                  ) -> Tuple[Array, network.KVCache]:
    """`network.Decoder.decode_step` with `numerics`, by default the
    model's own (`network.step_numerics(config)`)."""
    return self.decoder.decode_step(
        tokens, positions, cache,
        numerics or network.step_numerics(self.config))

  def speed_step(self, tokens: Array, carry: Array, positions: Array,
                 cache: network.KVCache,
                 speculative_vocab_size: Optional[int] = None,
                 numerics: layers.Numerics = None
                 ) -> Tuple[Array, Array, network.KVCache]:
    """`network.Decoder.speed_step` with `numerics`, by default the
    model's own (`network.step_numerics(config)`)."""
    return self.decoder.speed_step(
        tokens, carry, positions, cache, speculative_vocab_size,
        numerics or network.step_numerics(self.config))
