"""The encoder-decoder network: T5X parity, cached decoding, SPEED == greedy."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_speed import encoder_decoder
from t5x_speed import inference
from t5x_speed import layers
from t5x_speed import network
from t5x_speed import steps
import helpers

VOCAB = 13


def _config(**overrides):
  kwargs = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, head_dim=8,
                mlp_dim=48, num_unique_layers=2, num_repeats=3,
                num_encoder_layers=2, dtype='float32')
  kwargs.update(overrides)
  return network.TransformerConfig(**kwargs)


def _model(seed=0, **overrides):
  module = encoder_decoder.SpeedEncoderDecoder(_config(**overrides))
  params = helpers.random_params(module, seed)
  return module, params


def _encoder_inputs(batch, width, seed):
  """Random encoder tokens, each row padded after a random length >= 1."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(1, width + 1, size=batch)
  tokens = rng.randint(2, VOCAB, size=(batch, width))
  tokens[np.arange(width)[None] >= lengths[:, None]] = 0
  return jnp.asarray(tokens, jnp.int32)


class ModuleTest(absltest.TestCase):

  def test_docstring_example(self):
    helpers.assert_doctests(encoder_decoder)

  def test_bidirectional_buckets_are_t5s(self):
    # T5's bucket of query - key: 16 buckets per direction; exact to 8,
    # logarithmic to 128. Keys after the query take the upper half.
    bucket = lambda d: int(layers.relative_position_bucket(
        np.array(d), 32, 128, bidirectional=True))
    self.assertEqual([bucket(d) for d in (0, 1, 7, -1, -7)],
                     [0, 1, 7, 17, 23])
    self.assertEqual(bucket(8), 8)
    self.assertEqual(bucket(200), 15)
    self.assertEqual(bucket(-200), 31)
    bias = layers.RelativePositionBias(32, 128, 2, bidirectional=True)
    params = bias.init(jax.random.PRNGKey(0), 4, method='full')
    with self.assertRaisesRegex(ValueError, 'only `full`'):
      bias.apply(params, 4, method='by_distance')

  def test_cross_attention_weights_per_unique_layer(self):
    module, params = _model()
    names = set(params['decoder']['layers_0'])
    self.assertContainsSubset({'encoder_decoder_attention',
                               'pre_cross_attention_layer_norm'}, names)
    self.assertEqual(sorted(k for k in params['decoder']
                            if k.startswith('layers_')),
                     ['layers_0', 'layers_1'])
    self.assertNotIn('token_embedder', params['decoder'])
    self.assertEqual(len([k for k in params['encoder']
                          if k.startswith('layers_')]), 2)
    # The exits at given decoder positions only (a loss's targets).
    encoder = _encoder_inputs(2, 6, seed=1)
    decoder = jnp.asarray(np.random.RandomState(2).randint(
        2, VOCAB, size=(2, 5)), jnp.int32)
    run = jax.jit(lambda p, at: module.apply(
        {'params': p}, encoder, decoder, decoder, enable_dropout=False,
        exit_positions=at))
    positions = jnp.array([[4, 1], [0, 3]])
    np.testing.assert_allclose(
        run(params, positions), jnp.take_along_axis(
            run(params, None), positions[None, :, :, None], axis=2),
        rtol=1e-5, atol=1e-6)

  def test_decoder_only_config_is_refused(self):
    module = encoder_decoder.SpeedEncoderDecoder(_config(num_encoder_layers=0))
    tokens = jnp.ones((1, 4), jnp.int32)
    with self.assertRaisesRegex(ValueError, 'num_encoder_layers >= 1'):
      module.init(jax.random.PRNGKey(0), tokens, tokens, tokens,
                  enable_dropout=False)

  def test_generate_checks_encoder_inputs(self):
    module, params = _model()
    with self.assertRaisesRegex(ValueError, 'encoder_input_tokens are '
                                'required'):
      inference.generate(module, params, jnp.zeros((1, 0), jnp.int32),
                         jnp.zeros((1,), jnp.int32), max_decode_steps=2)
    with self.assertRaisesRegex(ValueError, r'encoder_input_tokens .*\[0, 13\)'):
      inference.generate(module, params, encoder_input_tokens=jnp.array(
          [[3, 40]]), max_decode_steps=2)
    decoder_only = helpers.tiny_model()
    with self.assertRaisesRegex(ValueError, 'meaningless'):
      inference.generate(*decoder_only, jnp.ones((1, 2), jnp.int32),
                         jnp.array([2]), max_decode_steps=2,
                         encoder_input_tokens=jnp.ones((1, 3), jnp.int32))

  def test_prefix_lm_attention_is_refused_wherever_a_decode_starts(self):
    # generate, prepare and the prefill: one check, naming what was given.
    module, params = _model()
    encoder_tokens = jnp.array([[3, 4]])
    with self.assertRaisesRegex(ValueError, 'bidirectional: a prefix-LM'):
      inference.generate(module, params, encoder_input_tokens=encoder_tokens,
                         max_decode_steps=2, bidirectional=True)
    bound = steps.BoundSteps(module, params)
    prompts, lengths = jnp.zeros((1, 0), jnp.int32), jnp.array([0])
    with self.assertRaisesRegex(ValueError, 'bidirectional: a prefix-LM'):
      inference.prepare(bound, prompts, lengths, 3, bidirectional=True,
                        encoder_input_tokens=encoder_tokens)
    with self.assertRaisesRegex(ValueError, 'causal_attention: a prefix-LM'):
      bound.prefill(jnp.zeros((1, 4), jnp.int32), lengths,
                    causal_attention=jnp.ones((1, 4), jnp.int32),
                    encoder_input_tokens=encoder_tokens)


class CachedDecodingTest(parameterized.TestCase):

  @parameterized.parameters('cycle', 'cycle_rev')
  def test_steps_match_the_full_pass(self, sharing):
    # Teacher-forced tokens through the prefill (BOS) and the cached steps
    # (greedy's full-depth step, SPEED's pipelined step with every slot at
    # the same position) give the full pass's logits at every position.
    module, params = _model(seed=1, sharing=sharing)
    cfg = module.config
    encoder_tokens = _encoder_inputs(2, 7, seed=2)
    targets = helpers.random_tokens(3, (2, 5), VOCAB)
    decoder_inputs = jnp.concatenate(
        [jnp.zeros((2, 1), jnp.int32), targets[:, :-1]], axis=1)
    full = jax.jit(lambda p: module.apply(
        {'params': p}, encoder_tokens, decoder_inputs, jnp.ones_like(targets),
        enable_dropout=False))(params)
    bound = steps.BoundSteps(module, params)
    # Each step jitted, as a decode runs it (eager, each operation would
    # compile apart).
    decode_step = jax.jit(
        lambda p, *a: steps.BoundSteps(module, p).decode_step(*a))
    pipeline_step = jax.jit(
        lambda p, *a: steps.BoundSteps(module, p).pipeline_step(*a))
    cache = jax.jit(lambda p: steps.BoundSteps(module, p).prefill(
        decoder_inputs[:, :1], jnp.ones((2,), jnp.int32), cache_length=6,
        encoder_input_tokens=encoder_tokens))(params)
    self.assertLen(cache.cross_keys, cfg.num_unique_layers)
    self.assertEqual(cache.cross_keys[0].shape, (1, 2, 4, 7, 8))
    np.testing.assert_array_equal(
        cache.cross_bias[0] == 0, encoder_tokens > 0)
    greedy_cache = cache
    for t in range(1, 5):
      logits, greedy_cache = decode_step(
          params, decoder_inputs[:, t], jnp.full((2,), t), greedy_cache)
      np.testing.assert_allclose(logits, full[-1, :, t], rtol=2e-5,
                                 atol=2e-5)
    # SPEED's step: every slot holds position 1's token at its stage, the
    # carry the hidden states an exact pipeline would hand on.
    position = 1
    carry = bound.initial_carry(2)
    for stage in range(cfg.num_repeats):
      positions = jnp.where(jnp.arange(cfg.num_repeats) == stage, position,
                            -1)[None].repeat(2, 0)
      logits, hidden, cache = pipeline_step(
          params, decoder_inputs[:, position], carry, positions, cache)
      np.testing.assert_allclose(logits[:, stage], full[stage, :, position],
                                 rtol=2e-5, atol=2e-5)
      carry = hidden[:, :-1]


def _speed_and_greedy(module, params, encoder_tokens, steps_):
  """SPEED (its pipeline at any batch) and greedy `inference.Generation`s."""
  speed = inference.generate(
      module, params, encoder_input_tokens=encoder_tokens,
      max_decode_steps=steps_, method='speed', eos_id=1,
      max_speculative_rows=None)
  assert np.asarray(speed.stats.pipelined).all()
  greedy = inference.generate(
      module, params, encoder_input_tokens=encoder_tokens,
      max_decode_steps=steps_, method='greedy', eos_id=1)
  return speed, greedy


class SpeedEqualsGreedyTest(parameterized.TestCase):

  @parameterized.parameters(
      dict(g=2, r=3, sharing='cycle', seed=11, tied=False),
      dict(g=2, r=2, sharing='sequence', seed=13, tied=True, matmul='xla'),
      dict(g=3, r=2, sharing='cycle_rev', seed=15, tied=False))
  def test_random_models(self, g, r, sharing, seed, tied, matmul='auto'):
    # Amplified residual branches make the exits disagree, so SPEED flushes.
    module, params = _model(seed=seed, num_unique_layers=g, num_repeats=r,
                            sharing=sharing, logits_via_embedding=tied,
                            decode_matmul=matmul)
    gain = 4.0 if seed % 2 else 2.0
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * gain if helpers.is_residual_output(path) else x,
        params)
    encoder_tokens = _encoder_inputs(5, 9, seed)
    speed, greedy = _speed_and_greedy(module, params, encoder_tokens, 12)
    np.testing.assert_array_equal(speed.tokens, greedy.tokens)
    np.testing.assert_allclose(speed.scores, greedy.scores, rtol=1e-5,
                               atol=1e-5)
    self.assertGreater(int(np.asarray(speed.stats.flushes).sum()), 0)
    self.assertTrue(np.all(speed.stats.num_steps >= speed.stats.num_tokens))

  def test_bfloat16_on_the_kernel_path(self):
    module, params = _model(seed=21, dtype='bfloat16')
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (x * (4.0 if helpers.is_residual_output(path) else 1.0)
                         ).astype(jnp.bfloat16), params)
    encoder_tokens = _encoder_inputs(4, 11, 21)
    speed, greedy = _speed_and_greedy(module, params, encoder_tokens, 10)
    np.testing.assert_array_equal(speed.tokens, greedy.tokens)
    self.assertGreater(int(np.asarray(speed.stats.flushes).sum()), 0)

  def test_an_examples_output_does_not_depend_on_its_batch(self):
    # Padding: each row decodes as it would alone.
    module, params = _model(seed=31)
    encoder_tokens = _encoder_inputs(3, 8, 31)
    speed, _ = _speed_and_greedy(module, params, encoder_tokens, 8)
    for b in range(3):
      alone, _ = _speed_and_greedy(module, params, encoder_tokens[b:b + 1], 8)
      np.testing.assert_array_equal(alone.tokens[0], speed.tokens[b])


class T5XParityTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.t5x_network = pytest.importorskip('t5x.examples.t5.network')

  def _pair(self, dtype, tied):
    kw = dict(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
              mlp_activations=('gelu', 'linear'), dtype=dtype,
              logits_via_embedding=tied)
    theirs = self.t5x_network.Transformer(self.t5x_network.T5Config(
        num_encoder_layers=2, num_decoder_layers=3, dropout_rate=0.0, **kw))
    ours = encoder_decoder.SpeedEncoderDecoder(network.TransformerConfig(
        num_unique_layers=3, num_repeats=1, num_encoder_layers=2, **kw))
    return theirs, ours

  @parameterized.product(dtype=('float32', 'bfloat16'), tied=(True, False))
  def test_unshared_network_is_t5x_t5(self, dtype, tied):
    theirs, ours = self._pair(dtype, tied)
    params = helpers.random_params(theirs, 0)
    ours_shape = jax.eval_shape(lambda: ours.init(
        jax.random.PRNGKey(0), *(jnp.ones((1, 4), jnp.int32),) * 3,
        enable_dropout=False))['params']
    self.assertEqual(jax.tree.structure(params), jax.tree.structure(ours_shape))
    encoder_tokens = _encoder_inputs(2, 9, 5) * 4 % 64
    targets = helpers.random_tokens(6, (2, 7), 64).at[1, 5:].set(0)
    decoder_inputs = jnp.concatenate(
        [jnp.zeros((2, 1), jnp.int32), targets[:, :-1]], axis=1)
    expected = theirs.apply({'params': params}, encoder_tokens,
                            decoder_inputs, targets, enable_dropout=False)
    got = ours.apply({'params': params}, encoder_tokens, decoder_inputs,
                     targets, enable_dropout=False, all_exits=False)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(expected, np.float32))

  def test_segments_as_t5x(self):
    # Decoder segments alone mask the decoder's self-attention only, as in
    # T5X; encoder segments need decoder segments.
    theirs, ours = self._pair('float32', False)
    params = helpers.random_params(theirs, 2)
    encoder_tokens = jnp.array([[3, 4, 5, 0]])
    targets = jnp.array([[11, 12, 13, 14]])
    decoder_inputs = jnp.array([[0, 11, 0, 13]])
    segments = jnp.array([[1, 1, 2, 2]])
    expected = theirs.apply({'params': params}, encoder_tokens,
                            decoder_inputs, targets,
                            decoder_segment_ids=segments,
                            enable_dropout=False)
    got = ours.apply({'params': params}, encoder_tokens, decoder_inputs,
                     targets, decoder_segment_ids=segments,
                     enable_dropout=False, all_exits=False)
    np.testing.assert_array_equal(got, expected)
    with self.assertRaisesRegex(ValueError, 'need decoder_segment_ids'):
      ours.apply({'params': params}, encoder_tokens, decoder_inputs, targets,
                 encoder_segment_ids=segments, enable_dropout=False)

  def test_packed_examples(self):
    theirs, ours = self._pair('float32', False)
    params = helpers.random_params(theirs, 1)
    encoder_tokens = jnp.array([[3, 4, 5, 6, 7, 0], [8, 9, 10, 0, 0, 0]])
    encoder_segments = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0]])
    targets = jnp.array([[11, 12, 13, 14, 0], [15, 16, 0, 0, 0]])
    decoder_segments = jnp.array([[1, 1, 2, 2, 0], [1, 1, 0, 0, 0]])
    decoder_inputs = jnp.array([[0, 11, 0, 13, 0], [0, 15, 0, 0, 0]])
    kwargs = dict(encoder_segment_ids=encoder_segments,
                  decoder_segment_ids=decoder_segments, enable_dropout=False)
    expected = theirs.apply({'params': params}, encoder_tokens,
                            decoder_inputs, targets, **kwargs)
    got = ours.apply({'params': params}, encoder_tokens, decoder_inputs,
                     targets, all_exits=False, **kwargs)
    np.testing.assert_array_equal(got, expected)


if __name__ == '__main__':
  absltest.main()
