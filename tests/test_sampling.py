"""Exact SPEED sampling: speed_sample_decode == sample_decode, sample by sample.

Float32, random models (some with exits that disagree on most tokens), and
per architecture one compile that serves every temperature, top-p, RNG and
per-row setting (they are traced arguments); top-k and num_decodes are
static, so they vary across architectures.
"""

import functools
import random

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import inference
from t5x_speed import sampling
from t5x_speed import steps
from helpers import random_model
from helpers import tiny_model

VOCAB = 23
LENGTH = 14


def _architectures(count, seed=0):
  rng = random.Random(seed)
  return [dict(g=rng.choice((1, 2, 3)), r=rng.choice((2, 3, 4, 6)),
               sharing=rng.choice(('cycle', 'cycle', 'sequence', 'cycle_rev')),
               batch=rng.randint(1, 5), num_decodes=rng.choice((1, 2, 3)),
               topk=rng.choice((0, 0, 5)), seed=2000 + i)
          for i in range(count)]


def _batch(batch, seed):
  """BOS-shifted prompts [batch, LENGTH] and their lengths (ragged, >= 0)."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(0, 6, size=batch)
  inputs = rng.randint(2, VOCAB, size=(batch, LENGTH))
  inputs[np.arange(LENGTH)[None] > lengths[:, None]] = 0
  inputs[:, 0] = 0
  return jnp.asarray(inputs, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _decoders(module, params, num_decodes, topk):
  """One jitted program over traced settings running both samplers,
  returning `decoding.DecodeResult`s (sequential, SPEED). SPEED runs its
  pipeline at every batch size (max_speculative_rows=None)."""
  bound = steps.BoundSteps(module, params)

  def run(fn, inputs, lengths, cache, rng, temperature, topp, eos, max_steps):
    options = ({'max_speculative_rows': None}
               if fn is sampling.speed_sample_decode else {})
    return decoding.decode(
        fn, **bound.decode_fn_kwargs(fn, inputs, cache, lengths), eos_id=eos,
        decode_rng=rng, temperature=temperature, topk=topk,
        topp=0.0 if topk else topp, num_decodes=num_decodes,
        max_decode_steps=max_steps, **options)

  @jax.jit
  def both(inputs, lengths, *settings):
    cache = bound.prefill(inputs, lengths)
    return tuple(run(fn, inputs, lengths, cache, *settings)
                 for fn in (sampling.sample_decode,
                            sampling.speed_sample_decode))

  return both


class SpeedSampleEqualsSampleTest(parameterized.TestCase):

  @parameterized.parameters(*_architectures(4))
  def test_random_models(self, g, r, sharing, batch, num_decodes, topk, seed):
    module, params = random_model(g, r, sharing, seed, VOCAB)
    decode = _decoders(module, params, num_decodes, topk)
    inputs, lengths = _batch(batch, seed)
    rng = np.random.RandomState(seed)
    settings = [(0.5, 0.0), (0.7, 0.0), (1.0, 0.0), (1.0, 0.9), (0.7, 0.9)]
    mixed = rng.choice([0.0, 0.5, 1.0, 2.0], size=batch).astype(np.float32)
    settings.append((mixed, 0.0))          # one temperature per example
    flushes = 0
    for i, (temperature, topp) in enumerate(settings):
      if topk and topp:
        continue                            # at most one of them (as T5X)
      args = (inputs, lengths, jax.random.PRNGKey(seed * 10 + i),
              jnp.broadcast_to(jnp.float32(temperature), (batch,)),
              jnp.float32(topp),
              jnp.asarray(rng.choice([1, -1], size=batch), jnp.int32),
              jnp.asarray(rng.randint(1, LENGTH + 1, size=batch), jnp.int32))
      want, got = decode(*args)
      np.testing.assert_array_equal(got.sequences, want.sequences,
                                    err_msg=f'setting {i}')
      np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4,
                                 atol=1e-4)
      self.assertEqual(want.sequences.shape, (batch, num_decodes, LENGTH))
      self.assertIsNone(want.stats)
      stats = got.stats
      self.assertTrue(np.all(np.asarray(stats.num_tokens) >= 1))
      self.assertTrue(np.all(np.asarray(stats.invalid) == 0))
      flushes += int(np.asarray(stats.flushes).sum())
    if r > 1 and seed % 2:
      self.assertGreater(flushes, 0)         # the property was exercised

  def test_temperature_zero_is_greedy(self):
    module, params = random_model(2, 3, 'cycle', 7, VOCAB)
    bound = steps.BoundSteps(module, params)
    inputs, lengths = _batch(3, 7)
    greedy_fns = (decoding.greedy_decode, decoding.speed_decode)

    @jax.jit
    def decode_all(inputs, lengths):
      cache = bound.prefill(inputs, lengths)
      out = {}
      for fn in greedy_fns + (sampling.sample_decode,
                              sampling.speed_sample_decode):
        extra = {} if fn in greedy_fns else dict(
            temperature=0.0, rescale_log_probs=False,
            decode_rng=jax.random.PRNGKey(3))
        if steps.uses_pipeline(fn):  # the pipeline, even at 3 x R rows
          extra['max_speculative_rows'] = None
        out[fn.__name__] = decoding.decode(
            fn, **bound.decode_fn_kwargs(fn, inputs, cache, lengths),
            eos_id=1, **extra)
      # T5X's convention: rescaled log-probabilities of greedy rows are 0.
      out['rescaled'] = decoding.decode(
          sampling.sample_decode, **bound.decode_fn_kwargs(
              sampling.sample_decode, inputs, cache, lengths),
          eos_id=1, temperature=0.0)
      return out

    out = decode_all(inputs, lengths)
    greedy = out['greedy_decode']
    for name in ('speed_decode', 'sample_decode', 'speed_sample_decode'):
      np.testing.assert_array_equal(out[name].sequences, greedy.sequences)
      np.testing.assert_allclose(out[name].scores, greedy.scores, rtol=1e-5)
    np.testing.assert_array_equal(out['rescaled'].sequences, greedy.sequences)
    np.testing.assert_array_equal(out['rescaled'].scores, np.zeros((3, 1)))

  def test_rng_decides_the_samples(self):
    module, params = random_model(2, 3, 'cycle', 8, VOCAB)
    both = _decoders(module, params, 4, 0)
    inputs, lengths = _batch(2, 8)
    decode = lambda seed: [np.asarray(result.sequences) for result in both(
        inputs, lengths, jax.random.PRNGKey(seed), jnp.ones((2,)),
        jnp.float32(0), jnp.full((2,), -1, jnp.int32),
        jnp.full((2,), LENGTH, jnp.int32))]
    first, speed = decode(1)
    np.testing.assert_array_equal(decode(1)[0], first)
    np.testing.assert_array_equal(speed, first)
    self.assertFalse(np.array_equal(decode(2)[0], first))
    # The 4 samples of an example differ from each other (decode index).
    self.assertGreater(len({tuple(s) for s in first[0]}), 1)


def _chi2_pvalue(counts, expected):
  """P-value of Pearson's chi-square goodness-of-fit (cells with expected
  count < 5 pooled)."""
  counts, expected = np.asarray(counts, float), np.asarray(expected, float)
  small = expected < 5
  if small.any():
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  keep = expected > 0
  stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
  dof = int(keep.sum()) - 1
  return float(jax.scipy.special.gammaincc(dof / 2, stat / 2))


# (setting, a different setting) pairs of `DistributionTest`.
DISTRIBUTION_SETTINGS = (
    dict(temperature=0.7, topk=0, topp=0.0, other=dict(temperature=1.0)),
    dict(temperature=1.0, topk=4, topp=0.0, other=dict(topk=6)),
    dict(temperature=1.0, topk=0, topp=0.8, other=dict(topp=0.95)))
SAMPLES = 8000


def _filtered_probs(logits, temperature, topk, topp):
  rule = sampling.PositionKeyedSampler(
      row_keys=jax.random.PRNGKey(0)[None],
      temperature=jnp.array([temperature], jnp.float32),
      topp=jnp.float32(topp), topk=topk, use_topp=topp > 0)
  return jax.nn.softmax(rule.filtered(logits))[0]


@functools.lru_cache(maxsize=None)
def _first_tokens():
  """Per setting of `DISTRIBUTION_SETTINGS`: the first tokens of `SAMPLES`
  SPEED samples of one prompt, and softmax(filtered logits / T) of its
  setting and of its other setting; one compiled program for all."""
  module, params = tiny_model(vocab_size=VOCAB)
  bound = steps.BoundSteps(module, params)

  @jax.jit
  def run(inputs, lengths, rng):
    cache = bound.prefill(inputs, lengths)
    logits = bound.decode_step(jnp.array([9]), jnp.array([2]), cache)[0]
    out = []
    for entry in DISTRIBUTION_SETTINGS:
      setting = {k: entry[k] for k in ('temperature', 'topk', 'topp')}
      decodes, _ = sampling.speed_sample_decode(
          **bound.decode_fn_kwargs(sampling.speed_sample_decode, inputs,
                                   cache, lengths), eos_id=1,
          decode_rng=rng, num_decodes=SAMPLES, max_decode_steps=1,
          max_speculative_rows=None, **setting)  # the pipeline's samples
      out.append((decodes[0, :, 2], _filtered_probs(logits, **setting),
                  _filtered_probs(logits, **{**setting, **entry['other']})))
    return out

  return jax.device_get(run(jnp.array([[0, 5, 9, 0, 0]]), jnp.array([2]),
                            jax.random.PRNGKey(11)))


class DistributionTest(parameterized.TestCase):
  """The first sampled token follows softmax(filtered logits / T).

  8,000 samples of one prompt; Pearson's chi-square test at the 99.9%
  confidence level (p > 0.001), with fixed seeds. The same samples must be
  rejected against the distribution of a different setting (power).
  """

  @parameterized.parameters(*range(len(DISTRIBUTION_SETTINGS)))
  def test_first_token(self, index):
    first, probs, other = _first_tokens()[index]
    counts = np.bincount(first, minlength=VOCAB)
    setting = DISTRIBUTION_SETTINGS[index]
    self.assertGreater(_chi2_pvalue(counts, SAMPLES * probs), 1e-3, setting)
    self.assertLess(_chi2_pvalue(counts, SAMPLES * other), 1e-3, setting)


class FilterTest(absltest.TestCase):

  def test_topp_keeps_the_smallest_set_reaching_the_mass(self):
    probs = jnp.array([0.05, 0.4, 0.25, 0.2, 0.1])
    logits = jnp.log(probs)
    kept = lambda p: np.isfinite(np.asarray(
        sampling.topp_filter(logits, jnp.float32(p)))).nonzero()[0].tolist()
    self.assertEqual(kept(0.3), [1])              # 0.4 >= 0.3
    self.assertEqual(kept(0.6), [1, 2])           # 0.65
    self.assertEqual(kept(0.66), [1, 2, 3])       # 0.85
    self.assertEqual(kept(1.0), [0, 1, 2, 3, 4])
    self.assertEqual(kept(0.0), [0, 1, 2, 3, 4])  # off

  def test_topk_keeps_ties(self):
    rule = sampling.PositionKeyedSampler(
        row_keys=jax.random.PRNGKey(0)[None], temperature=jnp.ones((1,)),
        topp=jnp.float32(0), topk=2)
    out = rule.filtered(jnp.array([[1.0, 3.0, 2.0, 3.0, 0.0]]))
    self.assertEqual(np.isfinite(np.asarray(out))[0].tolist(),
                     [False, True, False, True, False])


class GenerateTest(absltest.TestCase):

  def test_generate_samples_exactly(self):
    module, params = random_model(2, 3, 'cycle', 9, VOCAB)
    prompts, lengths = jnp.array([[3, 4, 5], [6, 7, 0]]), jnp.array([3, 2])
    kwargs = dict(max_decode_steps=8, eos_id=-1, temperature=0.8, topp=0.9,
                  rng=jax.random.PRNGKey(5), bidirectional=True)
    speed = inference.generate(module, params, prompts, lengths,
                               method='speed_sample', record_schedule=True,
                               **kwargs)
    sequential = inference.generate(module, params, prompts, lengths,
                                    method='sample', **kwargs)
    np.testing.assert_array_equal(speed.tokens, sequential.tokens)
    np.testing.assert_allclose(speed.scores, sequential.scores, rtol=1e-4)
    # A typed key (jax.random.key) draws what its raw key draws.
    typed = inference.generate(module, params, prompts, lengths,
                               method='sample',
                               **{**kwargs, 'rng': jax.random.key(5)})
    np.testing.assert_array_equal(typed.tokens, sequential.tokens)
    # No rng draws what PRNGKey(0) draws.
    default, zero = (inference.generate(module, params, prompts, lengths,
                                        method='sample',
                                        **{**kwargs, 'rng': rng})
                     for rng in (None, jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(default.tokens, zero.tokens)
    np.testing.assert_array_equal(default.scores, zero.scores)
    self.assertFalse(np.array_equal(default.tokens, sequential.tokens))
    self.assertEqual(np.asarray(speed.stats.num_tokens).tolist(), [8, 8])
    self.assertGreater(int(speed.schedule.num_steps), 8)
    self.assertIsNone(sequential.stats)
    self.assertEqual(np.asarray(speed.stats.pipelined).tolist(), [1, 1])
    # Beyond max_speculative_rows, the same samples from the sequential loop.
    for rows, pipelined in ((5, 0), (6, 1)):    # 2 examples x R = 3
      out = inference.generate(module, params, prompts, lengths,
                               method='speed_sample', max_speculative_rows=rows,
                               **kwargs)
      np.testing.assert_array_equal(out.tokens, sequential.tokens)
      self.assertEqual(np.asarray(out.stats.pipelined).tolist(),
                       [pipelined] * 2)
      self.assertEqual(np.asarray(out.stats.num_tokens).tolist(), [8, 8])
    # The rows count every decode: 2 examples x 2 decodes x R = 3.
    fn = sampling.speed_sample_decode

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def decode(params, rows, branches):  # one program per setting
      bound = steps.BoundSteps(module, params)
      inputs, cache = inference.prepare(bound, prompts, lengths, 8, True)
      return decoding.decode(
          fn, **bound.decode_fn_kwargs(fn, inputs, cache, lengths), eos_id=-1,
          decode_rng=jax.random.PRNGKey(5), num_decodes=2,
          max_speculative_rows=rows, speed_branches=branches)
    outs = [decode(params, rows, branches)
            for rows, branches in ((11, 0), (12, 0), (12, 2))]
    for out in outs[1:]:   # candidate branches draw the same samples
      np.testing.assert_array_equal(outs[0].sequences, out.sequences)
    self.assertEqual([np.asarray(o.stats.pipelined).tolist() for o in outs],
                     [[0, 0], [1, 1], [1, 1]])
    # Per example: the decodes' counters summed, their K kept.
    self.assertEqual(np.asarray(outs[2].stats.branches).tolist(), [2, 2])
    self.assertLessEqual(int(np.asarray(outs[2].stats.num_steps).sum()),
                         int(np.asarray(outs[1].stats.num_steps).sum()))
    with self.assertRaisesRegex(ValueError, 'topp'):
      inference.generate(module, params, prompts, lengths, method='sample',
                         max_decode_steps=8, topp=2.0)
    with self.assertRaisesRegex(ValueError, 'record_schedule'):
      inference.generate(module, params, prompts, lengths, method='sample',
                         max_decode_steps=8, record_schedule=True)


class ArgumentTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    module, params = tiny_model(vocab_size=VOCAB)
    cls.bound = steps.BoundSteps(module, params)
    cls.inputs, cls.lengths = _batch(2, 0)
    cls.cache = jax.jit(cls.bound.prefill)(cls.inputs, cls.lengths)

  @parameterized.named_parameters(
      ('negative_temperature', dict(temperature=-0.5), 'temperature'),
      ('temperature_shape', dict(temperature=jnp.ones((3,))), 'temperature'),
      ('negative_topk', dict(topk=-1), 'topk'),
      ('float_topk', dict(topk=2.0), 'topk'),
      ('topp_range', dict(topp=1.5), 'topp'),
      ('both', dict(topk=3, topp=0.9), 'at most one'),
      ('num_decodes', dict(num_decodes=0), 'num_decodes'),
      ('int_rng', dict(decode_rng=3), 'decode_rng must be one PRNG key'),
      ('rng_batch', dict(decode_rng=np.zeros((2, 2), np.uint32)),
       r'decode_rng must be one PRNG key.*shape \(2, 2\)'),
      ('rescale', dict(rescale_log_probs=1), 'rescale_log_probs'))
  def test_bad_arguments_raise(self, kwargs, message):
    for fn in (sampling.sample_decode, sampling.speed_sample_decode):
      with self.assertRaisesRegex(ValueError, message):
        fn(**self.bound.decode_fn_kwargs(fn, self.inputs, self.cache,
                                         self.lengths), eos_id=1, **kwargs)

  def test_greedy_fns_point_to_the_samplers(self):
    with self.assertRaisesRegex(ValueError, 'speed_sample_decode'):
      decoding.speed_decode(jnp.zeros((1, 4), jnp.int32), None,
                            temperature=1.0, topk=0)


if __name__ == '__main__':
  absltest.main()
