"""The kernel's attention over the caches: values, row independence, masks,
threads, vmap, gradient, fallback; and, with it, SPEED's scores bit-identical
to greedy's.

Tolerances against XLA's float32 attention (`attention.reference`):
|kernel - ref| <= 1e-5 * max |v| (sums in another order over softmax
weights that add up to 1). bfloat16 operands are compared with the float32
attention of the same bfloat16 values: the kernel rounds its float32 result
once, so |kernel - ref| <= 2**-8 * |ref| + 1e-5 * max |v|.
"""

import dataclasses
import itertools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import inference
from t5x_speed import network
from t5x_speed.cpu import attention
from t5x_speed.cpu import build
import helpers

F32, BF16 = jnp.float32, jnp.bfloat16
needs_kernel = absltest.skipUnless(build.available(),
                                   'kernel not built (no C++ compiler)')


def _case(batch, slots, stages, length, dtype, seed, heads=3, dim=20,
          positions=None, gaps=False):
  """(query, keys, values, bias, new_keys, new_values, positions) with
  T5X's -1e10 mask after each slot's position (-1: an empty slot, every key
  masked and nothing written; >= length: nothing written); with `gaps`, a
  third of the keys before it masked too (not the slot's own key)."""
  rng = np.random.RandomState(seed)
  draw = lambda *s: rng.standard_normal(s).astype(np.float32)
  if positions is None:
    positions = rng.randint(-1, length + 2, size=(batch, slots))
  positions = np.asarray(positions, np.int32)
  keys = np.arange(length)
  visible = keys <= positions[..., None, None]
  if gaps:
    visible = visible & (
        (rng.uniform(size=(batch, slots, heads, length)) < 2 / 3) |
        (keys == positions[..., None, None]))
  bias = np.where(visible, draw(batch, slots, heads, length), -1e10)
  arrays = [draw(batch, slots, heads, dim),
            draw(stages, batch, heads, length, dim),
            draw(stages, batch, heads, length, dim), bias.astype(np.float32),
            draw(batch, slots, heads, dim), draw(batch, slots, heads, dim)]
  return (*(jnp.asarray(a.astype(dtype)) for a in arrays),
          jnp.asarray(positions))


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


def _attend(arrays, stages, **kwargs):
  return attention.cached_attention(*arrays, stages=stages, **kwargs)


@needs_kernel
class ValuesTest(parameterized.TestCase):

  @parameterized.parameters(F32, BF16)
  def test_equals_xla_and_each_row_alone(self, dtype):
    """Every case in one compiled program: the caches written exactly as
    XLA's scatter writes them, the context against XLA's attention, and
    each slot bit-identical to the same slot attended alone."""
    cases = []
    # Lengths below, at and past whole vectors of keys; head widths of a
    # partial vector (20), of whole ones (64) and wider than the kernel
    # keeps in registers (144); masks with gaps.
    for (batch, slots, stages, length, dim, gaps), order in itertools.product(
        ((1, 1, 1, 9, 20, False), (2, 3, 3, 17, 20, False),
         (3, 2, 4, 40, 20, False), (2, 2, 2, 33, 64, True),
         (1, 2, 3, 21, 144, True)), ('same', 'mixed')):
      chosen = (tuple(range(slots)) if order == 'same' else
                tuple((3 * s + 1) % stages for s in range(slots)))
      cases.append((chosen, _case(batch, slots, stages, length, dtype,
                                  seed=len(cases), dim=dim, gaps=gaps)))
    run = jax.jit(lambda arrays: [_attend(a, st)
                                  for (st, _), a in zip(cases, arrays)])
    outs = run([a for _, a in cases])
    alone = jax.jit(_attend, static_argnums=1)
    for (stages, arrays), (context, keys, values) in zip(cases, outs):
      query, _, _, bias, new_keys, new_values, positions = arrays
      case = f'{query.shape} stages {stages} {jnp.dtype(dtype).name}'
      self.assertEqual(context.dtype, query.dtype, case)
      _, want_keys, want_values = _attend(arrays, stages, force_xla=True)
      np.testing.assert_array_equal(_bits(keys), _bits(want_keys), case)
      np.testing.assert_array_equal(_bits(values), _bits(want_values), case)
      f32 = [jnp.asarray(a, F32) for a in (query, keys, values, bias)]
      ref = np.asarray(attention.reference(*f32, stages), np.float64)
      err = np.abs(np.asarray(context, np.float64) - ref)
      tol = 1e-5 * float(np.abs(np.asarray(values, np.float32)).max())
      if dtype == BF16:
        tol = tol + 2.0**-8 * np.abs(ref)
      self.assertTrue(np.all(err <= tol), f'{case}: {np.max(err - tol):.3g}')
      for s in range(query.shape[1]):
        # On the written caches, writing the slot's row again changes
        # nothing.
        one = alone((query[:, s:s + 1], keys, values, bias[:, s:s + 1],
                     new_keys[:, s:s + 1], new_values[:, s:s + 1],
                     positions[:, s:s + 1]), (stages[s],))[0]
        np.testing.assert_array_equal(_bits(context)[:, s], _bits(one)[:, 0],
                                      f'{case}: slot {s}')

  def test_masked_keys_are_not_read(self):
    """Masked keys have weight 0 whatever their keys and values hold, after
    a row's position and between visible keys; a row with every key masked
    attends to all of them, as XLA's softmax does."""
    arrays = _case(1, 3, 3, 40, F32, seed=5, positions=[[30, -1, 35]],
                   gaps=True)
    masked = np.asarray(arrays[3] < -1e9)[0]  # [slots, heads, length]
    poisoned = list(arrays)
    for s, stage in ((0, 0), (2, 2)):  # slot 1 attends to every key
      for i in (1, 2):
        poisoned[i] = poisoned[i].at[stage, 0].set(
            jnp.where(masked[s][..., None], jnp.nan, arrays[i][stage, 0]))
    self.assertTrue(masked[0, :, :30].any())  # gaps before the position
    got = _attend(poisoned, (0, 1, 2))[0]
    want = _attend(arrays, (0, 1, 2), force_xla=True)[0]
    self.assertTrue(np.isfinite(np.asarray(got)).all())
    np.testing.assert_allclose(got, want, atol=1e-5)

  def test_threads_vmap_and_gradient(self):
    arrays = _case(2, 3, 3, 30, F32, seed=7, heads=4, dim=32)
    stages = (2, 0, 1)
    f = jax.jit(lambda a: [_attend(a, stages, threads=t)[0]
                           for t in (0, 1, 3)])
    every_core, one, three = (_bits(y) for y in f(arrays))
    np.testing.assert_array_equal(one, every_core)
    np.testing.assert_array_equal(three, every_core)
    # vmap over the query only: one call, each element its own attention.
    queries = jnp.stack([arrays[0], 2 * arrays[0]])
    mapped = jax.jit(jax.vmap(lambda q: _attend((q, *arrays[1:]), stages)))
    self.assertEqual(mapped.lower(queries).as_text().count(
        '@t5x_speed_cached_attention('), 1)
    got = mapped(queries)
    for i in range(2):
      for g, w in zip(got, _attend((queries[i], *arrays[1:]), stages)):
        np.testing.assert_array_equal(_bits(g[i]), _bits(w))
    loss = lambda force: lambda *a: sum(
        jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(_attend(
            (*a, arrays[6]), stages, force_xla=force)))
    for g, r in zip(jax.grad(loss(False), tuple(range(6)))(*arrays[:6]),
                    jax.grad(loss(True), tuple(range(6)))(*arrays[:6])):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@needs_kernel
class AttentionWithoutWritesTest(parameterized.TestCase):
  """`attention.attention`: the same attention over caches it does not
  write (an encoder-decoder's cross-attention)."""

  @parameterized.parameters(F32, BF16)
  def test_is_cached_attentions_without_the_writes(self, dtype):
    # Positions -1 make cached_attention write nothing: both calls attend
    # bit for bit alike, and each slot alone gives its row.
    query, keys, values, bias, *_ = _case(3, 4, 2, 23, dtype, seed=9,
                                          positions=np.full((3, 4), 20))
    stages = (1, 0, 1, 1)
    got = jax.jit(lambda *a: attention.attention(*a, stages=stages))(
        query, keys, values, bias)
    want = attention.cached_attention(
        query, keys, values, bias, query, query, jnp.full((3, 4), -1),
        stages=stages)[0]
    np.testing.assert_array_equal(_bits(got), _bits(want))
    for s in range(4):
      one = attention.attention(query[:, s:s + 1], keys, values,
                                   bias[:, s:s + 1], stages=(stages[s],))
      np.testing.assert_array_equal(_bits(one)[:, 0], _bits(got)[:, s])
    xla = attention.attention(query, keys, values, bias, stages=stages,
                                 force_xla=True)
    # XLA's ops over one cache for every slot (no per-slot copy) give each
    # slot's own attention.
    one_cache = attention.reference(query, keys, values, bias, (1,) * 4)
    for s in range(4):
      np.testing.assert_allclose(
          np.asarray(one_cache[:, s], np.float32),
          np.asarray(attention.reference(
              query[:, s:s + 1], keys, values, bias[:, s:s + 1], (1,))[:, 0],
                     np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(xla, np.float32),
                               rtol=2e-2 if dtype == BF16 else 1e-5,
                               atol=2e-2 if dtype == BF16 else 1e-5)
    self.assertIn('@t5x_speed_attention(', jax.jit(
        lambda *a: attention.attention(*a, stages=stages)).lower(
            query, keys, values, bias).as_text())

  def test_gradient_and_bad_arguments(self):
    query, keys, values, bias, *_ = _case(2, 2, 1, 8, F32, seed=3,
                                          positions=np.full((2, 2), 7))
    loss = lambda force: lambda *a: jnp.sum(jnp.sin(attention.attention(
        *a, bias, stages=(0, 0), force_xla=force)))
    for g, r in zip(jax.grad(loss(False), (0, 1, 2))(query, keys, values),
                    jax.grad(loss(True), (0, 1, 2))(query, keys, values)):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    with self.assertRaisesRegex(ValueError, 'do not match'):
      attention.attention(query, keys, values, bias, stages=(0, 1))
    with self.assertRaisesRegex(ValueError, 'needs query'):
      attention.attention(query[0], keys, values, bias, stages=(0,))


class ArgumentsTest(absltest.TestCase):

  def test_bad_arguments_raise(self):
    arrays = _case(1, 2, 2, 6, F32, seed=0)
    with self.assertRaisesRegex(ValueError, 'needs query'):
      _attend((arrays[0][0], *arrays[1:]), (0, 1))
    with self.assertRaisesRegex(ValueError, 'do not match'):
      _attend(arrays, (0,))
    with self.assertRaisesRegex(ValueError, 'do not match'):
      _attend(arrays, (0, 2))
    with self.assertRaisesRegex(ValueError, 'do not match'):
      _attend((*arrays[:6], arrays[6][:, :1]), (0, 1))
    with self.assertRaisesRegex(ValueError, 'threads must be'):
      _attend(arrays, (0, 1), threads=-1)

  def test_without_the_kernel_it_is_xla(self):
    arrays = _case(1, 2, 2, 6, F32, seed=0, positions=[[3, 1]])
    with mock.patch.object(build, 'available', return_value=False):
      jaxpr = str(jax.make_jaxpr(lambda *a: _attend(a, (1, 0)))(*arrays))
      got = _attend(arrays, (1, 0))
    self.assertNotIn('ffi_call', jaxpr)
    for g, w in zip(got, _attend(arrays, (1, 0), force_xla=True)):
      np.testing.assert_array_equal(g, w)
    # Slot 0 wrote its key at position 3 of stage 1.
    np.testing.assert_array_equal(got[1][1, 0, :, 3], arrays[4][0, 0])

  def test_module_example(self):
    helpers.assert_doctests(attention)


@needs_kernel
class SpeedScoresTest(parameterized.TestCase):
  """With every decode-step matmul and the attention row-independent,
  SPEED's final-exit logits are greedy's bit for bit: so are the scores
  (sums of the chosen tokens' log-probabilities)."""

  @parameterized.parameters(('float32', 'cycle', 0), ('float32', 'sequence', 1),
                            ('bfloat16', 'cycle', 2))
  def test_scores_are_greedys(self, dtype, sharing, seed):
    module, params = helpers.random_model(2, 3, sharing, seed, 97)
    module = network.SpeedTransformer(
        dataclasses.replace(module.config, dtype=dtype))
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, 6, size=3)
    prompts = rng.randint(2, 97, size=(3, 6))
    run = lambda method, **kw: inference.generate(
        module, params, jnp.asarray(prompts), jnp.asarray(lengths),
        max_decode_steps=16, method=method, eos_id=1, **kw)
    # The pipeline is the subject, at any batch size.
    speed, greedy = run('speed', max_speculative_rows=None), run('greedy')
    np.testing.assert_array_equal(speed.tokens, greedy.tokens)
    np.testing.assert_array_equal(_bits(speed.scores), _bits(greedy.scores))


if __name__ == '__main__':
  absltest.main()
