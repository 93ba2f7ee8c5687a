"""int8 weights for decoding: symmetric, one float32 scale per output channel.

A batch-1 decode step on CPU is bound by the bytes of weights it reads;
int8 weights read a quarter of float32's. `quantize_int8` turns a model's
parameters into int8 once, when they are loaded for decoding: every Dense
kernel [..., K, N] (scaled per column, its output channel) and the token
embedding table [..., V, E] (scaled per row: the classifier's output channel
and the embedded token's). Norm scales, the relative position bias and exit
adapters stay float32. Each weight w becomes q = round(w / s) in [-127, 127] with
s = max |w| / 127 over its channel, stored as `<name>` (int8) with
`<name>_scale` (float32) beside it, which `t5x_speed.layers` reads: every
pass multiplies the widened weights in float32 and scales each finished sum
by its channel's s, the CPU kernels (`t5x_speed.cpu.matmul`) without a
converted copy. Activations and accumulation stay float32 (or the model's
dtype); training, checkpoints and the T5X train path never see int8.

SPEED stays exact on a quantized model: greedy and SPEED decode the same
int8 weights with the same row-independent arithmetic, so SPEED's tokens are
greedy's on that model. The quantized model is another model, though: its
greedy output may differ from the float32 model's (docs/library.md reports
the effect on trained models).

Example:
  >>> params = {'wo': {'kernel': jnp.array([[1.0, -2.0], [0.5, 4.0]])}}
  >>> q = quantize_int8(params)
  >>> q['wo']['kernel'].tolist(), q['wo']['kernel_scale'].tolist()
  ([[127, -64], [64, 127]], [0.007874015718698502, 0.031496062874794006])
  >>> error = dequantize(q)['wo']['kernel'] - params['wo']['kernel']
  >>> bool((abs(error) <= q['wo']['kernel_scale'] / 2).all())  # half a step
  True
"""

from typing import Any

from flax import traverse_util
import jax.numpy as jnp
import numpy as np

__all__ = ['quantize_int8', 'dequantize', 'is_quantized', 'QUANTIZED',
           'DECODE_WEIGHTS', 'check_decode_weights']

# Parameter names quantized, with the axis their channel scale runs over
# (the reduced one): a Dense kernel per column, the embedding per row.
QUANTIZED = {'kernel': -2, 'embedding': -1}

# Values of a decode option choosing the weights decoding reads: the
# parameters as given, or `quantize_int8` of them.
DECODE_WEIGHTS = ('as_given', 'int8')

_SCALE = '_scale'


def check_decode_weights(value: str, name: str = 'decode_weights') -> None:
  """Raises ValueError, naming `name`, unless `value` is in DECODE_WEIGHTS."""
  if not isinstance(value, str) or value not in DECODE_WEIGHTS:
    raise ValueError(f'{name} must be one of {list(DECODE_WEIGHTS)}, got '
                     f'{value!r}.')


def _channel_scales(w, axis: int):
  """(int8 q, float32 scales) of `w`, one scale per channel (over `axis`).

  A channel holding NaN or inf gets a NaN scale: int8 cannot hold the value,
  and every product with the channel stays NaN, as the float weight's would,
  where `inference.check_finite` finds it.
  """
  w = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=axis, keepdims=True)
  scale = jnp.where(jnp.isfinite(amax),
                    jnp.where(amax > 0, amax / 127.0, 1.0),
                    jnp.nan).astype(jnp.float32)
  q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
  return q, jnp.squeeze(scale, axis)


def _flat(params: Any):
  if hasattr(params, 'unfreeze'):
    params = params.unfreeze()
  return traverse_util.flatten_dict(dict(params))


def quantize_int8(params: Any) -> Any:
  """`params` with every Dense kernel and embedding table in int8.

  Args:
    params: a model's parameters (the 'params' collection, as a nested dict
      or FrozenDict), float32 or bfloat16.

  Returns:
    A nested dict: each `kernel` / `embedding` of 2 or more axes as int8,
    with float32 `kernel_scale` [..., N] / `embedding_scale` [..., V] beside
    it; everything else as given.

  Raises:
    ValueError: if `params` are already quantized.
  """
  flat = _flat(params)
  if is_quantized(params):
    raise ValueError('params are already quantized (int8 weights found).')
  out = {}
  for path, value in flat.items():
    axis = QUANTIZED.get(path[-1])
    if axis is None or np.ndim(value) < 2:
      out[path] = value
      continue
    out[path], out[path[:-1] + (path[-1] + _SCALE,)] = _channel_scales(
        value, axis)
  return traverse_util.unflatten_dict(out)


def dequantize(params: Any) -> Any:
  """The float32 weights a quantized model multiplies by: q * scale."""
  flat = _flat(params)
  out = {}
  for path, value in flat.items():
    scale_path = path[:-1] + (path[-1] + _SCALE,)
    if path[-1].endswith(_SCALE) and path[:-1] + (
        path[-1][:-len(_SCALE)],) in flat:
      continue
    if scale_path in flat and jnp.asarray(value).dtype == jnp.int8:
      axis = QUANTIZED[path[-1]]
      value = jnp.asarray(value, jnp.float32) * jnp.expand_dims(
          flat[scale_path], axis)
    out[path] = value
  return traverse_util.unflatten_dict(out)


def is_quantized(params: Any) -> bool:
  """Whether any weight of `params` is int8."""
  return any(jnp.asarray(v).dtype == jnp.int8 for v in _flat(params).values())

