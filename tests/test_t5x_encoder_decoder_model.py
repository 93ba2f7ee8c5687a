"""SpeedEncoderDecoderModel against T5X's EncoderDecoderModel, and every
decode fn through it."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import pytest

pytest.importorskip('t5x')

from t5x import decoding as t5x_decoding  # pylint: disable=g-import-not-at-top
import seqio  # pylint: disable=g-import-not-at-top
from t5x import adafactor  # pylint: disable=g-import-not-at-top

from t5x_speed import decoding  # pylint: disable=g-import-not-at-top
from t5x_speed import encoder_decoder
from t5x_speed import models
from t5x_speed import network
from t5x_speed import sampling
import t5x_helpers as th

BEAM = jax.tree_util.Partial(t5x_decoding.beam_search, alpha=0.0)


class UnsharedParityTest(absltest.TestCase):

  def test_r1_model_behaves_like_t5x_encoder_decoder_model(self):
    ours = th.speed_encdec_model(g=3, r=1, decode_fn=decoding.greedy_decode)
    theirs = th.t5x_encdec_model(num_decoder_layers=3)
    batch = th.encdec_batch(seed=1)
    params = th.init_params(theirs, batch)
    self.assertEqual(
        jax.tree.structure(params),
        jax.tree.structure(th.init_params(ours, batch)))
    # Each method jitted, as T5X's binaries run them.
    loss, metrics = th.jitted(ours.loss_fn)(params, batch, None)
    t5x_loss, t5x_metrics = th.jitted(theirs.loss_fn)(params, batch, None)
    np.testing.assert_allclose(loss, t5x_loss, rtol=1e-6)
    # Every metric of T5X's (accuracy, losses, padding and batch sizes of
    # both token features), with the same values; timings need a duration.
    self.assertContainsSubset(set(t5x_metrics), set(metrics))
    self.assertIn('non_padding_fraction/encoder_input_tokens', metrics)
    for name, metric in t5x_metrics.items():
      if not name.startswith('timing/'):
        np.testing.assert_allclose(metrics[name].compute(), metric.compute(),
                                   rtol=1e-6, err_msg=name)
    aux, t5x_aux = th.assert_scores_and_decodes_match(ours, theirs, params,
                                                      batch)
    self.assertEqual(set(aux), set(t5x_aux))

  def test_beam_search_matches_t5x_model(self):
    batch = th.encdec_batch(seed=2, batch=3)
    ours = th.speed_encdec_model(g=3, r=1, decode_fn=BEAM)
    theirs = th.t5x_encdec_model(num_decoder_layers=3, decode_fn=BEAM)
    params = th.init_params(theirs, batch, seed=3)
    kwargs = dict(num_decodes=3, return_all_decodes=True)
    decodes, aux = th.jitted(ours.predict_batch_with_aux, **kwargs)(params,
                                                                    batch)
    t5x_decodes, t5x_aux = th.jitted(theirs.predict_batch_with_aux,
                                     **kwargs)(params, batch)
    self.assertEqual(decodes.shape, (3, 3, 12))
    np.testing.assert_array_equal(decodes, t5x_decodes)
    np.testing.assert_allclose(aux['scores'], t5x_aux['scores'], rtol=1e-5)
    # A decoder prompt (prompts of different lengths): T5X's beam search
    # forces it from BOS, as T5X's own model runs it.
    kwargs['prompt_with_targets'] = True
    decodes, aux = th.jitted(ours.predict_batch_with_aux, **kwargs)(params,
                                                                    batch)
    t5x_decodes, t5x_aux = th.jitted(theirs.predict_batch_with_aux,
                                     **kwargs)(params, batch)
    np.testing.assert_array_equal(decodes, t5x_decodes)
    np.testing.assert_allclose(aux['scores'], t5x_aux['scores'], rtol=1e-5)


class SharedModelTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.batch = th.encdec_batch(seed=4, batch=5)
    self.params = th.init_params(th.speed_encdec_model(), self.batch, seed=5)

  def _predict(self, decode_fn, rng=None, **kwargs):
    model = th.speed_encdec_model(decode_fn=decode_fn)
    return th.jitted(model.predict_batch_with_aux, **kwargs)(
        self.params, self.batch, rng)

  def test_speed_greedy_and_t5x_greedy_agree(self):
    decodes, aux = self._predict(th.SPEED_PIPELINE)
    greedy, greedy_aux = self._predict(decoding.greedy_decode)
    np.testing.assert_array_equal(decodes, greedy)
    np.testing.assert_allclose(aux['scores'], greedy_aux['scores'], rtol=1e-4)
    t5x_greedy, _ = self._predict(th.T5X_GREEDY)
    np.testing.assert_array_equal(decodes, t5x_greedy)
    self.assertEqual(aux['speed/flushes'].shape, (5, 3))
    np.testing.assert_array_equal(aux['speed/pipelined'], np.ones(5))
    self.assertNotIn('speed/flushes', greedy_aux)

  def test_speed_sampling_equals_sequential_sampling(self):
    kwargs = dict(temperature=0.7, topp=0.9)
    rng = jax.random.PRNGKey(6)
    speed, aux = self._predict(functools.partial(
        sampling.speed_sample_decode, max_speculative_rows=None, **kwargs),
                               rng=rng)
    sequential, _ = self._predict(functools.partial(sampling.sample_decode,
                                                    **kwargs), rng=rng)
    np.testing.assert_array_equal(speed, sequential)
    self.assertIn('speed/flushes', aux)

  @parameterized.named_parameters(
      ('beam_search', BEAM, 3),
      ('temperature_sample', jax.tree_util.Partial(
          t5x_decoding.temperature_sample, temperature=1.0, topk=4), 2))
  def test_t5x_decode_fns_with_num_decodes(self, decode_fn, num_decodes):
    decodes, aux = jax.jit(functools.partial(
        th.speed_encdec_model(decode_fn=decode_fn).predict_batch_with_aux,
        num_decodes=num_decodes, return_all_decodes=True))(
            self.params, self.batch, jax.random.PRNGKey(7))
    self.assertEqual(decodes.shape, (5, num_decodes, 12))
    self.assertEqual(aux['scores'].shape, (5, num_decodes))
    self.assertTrue(np.isfinite(np.asarray(aux['scores'])).all())
    # Each decode ends in EOS or fills the buffer with tokens.
    ended = (np.asarray(decodes) == 1).any(-1)
    self.assertTrue(ended.any())

  def test_decoder_prompt(self):
    # prompt_with_targets: the decoder inputs (EOS removed) are forced.
    speed, _ = self._predict(th.SPEED_PIPELINE, prompt_with_targets=True)
    greedy, _ = self._predict(decoding.greedy_decode,
                              prompt_with_targets=True)
    np.testing.assert_array_equal(speed, greedy)
    inputs = np.asarray(self.batch['decoder_input_tokens'])
    for b in range(5):
      prompt = inputs[b][inputs[b] != 0]
      prompt = prompt[prompt != 1]
      np.testing.assert_array_equal(np.asarray(speed)[b, :len(prompt)],
                                    prompt)

  def test_loss_trains_every_exit(self):
    model = th.speed_encdec_model()
    loss, metrics = th.jitted(model.loss_fn)(self.params, self.batch, None)
    self.assertTrue(np.isfinite(loss))
    for i in (1, 2, 3):
      self.assertIn(f'exit_{i}/loss', metrics)
      self.assertIn(f'exit_{i}/accuracy', metrics)
    scores = th.jitted(th.speed_encdec_model(score_all_exits=True).score_batch)(
        self.params, self.batch)
    self.assertEqual(scores.shape, (5, 3))
    np.testing.assert_allclose(scores[:, -1], th.jitted(model.score_batch)(
        self.params, self.batch), rtol=1e-6)

  def test_bad_module(self):
    vocab = seqio.PassThroughVocabulary(th.VOCAB, eos_id=1)
    decoder_only = network.SpeedTransformer(network.TransformerConfig(
        num_unique_layers=2, num_repeats=3, **th.TINY))
    with self.assertRaisesRegex(ValueError, 'SpeedEncoderDecoder module'):
      models.SpeedEncoderDecoderModel(decoder_only, vocab, vocab,
                                      adafactor.Adafactor())
    encdec = encoder_decoder.SpeedEncoderDecoder(network.TransformerConfig(
        num_unique_layers=2, num_repeats=3, num_encoder_layers=1, **th.TINY))
    with self.assertRaisesRegex(ValueError, 'SpeedEncoderDecoderModel'):
      models.SpeedDecoderOnlyModel(encdec, vocab, adafactor.Adafactor())


if __name__ == '__main__':
  absltest.main()
