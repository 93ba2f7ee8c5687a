"""Our network and loss against T5X's own (skipped when T5X is absent)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

t5x_losses = pytest.importorskip('t5x.losses')
t5x_network = pytest.importorskip('t5x.examples.decoder_only.network')

from t5x_speed import losses  # pylint: disable=g-import-not-at-top
from t5x_speed import network
import helpers

_KW = dict(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
           mlp_activations=('gelu', 'linear'))


def _pair(dtype, logits_via_embedding=True):
  theirs = t5x_network.DecoderWrapper(t5x_network.TransformerConfig(
      num_layers=3, dropout_rate=0.0, dtype=dtype,
      logits_via_embedding=logits_via_embedding, **_KW))
  ours = network.SpeedTransformer(network.TransformerConfig(
      num_unique_layers=3, num_repeats=1, dtype=dtype,
      logits_via_embedding=logits_via_embedding, **_KW))
  return theirs, ours


class NetworkParityTest(parameterized.TestCase):

  @parameterized.product(dtype=('float32', 'bfloat16'), tied=(True, False))
  def test_unshared_network_is_t5x_decoder_only(self, dtype, tied):
    theirs, ours = _pair(dtype, tied)
    tokens = helpers.random_tokens(1, (2, 10), 64)
    tokens = tokens.at[1, 8:].set(0)  # padding
    causal = (jnp.arange(10) < jnp.array([[4], [6]])).astype(jnp.int32)
    params = helpers.random_params(theirs, 0)
    ours_shape = jax.eval_shape(lambda: ours.init(
        jax.random.PRNGKey(0), tokens, tokens, enable_dropout=False))['params']
    self.assertEqual(jax.tree.structure(params), jax.tree.structure(ours_shape))
    for bidirectional in (None, causal):
      expected = theirs.apply({'params': params}, tokens, tokens,
                              decoder_causal_attention=bidirectional,
                              enable_dropout=False)
      got = ours.apply({'params': params}, tokens, tokens,
                       decoder_causal_attention=bidirectional,
                       enable_dropout=False, all_exits=False)
      np.testing.assert_array_equal(np.asarray(got, np.float32),
                                    np.asarray(expected, np.float32))

  def test_cached_decode_matches_t5x_cached_decode(self):
    theirs, ours = _pair('float32')
    tokens = helpers.random_tokens(2, (2, 8), 64)
    params = helpers.random_params(theirs, 0)
    lengths = jnp.array([3, 5])
    # T5X: initialise the cache, prefill, then one decode=True step each;
    # each call jitted, as T5X's decoding runs it (eager, each operation
    # would compile apart).
    _, init = jax.jit(lambda p: theirs.apply(
        {'params': p}, jnp.ones_like(tokens), jnp.ones_like(tokens),
        enable_dropout=False, decode=True, mutable=['cache']))(params)
    _, t5x_vars = jax.jit(lambda p, c: theirs.apply(
        {'params': p, 'cache': c}, tokens,
        (jnp.arange(8) <= lengths[:, None]).astype(jnp.int32),
        enable_dropout=False, prefill=True, prefill_lengths=lengths,
        mutable=['cache']))(params, init['cache'])
    t5x_cache = t5x_vars['cache']
    _, cache = jax.jit(lambda p: ours.apply(
        {'params': p}, tokens, lengths, method='prefill'))(params)
    t5x_step = jax.jit(lambda p, c, x: theirs.apply(
        {'params': p, 'cache': c}, x[:, None], x[:, None],
        enable_dropout=False, decode=True, max_decode_length=8,
        mutable=['cache']))
    our_step = jax.jit(lambda p, *a: ours.apply(
        {'params': p}, *a, method='decode_step'))
    rows = jnp.arange(2)
    for t in range(3):
      step_tokens = tokens[rows, lengths + t]
      expected, t5x_vars = t5x_step(params, t5x_cache, step_tokens)
      t5x_cache = t5x_vars['cache']
      got, cache = our_step(params, step_tokens, lengths + t, cache)
      np.testing.assert_allclose(got, expected[:, 0], atol=1e-5, rtol=1e-5)


class LossParityTest(parameterized.TestCase):

  @parameterized.product(label_smoothing=(0.0, 0.1), z_loss=(0.0, 1e-4),
                         normalizer=(None, 5.0), weighted=(False, True))
  def test_exit_loss_is_t5x_loss(self, label_smoothing, z_loss, normalizer,
                                 weighted):
    rng = np.random.default_rng(3)
    logits = jnp.asarray(2 * rng.standard_normal((2, 6, 13)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 13, (2, 6)), jnp.int32)
    weights = (jnp.asarray(rng.uniform(size=(2, 6)), jnp.float32)
               if weighted else None)
    args = (targets, weights, label_smoothing, z_loss, normalizer)
    ours = losses.weighted_cross_entropy(logits, *args)
    theirs = t5x_losses.compute_weighted_cross_entropy(logits, *args)
    for a, b in zip(ours, theirs):
      np.testing.assert_allclose(a, b, rtol=1e-6)
    g_ours = jax.grad(lambda x: losses.weighted_cross_entropy(x, *args)[0])
    g_theirs = jax.grad(
        lambda x: t5x_losses.compute_weighted_cross_entropy(x, *args)[0])
    np.testing.assert_allclose(g_ours(logits), g_theirs(logits), rtol=1e-6,
                               atol=1e-8)


if __name__ == '__main__':
  absltest.main()
