"""int8 weights: the quantizer, the int8 kernels against NumPy with row
independence at every row count a step uses, and SPEED == greedy on
quantized models of both families (greedy and sampling).

Tolerance of the kernels: as test_cpu_matmul.py's, against the float64
product of x and the dequantized weights (q * scale), since the kernel
widens q exactly and scales each finished float32 sum once.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import encoder_decoder
from t5x_speed import inference
from t5x_speed import quantize
from t5x_speed import testing
from t5x_speed.cpu import build
from t5x_speed.cpu import matmul
import helpers
from helpers import random_model
from helpers import tiny_config

needs_kernel = absltest.skipUnless(build.available(),
                                   'kernel not built (no C++ compiler)')


class QuantizeTest(absltest.TestCase):

  def test_docstring_examples(self):
    helpers.assert_doctests(quantize, matmul)

  def test_channels_round_trip_and_what_stays_float(self):
    module, params = random_model(2, 3, 'cycle', 1, 40)
    q = quantize.quantize_int8(params)
    self.assertTrue(quantize.is_quantized(q))
    self.assertFalse(quantize.is_quantized(params))
    flat = jax.tree_util.tree_flatten_with_path(q)[0]
    names = {jax.tree_util.keystr(p): v for p, v in flat}
    wo = "['decoder']['layers_0']['mlp']['wo']"
    self.assertEqual(names[wo + "['kernel']"].dtype, jnp.int8)
    self.assertEqual(names[wo + "['kernel_scale']"].shape,
                     (module.config.emb_dim,))
    table = "['decoder']['token_embedder']"
    self.assertEqual(names[table + "['embedding_scale']"].shape, (40,))
    for name, value in names.items():  # norms and position bias untouched
      if name.endswith("['scale']") or 'rel_embedding' in name:
        self.assertEqual(value.dtype, jnp.float32, name)
    # Every weight within half a step of its channel's scale, and the
    # largest of each channel exactly +-127.
    back = quantize.dequantize(q)
    for (path, w), w_back in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(back)):
      key = getattr(path[-1], 'key', '')
      if key not in quantize.QUANTIZED:
        np.testing.assert_array_equal(w, w_back)
        continue
      axis = quantize.QUANTIZED[key]
      step = np.max(np.abs(w), axis=axis, keepdims=True) / 127
      self.assertTrue(np.all(np.abs(w - w_back) <= step / 2 * 1.0001))
    self.assertTrue(np.all(np.max(np.abs(np.asarray(
        names[wo + "['kernel']"], np.int32)), axis=0) == 127))
    with self.assertRaisesRegex(ValueError, 'already quantized'):
      quantize.quantize_int8(q)

  def test_zero_channel_and_bad_option(self):
    q = quantize.quantize_int8({'d': {'kernel': jnp.zeros((3, 2))}})
    self.assertEqual(q['d']['kernel_scale'].tolist(), [1.0, 1.0])
    quantize.check_decode_weights('int8')
    with self.assertRaisesRegex(ValueError, 'decode_weights must be one of'):
      quantize.check_decode_weights('int4')


@needs_kernel
class Int8KernelTest(parameterized.TestCase):

  @parameterized.product(transpose_w=(False, True),
                         dtype=(jnp.float32, jnp.bfloat16))
  def test_values_and_row_independence(self, transpose_w, dtype):
    rng = np.random.RandomState(0)
    # Whole vectors, tails in k and n, and several slices of k.
    for k, n in ((100, 37), (768, 300), (130, 2000)):
      x = jnp.asarray(rng.standard_normal((13, k)), dtype)
      w = rng.randint(-127, 128, (n, k) if transpose_w else (k, n)).astype(
          np.int8)
      s = rng.uniform(0.001, 0.02, n).astype(np.float32)
      # Every row count up to 13 (SPEED's batch x R and the 12-row groups),
      # one kernel call each, in one compiled program.
      outs = jax.jit(lambda x, w, s: [  # pylint: disable=g-long-lambda
          matmul.matmul(x[:m], w, w_scale=s, transpose_w=transpose_w)
          for m in range(1, 14)])(x, w, s)
      got = np.asarray(outs[-1], np.float64)
      ws = w.astype(np.float64) * (s[:, None] if transpose_w else s)
      ws = ws.T if transpose_w else ws
      xs = np.asarray(x, np.float64)
      ref, scale = xs @ ws, np.abs(xs) @ np.abs(ws)
      tol = 1e-5 * scale + (2.0**-8 * np.abs(ref) if dtype == jnp.bfloat16
                            else 0)
      self.assertTrue(np.all(np.abs(got - ref) <= tol), (k, n))
      self.assertEqual(outs[-1].dtype, dtype)
      for m, out in enumerate(outs, 1):
        np.testing.assert_array_equal(out, outs[-1][:m], err_msg=f'{m} rows')
      xla = matmul.matmul(x, w, w_scale=s, transpose_w=transpose_w,
                          force_xla=True)
      self.assertTrue(np.all(np.abs(np.asarray(xla, np.float64) - ref) <=
                             tol))

  def test_matmuls_vmap_cols_and_scale(self):
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    ws = [rng.randint(-127, 128, (96, n)).astype(np.int8) for n in (64, 200)]
    ss = [rng.uniform(0.01, 0.02, n).astype(np.float32) for n in (64, 200)]
    for one, alone in zip(matmul.matmuls(x, ws, w_scales=ss),
                          [matmul.matmul(x, w, w_scale=s)
                           for w, s in zip(ws, ss)]):
      np.testing.assert_array_equal(one, alone)
    # vmapped weights with their scales: one call, each element alone.
    stacked = jnp.stack([ws[0], -ws[0]])
    scales = jnp.stack([ss[0], 2 * ss[0]])
    batched = jax.vmap(lambda w, s: matmul.matmul(x, w, w_scale=s))(
        stacked, scales)
    for i in range(2):
      np.testing.assert_array_equal(
          batched[i], matmul.matmul(x, stacked[i], w_scale=scales[i]))
    # The classifier's form: a vocabulary prefix, scaled products.
    table = rng.randint(-127, 128, (50, 96)).astype(np.int8)
    rows = rng.uniform(0.01, 0.02, 50).astype(np.float32)
    got = matmul.matmul(x, table, transpose_w=True, cols=20, scale=0.5,
                        w_scale=rows)
    ref = np.asarray(x) @ (table[:20] * rows[:20, None]).T * 0.5
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

  def test_gather_rows_scales_int8_rows(self):
    rng = np.random.RandomState(2)
    table = rng.randint(-127, 128, (50, 24)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, 50).astype(np.float32)
    ids = jnp.asarray([[3, 49], [0, 7]])
    want = table[np.asarray(ids)].astype(np.float32) * scale[np.asarray(
        ids)][..., None]
    for force_xla in (False, True):
      got = matmul.gather_rows(table, ids, row_scale=scale,
                               force_xla=force_xla)
      self.assertEqual(got.dtype, jnp.float32)
      np.testing.assert_array_equal(got, want)
    batched = jax.vmap(lambda t, s: matmul.gather_rows(t, ids, row_scale=s))(
        jnp.stack([table, -table]), jnp.stack([scale, scale]))
    np.testing.assert_array_equal(batched[1], -want)
    with self.assertRaisesRegex(ValueError, 'need row_scale'):
      matmul.gather_rows(table, ids)

  def test_bad_scales_raise(self):
    x, w = jnp.ones((2, 8)), jnp.ones((8, 4), jnp.int8)
    with self.assertRaisesRegex(ValueError, r'need w_scale: float32 \(4,\)'):
      matmul.matmul(x, w)
    with self.assertRaisesRegex(ValueError, r'need w_scale'):
      matmul.matmul(x, w, w_scale=jnp.ones((3,)))
    with self.assertRaisesRegex(ValueError, 'for int8 weights only'):
      matmul.matmul(x, jnp.ones((8, 4)), w_scale=jnp.ones((4,)))
    with self.assertRaisesRegex(ValueError, 'one w_scales entry per weight'):
      matmul.matmuls(x, [w, w], w_scales=[jnp.ones((4,))])


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _encoder_decoder(seed):
  config = tiny_config(vocab_size=40, num_unique_layers=2, num_repeats=3,
                       num_encoder_layers=2)
  module = encoder_decoder.SpeedEncoderDecoder(config)
  return module, testing.random_params(module, seed)


class Int8SpeedEqualsGreedyTest(parameterized.TestCase):
  """SPEED's tokens are greedy's on the same int8 model (both families,
  greedy and sampled), in the pipelined step (batch x R <= 8 rows) and
  through random models whose exits disagree often (odd seeds)."""

  @parameterized.parameters(('speed', 'greedy', {}),
                            ('speed_sample', 'sample',
                             dict(temperature=0.8, topp=0.9)))
  def test_decoder_only_and_encoder_decoder(self, method, reference,
                                            settings):
    rng = np.random.RandomState(0)
    for seed in (1, 2):
      module, params = random_model(2, 3, 'cycle', seed, 40)
      q = quantize.quantize_int8(params)
      prompts = jnp.asarray(rng.randint(2, 40, (2, 5)))
      lengths = jnp.asarray([5, 2])
      run = lambda m, p=prompts, l=lengths: inference.generate(
          module, q, p, l, max_decode_steps=16, method=m, eos_id=-1,
          **settings)
      speed, sequential = run(method), run(reference)
      np.testing.assert_array_equal(speed.tokens, sequential.tokens)
      # The final exit's logits are the same bits: so are the scores.
      np.testing.assert_array_equal(_bits(speed.scores),
                                    _bits(sequential.scores))
      self.assertTrue(np.all(speed.stats.pipelined))
    module, params = _encoder_decoder(3)
    q = quantize.quantize_int8(params)
    inputs = jnp.asarray(rng.randint(2, 40, (2, 7)))
    run = lambda m: inference.generate(
        module, q, encoder_input_tokens=inputs, max_decode_steps=16,
        method=m, eos_id=-1, **settings)
    speed, sequential = run(method), run(reference)
    np.testing.assert_array_equal(speed.tokens, sequential.tokens)
    np.testing.assert_array_equal(_bits(speed.scores),
                                  _bits(sequential.scores))
    self.assertTrue(np.all(speed.stats.pipelined))

  def test_int8_model_is_its_dequantized_model(self):
    """The kernels' int8 products are the float32 products of q * scale up
    to summation order: greedy on the int8 model and on its dequantized
    float32 model agree on these random models."""
    module, params = random_model(2, 3, 'cycle', 2, 40)
    q = quantize.quantize_int8(params)
    prompts = jnp.asarray(np.random.RandomState(5).randint(2, 40, (2, 5)))
    lengths = jnp.asarray([5, 3])
    run = lambda p: inference.generate(module, p, prompts, lengths,
                                       max_decode_steps=12, method='greedy',
                                       eos_id=-1).tokens
    np.testing.assert_array_equal(run(q), run(quantize.dequantize(q)))

  def test_non_finite_weights_stay_visible_and_cast_params_raise(self):
    """A NaN weight gives its channel a NaN scale (check_finite names it;
    decoding gives NaN scores, as the float model does), and quantized
    parameters cast to float32 are refused, naming the scale."""
    module, params = random_model(2, 3, 'cycle', 2, 40)
    wo = params['decoder']['layers_1']['mlp']['wo']
    wo['kernel'] = wo['kernel'].at[3, 5].set(jnp.nan)
    q = quantize.quantize_int8(params)
    scale = q['decoder']['layers_1']['mlp']['wo']['kernel_scale']
    self.assertEqual(np.isnan(np.asarray(scale)).tolist(),
                     [i == 5 for i in range(scale.shape[0])])
    with self.assertRaisesRegex(ValueError, r"layers_1.*'wo'.*kernel_scale"):
      inference.check_finite(q)
    prompts = jnp.asarray(np.random.RandomState(5).randint(2, 40, (2, 5)))
    lengths = jnp.asarray([5, 3])
    run = lambda p, **kw: inference.generate(
        module, p, prompts, lengths, max_decode_steps=12, method='greedy',
        eos_id=-1, **kw)
    self.assertTrue(np.all(np.isnan(run(q).scores)))
    with self.assertRaisesRegex(ValueError, 'non-finite'):
      run(q, check_params=True)
    cast = jax.tree.map(lambda x: x.astype(jnp.float32),
                        quantize.quantize_int8(helpers.tiny_model(
                            vocab_size=40)[1]))
    with self.assertRaisesRegex(ValueError, "token_embedder: "
                                "'embedding_scale' stands beside a float32 "
                                'weight'):
      run(cast)


if __name__ == '__main__':
  absltest.main()
