"""The Transformer blocks of the networks, with T5X's parameter names.

`Attention` holds a block's query, key, value and output projections;
`DecoderLayer` is a decoder block (self-attention, then, in an
encoder-decoder model, attention to the encoder's output, then the MLP),
usable on a whole sequence or on a decode step's slots; `EncoderLayer` is T5
1.1's encoder block. Each matches its T5X counterpart
(t5x/examples/decoder_only and t5x/examples/t5) parameter for parameter.
"""

from typing import Optional, Sequence, Tuple

from flax import linen as nn
import jax
import jax.numpy as jnp

from t5x_speed import layers
from t5x_speed.config import TransformerConfig

__all__ = ['Attention', 'DecoderLayer', 'EncoderLayer', 'SequenceCross',
           'StepCross']

Array = jax.Array
# Cross-attention of a whole sequence: the encoder's keys and values, each
# [batch, enc_len, heads, head_dim], and the bias [batch, 1, length or 1,
# enc_len].
SequenceCross = Tuple[Array, Array, Array]
# Cross-attention of a decode step: the encoder's keys and values, each
# [1, batch, heads, enc_len, head_dim], and the bias [batch, slots, heads,
# enc_len].
StepCross = Tuple[Array, Array, Array]


class Attention(nn.Module):
  """Multi-head attention projections (T5X names and initialisers)."""

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    features = (cfg.num_heads, cfg.head_dim)
    # T5 folds 1/sqrt(head_dim) into the query initialiser, not the logits.
    depth_scaling = jnp.sqrt(cfg.head_dim).astype(cfg.dtype)
    query_init = lambda *a: layers.attention_kernel_init(*a) / depth_scaling
    proj = lambda init: layers.Dense(features, dtype=cfg.dtype,
                                     kernel_init=init,
                                     kernel_axes=('embed', 'joined_kv'))
    self.query = proj(query_init)
    self.key = proj(layers.attention_kernel_init)
    self.value = proj(layers.attention_kernel_init)
    self.out = layers.Dense((cfg.emb_dim,), num_in_axes=2, dtype=cfg.dtype,
                            kernel_init=layers.attention_kernel_init,
                            kernel_axes=('joined_kv', 'embed'))

  def qkv(self, x: Array, numerics: layers.Numerics = None
          ) -> Tuple[Array, Array, Array]:
    """[..., emb] -> three [..., heads, head_dim]."""
    axes = ('batch', 'length', 'heads', 'kv')
    return tuple(layers.with_sharding_constraint(y, axes) for y in
                 layers.dense_group((self.query, self.key, self.value), x,
                                    numerics))

  def kv(self, x: Array) -> Tuple[Array, Array]:
    """[..., emb] -> keys and values, each [..., heads, head_dim]."""
    axes = ('batch', 'length', 'heads', 'kv')
    return tuple(layers.with_sharding_constraint(y, axes) for y in
                 layers.dense_group((self.key, self.value), x))

  def q(self, x: Array, numerics: layers.Numerics = None) -> Array:
    """[..., emb] -> queries [..., heads, head_dim]."""
    return layers.with_sharding_constraint(
        self.query(x, numerics), ('batch', 'length', 'heads', 'kv'))

  def __call__(self, context: Array, numerics: layers.Numerics = None
               ) -> Array:
    """[..., heads, head_dim] -> [..., emb]."""
    return self.out(context, numerics)


def _dropout_rng(module: nn.Module, deterministic: bool) -> Optional[Array]:
  if deterministic or module.config.dropout_rate == 0:
    return None
  return module.make_rng('dropout')


def _attention_residual(layer: nn.Module, attention: Attention,
                        dropout: nn.Dropout, x: Array, q: Array, k: Array,
                        v: Array, bias: Array, deterministic: bool) -> Array:
  """x + dropout(out(attention of q over k, v)): a whole-sequence attention
  sub-block of `layer` (T5X's arithmetic and dropout)."""
  cfg = layer.config
  context = layers.dot_product_attention(
      q, k, v, bias, cfg.dropout_rate, _dropout_rng(layer, deterministic),
      cfg.dtype)
  return x + dropout(attention(context), deterministic=deterministic)


def _mlp_residual(layer: nn.Module, x: Array, deterministic: bool,
                  numerics: layers.Numerics = None) -> Array:
  """x + dropout(mlp(norm(x))): the MLP sub-block of a decoder or encoder
  layer (its `pre_mlp_layer_norm`, `mlp` and `post_mlp_dropout`)."""
  y = layer.mlp(layer.pre_mlp_layer_norm(x, numerics),
                deterministic=deterministic, numerics=numerics)
  return x + layer.post_mlp_dropout(y, deterministic=deterministic)


class DecoderLayer(nn.Module):
  """Pre-norm self-attention (+ cross-attention) + gated MLP block, usable
  on a sequence or on a decode step's slots."""

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    dropout = lambda: nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    self.pre_self_attention_layer_norm = layers.RMSNorm(dtype=cfg.dtype)
    self.self_attention = Attention(cfg)
    self.post_self_attention_dropout = dropout()
    if cfg.is_encoder_decoder:
      self.pre_cross_attention_layer_norm = layers.RMSNorm(dtype=cfg.dtype)
      self.encoder_decoder_attention = Attention(cfg)
      self.post_cross_attention_dropout = dropout()
    self.pre_mlp_layer_norm = layers.RMSNorm(dtype=cfg.dtype)
    self.mlp = layers.Mlp(cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate,
                          dtype=cfg.dtype)
    self.post_mlp_dropout = dropout()

  def cross_kv(self, encoded: Array) -> Tuple[Array, Array]:
    """The encoder output's keys and values for this layer's
    cross-attention: [batch, enc_len, emb] -> two [batch, enc_len, heads,
    head_dim]."""
    return self.encoder_decoder_attention.kv(encoded)

  def __call__(self, x: Array, bias: Array, deterministic: bool,
               cross: Optional[SequenceCross] = None
               ) -> Tuple[Array, Array, Array]:
    """Whole-sequence pass.

    Args:
      x: [batch, length, emb].
      bias: [batch or 1, heads or 1, length, length] additive attention bias.
      deterministic: disables dropout.
      cross: in an encoder-decoder model, this layer's `cross_kv` of the
        encoder's output and the bias [batch, 1, length or 1, enc_len]
        masking its padding (`SequenceCross`).

    Returns:
      The output [batch, length, emb] and this layer's keys and values, each
      [batch, length, heads, head_dim], for the caller to cache.
    """
    q, k, v = self.self_attention.qkv(self.pre_self_attention_layer_norm(x))
    x = _attention_residual(self, self.self_attention,
                            self.post_self_attention_dropout, x, q, k, v,
                            bias, deterministic)
    if cross is not None:
      cross_k, cross_v, cross_bias = cross
      attention = self.encoder_decoder_attention
      q = attention.q(self.pre_cross_attention_layer_norm(x))
      x = _attention_residual(self, attention,
                              self.post_cross_attention_dropout, x, q,
                              cross_k, cross_v, cross_bias, deterministic)
    return _mlp_residual(self, x, deterministic), k, v

  def step(self, x: Array, positions: Array, bias: Array, keys: Array,
           values: Array, stages: Sequence[int],
           cross: Optional[StepCross] = None,
           numerics: layers.Numerics = None) -> Tuple[Array, Array, Array]:
    """Cached pass of one token per slot (inference only).

    Args:
      x: [batch, slots, emb].
      positions: [batch, slots] absolute positions, -1 for empty slots.
      bias: [batch, slots, heads, length] relative bias + own-position mask.
      keys: [R, batch, heads, length, head_dim] caches of this pass position.
      values: like `keys`.
      stages: static stage (repetition) of each slot.
      cross: in an encoder-decoder model, this layer's cached cross-attention
        keys and values and the slots' bias (`StepCross`).
      numerics: the decode step's (`t5x_speed.cpu.DecodeNumerics`).

    Returns:
      The output [batch, slots, emb] and the updated `keys` and `values`.
    """
    q, k, v = self.self_attention.qkv(
        self.pre_self_attention_layer_norm(x, numerics), numerics)
    context, keys, values = layers.cached_attention(
        q, keys, values, bias, k, v, positions, stages, numerics)
    x = x + self.self_attention(context, numerics)
    if cross is not None:
      cross_k, cross_v, cross_bias = cross
      attention = self.encoder_decoder_attention
      q = attention.q(self.pre_cross_attention_layer_norm(x, numerics),
                      numerics)
      context = layers.attention(q, cross_k, cross_v, cross_bias, numerics)
      x = x + attention(context, numerics)
    return _mlp_residual(self, x, True, numerics), keys, values


class EncoderLayer(nn.Module):
  """T5 1.1's encoder block: pre-norm bidirectional self-attention + MLP."""

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.pre_attention_layer_norm = layers.RMSNorm(dtype=cfg.dtype)
    self.attention = Attention(cfg)
    self.post_attention_dropout = nn.Dropout(cfg.dropout_rate,
                                             broadcast_dims=(-2,))
    self.pre_mlp_layer_norm = layers.RMSNorm(dtype=cfg.dtype)
    self.mlp = layers.Mlp(cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate,
                          dtype=cfg.dtype)
    self.post_mlp_dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

  def __call__(self, x: Array, bias: Array, deterministic: bool) -> Array:
    """[batch, length, emb] -> [batch, length, emb]; `bias` [batch or 1,
    heads or 1, length, length] holds the relative-position bias and the
    padding mask."""
    q, k, v = self.attention.qkv(self.pre_attention_layer_norm(x))
    x = _attention_residual(self, self.attention, self.post_attention_dropout,
                            x, q, k, v, bias, deterministic)
    return _mlp_residual(self, x, deterministic)
