"""SpeedDecoderOnlyModel inside T5X (skipped when T5X is absent)."""

import functools
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip('t5x')

import gin  # pylint: disable=g-import-not-at-top
from t5x import decoding as t5x_decoding  # pylint: disable=g-import-not-at-top
from t5x_speed import decoding
from t5x_speed import losses
from t5x_speed import quantize
from t5x_speed import sampling
from t5x_speed import steps
import t5x_helpers as th
from test_decoding import toy_pipeline

BEAM = jax.tree_util.Partial(t5x_decoding.beam_search, alpha=0.6)
SCORED_ROWS = 24  # the most rows _continuations makes (6 examples x 4)


def _continuations(batch, decodes):
  """[batch, k, length] decodes -> a scoring batch of prompt + decode rows.

  Each row keeps its decode up to and including the first EOS (1). Returns
  the batch and the (example, decode) index of each row; decodes holding the
  padding id 0 before their end (which scoring would read as padding) or
  without EOS are left out. Empty rows (score 0, indexed by none) pad the
  batch to SCORED_ROWS rows: one shape for every scoring batch, whose eager
  ops then compile once.
  """
  decodes = np.asarray(decodes)
  inputs = np.asarray(batch['decoder_input_tokens'] *
                      batch['decoder_causal_attention'])
  length = inputs.shape[1]
  rows, index = [], []
  for b in range(decodes.shape[0]):
    prompt = list(inputs[b, 1:][inputs[b, 1:] != 0])
    for k in range(decodes.shape[1]):
      gen = list(decodes[b, k])
      if 1 not in gen or 0 in gen[:gen.index(1)]:
        continue
      rows.append((prompt, gen[:gen.index(1) + 1]))
      index.append((b, k))
  assert len(rows) <= SCORED_ROWS, len(rows)
  fields = {k: np.zeros((SCORED_ROWS, length), np.int32) for k in (
      'decoder_target_tokens', 'decoder_input_tokens',
      'decoder_causal_attention', 'decoder_loss_weights')}
  for i, (prompt, gen) in enumerate(rows):
    seq = (prompt + gen)[:length]
    fields['decoder_target_tokens'][i, :len(seq)] = seq
    fields['decoder_input_tokens'][i, 1:len(seq)] = seq[:-1]
    fields['decoder_causal_attention'][i, :len(prompt) + 1] = 1
    fields['decoder_loss_weights'][i, len(prompt):len(seq)] = 1
  return {k: jnp.asarray(v) for k, v in fields.items()}, index


class UnsharedParityTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_r1_model_behaves_like_t5x_decoder_only_model(self, bidirectional):
    ours = th.speed_model(g=3, r=1, decode_fn=decoding.greedy_decode,
                          bidirectional=bidirectional)
    theirs = th.t5x_model(num_layers=3, bidirectional=bidirectional)
    batch = th.prefix_lm_batch(seed=1)
    params = th.init_params(theirs, batch)
    loss, metrics = th.jitted(ours.loss_fn)(params, batch, None)
    t5x_loss, t5x_metrics = th.jitted(theirs.loss_fn)(params, batch, None)
    np.testing.assert_allclose(loss, t5x_loss, rtol=1e-6)
    for name in ('accuracy', 'loss', 'z_loss', 'cross_ent_loss'):
      np.testing.assert_allclose(metrics[name].compute(),
                                 t5x_metrics[name].compute(), rtol=1e-6)
    aux, _ = th.assert_scores_and_decodes_match(ours, theirs, params, batch)
    self.assertEqual(set(aux), {'scores'})


class SharedModelTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_speed_greedy_and_t5x_sampling_agree(self, bidirectional):
    batch = th.prefix_lm_batch(seed=2, batch=5)
    speed = th.speed_model(bidirectional=bidirectional)
    params = th.init_params(speed, batch, seed=3)
    decodes, aux = th.jitted(speed.predict_batch_with_aux)(params, batch)
    greedy_decodes, greedy_aux = th.speed_model(
        decode_fn=decoding.greedy_decode, bidirectional=bidirectional
    ).predict_batch_with_aux(params, batch)
    np.testing.assert_array_equal(decodes, greedy_decodes)
    t5x_decodes, _ = th.speed_model(
        decode_fn=th.T5X_GREEDY, bidirectional=bidirectional
    ).predict_batch_with_aux(params, batch)
    np.testing.assert_array_equal(decodes, t5x_decodes)
    np.testing.assert_allclose(aux['scores'], greedy_aux['scores'], rtol=1e-4)
    self.assertEqual(aux['speed/flushes'].shape, (5, 3))
    self.assertEqual(aux['speed/num_tokens'].shape, (5,))
    produced = np.sum(np.cumsum(np.asarray(decodes) == 1, -1) -
                      (np.asarray(decodes) == 1) == 0, -1)
    # Tokens up to and including the first EOS (or to the buffer's end).
    ended = (np.asarray(decodes) == 1).any(-1)
    np.testing.assert_array_equal(
        np.asarray(aux['speed/num_tokens'])[ended], produced[ended])

  def test_large_batches_decode_with_the_full_depth_step(self):
    # By default SPEED decodes 5 examples x R = 3 rows with greedy's loop on
    # CPU: greedy's tokens, its statistics say so.
    batch = th.prefix_lm_batch(seed=2, batch=5)
    speed = th.speed_model(decode_fn=decoding.speed_decode)
    params = th.init_params(speed, batch, seed=3)
    decodes, aux = th.jitted(speed.predict_batch_with_aux)(params, batch)
    greedy = th.speed_model(decode_fn=decoding.greedy_decode)
    np.testing.assert_array_equal(
        decodes, th.jitted(greedy.predict_batch)(params, batch))
    np.testing.assert_array_equal(aux['speed/pipelined'], np.zeros(5))
    np.testing.assert_array_equal(aux['speed/num_steps'],
                                  aux['speed/num_tokens'])
    _, aux = th.jitted(th.speed_model().predict_batch_with_aux)(params, batch)
    np.testing.assert_array_equal(aux['speed/pipelined'], np.ones(5))

  def test_speculative_shortlist_through_the_model(self):
    batch = th.prefix_lm_batch(seed=7, batch=5)
    short = th.speed_model(speculative_vocab_size=9)
    params = th.init_params(short, batch, seed=8)
    greedy = th.speed_model(decode_fn=decoding.greedy_decode)
    np.testing.assert_array_equal(
        th.jitted(short.predict_batch)(params, batch),
        th.jitted(greedy.predict_batch)(params, batch))

  def test_int8_decode_weights(self):
    """decode_weights='int8' decodes the quantized model: SPEED's tokens are
    greedy's on it and equal the library's greedy on quantize_int8(params);
    a bad value names the option."""
    batch = th.prefix_lm_batch(seed=7, batch=2)
    model = th.speed_model(decode_weights='int8')
    params = th.init_params(model, batch, seed=8)
    speed, aux = th.jitted(model.predict_batch_with_aux)(params, batch)
    greedy = th.speed_model(decode_fn=decoding.greedy_decode,
                            decode_weights='int8')
    np.testing.assert_array_equal(speed, th.jitted(greedy.predict_batch)(
        params, batch))
    np.testing.assert_array_equal(aux['speed/pipelined'], np.ones(2))
    as_given = th.speed_model(decode_fn=decoding.greedy_decode)
    np.testing.assert_array_equal(
        speed, th.jitted(as_given.predict_batch)(
            quantize.quantize_int8(params), batch))
    with self.assertRaisesRegex(ValueError, 'decode_weights must be one of'):
      th.speed_model(decode_weights='int4')

  def test_jitted_predict(self):
    batch = th.prefix_lm_batch(seed=4)
    model = th.speed_model()
    params = th.init_params(model, batch)
    eager = model.predict_batch(params, batch)  # eager, against jit
    jitted = jax.jit(model.predict_batch)(params, batch)
    np.testing.assert_array_equal(eager, jitted)

  def test_loss_and_per_exit_metrics(self):
    batch = th.prefix_lm_batch(seed=5)
    model = th.speed_model(exit_weighting='linear')
    params = th.init_params(model, batch)
    loss, metrics = th.jitted(model.loss_fn)(params, batch, None)
    exit_logits = th.jitted(model._compute_logits)(params, batch)
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
    # The agreement term: lambda times the mean of the early exits' A_i,
    # each logged; the paper's loss is unchanged underneath.
    agreeing = th.speed_model(exit_weighting='linear', exit_agreement=0.5,
                              exit_agreement_target='argmax')
    agreeing_loss, agreeing_metrics = th.jitted(agreeing.loss_fn)(
        params, batch, None)
    agreement = losses.exit_agreement(
        exit_logits, batch['decoder_loss_weights'], 'argmax')
    self.assertGreater(float(agreement.min()), 0.0)
    np.testing.assert_allclose(agreeing_loss,
                               expected + 0.5 * agreement.mean(), rtol=1e-6)
    for i in range(2):
      np.testing.assert_allclose(
          agreeing_metrics[f'exit_{i + 1}/agreement'].compute(),
          agreement[i], rtol=1e-6)
      np.testing.assert_allclose(
          agreeing_metrics[f'exit_{i + 1}/loss'].compute(), per_exit[i],
          rtol=1e-6)
    self.assertNotIn('exit_3/agreement', agreeing_metrics)
    self.assertNotIn('exit_1/agreement', metrics)
    grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, None)[0]))(
        params)
    self.assertEqual(sorted(grads['decoder']),
                     ['decoder_norm', 'layers_0', 'layers_1', 'relpos_bias',
                      'token_embedder'])

  def test_score_batch_final_and_every_exit(self):
    batch = th.prefix_lm_batch(seed=6)
    final = th.speed_model()
    every = th.speed_model(score_all_exits=True)
    params = th.init_params(final, batch)
    scores = th.jitted(every.score_batch)(params, batch)
    self.assertEqual(scores.shape, (4, 3))
    np.testing.assert_allclose(
        scores[:, -1], th.jitted(final.score_batch)(params, batch), rtol=1e-6)
    # The final-exit score is minus the (unsmoothed, z-loss-free) loss.
    logits = th.jitted(final._compute_logits)(params, batch)[-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits),
                               batch['decoder_target_tokens'][..., None],
                               -1)[..., 0]
    np.testing.assert_allclose(
        th.jitted(final.score_batch)(params, batch),
        -(nll * batch['decoder_loss_weights']).sum(-1), rtol=1e-5)
    _, intermediates = final.score_batch(params, batch,
                                         return_intermediates=True)
    self.assertEqual(intermediates['decoder']['exit_token_scores'][0].shape,
                     (3, 4, 16))

  def test_bad_configuration(self):
    with self.assertRaisesRegex(ValueError, 'exit_weighting'):
      th.speed_model(exit_weighting=[1.0, 2.0])
    with self.assertRaisesRegex(ValueError, 'exit_agreement_target'):
      th.speed_model(exit_agreement=0.1, exit_agreement_target='kl')
    with self.assertRaisesRegex(ValueError, 'exit_agreement must be finite'):
      th.speed_model(exit_agreement=-1.0)
    with self.assertRaisesRegex(ValueError, 'SpeedTransformer'):
      th.speed_model().__class__(
          th.t5x_model().module, None, None)


def _homogeneity_pvalue(a, b):
  """P-value of the chi-square test that samples a and b (token ids) come
  from one distribution; tokens with an expected count < 5 are pooled."""
  size = max(a.max(), b.max()) + 1
  table = np.stack([np.bincount(a, minlength=size),
                    np.bincount(b, minlength=size)]).astype(float)
  expected = table.sum(1, keepdims=True) * table.sum(0) / table.sum()
  small = expected.min(0) < 5
  if small.any():
    table = np.concatenate([table[:, ~small], table[:, small].sum(1,
                                                                  keepdims=True)], 1)
    expected = table.sum(1, keepdims=True) * table.sum(0) / table.sum()
  keep = expected.min(0) > 0
  stat = float(((table - expected)[:, keep] ** 2 / expected[:, keep]).sum())
  dof = int(keep.sum()) - 1
  return float(jax.scipy.special.gammaincc(dof / 2, stat / 2))


class T5XDecodeFnsTest(parameterized.TestCase):
  """T5X's own decode fns through the full-depth step of a shared model."""

  def test_beam_search_matches_t5x_model_when_unshared(self):
    batch = th.prefix_lm_batch(seed=11, batch=5)
    ours = th.speed_model(g=3, r=1, decode_fn=BEAM)
    theirs = th.t5x_model(num_layers=3)
    theirs._decode_fn = BEAM  # pylint: disable=protected-access
    params = th.init_params(theirs, batch, seed=12)
    kwargs = dict(num_decodes=4, return_all_decodes=True)
    decodes, aux = th.jitted(ours.predict_batch_with_aux, **kwargs)(params,
                                                                    batch)
    t5x_decodes, t5x_aux = th.jitted(theirs.predict_batch_with_aux,
                                     **kwargs)(params, batch)
    self.assertEqual(decodes.shape, (5, 4, 16))
    np.testing.assert_array_equal(decodes, t5x_decodes)
    np.testing.assert_allclose(aux['scores'], t5x_aux['scores'], rtol=1e-5)
    best, best_aux = th.jitted(ours.predict_batch_with_aux, num_decodes=4)(
        params, batch)
    np.testing.assert_array_equal(best, t5x_decodes[:, -1])
    np.testing.assert_allclose(best_aux['scores'], t5x_aux['scores'][:, -1],
                               rtol=1e-5)

  def test_beam_search_scores_are_final_exit_log_probs(self):
    # alpha = 0: a finished beam's score is its summed log-probability.
    batch = th.prefix_lm_batch(seed=13, batch=6)
    model = th.speed_model(decode_fn=jax.tree_util.Partial(
        t5x_decoding.beam_search, alpha=0.0))
    params = th.init_params(model, batch, seed=14)
    decodes, aux = jax.jit(functools.partial(
        model.predict_batch_with_aux, num_decodes=4,
        return_all_decodes=True))(params, batch)
    self.assertEqual(decodes.shape, (6, 4, 16))
    # Beams come sorted by increasing score.
    scores = np.asarray(aux['scores'])
    self.assertTrue((np.diff(scores, axis=1) >= 0).all())
    finished = scores > -1e6
    rows, index = _continuations(batch, decodes)
    checked = [i for i, (b, k) in enumerate(index) if finished[b, k]]
    self.assertGreaterEqual(len(checked), 3)
    expected = th.jitted(model.score_batch)(params, rows)
    for i in checked:
      b, k = index[i]
      self.assertAlmostEqual(float(scores[b, k]), float(expected[i]),
                             delta=1e-4 * max(1.0, abs(float(expected[i]))))
    # The best beam is at least as likely as the greedy (SPEED) decode.
    greedy = th.jitted(th.speed_model().predict_batch)(params, batch)
    greedy_rows, greedy_index = _continuations(batch,
                                               np.asarray(greedy)[:, None])
    greedy_scores = th.jitted(model.score_batch)(params, greedy_rows)
    compared = [i for i, (b, _) in enumerate(greedy_index) if finished[b, -1]]
    self.assertNotEmpty(compared)
    for i in compared:
      self.assertGreaterEqual(float(scores[greedy_index[i][0], -1]),
                              float(greedy_scores[i]) - 1e-4)

  @parameterized.named_parameters(
      ('topk', dict(temperature=1.0, topk=4)),
      ('topp', dict(temperature=0.8, topk=0, topp=0.9)),
  )
  def test_temperature_sample_num_decodes(self, params_kwargs):
    batch = th.prefix_lm_batch(seed=15, batch=4)
    model = th.speed_model(decode_fn=jax.tree_util.Partial(
        t5x_decoding.temperature_sample, rescale_log_probs=False,
        **params_kwargs))
    params = th.init_params(model, batch, seed=16)
    decodes, aux = jax.jit(functools.partial(
        model.predict_batch_with_aux, num_decodes=4,
        return_all_decodes=True))(params, batch, jax.random.PRNGKey(5))
    self.assertEqual(decodes.shape, (4, 4, 16))
    # Four different samples per example, each scored by the final exit.
    self.assertGreater(
        len({tuple(np.asarray(d)) for d in decodes.reshape(16, 16)}), 8)
    rows, index = _continuations(batch, decodes)
    self.assertGreaterEqual(len(index), 8)
    expected = th.jitted(model.score_batch)(params, rows)
    for i, (b, k) in enumerate(index):
      self.assertAlmostEqual(float(aux['scores'][b, k]), float(expected[i]),
                             delta=1e-4 * max(1.0, abs(float(expected[i]))))

  def test_speed_sampling_is_distributed_as_t5x_sampler(self):
    """Two-sample chi-square tests of the first 3 sampled tokens' marginals
    at temperature 0.7 and top-p 0.8, 4,000 samples each, at the 99.9%
    confidence level (fixed seeds); T5X's sampler at temperature 2 must be
    rejected (the test's power). Top-k: see test_sampling.FilterTest."""
    batch = jax.tree.map(lambda x: x[:1], th.prefix_lm_batch(seed=21, batch=1))
    n = 4000

    def sampler(fn, **options):
      model = th.speed_model(decode_fn=jax.tree_util.Partial(
          fn, max_decode_steps=3, topk=0, topp=0.8, **options))
      params = th.init_params(model, batch, seed=22)
      run = jax.jit(lambda rng, temperature: model.predict_batch_with_aux(
          params, batch, rng, num_decodes=n, return_all_decodes=True,
          decoder_params={'temperature': temperature})[0])
      return lambda seed, temperature: np.asarray(run(
          jax.random.PRNGKey(seed), jnp.float32(temperature)))[0, :, :3]

    ours = sampler(sampling.speed_sample_decode,
                   max_speculative_rows=None)(1, 0.7)  # the pipeline's
    t5x_sampler = sampler(t5x_decoding.temperature_sample)
    theirs = t5x_sampler(2, 0.7)
    for position in range(3):
      self.assertGreater(
          _homogeneity_pvalue(ours[:, position], theirs[:, position]), 1e-3,
          position)
    self.assertLess(_homogeneity_pvalue(ours[:, 0], t5x_sampler(3, 2.0)[:, 0]),
                    1e-3)

  def test_greedy_sampling_with_num_decodes_is_speed(self):
    batch = th.prefix_lm_batch(seed=17, batch=4)
    speed = th.speed_model()
    params = th.init_params(speed, batch, seed=18)
    sampler = th.speed_model(decode_fn=th.T5X_GREEDY)
    decodes, _ = th.jitted(sampler.predict_batch_with_aux, num_decodes=3,
                           return_all_decodes=True)(params, batch)
    expected = th.jitted(speed.predict_batch)(params, batch)
    for k in range(3):
      np.testing.assert_array_equal(decodes[:, k], expected)

  @parameterized.parameters(decoding.greedy_decode, decoding.speed_decode)
  def test_sampling_params_on_greedy_exact_decode_fns_raise(self, decode_fn):
    batch = th.prefix_lm_batch(seed=19, batch=2)
    model = th.speed_model(decode_fn=decode_fn)
    params = th.init_params(model, batch)
    with self.assertRaisesRegex(ValueError, 'would sample'):
      th.jitted(model.predict_batch_with_aux, decoder_params={
          'temperature': 0.7, 'topk': 5})(params, batch)
    # Values with which T5X's sampler is greedy too are accepted.
    np.testing.assert_array_equal(
        th.jitted(model.predict_batch_with_aux, decoder_params={
            'temperature': 0.0, 'topk': 5})(params, batch)[0],
        th.jitted(model.predict_batch)(params, batch))

  def test_which_decode_fns_take_the_kv_cache(self):
    self.assertTrue(steps.takes_kv_cache(decoding.greedy_decode))
    self.assertTrue(steps.takes_kv_cache(
        functools.partial(decoding.speed_decode, max_decode_steps=3)))
    self.assertTrue(steps.takes_kv_cache(sampling.speed_sample_decode))
    self.assertTrue(steps.uses_pipeline(sampling.speed_sample_decode))
    self.assertFalse(steps.uses_pipeline(sampling.sample_decode))
    self.assertFalse(steps.takes_kv_cache(BEAM))
    self.assertFalse(steps.takes_kv_cache(t5x_decoding.temperature_sample))

  def test_gin_references_keep_declarations_and_bindings(self):
    gin.parse_config(textwrap.dedent("""
        from __gin__ import dynamic_registration
        from t5x_speed import decoding
        from t5x_speed import sampling
        SPEED = @decoding.speed_decode
        GREEDY = @decoding.greedy_decode
        SAMPLE = @sampling.speed_sample_decode
        sampling.speed_sample_decode.temperature = 0.0
        """))
    self.addCleanup(gin.clear_config)
    fns = {name: gin.query_parameter(f'{name}/macro.value'
                                     ).scoped_configurable_fn
           for name in ('SPEED', 'GREEDY', 'SAMPLE')}
    self.assertTrue(steps.uses_pipeline(fns['SPEED']))
    self.assertFalse(steps.uses_pipeline(fns['GREEDY']))
    self.assertTrue(all(steps.takes_kv_cache(fn) for fn in fns.values()))
    # The gin-bound temperature 0 reaches the sampler through
    # decoding.decode: it decodes greedily, and T5X's rescaled score of a
    # greedy row is 0 (at temperature 1 it would be negative).
    table = [[5, 6, 9, 8, 1, 0], [5, 6, 7, 8, 1, 0], [5, 6, 7, 8, 1, 0]]
    step, _, carry = toy_pipeline(table)
    result = decoding.decode(
        fns['SAMPLE'], inputs=jnp.zeros((1, 6), jnp.int32),
        cache=jnp.zeros(()), eos_id=1, pipeline_step_fn=step, num_stages=3,
        initial_carry=carry, decode_rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(result.sequences[0, 0], [5, 6, 7, 8, 1, 0])
    np.testing.assert_array_equal(result.scores, [[0.0]])
    self.assertEqual(result.stats.flushes[0].tolist(), [0, 1, 0])

  def test_t5x_cache_expands_and_reorders_per_example(self):
    # T5X's helpers on the T5X-form cache move whole examples: batch axis 1.
    module = th.speed_model().module
    cache = jax.jit(functools.partial(module.apply, method='prefill'))(
        {'params': th.init_params(th.speed_model(), th.prefix_lm_batch())},
        jnp.arange(12, dtype=jnp.int32).reshape(2, 6) + 2,
        jnp.array([3, 5]))[1]
    t5x_cache = steps.to_t5x_cache(cache, jnp.array([3, 5]))
    expanded = t5x_decoding.cache_map(functools.partial(
        t5x_decoding.flat_batch_beam_expand, beam_size=3,
        offset=steps.CACHE_OFFSET), t5x_cache, apply_to_index=True)
    kv, index = steps.from_t5x_cache(expanded)
    np.testing.assert_array_equal(index, [3, 3, 3, 5, 5, 5])
    for j in range(2):
      np.testing.assert_array_equal(kv.keys[j][:, 4], cache.keys[j][:, 1])
      np.testing.assert_array_equal(kv.values[j][:, 2], cache.values[j][:, 0])
    beams = t5x_decoding.cache_map(lambda x: t5x_decoding.unflatten_beam_dim(
        x, 2, 3, steps.CACHE_OFFSET), expanded)
    gathered = t5x_decoding.cache_gather_beams(
        beams, jnp.array([[2, 2, 0], [1, 0, 0]]), 2, 3, 3,
        offset=steps.CACHE_OFFSET)
    np.testing.assert_array_equal(gathered['layers_1']['cached_key'][:, 1, 0],
                                  cache.keys[1][:, 1])


if __name__ == '__main__':
  absltest.main()
