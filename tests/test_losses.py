"""Tests of the weighted multi-exit loss and the per-exit statistics."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import losses
import helpers


def _reference_loss(logits, targets, weights, label_smoothing, z_loss):
  """Plain, autodiff-able formula of one exit's loss."""
  vocab = logits.shape[-1]
  on, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
  soft = jnp.where(jax.nn.one_hot(targets, vocab) > 0, on, off)
  log_z = jax.scipy.special.logsumexp(logits, axis=-1)
  entropy = -(on * np.log(on) + (vocab - 1) * off * np.log(off + 1e-20))
  per_token = (-jnp.sum(soft * jax.nn.log_softmax(logits), -1) +
               z_loss * log_z**2 - entropy)
  return jnp.sum(per_token * weights)


class ExitWeightsTest(parameterized.TestCase):

  def test_schemes(self):
    np.testing.assert_allclose(losses.exit_weights('linear', 4),
                               [0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(losses.exit_weights('uniform', 4), [0.25] * 4)
    np.testing.assert_allclose(losses.exit_weights('final_only', 3),
                               [0, 0, 1])
    np.testing.assert_allclose(losses.exit_weights([1, 0, 3], 3),
                               [0.25, 0, 0.75])
    for scheme in ('linear', 'uniform', 'final_only', [2.0, 5.0]):
      for r in ((1, 2, 3, 6) if isinstance(scheme, str) else (2,)):
        self.assertAlmostEqual(losses.exit_weights(scheme, r).sum(), 1.0)

  @parameterized.parameters(
      ('exit_weighting', 'cubic', 3),
      ('3 exits', [1.0, 2.0], 3),
      ('non-negative', [1.0, -1.0, 1.0], 3),
      ('non-negative', [0.0, 0.0], 2),
      ('num_exits', 'linear', 0),
  )
  def test_bad_weights(self, message, weighting, num_exits):
    with self.assertRaisesRegex(ValueError, message):
      losses.exit_weights(weighting, num_exits)

  def test_docstring_example(self):
    helpers.assert_doctests(losses)


class CrossEntropyTest(parameterized.TestCase):

  def test_hand_computed_case(self):
    # log_softmax([0, ln 3]) = [ln 1/4, ln 3/4]; Z = 4.
    logits = jnp.array([[[0.0, np.log(3.0)]]])
    loss, z, weight_sum = losses.weighted_cross_entropy(
        logits, jnp.array([[1]]), z_loss=0.5)
    self.assertAlmostEqual(float(z), 0.5 * np.log(4.0)**2, places=5)
    self.assertAlmostEqual(float(loss), -np.log(0.75) + float(z), places=5)
    self.assertEqual(int(weight_sum), 1)

  @parameterized.product(label_smoothing=(0.0, 0.1), z_loss=(0.0, 1e-4, 0.3),
                         normalizer=(None, 7.0))
  def test_matches_reference_value_and_gradient(self, label_smoothing, z_loss,
                                                normalizer):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(3 * rng.standard_normal((2, 5, 11)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (2, 5)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(2, 5)), jnp.float32)
    scale = 1.0 if normalizer is None else 1.0 / normalizer

    def ours(x):
      return losses.weighted_cross_entropy(x, targets, weights,
                                           label_smoothing, z_loss,
                                           normalizer)[0]

    ref = lambda x: scale * _reference_loss(x, targets, weights,
                                            label_smoothing, z_loss)
    np.testing.assert_allclose(ours(logits), ref(logits), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(ref)(logits),
                               rtol=1e-4, atol=1e-6)

  def test_final_only_equals_the_ordinary_loss(self):
    rng = np.random.default_rng(1)
    exit_logits = jnp.asarray(rng.standard_normal((3, 2, 4, 9)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 9, (2, 4)), jnp.int32)
    total, _, per_exit, _ = losses.multi_exit_cross_entropy(
        exit_logits, targets, exit_weighting='final_only', z_loss=1e-4)
    plain = losses.weighted_cross_entropy(exit_logits[-1], targets,
                                          z_loss=1e-4)[0]
    self.assertEqual(float(total), float(plain))
    self.assertEqual(float(per_exit[-1]), float(plain))
    # Earlier exits get no gradient at all.
    grad = jax.grad(lambda x: losses.multi_exit_cross_entropy(
        x, targets, exit_weighting='final_only')[0])(exit_logits)
    np.testing.assert_array_equal(grad[:2], 0)

  def test_weighted_sum_of_exits(self):
    rng = np.random.default_rng(2)
    exit_logits = jnp.asarray(rng.standard_normal((4, 2, 3, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, (2, 3)), jnp.int32)
    total, _, per_exit, _ = losses.multi_exit_cross_entropy(
        exit_logits, targets, exit_weighting='linear')
    expected = sum((i + 1) / 10 * losses.weighted_cross_entropy(
        exit_logits[i], targets)[0] for i in range(4))
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    np.testing.assert_allclose(per_exit[2], losses.weighted_cross_entropy(
        exit_logits[2], targets)[0], rtol=1e-6)


class ExitAgreementTest(parameterized.TestCase):

  def test_hand_computed(self):
    # Three exits, two positions (the second weighted 0), vocabulary 2.
    # Exit 1: p = [1/2, 1/2]; exit 2: p = [3/4, 1/4]; final: [1/4, 3/4].
    logits = jnp.array([[[[0.0, 0.0], [9.0, 0.0]]],
                        [[[np.log(3), 0.0], [0.0, 9.0]]],
                        [[[0.0, np.log(3)], [9.0, 0.0]]]], jnp.float32)
    weights = jnp.array([[1.0, 0.0]])
    kl = losses.exit_agreement(logits, weights, 'distribution')
    np.testing.assert_allclose(kl, [
        0.25 * np.log(0.5) + 0.75 * np.log(1.5),
        0.25 * np.log(1 / 3) + 0.75 * np.log(3)], rtol=1e-6)
    # 'argmax': -log p_i(token 1), the final exit's token.
    ce = losses.exit_agreement(logits, weights, 'argmax')
    np.testing.assert_allclose(ce, [np.log(2), np.log(4)], rtol=1e-6)
    np.testing.assert_allclose(
        losses.exit_agreement(logits, weights, 'argmax',
                              loss_normalizing_factor=4.0), ce / 4, rtol=1e-6)

  @parameterized.parameters('distribution', 'argmax')
  def test_gradient_reaches_only_the_early_exits(self, target):
    rng = np.random.default_rng(3)
    exit_logits = jnp.asarray(rng.standard_normal((3, 2, 4, 6)), jnp.float32)
    weights = jnp.asarray(rng.integers(0, 2, (2, 4)), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(losses.exit_agreement(
        x, weights, target)))(exit_logits)
    np.testing.assert_array_equal(grad[-1], 0)
    # Each early exit's logits move toward the final exit's prediction:
    # d A_i / d logits_i = (softmax(logits_i) - teacher) * weight.
    final = exit_logits[-1]
    teacher = (jax.nn.softmax(final) if target == 'distribution' else
               jax.nn.one_hot(jnp.argmax(final, -1), 6))
    for i in range(2):
      np.testing.assert_allclose(
          grad[i], (jax.nn.softmax(exit_logits[i]) - teacher) *
          weights[..., None], atol=1e-6)

  def test_agreeing_exits_cost_nothing(self):
    logits = jnp.asarray(np.random.default_rng(4).standard_normal(
        (1, 3, 5, 9)), jnp.float32)
    np.testing.assert_allclose(
        losses.exit_agreement(jnp.concatenate([logits] * 3), None), [0, 0],
        atol=1e-6)
    self.assertEqual(losses.exit_agreement(logits, None).shape, (0,))

  @parameterized.parameters(
      ('exit_agreement_target', 0.1, 'kl'),
      ('exit_agreement must be finite', -0.5, 'argmax'),
      ('exit_agreement must be finite', float('nan'), 'argmax'),
      ('exit_agreement must be a number', 'high', 'argmax'),
  )
  def test_bad_settings(self, message, weight, target):
    with self.assertRaisesRegex(ValueError, message):
      losses.check_exit_agreement(weight, target)


class ExitStatisticsTest(absltest.TestCase):

  def test_hand_computed(self):
    # Two exits over three tokens (the last is padding):
    # exit 1 predicts [2, 0, 1], exit 2 predicts [2, 1, 0]; targets [2, 1, 0].
    logits = jnp.array([
        [[[0, 0, 5], [5, 0, 0], [0, 5, 0]]],
        [[[0, 0, 5], [0, 5, 0], [5, 0, 0]]],
    ], jnp.float32)
    stats = losses.exit_statistics(logits, jnp.array([[2, 1, 0]]))
    ratio = {k: float(t) / float(c) for k, (t, c) in stats.items()}
    self.assertEqual(ratio, {'exit_1/accuracy': 0.5, 'exit_2/accuracy': 1.0,
                             'exit_2/flip_rate': 0.5})


if __name__ == '__main__':
  absltest.main()
