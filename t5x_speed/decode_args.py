"""Checks of the decode fns' arguments, before their loops.

Arguments are checked once, before the loop, and never per step:

* shapes and dtypes (token ids, `initial_index`, `eos_id` and
  `max_decode_steps` must be integers), `num_decodes` and `cache_offset` (the
  batch axis of the cache's leaves, an integer >= 0) always raise
  `ValueError`;
* values raise `ValueError` where they are concrete: `initial_index` outside
  [0, length), `max_decode_steps` < 1, prompt token ids (positions
  <= initial_index) outside [0, vocab), vocab being the step's logits width;
* where they are traced (inside `jit`, as T5X runs its decode fns) they
  cannot raise. An example with `initial_index` outside [0, length) or a
  prompt id outside [0, vocab) is then *invalid*: it produces no token, its
  decodes are its inputs unchanged and its score is NaN (`SpeedStats.invalid`
  says why, see `INVALID_*`). A traced `max_decode_steps` <= 0 produces zero
  tokens (score 0).

Example:
  >>> import numpy as np
  >>> check_token_range(np.array([[3, 4, 99]]), vocab_size=61,
  ...                   lengths=np.array([2]))   # 99 is padding: not checked
  >>> check_token_range(np.array([[3, 99]]), vocab_size=61)
  Traceback (most recent call last):
  ...
  ValueError: inputs holds token id 99 at [0, 1] (and 0 more), outside the vocabulary [0, 61).
"""

import operator
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['INVALID_INITIAL_INDEX', 'INVALID_TOKEN_ID', 'INVALID_STEP_LIMIT',
           'MIN_TEMPERATURE', 'IntOrArray', 'Checked', 'check_token_range',
           'check_greedy_params', 'check_prng_key']

Array = jax.Array
IntOrArray = Union[int, Array]

# Bit flags of `SpeedStats.invalid`: why an example produced nothing.
INVALID_INITIAL_INDEX = 1   # traced initial_index outside [0, length)
INVALID_TOKEN_ID = 2        # traced prompt token id outside [0, vocab)
INVALID_STEP_LIMIT = 4      # did not end within the loop's step bound


def check_int(name: str, value: Any, low: int) -> int:
  """`value` as a Python int >= `low`; bools, floats and arrays are refused."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise ValueError(f'{name} must be an integer >= {low}, got {value!r}.')
  value = operator.index(value)
  if value < low:
    raise ValueError(f'{name} must be an integer >= {low}, got {value}.')
  return value


def check_bool(name: str, value: Any) -> bool:
  """`value` if it is a bool; else ValueError naming `name`."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must be a bool, got {value!r}.')
  return bool(value)


def check_speculative_vocab_size(value: Optional[int]) -> Optional[int]:
  """None, or an integer >= 1 (>= the vocabulary size scores all of it).

  Raises:
    ValueError: otherwise (0 would leave the speculative exits nothing).
  """
  return None if value is None else check_int('speculative_vocab_size',
                                              value, 1)


def is_concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _is_integer_dtype(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.integer)


def per_example(name: str, value: Any, batch: int,
                 allow_scalar: bool = True) -> Array:
  """An integer scalar or [batch] array as an int32 [batch] array.

  Raises:
    ValueError: `value` is not integer-typed (bools and floats are refused:
      3.9 would silently become 3) or has another shape.
  """
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must be an integer, got {value!r}.')
  if isinstance(value, (int, np.integer)):
    if not allow_scalar:
      raise ValueError(f'{name} must be a [batch={batch}] integer array, got '
                       f'the scalar {value!r}.')
    return jnp.full((batch,), operator.index(value), jnp.int32)
  array = value if isinstance(value, jax.Array) else np.asarray(value)
  if not _is_integer_dtype(array.dtype):
    raise ValueError(f'{name} must hold integers, got dtype {array.dtype}.')
  shapes = [(batch,)] + ([()] if allow_scalar else [])
  if array.shape not in shapes:
    raise ValueError(f'{name} must have shape ({batch},)'
                     f'{" or be a scalar" if allow_scalar else ""}, got '
                     f'{array.shape}.')
  if is_concrete(array):
    big = np.asarray(array).astype(np.int64)
    if big.size and (big.min() < np.iinfo(np.int32).min or
                     big.max() > np.iinfo(np.int32).max):
      raise ValueError(f'{name} {big.tolist()} does not fit in int32.')
  return jnp.broadcast_to(jnp.asarray(array, jnp.int32), (batch,))


class Checked(NamedTuple):
  """Validated decode arguments, all [batch]."""
  initial_index: Array   # clamped into [0, length)
  max_len: Array         # last position to produce, min(length, ...)
  eos_id: Array
  invalid: Array         # INVALID_* flags (traced checks)
  done: Array            # bool: nothing to produce (invalid or no steps)


def check_one_decode(num_decodes) -> None:
  """Greedy-exact decode fns have one result per example."""
  if num_decodes != 1:
    raise ValueError(f'num_decodes={num_decodes}: greedy decoding has one '
                     'result per example; use num_decodes=1 (or sample with '
                     '`sampling.sample_decode` / `speed_sample_decode`).')


def check_structure(inputs, cache_offset, cache):
  """Checks what never depends on traced values; returns (batch, length)."""
  if getattr(inputs, 'ndim', None) != 2:
    raise ValueError('inputs must be a [batch, length] array, got shape '
                     f'{getattr(inputs, "shape", type(inputs).__name__)}.')
  if not _is_integer_dtype(inputs.dtype):
    raise ValueError(f'inputs must hold integer token ids, got dtype '
                     f'{inputs.dtype}.')
  batch, length = inputs.shape
  if batch == 0 or length == 0:
    raise ValueError(f'inputs is empty (shape {inputs.shape}): nothing to '
                     'decode.')
  check_int('cache_offset', cache_offset, 0)
  cache_length = getattr(cache, 'length', None)
  if cache_length is not None and cache_length < length:
    raise ValueError(f'The cache holds {cache_length} positions but inputs '
                     f'has length {length}.')
  return batch, length


def validate(inputs, initial_index, max_decode_steps, eos_id,
              vocab_size: Optional[int]) -> Checked:
  """Checks the argument values before the loop (see the module docstring)."""
  batch, length = inputs.shape
  if initial_index is None:
    initial_index = jnp.zeros((batch,), jnp.int32)
  initial_index = per_example('initial_index', initial_index, batch,
                               allow_scalar=False)
  invalid = jnp.zeros((batch,), jnp.int32)
  if is_concrete(initial_index):
    index = np.asarray(initial_index)
    if index.min() < 0 or index.max() >= length:
      raise ValueError(
          f'initial_index {index.tolist()} must lie in [0, {length}): it is '
          'the position of the last prompt token (the prompt length), in '
          f'inputs of length {length}.')
  else:
    outside = (initial_index < 0) | (initial_index >= length)
    invalid = invalid | jnp.where(outside, INVALID_INITIAL_INDEX, 0)
    initial_index = jnp.clip(initial_index, 0, length - 1)

  if max_decode_steps is None:
    max_len = jnp.full((batch,), length, jnp.int32)
  else:
    steps = per_example('max_decode_steps', max_decode_steps, batch)
    if is_concrete(steps):
      if np.asarray(steps).min() < 1:
        raise ValueError(f'max_decode_steps must be >= 1 (an integer or one '
                         f'per example), got {np.asarray(max_decode_steps)}.')
    # Traced steps <= 0 produce nothing: max_len <= initial_index.
    max_len = jnp.minimum(length, initial_index + jnp.maximum(steps, 0))

  eos_id = per_example('eos_id', eos_id, batch)

  # Prompt token ids: BOS and the prompt, positions <= initial_index.
  high = np.iinfo(np.int32).max if vocab_size is None else vocab_size
  if is_concrete(inputs, initial_index):
    # On the host: concrete arrays captured by a traced function would
    # otherwise give traced comparisons.
    inputs_np = np.asarray(inputs)
    in_prompt = np.arange(length)[None, :] <= np.asarray(initial_index)[:, None]
    ids = np.where(in_prompt, inputs_np, 0)
    rows, cols = np.nonzero(in_prompt & ((ids < 0) | (ids >= high)))
    if rows.size:
      value = int(inputs_np[rows[0], cols[0]])
      raise ValueError(
          f'inputs holds token id {value} at [{rows[0]}, {cols[0]}] (and '
          f'{rows.size - 1} more), outside the vocabulary [0, {high}).')
  else:
    in_prompt = jnp.arange(length)[None, :] <= initial_index[:, None]
    ids = jnp.where(in_prompt, inputs, 0)
    outside = in_prompt & ((ids < 0) | (ids >= high))
    invalid = invalid | jnp.where(jnp.any(outside, -1), INVALID_TOKEN_ID, 0)
  done = (invalid != 0) | (max_len <= initial_index)
  return Checked(initial_index, max_len.astype(jnp.int32), eos_id, invalid,
                  done)


def check_token_range(inputs: Array, vocab_size: int,
                      lengths: Optional[Array] = None, name: str = 'inputs'):
  """Raises ValueError if concrete `inputs` hold ids outside [0, vocab_size).

  Args:
    inputs: [batch, length] token ids; traced arrays are not checked.
    vocab_size: the vocabulary size.
    lengths: optional [batch]: only `inputs[b, :lengths[b]]` is checked (the
      padding after a prompt is not).
    name: the argument the error names.
  """
  if not is_concrete(inputs, lengths) or not np.size(inputs):
    return
  values = np.asarray(inputs)
  if not np.issubdtype(values.dtype, np.integer):
    raise ValueError(f'{name} must hold integer token ids, got dtype '
                     f'{values.dtype}.')
  mask = np.ones(values.shape, bool)
  if lengths is not None:
    mask = np.arange(values.shape[-1])[None, :] < np.asarray(lengths)[:, None]
  rows, cols = np.nonzero(mask & ((values < 0) | (values >= vocab_size)))
  if rows.size:
    raise ValueError(
        f'{name} holds token id {int(values[rows[0], cols[0]])} at '
        f'[{rows[0]}, {cols[0]}] (and {rows.size - 1} more), outside the '
        f'vocabulary [0, {vocab_size}).')


def check_prng_key(name: str, key: Any) -> None:
  """Checks that `key` is None or one PRNG key, before JAX's own error.

  Accepts a typed key (`jax.random.key`, shape []) and a raw key
  (`jax.random.PRNGKey`: uint32 of the default implementation's key shape,
  [2] for threefry); concrete or traced, only shape and dtype are read.

  Raises:
    ValueError: naming `name`, for anything else (an int seed, a batch of
      keys, another dtype).
  """
  if key is None:
    return
  dtype, shape = getattr(key, 'dtype', None), getattr(key, 'shape', None)
  raw_shape = jax.eval_shape(jax.random.PRNGKey, 0).shape
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape == ():
      return
  elif dtype == jnp.uint32 and shape == raw_shape:
    return
  got = (repr(key) if shape is None else
         f'an array of shape {tuple(shape)} and dtype {dtype}')
  raise ValueError(
      f'{name} must be one PRNG key: jax.random.PRNGKey(seed) (uint32 '
      f'{list(raw_shape)}) or jax.random.key(seed), got {got}.')


def shape_of(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                     jnp.result_type(x)), tree)


# At or below this temperature T5X's sampler takes the argmax
# (t5x.decoding.MIN_TEMPERATURE).
MIN_TEMPERATURE = 1e-4


def check_greedy_params(fn_name: str, temperature: Any = 0.0, topk: Any = 1,
                        topp: Any = 0.0,
                        max_decode_steps: Optional[IntOrArray] = None,
                        max_decode_steps_hard_limit: Optional[int] = None
                        ) -> Optional[IntOrArray]:
  """Checks T5X's sampling parameters given to a greedy-exact decode fn.

  They are accepted where T5X's `temperature_sample` with the same values
  would decode greedily: temperature at most 1e-4 (T5X's MIN_TEMPERATURE;
  any topk / topp), or topk = 1 with topp = 0 (any temperature).

  Returns:
    `max_decode_steps` clipped to `max_decode_steps_hard_limit` where that is
    set (> 0), as T5X's sampler does.

  Raises:
    ValueError: the values would sample (or are traced, so cannot be
      checked), or `max_decode_steps_hard_limit` is not None or an integer.
  """
  for name, value in (('temperature', temperature), ('topk', topk),
                      ('topp', topp)):
    if not is_concrete(value):
      raise ValueError(f'{fn_name} needs a concrete {name} (it checks that '
                       'it decodes greedily), got a traced value.')
  hot = bool(np.any(np.asarray(temperature, np.float64) > MIN_TEMPERATURE))
  topk, topp = np.asarray(topk), np.asarray(topp, np.float64)
  if hot and (np.any(topk != 1) or np.any(topp != 0)):
    raise ValueError(
        f'{fn_name} decodes greedily, token for token, but temperature='
        f'{temperature}, topk={topk}, topp={topp} would sample. Sample with '
        '`sampling.speed_sample_decode` (exact SPEED sampling; '
        't5x_speed/gin/decoding/speed_sample.gin) or '
        '`sampling.sample_decode`, or with T5X\'s temperature_sample '
        '(t5x_speed/gin/decoding/sample.gin); or leave temperature at 0 or '
        'topk at 1.')
  return apply_hard_limit(max_decode_steps, max_decode_steps_hard_limit)


def apply_hard_limit(max_decode_steps: Optional[IntOrArray],
                     max_decode_steps_hard_limit: Optional[int]
                     ) -> Optional[IntOrArray]:
  """`max_decode_steps` capped at `max_decode_steps_hard_limit` if that is
  > 0, as T5X's sampler caps it; the limit must be None or an integer."""
  limit = max_decode_steps_hard_limit
  if limit is not None and (isinstance(limit, (bool, np.bool_)) or
                            not isinstance(limit, (int, np.integer))):
    raise ValueError('max_decode_steps_hard_limit must be None or an '
                     f'integer, got {limit!r}.')
  if limit is None or limit <= 0 or max_decode_steps is None:
    return max_decode_steps
  if isinstance(max_decode_steps, (int, np.integer)) and not isinstance(
      max_decode_steps, (bool, np.bool_)):
    return min(int(max_decode_steps), int(limit))
  return jnp.minimum(max_decode_steps, limit)
