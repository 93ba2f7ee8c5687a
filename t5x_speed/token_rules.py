"""How a decode loop picks each next token: the `TokenRule` protocol, argmax.

Greedy decoding picks the most likely token (`Argmax`); `sampling`'s
`PositionKeyedSampler` is the other rule. Both loops (`sequential_loop`,
`speed_loop`) take a rule, so that greedy and sampled decoding share them.
Each rule carries its decode fn's `token_choice` ('auto', 'kernel', 'xla';
`t5x_speed.cpu.dispatch.token_kernel` resolves it): the CPU kernel's one
call per loop step, or XLA's passes over the vocabulary.
"""

from typing import Protocol, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp

from t5x_speed import cpu

__all__ = ['TokenRule', 'Argmax', 'argmax', 'token_log_prob']

Array = jax.Array


class TokenRule(Protocol):
  """How a decode loop picks each next token (greedy, or `sampling`'s).

  `pick` sees logits [batch, S, vocab] for S tokens per example (S = 1
  sequentially, R in SPEED's pipeline) and the position each would fill
  [batch, S]; it returns the tokens [batch, S] and the log-probability
  [batch] of the last slot's token (the one a loop commits). It must treat
  every (example, position) alike wherever it is computed, so that SPEED's
  final stage picks and scores what the sequential loop does.
  """

  def pick(self, logits: Array, positions: Array) -> Tuple[Array, Array]:
    ...


def argmax(logits: Array) -> Array:
  """jnp.argmax(logits, -1) as int32: the first maximum, or the first NaN.

  XLA:CPU runs jnp.argmax's (value, index) reduction one element at a time;
  two plain reductions and a masked minimum vectorise and pick the same
  index.

  Example:
    >>> int(argmax(jnp.array([1.0, 3.0, 2.0, 3.0])))
    1
  """
  nan = jnp.isnan(logits)
  top = jnp.max(logits, -1, keepdims=True)
  hit = jnp.where(jnp.any(nan, -1, keepdims=True), nan, logits == top)
  ids = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(hit, ids, logits.shape[-1]), -1)


def token_log_prob(logits: Array, tokens: Array) -> Array:
  """log_softmax(logits)[tokens]: [batch, vocab], [batch] -> [batch]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  return jnp.take_along_axis(log_probs, tokens[:, None], -1)[:, 0]


@flax.struct.dataclass
class Argmax:
  """Greedy: the most likely token, scored by its log-probability.

  Where `token_choice` resolves to the kernel, one `cpu.sample.pick` call at
  temperature 0 finds the argmax and the score (the same first maximum; the
  log-softmax within float rounding of XLA's) instead of XLA's passes over
  every slot's logits.

  Attributes:
    token_choice: 'auto', 'kernel' or 'xla' (`cpu.dispatch.token_kernel`).
  """

  token_choice: str = flax.struct.field(pytree_node=False, default='auto')

  def __post_init__(self):
    cpu.dispatch.check_token_choice(self.token_choice)

  def pick(self, logits: Array, positions: Array) -> Tuple[Array, Array]:
    if not cpu.dispatch.token_kernel(self.token_choice, logits.dtype):
      tokens = argmax(logits)
      return tokens, token_log_prob(logits[:, -1], tokens[:, -1])
    rows = logits.shape[0]
    zeros = jnp.zeros((rows,), jnp.float32)
    return cpu.sample.pick(logits, jnp.zeros((rows, 2), jnp.uint32),
                           positions, zeros, zeros, topk=0, rescale=False)
