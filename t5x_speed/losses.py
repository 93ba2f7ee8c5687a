"""Weighted multi-exit cross-entropy and per-exit training statistics.

Each exit's loss L_i is T5X's `compute_weighted_cross_entropy` (label
smoothing, z-loss with its stabilised gradient, loss weights, normalising
factor); the training loss is L_w = sum_i w_i L_i. Optionally,
`exit_agreement` adds a term that trains the early exits toward the final
exit's prediction, which SPEED's flushes depend on (beyond the paper).

Example:
  >>> exit_weights('linear', 3).tolist()  # w_i = i / sum(i)
  [0.16666666666666666, 0.3333333333333333, 0.5]
"""

from typing import Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['exit_weights', 'multi_exit_cross_entropy', 'exit_agreement',
           'check_exit_agreement', 'exit_statistics',
           'cross_entropy_with_logits', 'weighted_cross_entropy',
           'ExitWeighting', 'WEIGHTING_SCHEMES', 'AGREEMENT_TARGETS']

Array = jax.Array
ExitWeighting = Union[str, Sequence[float]]
WEIGHTING_SCHEMES = ('linear', 'uniform', 'final_only')
AGREEMENT_TARGETS = ('distribution', 'argmax')


def exit_weights(weighting: ExitWeighting, num_exits: int) -> np.ndarray:
  """Weights w_1..w_R of the exits, summing to 1.

  Args:
    weighting: 'linear' (w_i = i / sum(i), the paper's default), 'uniform',
      'final_only', or explicit non-negative weights (normalised to sum 1).
    num_exits: R.

  Returns:
    float64 array [num_exits].
  """
  if num_exits < 1:
    raise ValueError(f'num_exits must be >= 1, got {num_exits}.')
  if isinstance(weighting, str):
    if weighting == 'linear':
      w = np.arange(1, num_exits + 1, dtype=np.float64)
    elif weighting == 'uniform':
      w = np.ones(num_exits)
    elif weighting == 'final_only':
      w = np.eye(num_exits)[-1]
    else:
      raise ValueError(f'exit_weighting must be one of {WEIGHTING_SCHEMES} or '
                       f'a sequence of weights, got {weighting!r}.')
  else:
    w = np.asarray(weighting, dtype=np.float64)
    if w.shape != (num_exits,):
      raise ValueError(f'exit_weighting has {w.size} weights for '
                       f'{num_exits} exits.')
    if np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
      raise ValueError('exit_weighting weights must be finite, non-negative '
                       f'and not all zero, got {w.tolist()}.')
  return w / w.sum()


@jax.custom_vjp
def cross_entropy_with_logits(logits: Array, targets: Array,
                              z_loss: float) -> Tuple[Array, Array]:
  """-sum(targets * log_softmax(logits)) + z_loss * log(Z)^2, per position.

  Args:
    logits: [..., vocab] float.
    targets: [..., vocab] soft one-hot targets.
    z_loss: coefficient of the auxiliary log-partition penalty.

  Returns:
    (total loss, z-loss part), each [...].
  """
  log_z = jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  loss = -jnp.sum(targets * (logits - log_z), axis=-1)
  z_term = z_loss * jax.lax.square(jnp.squeeze(log_z, -1))
  return loss + z_term, z_term


def _cross_entropy_fwd(logits, targets, z_loss=0.0):
  max_logit = logits.max(axis=-1, keepdims=True)
  exp_shifted = jnp.exp(logits - max_logit)
  sum_exp = jnp.sum(exp_shifted, axis=-1, keepdims=True)
  log_softmax = logits - max_logit - jnp.log(sum_exp)
  log_z = jnp.squeeze(jnp.log(sum_exp) + max_logit, axis=-1)
  z_term = z_loss * jax.lax.square(log_z)
  loss = -jnp.sum(targets * log_softmax, axis=-1) + z_term
  return (loss, z_term), (logits, targets, z_loss, exp_shifted, sum_exp,
                          log_softmax, log_z)


def _cross_entropy_bwd(res, g):
  logits, targets, z_loss, exp_shifted, sum_exp, log_softmax, log_z = res
  g = g[0]  # The z-loss output is for logging only.
  softmax = exp_shifted / sum_exp
  deriv = jnp.expand_dims(1 + 2 * z_loss * log_z, -1) * softmax - targets
  return (jnp.asarray(g[..., None] * deriv, logits.dtype),
          jnp.asarray(-g[..., None] * log_softmax, targets.dtype),
          jnp.array(0.0))


cross_entropy_with_logits.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def weighted_cross_entropy(
    logits: Array,
    targets: Array,
    weights: Optional[Array] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    loss_normalizing_factor: Optional[float] = None,
) -> Tuple[Array, Array, Array]:
  """One exit's loss, as T5X's `compute_weighted_cross_entropy`.

  Args:
    logits: [batch, length, vocab].
    targets: [batch, length] int.
    weights: optional [batch, length] loss weights.
    label_smoothing: mass spread over the non-target classes.
    z_loss: auxiliary z-loss coefficient.
    loss_normalizing_factor: constant the summed loss is divided by.

  Returns:
    (scalar loss, scalar z-loss part, weight sum).
  """
  if logits.ndim != targets.ndim + 1:
    raise ValueError(f'Incorrect shapes: logits {logits.shape}, targets '
                     f'{targets.shape}.')
  vocab = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / max(vocab - 1, 1)
  normalizing_constant = -(
      confidence * jnp.log(confidence) +
      (vocab - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
  soft_targets = jnp.where(jax.nn.one_hot(targets, vocab, dtype=bool),
                           confidence, low_confidence)
  loss, z_term = cross_entropy_with_logits(logits, soft_targets, z_loss)
  loss = loss - normalizing_constant
  weight_sum = np.prod(targets.shape)
  if weights is not None:
    loss, z_term = loss * weights, z_term * weights
    weight_sum = jnp.sum(weights)
  if loss_normalizing_factor is not None:
    loss = loss / loss_normalizing_factor
    z_term = z_term / loss_normalizing_factor
  return jnp.sum(loss), jnp.sum(z_term), weight_sum


def multi_exit_cross_entropy(
    exit_logits: Array,
    targets: Array,
    weights: Optional[Array] = None,
    exit_weighting: ExitWeighting = 'linear',
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    loss_normalizing_factor: Optional[float] = None,
) -> Tuple[Array, Array, Array, Array]:
  """L_w = sum_i w_i L_i over the R exits.

  Args:
    exit_logits: [R, batch, length, vocab], exit i after repetition i+1.
    targets: [batch, length] int.
    weights: optional [batch, length] loss weights.
    exit_weighting: see `exit_weights`.
    label_smoothing: as `weighted_cross_entropy`.
    z_loss: as `weighted_cross_entropy`.
    loss_normalizing_factor: as `weighted_cross_entropy`.

  Returns:
    (weighted loss, weighted z-loss, per-exit losses [R], weight sum).
  """
  w = exit_weights(exit_weighting, exit_logits.shape[0])
  per_exit, z_terms = [], []
  weight_sum = None
  for logits in exit_logits:
    loss, z_term, weight_sum = weighted_cross_entropy(
        logits, targets, weights, label_smoothing, z_loss,
        loss_normalizing_factor)
    per_exit.append(loss)
    z_terms.append(z_term)
  per_exit, z_terms = jnp.stack(per_exit), jnp.stack(z_terms)
  # Exits with weight 0 add nothing, not even NaN gradients through 0 * x.
  total = sum(float(wi) * l for wi, l in zip(w, per_exit) if wi > 0)
  z_total = sum(float(wi) * z for wi, z in zip(w, z_terms) if wi > 0)
  return total, z_total, per_exit, weight_sum


def _check_agreement_target(target: str):
  if target not in AGREEMENT_TARGETS:
    raise ValueError(f'exit_agreement_target must be one of '
                     f'{AGREEMENT_TARGETS}, got {target!r}.')


def check_exit_agreement(weight: float, target: str) -> float:
  """Validates the agreement term's settings; returns the weight as float."""
  _check_agreement_target(target)
  try:
    weight = float(weight)
  except (TypeError, ValueError):
    raise ValueError('exit_agreement must be a number >= 0, got '
                     f'{weight!r}.') from None
  if not np.isfinite(weight) or weight < 0:
    raise ValueError(f'exit_agreement must be finite and >= 0, got {weight}.')
  return weight


def exit_agreement(
    exit_logits: Array,
    weights: Optional[Array] = None,
    target: str = 'distribution',
    loss_normalizing_factor: Optional[float] = None,
) -> Array:
  """Each early exit's disagreement with the final exit, A_1..A_{R-1}.

  The final exit is the teacher and receives no gradient from these terms:
  only exits 1..R-1 (and the layers below them) move toward it. With
  `target='distribution'`, A_i is KL(p_R || p_i) summed over positions, zero
  where the two distributions are equal; with 'argmax', A_i is the
  cross-entropy of exit i to the final exit's argmax token, the token SPEED
  commits. Positions are weighted and normalised as `weighted_cross_entropy`
  does, so A_i is on the scale of the exits' own losses.

  Args:
    exit_logits: [R, batch, length, vocab].
    weights: optional [batch, length] loss weights.
    target: 'distribution' or 'argmax'.
    loss_normalizing_factor: as `weighted_cross_entropy`.

  Returns:
    float32 [R - 1]: A_i for exits 1..R-1 (empty when R = 1).
  """
  _check_agreement_target(target)
  final = jax.lax.stop_gradient(exit_logits[-1]).astype(jnp.float32)
  if target == 'argmax':
    teacher = jax.nn.one_hot(jnp.argmax(final, -1), final.shape[-1])
    entropy = 0.0
  else:
    log_teacher = jax.nn.log_softmax(final)
    teacher = jnp.exp(log_teacher)
    entropy = -jnp.sum(teacher * log_teacher, -1)
  terms = []
  for logits in exit_logits[:-1]:
    per_position = cross_entropy_with_logits(
        logits.astype(jnp.float32), teacher, 0.0)[0] - entropy
    if weights is not None:
      per_position = per_position * weights
    if loss_normalizing_factor is not None:
      per_position = per_position / loss_normalizing_factor
    terms.append(jnp.sum(per_position))
  return jnp.stack(terms) if terms else jnp.zeros((0,), jnp.float32)


def exit_statistics(exit_logits: Array, targets: Array,
                    weights: Optional[Array] = None
                    ) -> Dict[str, Tuple[Array, Array]]:
  """Per-exit accuracy and consecutive-exit flips, as (total, count) pairs.

  `exit_i/flip_rate` is the fraction of (weighted) tokens whose argmax at exit
  i differs from exit i-1: the paper's prediction (in)consistency, which
  drives how often SPEED flushes. Pairs suit `clu.metrics.Average(total,
  count)` and sum across batches.

  Args:
    exit_logits: [R, batch, length, vocab].
    targets: [batch, length] int.
    weights: optional [batch, length]; defaults to targets > 0.

  Returns:
    {'exit_i/accuracy': ..., 'exit_i/flip_rate': ...} with exits numbered
    from 1; flip rates for exits 2..R.
  """
  if weights is None:
    weights = (targets > 0).astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  count = jnp.sum(weights)
  preds = jnp.argmax(exit_logits, axis=-1)                  # [R, batch, len]
  stats = {}
  for i in range(exit_logits.shape[0]):
    stats[f'exit_{i + 1}/accuracy'] = (
        jnp.sum((preds[i] == targets) * weights), count)
    if i:
      stats[f'exit_{i + 1}/flip_rate'] = (
          jnp.sum((preds[i] != preds[i - 1]) * weights), count)
  return stats
