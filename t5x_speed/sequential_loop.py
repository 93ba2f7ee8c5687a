"""The sequential decode loop: one full-depth token per loop step.

`decoding.greedy_decode` runs it with the argmax, `sampling.sample_decode`
with its position-keyed sampler. Positions, limits and invalid examples
follow the contract in `decoding`'s module docstring.
"""

from typing import Any, Callable, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp

from t5x_speed import decode_args
from t5x_speed import token_rules

__all__ = ['DecodingState', 'GreedyState', 'TokensToLogitsFn',
           'check_sequential', 'sequential_loop', 'first_tokens', 'write']

Array = jax.Array


@flax.struct.dataclass
class DecodingState:
  """What `tokens_to_logits` sees; the fields of T5X's `DecodingState`.

  Attributes:
    cur_index: [batch] position of `cur_token`; -1 for a finished example,
      whose step must write nothing.
    sequences: [batch, length] tokens so far.
    cur_token: [batch, 1] the token to run.
    cache: the model's cache.
  """

  cur_index: Array
  sequences: Array
  cur_token: Array
  cache: Any


TokensToLogitsFn = Callable[[DecodingState], Tuple[Array, Any]]


def first_tokens(inputs: Array, initial_index: Array) -> Tuple[Array, Array]:
  """The [batch, length + 1] sequence buffer and the tokens at initial_index."""
  sequences = jnp.pad(inputs.astype(jnp.int32), ((0, 0), (0, 1)))
  first = jnp.take_along_axis(sequences, initial_index[:, None], 1)[:, 0]
  return sequences, first


def write(sequences: Array, positions: Array, tokens: Array,
          where: Array) -> Array:
  """sequences[b, positions[b]] = tokens[b] where `where`, else untouched."""
  rows = jnp.arange(sequences.shape[0])
  positions = jnp.where(where, positions, sequences.shape[1])  # dropped
  return sequences.at[rows, positions].set(tokens, mode='drop')


@flax.struct.dataclass
class GreedyState:
  """Loop state of `sequential_loop`.

  Attributes:
    cur_index: [batch] position of `cur_token`.
    cur_token: [batch] token to run next.
    sequences: [batch, length + 1] token at each position.
    ended: [batch] bool.
    log_prob: [batch] summed log-probabilities of the produced tokens.
    cache: the model's cache.
    step: [] loop steps taken (the loop stops at length + 1).
  """

  cur_index: Array
  cur_token: Array
  sequences: Array
  ended: Array
  log_prob: Array
  cache: Any
  step: Array


def check_sequential(inputs, cache, tokens_to_logits, initial_index,
                     max_decode_steps, eos_id, cache_offset
                     ) -> decode_args.Checked:
  """Checks a full-depth decode's arguments (see `decoding`)."""
  batch, length = decode_args.check_structure(inputs, cache_offset, cache)
  logits_shape = jax.eval_shape(tokens_to_logits, DecodingState(
      cur_index=jax.ShapeDtypeStruct((batch,), jnp.int32),
      sequences=jax.ShapeDtypeStruct((batch, length), jnp.int32),
      cur_token=jax.ShapeDtypeStruct((batch, 1), jnp.int32),
      cache=decode_args.shape_of(cache)))[0]
  return decode_args.validate(inputs, initial_index, max_decode_steps,
                              eos_id, vocab_size=logits_shape.shape[-1])


def sequential_loop(inputs: Array, cache: Any,
                    tokens_to_logits: TokensToLogitsFn,
                    checked: decode_args.Checked,
                    rule: token_rules.TokenRule
                    ) -> Tuple[GreedyState, Array]:
  """One full-depth token per loop step, chosen by `rule`.

  Returns:
    (the final `GreedyState`: its sequences [batch, length + 1] with BOS
    first, cur_index - initial_index tokens produced per example; scores
    [batch]: the summed log-probabilities of the produced tokens as
    `rule.pick` gives them, NaN for an invalid example).
  """
  batch, length = inputs.shape
  initial_index, max_len = checked.initial_index, checked.max_len
  sequences, token0 = first_tokens(inputs, initial_index)

  def greedy_cond_fn(state: GreedyState) -> Array:
    # Each step advances every live example by one position: length + 1
    # steps bound any input.
    return ~jnp.all(state.ended) & (state.step <= length)

  def greedy_body_fn(state: GreedyState) -> GreedyState:
    live = ~state.ended
    logits, cache = tokens_to_logits(DecodingState(
        cur_index=jnp.where(live, state.cur_index, -1),
        sequences=state.sequences[:, :length],
        cur_token=state.cur_token[:, None],
        cache=state.cache))
    position = state.cur_index + 1
    tokens, log_prob = rule.pick(logits[:, None], position[:, None])
    token = tokens[:, 0]
    ended = state.ended | (live & ((token == checked.eos_id) |
                                   (position >= max_len)))
    return GreedyState(
        cur_index=jnp.where(live, position, state.cur_index),
        cur_token=token,
        sequences=write(state.sequences, position, token, live),
        ended=ended,
        log_prob=state.log_prob + jnp.where(
            live, log_prob, 0.0),
        cache=cache,
        step=state.step + 1)

  final = lax.while_loop(greedy_cond_fn, greedy_body_fn, GreedyState(
      cur_index=initial_index, cur_token=token0, sequences=sequences,
      ended=checked.done,
      log_prob=jnp.zeros((batch,), jnp.float32), cache=cache,
      step=jnp.zeros((), jnp.int32)))
  invalid = (checked.invalid != 0) | ~final.ended
  return final, jnp.where(invalid, jnp.nan, final.log_prob)
