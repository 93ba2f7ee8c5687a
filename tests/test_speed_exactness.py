"""SPEED == greedy, token for token, over many random models and batches."""

import functools
import random

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import inference
from t5x_speed import steps
from helpers import random_model

VOCAB = 13     # small, so random models often produce EOS mid-batch
NEAR_TIE = 1e-4


def _configs(count, seed=0):
  """A fixed random sample of (G, R, sharing, batch, seed) configurations."""
  rng = random.Random(seed)
  out = []
  for i in range(count):
    out.append(dict(
        g=rng.choice((1, 2, 4)), r=rng.choice((1, 2, 3, 4, 6)),
        sharing=rng.choice(('cycle', 'cycle', 'cycle', 'sequence',
                            'cycle_rev')),
        batch=rng.randint(1, 8), seed=1000 + i))
  return out


def _model(g, r, sharing, seed):
  return random_model(g, r, sharing, seed, VOCAB)


def _prompts(batch, seed, max_len=6):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(1, max_len + 1, size=batch)
  prompts = rng.randint(2, VOCAB, size=(batch, max_len))
  prompts[np.arange(max_len)[None] >= lengths[:, None]] = 0
  return jnp.asarray(prompts), jnp.asarray(lengths)


def _final_margins(module, params, prompts, lengths, produced):
  """Greedy's top-2 final-exit margin at each produced position."""
  steps = produced.shape[1]
  seq = inference.build_inputs(prompts, lengths, steps)
  rows = jnp.arange(seq.shape[0])[:, None]
  at = lengths[:, None] + 1 + jnp.arange(steps)
  seq = seq.at[rows, at].set(produced)
  logits = module.apply({'params': params}, seq, jnp.ones_like(seq),
                        enable_dropout=False, all_exits=False)
  top2 = jax.lax.top_k(logits, 2)[0]
  margins = top2[..., 0] - top2[..., 1]                     # [batch, length]
  return np.asarray(margins[rows, at - 1])


def assert_speed_equals_greedy(test, module, params, prompts, lengths, steps,
                               speed, greedy):
  """Strict equality, except after a near-tie of greedy's top-2 logits."""
  ours, ref = np.asarray(speed.tokens), np.asarray(greedy.tokens)
  if (ours == ref).all():
    np.testing.assert_allclose(speed.scores, greedy.scores, rtol=1e-4,
                               atol=1e-4)
    return
  margins = _final_margins(module, params, prompts, lengths,
                           jnp.asarray(ref))
  for b in np.flatnonzero((ours != ref).any(-1)):
    k = int(np.flatnonzero(ours[b] != ref[b])[0])
    test.assertLess(margins[b, k], NEAR_TIE,
                    f'row {b} diverges at token {k} with top-2 margin '
                    f'{margins[b, k]:.3g}: not a rounding near-tie')
    print(f'near-tie divergence: row {b} token {k} margin {margins[b, k]:.3g}')


def _produced_count(tokens, eos_id):
  tokens = np.asarray(tokens)
  out = []
  for row in tokens:
    hits = np.flatnonzero(row == eos_id)
    out.append(hits[0] + 1 if hits.size else len(row))
  return np.array(out)


class SpeedEqualsGreedyTest(parameterized.TestCase):

  # Four configurations here; the CI fuzz slice (test_fuzz.py) adds 200
  # random cases over more prompts and EOS settings, test_sampling.py and
  # test_rowmatmul.py (bf16) eight more random architectures.
  @parameterized.parameters(*_configs(4))
  def test_random_models(self, g, r, sharing, batch, seed):
    module, params = _model(g, r, sharing, seed)
    prompts, lengths = _prompts(batch, seed)
    steps = 4 + seed % 9
    run = functools.partial(inference.generate, module, params, prompts,
                            lengths, max_decode_steps=steps, eos_id=1,
                            bidirectional=bool(seed % 2))
    speed, greedy = run(method='speed'), run(method='greedy')
    assert_speed_equals_greedy(self, module, params, prompts, lengths, steps,
                               speed, greedy)
    stats = speed.stats
    np.testing.assert_array_equal(stats.num_tokens,
                                  _produced_count(greedy.tokens, 1))
    self.assertTrue(np.all(stats.num_steps >= stats.num_tokens))
    occupancy = stats.occupied_slots / np.maximum(stats.num_steps * r, 1)
    self.assertTrue(np.all((occupancy > 0) & (occupancy <= 1)))
    if r == 1:  # One stage: exactly one step per token, nothing to flush.
      np.testing.assert_array_equal(stats.num_steps, stats.num_tokens)
      np.testing.assert_array_equal(stats.flushes, 0)

  @parameterized.parameters((4, 3), (1, 6))
  def test_agreeing_exits_never_flush(self, g, r):
    module, params = _model(g, r, 'cycle', seed=7)
    # Zero every residual branch: all exits then see the embedding alone.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if any(
            getattr(p, 'key', None) in ('out', 'wo') for p in path) else x,
        params)
    prompts, lengths = _prompts(5, seed=3)
    run = functools.partial(inference.generate, module, params, prompts,
                            lengths, max_decode_steps=10, eos_id=1)
    speed, greedy = run(method='speed'), run(method='greedy')
    np.testing.assert_array_equal(speed.tokens, greedy.tokens)
    np.testing.assert_array_equal(speed.stats.flushes, 0)
    # A full pipeline: R - 1 fill steps, then one token per step.
    np.testing.assert_array_equal(speed.stats.num_steps,
                                  speed.stats.num_tokens + r - 1)


class ShortlistTest(parameterized.TestCase):

  @parameterized.parameters((2, 3, 41), (1, 4, 43))
  def test_speculative_shortlist_keeps_the_output(self, g, r, seed):
    module, params = _model(g, r, 'cycle', seed)
    prompts, lengths = _prompts(5, seed)
    run = functools.partial(inference.generate, module, params, prompts,
                            lengths, max_decode_steps=10)
    full = run(method='speed')
    short = run(method='speed', speculative_vocab_size=5)
    greedy = run(method='greedy')
    assert_speed_equals_greedy(self, module, params, prompts, lengths, 10,
                               short, greedy)
    np.testing.assert_array_equal(short.tokens, full.tokens)


def _decode_with(module, params, prompts, lengths, max_steps, wrap):
  """speed_decode with `wrap(step_fn, prefilled_cache, lengths)`."""
  @jax.jit
  def run(params, prompts, lengths):
    bound = steps.BoundSteps(module, params)
    inputs, cache = inference.prepare(bound, prompts, lengths, max_steps)
    kwargs = bound.decode_fn_kwargs(decoding.speed_decode, inputs, cache,
                                    lengths)
    kwargs['pipeline_step_fn'] = wrap(bound.pipeline_step, cache, lengths)
    return decoding.decode(decoding.speed_decode, eos_id=1,
                           max_decode_steps=max_steps, **kwargs)

  result = run(params, prompts, lengths)
  return inference.Generation(
      inference.produced_tokens(result.sequences, lengths, max_steps),
      result.scores[:, 0], result.stats)


class AdversarialSpeculationTest(parameterized.TestCase):

  @parameterized.parameters((2, 3, 11), (4, 3, 12), (2, 6, 13), (1, 4, 14))
  def test_last_stage_disagrees_with_all_earlier(self, g, r, seed):
    """Speculative exits pick the least likely token; output is unchanged."""
    module, params = _model(g, r, 'cycle', seed)
    prompts, lengths = _prompts(4, seed)

    def wrap(step, cache, lengths):
      def adversarial(tokens, carry, positions, cache):
        logits, hidden, cache = step(tokens, carry, positions, cache)
        return logits.at[:, :-1].multiply(-1.0), hidden, cache
      return adversarial

    speed = _decode_with(module, params, prompts, lengths, 9, wrap)
    greedy = inference.generate(module, params, prompts, lengths,
                                max_decode_steps=9, method='greedy')
    assert_speed_equals_greedy(self, module, params, prompts, lengths, 9,
                               speed, greedy)
    stats = speed.stats
    self.assertGreater(int(stats.flushes[:, -1].sum()), 0)
    # Nothing speculative survives: every token takes about R steps.
    self.assertTrue(np.all(stats.num_steps >= (stats.num_tokens - 1) * r))

  def test_prompt_cache_is_never_overwritten(self):
    """Empty stages (position -1) must not write over prompt entries."""
    module, params = _model(2, 4, 'cycle', seed=21)
    prompts, lengths = _prompts(6, seed=21)

    def wrap(step, prefilled, lengths):
      def guarded(tokens, carry, positions, cache):
        logits, hidden, cache = step(tokens, carry, positions, cache)
        prompt = (jnp.arange(cache.length) < lengths[:, None])[:, None, :, None]
        intact = jnp.all(jnp.stack([
            jnp.all(jnp.where(prompt, new == old, True))
            for new, old in zip(cache.keys + cache.values,
                                prefilled.keys + prefilled.values)]))
        # A clobbered prompt entry poisons the committed token.
        logits = jnp.where(intact, logits, -logits)
        return logits, hidden, cache
      return guarded

    speed = _decode_with(module, params, prompts, lengths, 8, wrap)
    greedy = inference.generate(module, params, prompts, lengths,
                                max_decode_steps=8, method='greedy')
    np.testing.assert_array_equal(speed.tokens, greedy.tokens)


class RaggedBatchTest(absltest.TestCase):

  def test_rows_end_independently(self):
    module, params = _model(2, 3, 'cycle', seed=31)
    prompts = jnp.array([[5, 6, 1, 0, 0, 0],      # prompt ends in EOS
                         [7, 8, 9, 10, 11, 12],   # long prompt
                         [3, 0, 0, 0, 0, 0]])
    lengths = jnp.array([3, 6, 1])
    # One shared buffer: the long prompt reaches the cache end first.
    inputs = inference.build_inputs(prompts, lengths, 4)
    bound = steps.BoundSteps(module, params)
    cache = bound.prefill(inputs, lengths)
    kwargs = lambda fn: bound.decode_fn_kwargs(fn, inputs, cache, lengths)
    result = decoding.decode(decoding.speed_decode, eos_id=1,
                             **kwargs(decoding.speed_decode))
    speed, stats = result.sequences, result.stats
    greedy, _ = decoding.greedy_decode(eos_id=1,
                                       **kwargs(decoding.greedy_decode))
    np.testing.assert_array_equal(speed, greedy)
    length = inputs.shape[1]
    expected = [_produced_count(np.asarray(greedy[b, 0, int(lengths[b]):])[None],
                                1)[0] for b in range(3)]
    np.testing.assert_array_equal(stats.num_tokens, expected)
    # The prompt's EOS does not end row 0; row 1 stops at the buffer's end.
    self.assertGreater(int(stats.num_tokens[0]), 0)
    self.assertLessEqual(int(stats.num_tokens[1]), length - 6)

if __name__ == '__main__':
  absltest.main()
