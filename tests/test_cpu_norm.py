"""The decode step's RMSNorm kernel: values against XLA's, each row the same
bits whatever the rows beside it (XLA's own norm is not, at some widths),
bfloat16's roundings, jax.vmap, and greedy's and SPEED's scores at such a
width."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import inference
from t5x_speed import network
from t5x_speed import testing
from t5x_speed.cpu import build
from t5x_speed.cpu import norm
import helpers


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@absltest.skipUnless(build.available(), 'kernel not built (no C++ compiler)')
class RmsNormTest(absltest.TestCase):

  def test_docstring_example(self):
    helpers.assert_doctests(norm)

  def test_values_rows_and_vmap(self):
    rng = np.random.RandomState(0)
    for width in (20, 192, 768):
      scale = jnp.asarray(rng.uniform(0.5, 1.5, width), jnp.float32)
      x = jnp.asarray(3 * rng.standard_normal((5, 6, width)), jnp.float32)
      for x_dtype, dtype in ((jnp.float32, jnp.float32),
                             (jnp.float32, jnp.bfloat16),
                             (jnp.bfloat16, jnp.bfloat16)):
        xs = x.astype(x_dtype)
        got = jax.jit(norm.rms_norm, static_argnums=(2, 3))(
            xs, scale, 1e-6, dtype)
        ref = norm.reference(xs, scale, 1e-6, dtype)
        self.assertEqual(got.dtype, dtype)
        tol = 1e-6 if dtype == jnp.float32 else 2**-7
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(ref, np.float32),
                                   rtol=tol, atol=tol)
        # Each row alone, in a program of its own: the same bits.
        alone = jax.jit(norm.rms_norm, static_argnums=(2, 3))(
            xs[:, :1], scale, 1e-6, dtype)
        np.testing.assert_array_equal(_bits(alone), _bits(got[:, :1]))
      batched = jax.vmap(lambda x: norm.rms_norm(x, scale, 1e-6,
                                                 jnp.float32))(x)
      np.testing.assert_array_equal(
          _bits(batched), _bits(norm.rms_norm(x, scale, 1e-6, jnp.float32)))
    # XLA's own norm sums a row in an order that depends on the rows beside
    # it at this width: what the kernel is for.
    x = jnp.asarray(3 * rng.standard_normal((5, 6, 192)), jnp.float32)
    mean = jax.jit(lambda x: jnp.mean(jax.lax.square(x), axis=-1))
    self.assertFalse(np.array_equal(_bits(mean(x)[:, :1]),
                                    _bits(mean(x[:, :1]))))

  def test_speed_scores_are_greedys_at_width_192(self):
    # 5 rows of greedy against 30 of SPEED, at a width where XLA's norm
    # would round them differently.
    config = network.TransformerConfig(
        vocab_size=32, emb_dim=192, num_heads=3, head_dim=64, mlp_dim=192,
        num_unique_layers=2, num_repeats=6, relpos_num_buckets=8,
        relpos_max_distance=32)
    module = network.SpeedTransformer(config)
    params = testing.random_params(module, 3)
    rng = np.random.RandomState(0)
    prompts = jnp.asarray(rng.randint(2, 32, size=(5, 6)))
    lengths = jnp.asarray(rng.randint(1, 6, size=5))
    run = lambda method, **kw: inference.generate(
        module, params, prompts, lengths, max_decode_steps=12, method=method,
        eos_id=-1, **kw)
    speed, greedy = run('speed', max_speculative_rows=None), run('greedy')
    np.testing.assert_array_equal(speed.tokens, greedy.tokens)
    np.testing.assert_array_equal(_bits(speed.scores), _bits(greedy.scores))


if __name__ == '__main__':
  absltest.main()
