"""The sampling kernel (t5x_speed.cpu.sample) against XLA's sampler.

Both draw jax.random's bits; only their logarithms and exponentials differ
(in the last ulps), so their tokens must agree wherever XLA's two largest
perturbed logits are not within a hair of each other and no probability
lies within rounding of the top-p cut (none does in these fixed cases), and
their log-probabilities to float precision. Each case is one compiled
program over many rows.
"""

import contextlib
import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed.cpu import build
from t5x_speed.cpu import dispatch
from t5x_speed.cpu import sample
from t5x_speed import sampling
import helpers

ROWS, SLOTS = 48, 3


@contextlib.contextmanager
def _config(name, value):
  old = getattr(jax.config, name)
  jax.config.update(name, value)
  try:
    yield
  finally:
    jax.config.update(name, old)
# XLA's top-two perturbed logits closer than this may order either way.
NEAR_TIE = 1e-4


def _case(vocab, seed, dtype):
  rng = np.random.RandomState(seed)
  scale = rng.choice([0.1, 1.0, 4.0, 30.0], size=(ROWS, 1, 1))
  logits = rng.randn(ROWS, SLOTS, vocab) * scale
  logits[:4, :, :vocab // 2] = logits[:4, :, :1]    # rows with many ties
  temperature = rng.choice([0.0, 5e-5, 0.3, 0.7, 1.0, 1.5], size=ROWS)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(
      jnp.arange(ROWS))
  positions = rng.randint(0, 1000, size=(ROWS, SLOTS))
  return (jnp.asarray(logits, dtype), keys, jnp.asarray(positions, jnp.int32),
          jnp.asarray(temperature, jnp.float32))


@functools.partial(jax.jit, static_argnames='topk')
def _margins(logits, keys, positions, temperature, topp, topk):
  """XLA's gap between its two largest perturbed logits, per (row, slot)."""
  rule = sampling.PositionKeyedSampler(
      row_keys=keys, temperature=temperature, topp=topp, topk=topk,
      use_topp=True)
  perturbed = rule.filtered(logits) + rule.noise(positions, logits.shape[-1])
  if logits.shape[-1] < 2:
    return jnp.full(logits.shape[:-1], jnp.inf)
  top2 = jax.lax.top_k(perturbed, 2)[0]
  return top2[..., 0] - top2[..., 1]


class RowSampleTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if not build.available():
      self.fail('the kernel must build on the test machine')

  @parameterized.parameters(
      (1000, 0, jnp.float32, True), (1000, 5, jnp.float32, False),
      (37, 0, jnp.bfloat16, True), (1, 0, jnp.float32, True))
  def test_kernel_samples_as_xla(self, vocab, topk, dtype, rescale):
    logits, keys, positions, temperature = _case(vocab, topk + vocab, dtype)

    @jax.jit
    def both(logits, keys, positions, temperature, topp):
      rules = [sampling.PositionKeyedSampler(
          row_keys=keys, temperature=temperature, topp=topp, topk=topk,
          use_topp=True, rescale_log_probs=rescale, token_choice=choice)
               for choice in ('kernel', 'xla')]
      return [rule.pick(logits, positions)[0] for rule in rules], [
          rule.pick(logits, positions)[1] for rule in rules]

    near = 0
    for topp in (0.0, 0.5, 0.9, 1.0):
      (kernel, xla), (kernel_lp, xla_lp) = both(
          logits, keys, positions, temperature, jnp.float32(topp))
      close = np.asarray(_margins(logits, keys, positions, temperature,
                                  jnp.float32(topp), topk) < NEAR_TIE)
      differ = np.asarray(kernel) != np.asarray(xla)
      self.assertFalse((differ & ~close).any(), (topp, np.argwhere(differ)))
      near += int(close.sum())
      same_last = ~differ[:, -1]
      np.testing.assert_allclose(np.asarray(kernel_lp)[same_last],
                                 np.asarray(xla_lp)[same_last],
                                 rtol=2e-5, atol=2e-5)
    self.assertLess(near, ROWS * SLOTS)  # the margins are not all ties

  def test_noise_is_jax_random_gumbel(self):
    vocab, rows = 4099, 64
    keys = jax.random.split(jax.random.PRNGKey(3), rows)
    positions = jnp.arange(rows, dtype=jnp.int32) * 7
    tokens, _ = sample.sample(
        jnp.zeros((rows, vocab)), keys, positions, jnp.ones(rows),
        jnp.zeros(rows), topk=0, rescale=True)
    noise = jax.vmap(lambda k, p: jax.random.gumbel(
        jax.random.fold_in(k, p), (vocab,)))(keys, positions)
    np.testing.assert_array_equal(tokens, jnp.argmax(noise, -1))

  def test_rows_are_independent_of_the_call(self):
    logits, keys, positions, temperature = _case(300, 1, jnp.float32)
    logits, positions = logits[:, 0], positions[:, 0]
    topp = jnp.linspace(0.0, 1.0, ROWS)
    run = jax.jit(lambda *a, threads: sample.sample(
        *a, topk=0, rescale=True, threads=threads),
                  static_argnames='threads')
    together = run(logits, keys, positions, temperature, topp, threads=0)
    one_thread = run(logits, keys, positions, temperature, topp, threads=1)
    alone = [run(logits[i:i + 1], keys[i:i + 1], positions[i:i + 1],
                 temperature[i:i + 1], topp[i:i + 1], threads=0)
             for i in range(0, ROWS, 7)]
    for a, b in zip(together, one_thread):
      np.testing.assert_array_equal(a, b)
    for j, i in enumerate(range(0, ROWS, 7)):
      np.testing.assert_array_equal(together[0][i], alone[j][0][0])
      np.testing.assert_array_equal(together[1][i], alone[j][1][0])

  def test_hand_computed(self):
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.7, 1e-9]] * 4))
    logits = logits.at[2:, 1].set(jnp.nan)
    tokens, log_probs = sample.sample(
        logits, jnp.zeros((4, 2), jnp.uint32), jnp.zeros(4, jnp.int32),
        jnp.array([0.0, 1.0, 1.0, 0.0]), jnp.array([0.0, 0.6, 0.0, 0.0]),
        topk=0, rescale=True)
    # Argmax row: id 2, scored 0 (T5X); top-p 0.6 keeps only id 2 (0.7 >=
    # 0.6): log-probability 0 under the filtered distribution; NaN rows take
    # the first NaN, scored NaN (0 for the greedy row, as XLA's sampler).
    self.assertEqual(tokens.tolist(), [2, 2, 1, 1])
    np.testing.assert_allclose(np.asarray(log_probs)[[0, 1, 3]], [0.0] * 3,
                               atol=1e-6)
    self.assertTrue(np.isnan(log_probs[2]))
    _, unscaled = sample.sample(
        logits[:1], jnp.zeros((1, 2), jnp.uint32), jnp.zeros(1, jnp.int32),
        jnp.zeros(1), jnp.zeros(1), topk=0, rescale=False)
    np.testing.assert_allclose(unscaled, [np.log(0.7)], rtol=1e-5)

  def test_typed_keys_sample_as_raw_keys(self):
    logits, keys, positions, temperature = _case(50, 2, jnp.float32)
    logits, positions = logits[:, 0], positions[:, 0]
    typed = jax.random.wrap_key_data(keys, impl='threefry2x32')
    args = (positions, temperature, jnp.full(ROWS, 0.9))
    for a, b in zip(sample.sample(logits, typed, *args, topk=0,
                                     rescale=True),
                    sample.sample(logits, keys, *args, topk=0,
                                     rescale=True)):
      np.testing.assert_array_equal(a, b)

  def test_kernel_only_where_its_noise_is_jax_randoms(self):
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    runs = lambda *a: dispatch.token_kernel('auto', *a)
    self.assertTrue(runs(jnp.float32, keys))
    self.assertTrue(runs(jnp.bfloat16))  # greedy
    self.assertFalse(runs(jnp.float16))
    self.assertFalse(runs(
        jnp.float32, jax.random.split(jax.random.key(0, impl='rbg'), 2)))
    with _config('jax_high_dynamic_range_gumbel', True):
      self.assertFalse(runs(jnp.float32, keys))
      self.assertTrue(runs(jnp.float32))
    with _config('jax_threefry_partitionable', False):
      self.assertFalse(runs(jnp.float32, keys))
    # 'xla' never runs it; 'kernel' is 'auto' with a message where it
    # cannot run.
    self.assertFalse(dispatch.token_kernel('xla', jnp.float32, keys))
    self.assertTrue(dispatch.token_kernel('kernel', jnp.float32, keys))
    self.assertFalse(dispatch.token_kernel('kernel', jnp.float16))
    with self.assertRaisesRegex(ValueError, 'token_choice'):
      dispatch.token_kernel('fast', jnp.float32)

  def test_bad_arguments_raise(self):
    logits = jnp.zeros((2, 5))
    args = (jnp.zeros((2, 2), jnp.uint32), jnp.zeros(2, jnp.int32),
            jnp.ones(2), jnp.zeros(2))
    with self.assertRaisesRegex(ValueError, 'keys'):
      sample.sample(logits, args[0][:1], *args[1:], topk=0, rescale=True)
    with self.assertRaisesRegex(ValueError, 'topk'):
      sample.sample(logits, *args, topk=-1, rescale=True)
    with self.assertRaisesRegex(ValueError, 'threads'):
      sample.sample(logits, *args, topk=0, rescale=True, threads=-1)
    with self.assertRaisesRegex(ValueError, 'rescale'):
      sample.sample(logits, *args, topk=0, rescale=1)
    with self.assertRaisesRegex(ValueError, 'vocabulary'):
      sample.sample(jnp.zeros((2, 0)), *args, topk=0, rescale=True)

  def test_docstring_example(self):
    helpers.assert_doctests(sample)


if __name__ == '__main__':
  absltest.main()
