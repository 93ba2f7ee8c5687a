"""Transformer building blocks with T5X parameter names and logical axes.

Each block reproduces the arithmetic of T5X's decoder-only example
(t5x/examples/decoder_only/layers.py) so that checkpoints map one to one,
with two decode-time changes: the embedding is a gather (a one-hot matmul
re-reads the whole table every step) and the key/value cache is written at
absolute positions by scatter, touching only the written entries.

A decode step's weight products, gathers and attention take its
`numerics` (a `t5x_speed.cpu.DecodeNumerics`, resolved once per model by
`t5x_speed.cpu.dispatch.decode_numerics`): the CPU kernels, XLA's dot or
per-row GEMVs. Full-sequence passes (training, scoring, prefill) pass none
and use XLA's ops. Gathers and scatters of 16-bit floats move the values as
uint16 bits in every pass (`move_values`).

Dense kernels and the embedding table may also be int8 with float32 scales
per output channel (`kernel_scale` / `embedding_scale` beside them, from
`t5x_speed.quantize.quantize_int8`): every pass then multiplies by the
widened weights in float32 and scales each finished sum.
"""

import functools
import operator
from typing import Any, Callable, Optional, Sequence, Tuple

from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from t5x_speed import cpu
from t5x_speed.cpu.dispatch import DecodeNumerics
from t5x_speed.cpu.dispatch import Matmul
from t5x_speed.position_bias import RelativePositionBias
from t5x_speed.position_bias import relative_position_bucket

__all__ = ['Dense', 'dense_group', 'RMSNorm', 'Mlp', 'Embed',
           'RelativePositionBias', 'relative_position_bucket',
           'make_attention_mask', 'dot_product_attention', 'write_cache',
           'cached_attention', 'attention', 'move_values', 'NEG_INF']

Array = jax.Array
Numerics = Optional[DecodeNumerics]
param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

# Additive attention bias of masked keys, as in T5X.
NEG_INF = -1e10

# Gathers and scatters move these dtypes as the unsigned integers of their
# width: they only move values, and XLA:CPU would convert the whole operand
# to float32 and back.
_MOVE_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
              jnp.dtype(jnp.float16): jnp.dtype(jnp.uint16)}

default_kernel_init = nn.initializers.variance_scaling(
    1.0, 'fan_in', 'truncated_normal')
attention_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in',
                                                         'normal')


def _per_row(x: Array, batch_ndim: int, row_fn) -> Array:
  """Stacks row_fn over the (few) rows in the leading batch_ndim axes."""
  batch_shape = x.shape[:batch_ndim]
  rows = x.reshape((-1,) + x.shape[batch_ndim:])
  out = jnp.stack([row_fn(row) for row in rows])
  return out.reshape(batch_shape + out.shape[1:])


def _int8_scale(module: nn.Module, weight: Array, name: str
                ) -> Optional[Array]:
  """The float32 scales of an int8 `weight` (the param `name`), else None.

  Raises:
    ValueError: naming the parameter, for a scale beside a weight that is
      not int8 (quantized parameters cast to a float dtype would multiply
      by the integers and ignore the scales).
  """
  if weight.dtype != jnp.int8:
    if module.has_variable('params', name):
      raise ValueError(
          f'{"/".join(module.path)}: {name!r} stands beside a {weight.dtype} '
          'weight, which must be int8: these are quantized parameters cast '
          'to another dtype. Decode the int8 parameters of '
          't5x_speed.quantize.quantize_int8 as they are, or its '
          'dequantize() for float weights.')
    return None
  scale = module.get_variable('params', name)
  if scale is None:
    raise ValueError(f'{module.name}: an int8 weight needs its {name!r} '
                     'beside it; quantize parameters with '
                     't5x_speed.quantize.quantize_int8.')
  return jnp.asarray(scale)


class Dense(nn.Module):
  """Bias-free linear map over the trailing `len(in_shape)` axes.

  The kernel is stored 2-D, [prod(in), prod(out)], as T5X's DenseGeneral does,
  so that its logical axes (`kernel_axes`) name the stored array. Called
  with a decode step's `numerics`, the product runs as they say (the CPU
  kernel reads the stored layout directly); without, it is XLA's dot. An
  int8 kernel (with `kernel_scale` [prod(out)]) is multiplied in float32,
  the result rounded once to `dtype`.
  """

  features: Tuple[int, ...]
  num_in_axes: int = 1
  dtype: Any = jnp.float32
  kernel_init: Callable[..., Array] = default_kernel_init
  kernel_axes: Tuple[str, str] = ('embed', 'mlp')

  @nn.compact
  def __call__(self, x: Array, numerics: Numerics = None) -> Array:
    features = tuple(np.atleast_1d(self.features))
    in_shape = x.shape[-self.num_in_axes:]
    kernel = param_with_axes(
        'kernel', self.kernel_init,
        (int(np.prod(in_shape)), int(np.prod(features))), jnp.float32,
        axes=self.kernel_axes)
    w_scale = _int8_scale(self, kernel, 'kernel_scale')
    x = jnp.asarray(x, self.dtype)
    batch_ndim = x.ndim - self.num_in_axes
    batch_shape = x.shape[:batch_ndim]
    path = _matmul_path(numerics, int(np.prod(batch_shape)), kernel.size)
    if path is Matmul.KERNEL or w_scale is not None:
      flat = x.reshape(batch_shape + (kernel.shape[0],))
      if w_scale is None:
        kernel = jnp.asarray(kernel, self.dtype)
      matmul = functools.partial(
          cpu.matmul.matmul, w=kernel, w_scale=w_scale,
          force_xla=path is not Matmul.KERNEL,
          threads=0 if numerics is None else numerics.threads)
      if path is Matmul.ROW_MATVECS:
        out = _per_row(flat, batch_ndim, lambda row: matmul(row))
      else:
        out = matmul(flat)
      return out.reshape(batch_shape + features)
    kernel = jnp.asarray(kernel, self.dtype).reshape(in_shape + features)
    k_axes = tuple(range(self.num_in_axes))
    if path is Matmul.ROW_MATVECS:
      return _per_row(x, batch_ndim, lambda row: lax.dot_general(
          row, kernel, ((k_axes, k_axes), ((), ()))))
    contract = tuple(range(batch_ndim, x.ndim))
    return lax.dot_general(x, kernel, ((contract, k_axes), ((), ())))


def dense_group(denses: Sequence[Dense], x: Array,
                numerics: Numerics = None) -> Tuple[Array, ...]:
  """`tuple(d(x, numerics) for d in denses)`, as one kernel call where the
  decode step's `numerics` put the product in the CPU kernel.

  The weights of all of `denses` (e.g. q, k and v) then stream in one call
  with one wait on its threads; every output is bit-identical to the
  Dense's own. Elsewhere (training, prefill, XLA's dot, initialisation)
  each Dense is called as usual.

  Args:
    denses: Dense modules of one parent, each with `num_in_axes` 1 and one
      dtype.
    x: [..., in] activations.
    numerics: a decode step's, or None (XLA's dot).
  """
  dtype = denses[0].dtype
  batch_shape = x.shape[:-1]
  if (len(denses) > 1 and
      all(d.num_in_axes == 1 and d.dtype == dtype for d in denses) and
      all(d.has_variable('params', 'kernel') for d in denses)):
    kernels = [jnp.asarray(d.get_variable('params', 'kernel'))
               for d in denses]
    w_scales = [_int8_scale(d, k, 'kernel_scale')
                for d, k in zip(denses, kernels)]
    if w_scales[0] is None:
      kernels, w_scales = [jnp.asarray(k, dtype) for k in kernels], None
    path = _matmul_path(numerics, int(np.prod(batch_shape)),
                        sum(k.size for k in kernels))
    if path is Matmul.KERNEL:
      outs = cpu.matmul.matmuls(jnp.asarray(x, dtype), kernels,
                                w_scales=w_scales, threads=numerics.threads)
      return tuple(o.reshape(batch_shape + tuple(np.atleast_1d(d.features)))
                   for o, d in zip(outs, denses))
  return tuple(d(x, numerics) for d in denses)


class RMSNorm(nn.Module):
  """T5 layer norm: scale by the root mean square, no centering, no bias.

  Called with a decode step's `numerics` on the kernels, each row is
  normalised by `cpu.norm.rms_norm` (one fixed order per row); without,
  by XLA's ops.
  """

  dtype: Any = jnp.float32
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: Array, numerics: Numerics = None) -> Array:
    scale = param_with_axes('scale', nn.initializers.ones, (x.shape[-1],),
                            jnp.float32, axes=('embed',))
    return cpu.norm.rms_norm(
        x, scale, self.epsilon, self.dtype,
        force_xla=numerics is None or not numerics.kernel)


def _activation(name: str) -> Callable[[Array], Array]:
  return (lambda x: x) if name == 'linear' else getattr(nn, name)


class Mlp(nn.Module):
  """Gated feed-forward block: wo(prod_i act_i(wi_i x))."""

  intermediate_dim: int
  activations: Sequence[str]
  dropout_rate: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, deterministic: bool,
               numerics: Numerics = None) -> Array:
    names = (['wi'] if len(self.activations) == 1 else
             [f'wi_{i}' for i in range(len(self.activations))])
    projections = dense_group([
        Dense((self.intermediate_dim,), dtype=self.dtype,
              kernel_axes=('embed', 'mlp'), name=name) for name in names
    ], x, numerics)
    hidden = functools.reduce(operator.mul, [
        _activation(act)(h) for h, act in zip(projections, self.activations)
    ])
    hidden = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(
        hidden, deterministic=deterministic)
    hidden = with_sharding_constraint(hidden, ('batch', 'length', 'mlp'))
    return Dense((x.shape[-1],), dtype=self.dtype, kernel_axes=('mlp', 'embed'),
                 name='wo')(hidden, numerics)


class Embed(nn.Module):
  """Token embedding table, also usable as the tied output classifier.

  An int8 table takes `embedding_scale` [num_embeddings] beside it: row v
  is embedding[v] * embedding_scale[v] as float32.
  """

  num_embeddings: int
  features: int
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = param_with_axes(
        'embedding', nn.initializers.normal(stddev=1.0),
        (self.num_embeddings, self.features), jnp.float32,
        axes=('vocab', 'embed'))

  def __call__(self, tokens: Array, numerics: Numerics = None) -> Array:
    """Gathers rows: [...] int -> [..., features] in `dtype`.

    With a decode step's `numerics` on the kernel, the rows are copied as
    stored (a uint16 view of a bf16 table would be a copy per step).
    """
    w_scale = _int8_scale(self, self.embedding, 'embedding_scale')
    if w_scale is not None:
      rows = cpu.matmul.gather_rows(
          self.embedding, tokens, row_scale=w_scale,
          force_xla=numerics is None or not numerics.kernel)
      return jnp.asarray(rows, self.dtype)
    if numerics is not None and numerics.kernel:
      rows = cpu.matmul.gather_rows(self.embedding, tokens)
      return jnp.asarray(rows, self.dtype)
    table = jnp.asarray(self.embedding, self.dtype)
    return move_values(lambda t, i: t[i], (table,), tokens)

  def attend(self, query: Array, vocab_limit: Optional[int] = None,
             scale: float = 1.0, numerics: Numerics = None) -> Array:
    """Scores `query` [..., features] against the rows, in float32.

    `vocab_limit` scores only the first `vocab_limit` rows; every score is
    multiplied by float32(`scale`). With a decode step's `numerics` on the
    kernel, it reads the table as stored (bf16 or f32) without a converted
    copy and scales each score as it stores it; the arithmetic is float32
    either way, and the scaling is the same float32 multiply on every path
    (the paths differ only in how they sum the dot products).
    """
    query = jnp.asarray(query, jnp.float32)
    rows = int(np.prod(query.shape[:-1]))
    scored = self.num_embeddings if vocab_limit is None else vocab_limit
    path = _matmul_path(numerics, rows, scored * self.features)
    w_scale = _int8_scale(self, self.embedding, 'embedding_scale')
    if path is Matmul.KERNEL or w_scale is not None:
      matmul = functools.partial(
          cpu.matmul.matmul, w=self.embedding, transpose_w=True,
          cols=vocab_limit, scale=scale, w_scale=w_scale,
          force_xla=path is not Matmul.KERNEL,
          threads=0 if numerics is None else numerics.threads)
      if path is Matmul.ROW_MATVECS:
        return _per_row(query, query.ndim - 1, lambda row: matmul(row))
      return matmul(query)
    table = jnp.asarray(self.embedding, jnp.float32)
    if vocab_limit is not None:
      table = table[:vocab_limit]
    if path is Matmul.ROW_MATVECS:
      scores = _per_row(query, query.ndim - 1, lambda row: jnp.dot(table, row))
    else:
      scores = jnp.dot(query, table.T)
    return scores if scale == 1.0 else scores * np.float32(scale)


def make_attention_mask(target_tokens: Array,
                        causal_attention: Optional[Array] = None,
                        segment_ids: Optional[Array] = None) -> Array:
  """Training mask, as T5X's `make_decoder_mask`: [batch, 1, length, length].

  Causal, except that positions with `causal_attention` = 1 (a prefix-LM's
  inputs) see each other; padding (token 0) and other segments are masked.
  """
  pos = jnp.arange(target_tokens.shape[-1])
  mask = pos[:, None] >= pos[None, :]                       # [len, len]
  if causal_attention is not None:
    bidir = causal_attention.astype(bool)
    mask = mask | (bidir[:, :, None] & bidir[:, None, :])   # [batch, len, len]
  valid = target_tokens > 0
  mask = mask & valid[:, :, None] & valid[:, None, :]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return mask[:, None]


def dot_product_attention(query: Array, key: Array, value: Array, bias: Array,
                          dropout_rate: float, dropout_rng: Optional[Array],
                          dtype: Any) -> Array:
  """Full-sequence attention, T5X arithmetic (no 1/sqrt(d): it is in init).

  Args:
    query: [batch, q_len, heads, head_dim].
    key: [batch, k_len, heads, head_dim].
    value: [batch, k_len, heads, head_dim].
    bias: additive bias broadcastable to [batch, heads, q_len, k_len].
    dropout_rate: attention-weight dropout, used when `dropout_rng` is given.
    dropout_rng: PRNG key, or None for deterministic attention.
    dtype: dtype of the attention weights.

  Returns:
    [batch, q_len, heads, head_dim].
  """
  weights = jnp.einsum('bqhd,bkhd->bhqk', query, key)
  weights = jax.nn.softmax(weights + bias.astype(weights.dtype)).astype(dtype)
  if dropout_rng is not None and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = list(weights.shape)
    shape[-2] = 1  # T5 broadcasts the dropout mask along the query axis.
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (keep.astype(weights.dtype) /
                         jnp.asarray(keep_prob, dtype))
  return jnp.einsum('bhqk,bkhd->bqhd', weights, value)


def write_cache(cache: Array, stages: Sequence[int], positions: Array,
                update: Array) -> Array:
  """Writes one key (or value) per row at its absolute position.

  A write at position p replaces what was there. Rows whose position is
  negative (empty slots) or beyond the cache write nothing at all.

  Args:
    cache: [stages, batch, heads, length, head_dim], one cache per stage.
    stages: static stage index of each slot, len(stages) == slots.
    positions: [batch, slots] absolute positions, -1 for an empty slot.
    update: [batch, slots, heads, head_dim].

  Returns:
    The cache with exactly the valid rows' entries replaced.
  """
  update = update.astype(cache.dtype)
  if positions.size == 1:
    # XLA makes a single write a dynamic-update-slice, and XLA:CPU then
    # copies the whole cache several times per loop step when a dot reads
    # it. A second write, always dropped, keeps it a scatter.
    stages = tuple(stages) * 2
    positions = jnp.concatenate([positions, jnp.full_like(positions, -1)], 1)
    update = jnp.concatenate([update, update], 1)
  scatter = lambda c, u, p: cpu.attention.write_reference(c, stages, p, u)
  return move_values(scatter, (cache, update), positions)


def cached_attention(query: Array, keys: Array, values: Array, bias: Array,
                     new_keys: Array, new_values: Array, positions: Array,
                     stages: Sequence[int], numerics: Numerics = None
                     ) -> Tuple[Array, Array, Array]:
  """Writes a step's keys and values, then attends one query per slot.

  With `numerics` on the kernel, one kernel call does both
  (`t5x_speed.cpu.attention`); elsewhere `write_cache` and XLA's attention
  (`cpu.attention.reference`).

  Args:
    query: [batch, slots, heads, head_dim].
    keys: [stages, batch, heads, length, head_dim], every stage's cache.
    values: like `keys`.
    bias: [batch, slots, heads, length], relative-position bias plus the
      mask of keys after each query's own position.
    new_keys: [batch, slots, heads, head_dim], this step's keys.
    new_values: like `new_keys`.
    positions: [batch, slots] absolute positions, -1 for an empty slot.
    stages: static stage index of each slot, len(stages) == slots.
    numerics: the decode step's.

  Returns:
    (context [batch, slots, heads, head_dim], keys, values): the attention
    and the updated caches.
  """
  if numerics is not None and numerics.kernel:
    return cpu.attention.cached_attention(
        query, keys, values, bias, new_keys, new_values, positions,
        stages=stages, threads=numerics.threads)
  keys = write_cache(keys, stages, positions, new_keys)
  values = write_cache(values, stages, positions, new_values)
  return (cpu.attention.reference(query, keys, values, bias, stages), keys,
          values)


def attention(query: Array, keys: Array, values: Array, bias: Array,
              numerics: Numerics = None) -> Array:
  """A decode step's attention over keys and values it does not write (an
  encoder's, for cross-attention), one query per slot.

  Args:
    query: [batch, slots, heads, head_dim].
    keys: [1, batch, heads, length, head_dim].
    values: like `keys`.
    bias: [batch, slots, heads, length] additive bias (the padding mask).
    numerics: the decode step's.

  Returns:
    context [batch, slots, heads, head_dim], row by row through the kernel
    where `numerics` put the step on it, else by XLA's ops.
  """
  stages = (0,) * query.shape[1]
  if numerics is not None and numerics.kernel:
    return cpu.attention.attention(query, keys, values, bias, stages=stages,
                                   threads=numerics.threads)
  return cpu.attention.reference(query, keys, values, bias, stages)


def _matmul_path(numerics: Numerics, rows: int,
                 weight_elements: int) -> Matmul:
  """XLA's dot for a full-sequence pass; as `numerics` say in a decode
  step."""
  if numerics is None:
    return Matmul.XLA
  return numerics.matmul_path(rows, weight_elements)


def move_values(move: Callable[..., Array], values: Sequence[Array],
                *indices: Array) -> Array:
  """`move(*values, *indices)` for a `move` that only moves values.

  Args:
    move: a gather or scatter, linear in `values` (e.g. `lambda t, i: t[i]`).
    values: the arrays whose elements are moved, all of one dtype.
    *indices: the other (integer) operands.

  Returns:
    What `move` returns. 16-bit floats are moved as their bits, with the
    derivative of `move` itself.
  """
  dtype = jnp.dtype(values[0].dtype)
  bits = _MOVE_BITS.get(dtype)
  if bits is None:
    return move(*values, *indices)

  @jax.custom_jvp
  def moved(values, indices):
    out = move(*(lax.bitcast_convert_type(v, bits) for v in values), *indices)
    return lax.bitcast_convert_type(out, dtype)

  @moved.defjvp
  def moved_jvp(primals, tangents):
    values, indices = primals
    # The derivative of `move` on the values themselves: JAX's own rule,
    # which stays transposable where a scatter's indices may repeat.
    _, tangent = jax.jvp(lambda *v: move(*v, *indices), values, tangents[0])
    return moved(values, indices), tangent

  return moved(tuple(values), tuple(indices))
