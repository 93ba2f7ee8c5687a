"""Tests of the parameter-shared network and its three cached calls."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import config as config_lib
from t5x_speed import layers
from t5x_speed import network
from t5x_speed import testing
from t5x_speed.cpu import build
from t5x_speed.cpu.dispatch import DecodeNumerics
import helpers
from helpers import random_tokens, tiny_config, tiny_model

ORDERS = ('cycle', 'sequence', 'cycle_rev')
# T5X logical axis names known to its standard partitioning rules.
T5X_AXES = {'vocab', 'embed', 'mlp', 'heads', 'kv', 'joined_kv',
            'relpos_buckets'}


def _model(**overrides):
  """`tiny_model`'s module with `overrides`, and its parameters.

  The layer order and the dropout rate change no parameter, and `tiny_model`
  seeds by G and R alone: models that differ only in those have the same
  parameters, initialised (compiled) once here.
  """
  defaults = tiny_config()
  shape = {k: v for k, v in overrides.items()
           if k not in ('sharing', 'dropout_rate') and
           getattr(defaults, k) != v}
  _, params = tiny_model(**shape)
  return network.SpeedTransformer(tiny_config(**overrides)), params


@functools.lru_cache(maxsize=None)
def _jitted(module, method, **static):
  """jit(module.apply) of one method, built once per (module, method, static
  keyword arguments) so that tests with the same shapes share the program."""
  return jax.jit(lambda params, *args: module.apply(
      {'params': params}, *args, method=method, **static))


def _jit_apply(module, params):
  """Like `module.apply` with `params`, each call one compiled program.

  For calls whose shapes no other test runs: op by op, each of the pass's
  ops would compile on its own, which costs more than the whole program.
  Keyword arguments are static.
  """
  return lambda *args, method=None, **static: _jitted(
      module, method, **static)(params, *args)


def _param_count(cfg):
  module = network.SpeedTransformer(cfg)
  tokens = jnp.ones((1, 4), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(
      jax.random.PRNGKey(0), tokens, tokens, enable_dropout=False))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes['params']))


class ConfigTest(parameterized.TestCase):

  def test_layer_orders(self):
    def order(sharing, g=4, r=3):
      return config_lib.TransformerConfig(
          num_unique_layers=g, num_repeats=r, sharing=sharing).layer_order
    self.assertEqual(order('cycle'), (0, 1, 2, 3) * 3)
    self.assertEqual(order('sequence'), (0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3))
    self.assertEqual(order('cycle_rev'), (0, 1, 2, 3, 0, 1, 2, 3, 3, 2, 1, 0))
    self.assertEqual(order('cycle', g=12, r=1), tuple(range(12)))
    self.assertEqual(order('cycle_rev', g=2, r=1), (1, 0))

  @parameterized.parameters(
      ('num_unique_layers', dict(num_unique_layers=0)),
      ('num_repeats', dict(num_repeats=0)),
      ('num_repeats', dict(num_repeats=-2)),
      ('sharing', dict(sharing='zigzag')),
      ('head_dim', dict(head_dim=None, emb_dim=30, num_heads=4)),
      ('head_dim', dict(head_dim=0)),
      ('dtype', dict(dtype='not_a_dtype')),
      ('dropout_rate', dict(dropout_rate=1.5)),
      ('mlp_activations', dict(mlp_activations='gelu')),
  )
  def test_bad_config_names_the_field(self, field, kwargs):
    with self.assertRaisesRegex(ValueError, field):
      config_lib.TransformerConfig(**kwargs)

  def test_head_dim_defaults_to_width_over_heads(self):
    cfg = config_lib.TransformerConfig(head_dim=None, emb_dim=96, num_heads=6)
    self.assertEqual(cfg.head_dim, 16)

  def test_docstring_examples(self):
    helpers.assert_doctests(
        config_lib, network, testing,
        extraglobs={'TransformerConfig': config_lib.TransformerConfig})


class ParameterTest(parameterized.TestCase):

  def test_unshared_base_matches_t5x_decoder_only_base(self):
    # T5X's decoder-only Base network (tied logits, one relative-bias table)
    # has 109,628,544 parameters; docs/t5x.md#parameter-count explains the
    # 134,307,072 in the header comment of its base.gin.
    cfg = config_lib.TransformerConfig(num_unique_layers=12, num_repeats=1)
    self.assertEqual(_param_count(cfg), 109_628_544)

  def test_shared_model_has_g_layers_plus_embeddings(self):
    per_layer = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768
    shared = 32128 * 768 + 768 + 32 * 12
    for g, r in ((4, 3), (2, 6), (4, 4)):
      cfg = config_lib.TransformerConfig(num_unique_layers=g, num_repeats=r)
      self.assertEqual(_param_count(cfg), shared + g * per_layer, (g, r))
    self.assertEqual(
        _param_count(config_lib.TransformerConfig(num_unique_layers=4,
                                                  num_repeats=3)),
        _param_count(config_lib.TransformerConfig(num_unique_layers=4,
                                                  num_repeats=1)))

  def test_untied_classifier_adds_one_projection(self):
    tied = config_lib.TransformerConfig(num_unique_layers=12, num_repeats=1)
    untied = config_lib.TransformerConfig(num_unique_layers=12, num_repeats=1,
                                          logits_via_embedding=False)
    self.assertEqual(_param_count(untied) - _param_count(tied), 768 * 32128)

  def test_every_parameter_has_t5x_logical_axes(self):
    module, _ = tiny_model()
    tokens = jnp.ones((1, 4), jnp.int32)
    # The parameters' shapes and axis names, without computing any value.
    variables = jax.eval_shape(lambda: module.init(
        jax.random.PRNGKey(0), tokens, tokens, enable_dropout=False))
    params = jax.tree_util.tree_leaves_with_path(variables['params'])
    axes = variables['params_axes']
    for path, leaf in params:
      keys = [p.key for p in path]
      node = axes
      for key in keys[:-1]:
        node = node[key]
      names = node[keys[-1] + '_axes'].names
      self.assertLen(names, leaf.ndim, keys)
      self.assertContainsSubset(names, T5X_AXES, keys)

  @parameterized.parameters(*ORDERS)
  def test_gradients_reach_exactly_the_unique_layers(self, sharing):
    module, params = _model(sharing=sharing, num_unique_layers=3,
                            num_repeats=2)
    tokens = random_tokens(1, (2, 6), 61)

    def loss(p):
      logits = module.apply({'params': p}, tokens, tokens,
                            enable_dropout=False)
      return jnp.sum(jax.nn.log_softmax(logits)[..., 3])

    grads = jax.jit(jax.grad(loss))(params)['decoder']
    self.assertEqual(
        sorted(grads),
        ['decoder_norm', 'layers_0', 'layers_1', 'layers_2', 'relpos_bias',
         'token_embedder'])
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      self.assertTrue(np.all(np.isfinite(g)), path)
      self.assertGreater(float(jnp.abs(g).sum()), 0.0, path)

  def test_every_exit_has_its_own_depth(self):
    module, params = tiny_model()
    tokens = random_tokens(2, (2, 5), 61)
    logits = module.apply({'params': params}, tokens, tokens,
                          enable_dropout=False)
    last = module.apply({'params': params}, tokens, tokens,
                        enable_dropout=False, all_exits=False)
    self.assertEqual(logits.shape, (3, 2, 5, 61))
    np.testing.assert_array_equal(logits[-1], last)
    self.assertGreater(float(jnp.abs(logits[0] - logits[1]).max()), 1e-3)
    # With exit_positions the exits score those positions of each row only.
    positions = jnp.array([[4, 0], [2, 3]])
    at = module.apply({'params': params}, tokens, tokens,
                      enable_dropout=False, exit_positions=positions)
    np.testing.assert_allclose(at, jnp.take_along_axis(
        logits, positions[None, :, :, None], axis=2), rtol=1e-5, atol=1e-6)

  def test_dropout_is_active_only_when_enabled(self):
    module, params = _model(dropout_rate=0.3)
    tokens = random_tokens(2, (2, 5), 61)
    run = lambda seed, enable: module.apply(
        {'params': params}, tokens, tokens, enable_dropout=enable,
        rngs={'dropout': jax.random.PRNGKey(seed)})
    np.testing.assert_array_equal(run(0, False), run(1, False))
    self.assertGreater(float(jnp.abs(run(0, True) - run(1, True)).max()), 1e-3)


class CachedCallsTest(parameterized.TestCase):

  @parameterized.product(sharing=ORDERS, repeats=(1, 2, 3),
                         bidirectional=(False, True))
  def test_prefill_and_steps_match_full_forward(self, sharing, repeats,
                                                bidirectional):
    module, params = _model(sharing=sharing, num_repeats=repeats)
    apply = lambda *a, **k: module.apply({'params': params}, *a, **k)
    tokens = random_tokens(3, (3, 9), 61)
    prefix = jnp.array([2, 4, 1])
    region = (jnp.arange(9) < prefix[:, None]).astype(jnp.int32)
    causal = region if bidirectional else None
    full = apply(tokens, tokens, decoder_causal_attention=causal,
                 enable_dropout=False)                     # [R, b, len, v]

    exits, cache = apply(tokens, prefix, causal, method='prefill')
    rows = jnp.arange(3)
    for r in range(repeats):
      np.testing.assert_allclose(exits[:, r], full[r, rows, prefix - 1],
                                 atol=2e-5, rtol=2e-5)
    # Greedy-style full-depth steps from each example's own prefix length.
    for t in range(9 - 4):
      pos = prefix + t
      logits, cache = apply(tokens[rows, pos], pos, cache,
                            method='decode_step')
      np.testing.assert_allclose(logits, full[-1, rows, pos], atol=2e-5,
                                 rtol=2e-5)

  @parameterized.product(sharing=ORDERS, repeats=(1, 2, 3))
  def test_speed_step_matches_every_exit(self, sharing, repeats):
    """Slots at different stages and positions give the full-depth logits."""
    module, params = _model(sharing=sharing, num_repeats=repeats)
    apply = lambda *a, **k: module.apply({'params': params}, *a, **k)
    tokens = random_tokens(4, (2, 12), 61)
    prefix = jnp.array([3, 5])
    full = apply(tokens, tokens, enable_dropout=False)
    _, cache = apply(tokens, prefix, method='prefill')
    stages = jnp.arange(repeats)
    rows = jnp.arange(2)[:, None]
    hidden = jnp.zeros((2, repeats, 32))
    for t in range(6 + repeats):
      # Slot s holds the token that entered stage 0 at step t - s.
      pos = prefix[:, None] + t - stages                       # [b, R]
      live = (t - stages >= 0) & (pos < 12)
      pos = jnp.where(live, pos, -1)
      logits, hidden, cache = apply(tokens[rows[:, 0], pos[:, 0]],
                                    hidden[:, :-1], pos, cache,
                                    method='speed_step')
      expected = full[stages[None, :], rows, jnp.maximum(pos, 0)]
      np.testing.assert_allclose(np.where(live[..., None], logits, 0),
                                 np.where(live[..., None], expected, 0),
                                 atol=2e-5, rtol=2e-5)

  def test_speculative_vocab_shortlist(self):
    module, params = tiny_model()
    apply = _jit_apply(module, params)
    tokens = random_tokens(9, (2, 8), 61)
    _, cache = apply(tokens, jnp.array([4, 5]), method='prefill')
    args = (tokens[:, 4], jnp.ones((2, 2, 32)), jnp.array([[4, 3, 2],
                                                            [5, -1, 3]]))
    full, hidden, _ = apply(*args, cache, method='speed_step')
    short, short_hidden, _ = apply(*args, cache, method='speed_step',
                                   speculative_vocab_size=20)
    np.testing.assert_array_equal(short_hidden, hidden)
    np.testing.assert_allclose(short[:, -1], full[:, -1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(short[:, :-1, :20], full[:, :-1, :20],
                               rtol=1e-6, atol=1e-6)
    self.assertTrue(np.all(np.isneginf(short[:, :-1, 20:])))

  def test_one_cache_per_virtual_layer(self):
    module, params = _model(num_unique_layers=2, num_repeats=3)
    tokens = random_tokens(5, (2, 6), 61)
    _, cache = _jit_apply(module, params)(tokens, jnp.array([4, 6]),
                                          method='prefill')
    self.assertLen(cache.keys, 2)
    self.assertEqual(cache.keys[0].shape, (3, 2, 4, 6, 8))
    # Every virtual layer holds different keys for the same tokens.
    flat = [cache.keys[j][r] for r in range(3) for j in range(2)]
    for a in range(6):
      for b in range(a + 1, 6):
        self.assertGreater(float(jnp.abs(flat[a] - flat[b]).max()), 1e-4)

  def test_empty_slot_writes_nothing(self):
    module, params = tiny_model()
    apply = _jit_apply(module, params)
    tokens = random_tokens(6, (2, 8), 61)
    _, cache = apply(tokens, jnp.array([5, 5]), method='prefill')
    # Only slot 1 of example 0 is live; every other slot is empty (-1).
    pos = jnp.array([[-1, 5, -1], [-1, -1, -1]])
    _, _, new = apply(jnp.zeros((2,), jnp.int32), jnp.ones((2, 2, 32)), pos,
                      cache, method='speed_step')
    for old_k, new_k in zip(cache.keys + cache.values, new.keys + new.values):
      changed = np.argwhere(np.any(np.asarray(old_k != new_k), axis=(2, 4)))
      self.assertEqual({tuple(x) for x in changed}, {(1, 0, 5)})

  def test_rewriting_a_position_replaces_it(self):
    module, params = tiny_model()
    apply = _jit_apply(module, params)
    tokens = random_tokens(7, (1, 8), 61)
    _, cache = apply(tokens, jnp.array([4]), method='prefill')
    pos = jnp.array([4])
    _, once = apply(tokens[:, 4], pos, cache, method='decode_step')
    _, garbage = apply(jnp.array([17]), pos, cache, method='decode_step')
    logits, twice = apply(tokens[:, 4], pos, garbage, method='decode_step')
    for a, b in zip(once.keys + once.values, twice.keys + twice.values):
      np.testing.assert_array_equal(a, b)
    full = apply(tokens, tokens, enable_dropout=False)
    np.testing.assert_allclose(logits[0], full[-1, 0, 4], atol=2e-5)

  def test_prefill_pads_to_cache_length(self):
    module, params = tiny_model()
    tokens = random_tokens(8, (2, 5), 61)
    _, cache = _jit_apply(module, params)(tokens, jnp.array([5, 3]),
                                          cache_length=9, method='prefill')
    self.assertEqual(cache.length, 9)
    np.testing.assert_array_equal(cache.keys[0][:, 0, :, 5:], 0)
    np.testing.assert_array_equal(cache.keys[0][:, 1, :, 3:], 0)
    self.assertGreater(float(jnp.abs(cache.keys[0][:, 1, :, :3]).min()), 0)


class CacheAndEmbeddingTest(parameterized.TestCase):
  """The cache write and the embedding gather, which move bf16 as bits."""

  @parameterized.parameters('float32', 'bfloat16')
  def test_write_cache_replaces_exactly_the_valid_rows(self, dtype):
    rng = np.random.RandomState(0)
    stages, batch, heads, length, dim = 3, 2, 2, 5, 4
    cache = rng.randn(stages, batch, heads, length, dim).astype(np.float32)
    update = rng.randn(batch, 2, heads, dim).astype(np.float32)
    # Slots 0 and 2 (stages 0 and 2); -1 and 5 (beyond the cache) write
    # nothing.
    positions = np.array([[1, -1], [4, 5]], np.int32)
    got = jax.jit(layers.write_cache, static_argnums=1)(
        jnp.asarray(cache, dtype), (0, 2), positions,
        jnp.asarray(update, dtype))
    want = np.asarray(jnp.asarray(cache, dtype)).copy()
    rounded = np.asarray(jnp.asarray(update, dtype))
    want[0, 0, :, 1] = rounded[0, 0]
    want[0, 1, :, 4] = rounded[1, 0]
    self.assertEqual(got.dtype, jnp.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(got), want)

  @parameterized.parameters('float32', 'bfloat16')
  def test_embedding_gathers_the_rows(self, dtype):
    embed = layers.Embed(num_embeddings=11, features=6, dtype=dtype)
    params = embed.init(jax.random.PRNGKey(0), jnp.zeros((1,), jnp.int32))
    tokens = jnp.asarray([[3, 0, 10], [7, 7, 1]])
    got = jax.jit(embed.apply)(params, tokens)
    table = jnp.asarray(params['params']['embedding'], dtype)
    self.assertEqual(got.dtype, jnp.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(table)[np.asarray(tokens)])

  @parameterized.product(stages=(1, 3), kernel=(False, True))
  def test_decode_loop_does_not_copy_the_cache(self, stages, kernel):
    # XLA's path: one write per step (batch 1, one stage) must not become a
    # dynamic-update-slice that XLA:CPU copies the cache around. The
    # kernel's path: the call's updated caches must reuse the loop's
    # buffers.
    if kernel and not build.available():
      self.skipTest('kernel not built (no C++ compiler)')
    caches = (jnp.zeros((stages, 1, 2, 9, 20)), jnp.ones((stages, 1, 2, 9, 20)))
    query = jnp.ones((1, stages, 2, 20))
    numerics = DecodeNumerics(kernel=kernel)

    def loop(caches):
      def body(i, carry):
        (keys, values), total = carry
        positions = jnp.full((1, stages), i)
        context, keys, values = layers.cached_attention(
            query, keys, values, jnp.zeros((1, stages, 2, 9)), query, query,
            positions, tuple(range(stages)), numerics)
        return (keys, values), total + context.sum()
      return jax.lax.fori_loop(0, 5, body, (caches, 0.0))

    hlo = jax.jit(loop).lower(caches).compile().as_text()
    self.assertEqual(hlo.count('t5x_speed_cached_attention'), int(kernel))
    copies = [l for l in hlo.splitlines()
              if f'= f32[{stages},1,2,9,20]' in l and ' copy(' in l]
    self.assertLessEqual(len(copies), 2, copies)  # the loop's inputs, once

  def test_bf16_decode_loop_converts_no_table_or_cache(self):
    # XLA:CPU would gather and scatter bf16 through float32: a float32 copy
    # of the whole table per decode call and of every cache per step.
    embed = layers.Embed(num_embeddings=4099, features=40, dtype='bfloat16')
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), embed.init(
        jax.random.PRNGKey(0), jnp.zeros((1,), jnp.int32)))
    cache = jnp.zeros((3, 1, 2, 9, 20), jnp.bfloat16)

    def loop(params, cache):
      def body(i, carry):
        cache, total = carry
        x = embed.apply(params, jnp.full((1, 2), i))          # [1, 2, 40]
        cache = layers.write_cache(cache, (0, 1), jnp.stack([i, i - 1])[None],
                                   x.reshape(1, 2, 2, 20))
        return cache, total + x.astype(jnp.float32).sum()
      return jax.lax.fori_loop(0, 5, body, (cache, 0.0))

    hlo = jax.jit(loop).lower(params, cache).compile().as_text()
    for shape in ('f32[4099,40]', 'f32[3,1,2,9,20]'):
      self.assertNotIn(shape, hlo)


if __name__ == '__main__':
  absltest.main()
