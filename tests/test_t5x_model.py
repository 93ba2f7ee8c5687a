"""SpeedDecoderOnlyModel inside T5X (skipped when T5X is absent)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip('t5x')

from t5x_speed import decoding  # pylint: disable=g-import-not-at-top
from t5x_speed import losses
import t5x_helpers as th


class UnsharedParityTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_r1_model_behaves_like_t5x_decoder_only_model(self, bidirectional):
    ours = th.speed_model(g=3, r=1, decode_fn=decoding.greedy_decode,
                          bidirectional=bidirectional)
    theirs = th.t5x_model(num_layers=3, bidirectional=bidirectional)
    batch = th.prefix_lm_batch(seed=1)
    params = th.init_params(theirs, batch)
    loss, metrics = ours.loss_fn(params, batch, None)
    t5x_loss, t5x_metrics = theirs.loss_fn(params, batch, None)
    np.testing.assert_allclose(loss, t5x_loss, rtol=1e-6)
    for name in ('accuracy', 'loss', 'z_loss', 'cross_ent_loss'):
      np.testing.assert_allclose(metrics[name].compute(),
                                 t5x_metrics[name].compute(), rtol=1e-6)
    np.testing.assert_allclose(ours.score_batch(params, batch),
                               theirs.score_batch(params, batch), rtol=1e-5)
    decodes, aux = ours.predict_batch_with_aux(params, batch)
    t5x_decodes, t5x_aux = theirs.predict_batch_with_aux(params, batch)
    np.testing.assert_array_equal(decodes, t5x_decodes)
    self.assertEqual(set(aux), {'scores'})


class SharedModelTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_speed_greedy_and_t5x_sampling_agree(self, bidirectional):
    batch = th.prefix_lm_batch(seed=2, batch=5)
    speed = th.speed_model(bidirectional=bidirectional)
    params = th.init_params(speed, batch, seed=3)
    decodes, aux = speed.predict_batch_with_aux(params, batch)
    for decode_fn in (decoding.greedy_decode, th.T5X_GREEDY):
      other = th.speed_model(decode_fn=decode_fn, bidirectional=bidirectional)
      other_decodes, _ = other.predict_batch_with_aux(params, batch)
      np.testing.assert_array_equal(decodes, other_decodes)
    greedy_aux = th.speed_model(decode_fn=decoding.greedy_decode,
                                bidirectional=bidirectional
                                ).predict_batch_with_aux(params, batch)[1]
    np.testing.assert_allclose(aux['scores'], greedy_aux['scores'], rtol=1e-4)
    self.assertEqual(aux['speed/flushes'].shape, (5, 3))
    self.assertEqual(aux['speed/num_tokens'].shape, (5,))
    produced = np.sum(np.cumsum(np.asarray(decodes) == 1, -1) -
                      (np.asarray(decodes) == 1) == 0, -1)
    # Tokens up to and including the first EOS (or to the buffer's end).
    ended = (np.asarray(decodes) == 1).any(-1)
    np.testing.assert_array_equal(
        np.asarray(aux['speed/num_tokens'])[ended], produced[ended])

  def test_speculative_shortlist_through_the_model(self):
    batch = th.prefix_lm_batch(seed=7, batch=5)
    short = th.speed_model(speculative_vocab_size=9)
    params = th.init_params(short, batch, seed=8)
    greedy = th.speed_model(decode_fn=decoding.greedy_decode)
    np.testing.assert_array_equal(short.predict_batch(params, batch),
                                  greedy.predict_batch(params, batch))

  def test_jitted_predict(self):
    batch = th.prefix_lm_batch(seed=4)
    model = th.speed_model()
    params = th.init_params(model, batch)
    eager = model.predict_batch(params, batch)
    jitted = jax.jit(model.predict_batch)(params, batch)
    np.testing.assert_array_equal(eager, jitted)

  def test_loss_and_per_exit_metrics(self):
    batch = th.prefix_lm_batch(seed=5)
    model = th.speed_model(exit_weighting='linear')
    params = th.init_params(model, batch)
    loss, metrics = model.loss_fn(params, batch, None)
    exit_logits = model._compute_logits(params, batch)
    self.assertEqual(exit_logits.shape[0], 3)
    expected, _, per_exit, _ = losses.multi_exit_cross_entropy(
        exit_logits, batch['decoder_target_tokens'],
        batch['decoder_loss_weights'], 'linear', z_loss=1e-4)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    for i in range(3):
      np.testing.assert_allclose(metrics[f'exit_{i + 1}/loss'].compute(),
                                 per_exit[i], rtol=1e-6)
      self.assertBetween(float(metrics[f'exit_{i + 1}/accuracy'].compute()),
                         0.0, 1.0)
    self.assertNotIn('exit_1/flip_rate', metrics)
    self.assertBetween(float(metrics['exit_3/flip_rate'].compute()), 0.0, 1.0)
    # The final exit drives T5X's own accuracy metric.
    final_acc = losses.exit_statistics(
        exit_logits, batch['decoder_target_tokens'],
        batch['decoder_loss_weights'])['exit_3/accuracy']
    np.testing.assert_allclose(metrics['accuracy'].compute(),
                               final_acc[0] / final_acc[1], rtol=1e-6)
    grads = jax.grad(lambda p: model.loss_fn(p, batch, None)[0])(params)
    self.assertEqual(sorted(grads['decoder']),
                     ['decoder_norm', 'layers_0', 'layers_1', 'relpos_bias',
                      'token_embedder'])

  def test_score_batch_final_and_every_exit(self):
    batch = th.prefix_lm_batch(seed=6)
    final = th.speed_model()
    every = th.speed_model(score_all_exits=True)
    params = th.init_params(final, batch)
    scores = every.score_batch(params, batch)
    self.assertEqual(scores.shape, (4, 3))
    np.testing.assert_allclose(scores[:, -1], final.score_batch(params, batch),
                               rtol=1e-6)
    # The final-exit score is minus the (unsmoothed, z-loss-free) loss.
    logits = final._compute_logits(params, batch)[-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits),
                               batch['decoder_target_tokens'][..., None],
                               -1)[..., 0]
    np.testing.assert_allclose(
        final.score_batch(params, batch),
        -(nll * batch['decoder_loss_weights']).sum(-1), rtol=1e-5)
    _, intermediates = final.score_batch(params, batch,
                                         return_intermediates=True)
    self.assertEqual(intermediates['decoder']['exit_token_scores'][0].shape,
                     (3, 4, 16))

  def test_bad_configuration(self):
    with self.assertRaisesRegex(ValueError, 'exit_weighting'):
      th.speed_model(exit_weighting=[1.0, 2.0])
    with self.assertRaisesRegex(ValueError, 'SpeedTransformer'):
      th.speed_model().__class__(
          th.t5x_model().module, None, None)


if __name__ == '__main__':
  absltest.main()
