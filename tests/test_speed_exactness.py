"""SPEED == greedy, token for token, over many random models and batches.

Compilation, not decoding, dominates here, so every case of one architecture
(G, R, sharing order, prefix attention) is decoded by one compiled program
(`_arch_program`): its cases are padded to one batch and one buffer, and each
row gets its own step limit. The program decodes greedily and with SPEED,
whose pipelined step is instrumented for the adversarial and prompt-cache
cases (`_instrumented`: the identity for every other case), and with the
speculative shortlist where a case of the architecture asks for it. Each test
checks its own cases' rows.
"""

import dataclasses
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
from helpers import is_residual_output
from helpers import random_model
from helpers import tiny_model

VOCAB = 13     # small, so random models often produce EOS mid-batch
NEAR_TIE = 1e-4
PROMPT_WIDTH = 6
SHORTLIST = 5  # speculative_vocab_size of the shortlist cases


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


def _prompts(batch, seed, max_len=PROMPT_WIDTH):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(1, max_len + 1, size=batch)
  prompts = rng.randint(2, VOCAB, size=(batch, max_len))
  prompts[np.arange(max_len)[None] >= lengths[:, None]] = 0
  return jnp.asarray(prompts), jnp.asarray(lengths)


def _zero_residuals(params):
  """Every residual branch zeroed: all exits then see the embedding alone."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if is_residual_output(path) else x,
      params)


@dataclasses.dataclass(frozen=True)
class Case:
  """One model and batch, decoded greedily and with SPEED (eos_id 1)."""
  g: int
  r: int
  sharing: str
  seed: int                    # the weights (`random_model`)
  prompt_seed: int             # the prompts (`_prompts`)
  batch: int
  steps: int                   # max_decode_steps
  bidirectional: bool = False  # prefix-LM attention over the prompts
  zero_residuals: bool = False
  adversarial: bool = False    # speculative exits pick the least likely token
  shortlist: bool = False      # also SPEED with speculative_vocab_size
  swap: bool = False           # the first exit's top two logits swapped
  branched: bool = False       # also SPEED with BRANCHES candidate branches

  @property
  def arch(self):
    return (self.g, self.r, self.sharing, self.bidirectional)


CASES = {f'random{i}': Case(c['g'], c['r'], c['sharing'], c['seed'],
                            c['seed'], c['batch'], 4 + c['seed'] % 9,
                            bidirectional=bool(c['seed'] % 2), branched=True)
         for i, c in enumerate(_configs(4))}
CASES.update({f'agreeing{i}': Case(g, r, 'cycle', 7, 3, 5, 10,
                                   zero_residuals=True)
              for i, (g, r) in enumerate(((4, 3), (1, 6)))})
CASES.update({f'shortlist{i}': Case(g, r, 'cycle', seed, seed, 5, 10,
                                    shortlist=True)
              for i, (g, r, seed) in enumerate(((2, 3, 41), (1, 4, 43)))})
CASES.update({f'adversarial{i}': Case(g, r, 'cycle', seed, seed, 4, 9,
                                      adversarial=True, branched=True)
              for i, (g, r, seed) in enumerate(
                  ((2, 3, 11), (4, 3, 12), (2, 6, 13), (1, 4, 14)))})
CASES['prompt_cache'] = Case(2, 4, 'cycle', 21, 21, 6, 8, branched=True)
# Exits that agree, but the first one's top two swapped: every token it
# starts is flipped at stage 2 to the runner-up a branch carries.
CASES.update({f'swapped{i}': Case(g, r, 'cycle', 7, 3, 5, 10,
                                  zero_residuals=True, swap=True,
                                  branched=True)
              for i, (g, r) in enumerate(((2, 3), (1, 5)))})
# Candidate branches of the cases that are also decoded with them.
BRANCHES = 2


def _instrumented(step, prefilled, lengths, flip, swap, r):
  """SPEED's step with the speculative exits' logits times `flip` (-1: the
  least likely token; +1: unchanged), the first exit's top two logits
  swapped where `swap`, and every logit negated if an entry of the prompt's
  cache differs from the prefill's (empty stages, at position -1, must not
  write over it): a clobbered prompt poisons the committed token. Slots
  past the R stages are branches, which run the first exit."""
  def wrapped(tokens, carry, positions, cache):
    logits, hidden, cache = step(tokens, carry, positions, cache)
    slots = logits.shape[1]
    speculative = np.asarray([s for s in range(slots) if s != r - 1])
    logits = logits.at[:, speculative].multiply(flip)
    first = np.asarray([0] + list(range(r, slots)))
    top, ids = jax.lax.top_k(logits[:, first], 2)
    rows = jnp.arange(logits.shape[0])[:, None]
    swapped = logits.at[rows, first[None], ids[..., 0]].set(top[..., 1])
    swapped = swapped.at[rows, first[None], ids[..., 1]].set(top[..., 0])
    logits = jnp.where(swap, swapped, logits)
    prompt = (jnp.arange(cache.length) < lengths[:, None])[:, None, :, None]
    intact = jnp.all(jnp.stack([
        jnp.all(jnp.where(prompt, new == jnp.concatenate(
            [old] + [old[:1]] * (new.shape[0] - r)), True))
        for new, old in zip(cache.keys + cache.values,
                            prefilled.keys + prefilled.values)]))
    return jnp.where(intact, logits, -logits), hidden, cache
  return wrapped


def _generation(result, lengths, max_steps):
  return inference.Generation.from_result(result, lengths, max_steps)


def _arch_program(g, r, sharing, bidirectional, max_steps, shortlist,
                  branched):
  """Jitted decodes of one padded case, as `inference.generate` compiles
  them, but with one step limit per row: {'greedy', 'speed'[, 'short']}."""
  module, _ = tiny_model(vocab_size=VOCAB, num_unique_layers=g,
                         num_repeats=r, sharing=sharing)

  @functools.partial(jax.jit, compiler_options=inference.COMPILER_OPTIONS)
  def run(params, prompts, lengths, row_steps, flip, swap):
    bound = steps.BoundSteps(module, params)
    inputs, cache = inference.prepare(bound, prompts, lengths, max_steps,
                                      bidirectional)

    def decode(fn, bound, wrap=lambda step: step, **options):
      kwargs = bound.decode_fn_kwargs(fn, inputs, cache, lengths)
      if 'pipeline_step_fn' in kwargs:
        kwargs['pipeline_step_fn'] = wrap(kwargs['pipeline_step_fn'])
        # The pipeline at every batch size, not greedy's loop beyond the
        # CPU's limit.
        kwargs['max_speculative_rows'] = None
      return _generation(decoding.decode(fn, eos_id=1,
                                         max_decode_steps=row_steps,
                                         **kwargs, **options), lengths,
                         max_steps)

    instrument = lambda step: _instrumented(step, cache, lengths, flip, swap,
                                            r)
    out = dict(greedy=decode(decoding.greedy_decode, bound),
               speed=decode(decoding.speed_decode, bound, instrument,
                            speed_branches=0))
    if branched:
      out['branch'] = decode(decoding.speed_decode, bound, instrument,
                             speed_branches=BRANCHES)
    if shortlist:
      out['short'] = decode(decoding.speed_decode,
                            steps.BoundSteps(module, params, SHORTLIST))
    return out

  return module, run


def _pad_rows(x, batch, fill):
  """`x` with rows of `fill` appended up to `batch` rows: one-token prompts,
  decoded and ignored."""
  x = np.asarray(x)
  return np.concatenate([x, np.full((batch - len(x),) + x.shape[1:], fill,
                                    x.dtype)])


@functools.lru_cache(maxsize=None)
def _arch_results(arch):
  """Host results of every case of `arch`, by case name: one compile."""
  names = [name for name, case in CASES.items() if case.arch == arch]
  cases = [CASES[name] for name in names]
  batch = max(case.batch for case in cases)
  max_steps = max(case.steps for case in cases)
  module, run = _arch_program(*arch, max_steps,
                              any(case.shortlist for case in cases),
                              any(case.branched for case in cases))
  out = {}
  for name, case in zip(names, cases):
    _, params = _model(case.g, case.r, case.sharing, case.seed)
    if case.zero_residuals:
      params = _zero_residuals(params)
    prompts, lengths = _prompts(case.batch, case.prompt_seed)
    result = run(params, _pad_rows(prompts, batch, 2),
                 _pad_rows(lengths, batch, 1),
                 _pad_rows(np.full(case.batch, case.steps, np.int32), batch, 1),
                 jnp.float32(-1.0 if case.adversarial else 1.0),
                 jnp.asarray(case.swap))
    out[name] = (module, params, prompts, lengths,
                 jax.tree.map(lambda x, n=case.batch: x[:n],
                              jax.device_get(result)))
  return out


def _decoded(name):
  """(module, params, prompts, lengths, {'greedy', 'speed'[, 'short']}:
  `inference.Generation`s of the case's rows, cut to its steps)."""
  case = CASES[name]
  module, params, prompts, lengths, out = _arch_results(case.arch)[name]
  for method, generation in out.items():
    np.testing.assert_array_equal(generation.tokens[:, case.steps:], 0,
                                  f'{name} {method}: past its step limit')
  return module, params, prompts, lengths, {
      method: generation.replace(tokens=generation.tokens[:, :case.steps])
      for method, generation in out.items()}


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
  # test_cpu_matmul.py (bf16) eight more random architectures.
  @parameterized.parameters(*range(4))
  def test_random_models(self, index):
    name = f'random{index}'
    module, params, prompts, lengths, out = _decoded(name)
    speed, greedy, r = out['speed'], out['greedy'], CASES[name].r
    assert_speed_equals_greedy(self, module, params, prompts, lengths,
                               CASES[name].steps, speed, greedy)
    assert_speed_equals_greedy(self, module, params, prompts, lengths,
                               CASES[name].steps, out['branch'], greedy)
    branched = out['branch'].stats
    np.testing.assert_array_equal(branched.num_tokens,
                                  _produced_count(greedy.tokens, 1))
    # A branch absorbs a flip or lets it flush; it never adds a step.
    self.assertTrue(np.all(branched.num_steps <= speed.stats.num_steps))
    np.testing.assert_array_equal(branched.branches, BRANCHES if r > 1 else 0)
    stats = speed.stats
    produced = _produced_count(greedy.tokens, 1)
    np.testing.assert_array_equal(stats.num_tokens, produced)
    # Each result says how many tokens it produced (0 is a token id too).
    np.testing.assert_array_equal(greedy.lengths, produced)
    np.testing.assert_array_equal(speed.lengths, produced)
    self.assertTrue(np.all(stats.num_steps >= stats.num_tokens))
    occupancy = stats.occupied_slots / np.maximum(stats.num_steps * r, 1)
    self.assertTrue(np.all((occupancy > 0) & (occupancy <= 1)))
    if r == 1:  # One stage: exactly one step per token, nothing to flush.
      np.testing.assert_array_equal(stats.num_steps, stats.num_tokens)
      np.testing.assert_array_equal(stats.flushes, 0)

  @parameterized.parameters(*range(2))
  def test_agreeing_exits_never_flush(self, index):
    name = f'agreeing{index}'
    *_, out = _decoded(name)
    speed, greedy = out['speed'], out['greedy']
    np.testing.assert_array_equal(speed.tokens, greedy.tokens, name)
    np.testing.assert_array_equal(speed.stats.flushes, 0, name)
    # A full pipeline: R - 1 fill steps, then one token per step.
    np.testing.assert_array_equal(speed.stats.num_steps,
                                  speed.stats.num_tokens + CASES[name].r - 1,
                                  name)


class BranchTest(parameterized.TestCase):

  @parameterized.parameters(*range(2))
  def test_branches_absorb_every_runner_up_flip(self, index):
    """Agreeing exits with the first one's top two swapped: without
    branches every token it starts is flushed at stage 2; with them the
    runner-up is in flight every time, so nothing flushes and the pipeline
    stays full (R - 1 fill steps, then one token per step)."""
    name = f'swapped{index}'
    *_, out = _decoded(name)
    r = CASES[name].r
    speed, branch, greedy = out['speed'], out['branch'], out['greedy']
    np.testing.assert_array_equal(speed.tokens, greedy.tokens, name)
    np.testing.assert_array_equal(branch.tokens, greedy.tokens, name)
    tokens = branch.stats.num_tokens
    self.assertGreater(int(speed.stats.flushes[:, 1].sum()), 0, name)
    np.testing.assert_array_equal(branch.stats.flushes, 0, name)
    np.testing.assert_array_equal(branch.stats.num_steps, tokens + r - 1,
                                  name)
    # Every token's stage-2 prediction flips; each but the last one's had a
    # successor in flight, on the wrong token, with the right one beside it.
    np.testing.assert_array_equal(branch.stats.stage_flips[:, 1], tokens,
                                  name)
    np.testing.assert_array_equal(branch.stats.branch_hits,
                                  np.maximum(tokens - 1, 0), name)


class ShortlistTest(parameterized.TestCase):

  @parameterized.parameters(*range(2))
  def test_speculative_shortlist_keeps_the_output(self, index):
    name = f'shortlist{index}'
    module, params, prompts, lengths, out = _decoded(name)
    assert_speed_equals_greedy(self, module, params, prompts, lengths, 10,
                               out['short'], out['greedy'])
    np.testing.assert_array_equal(out['short'].tokens, out['speed'].tokens,
                                  name)


class AdversarialSpeculationTest(parameterized.TestCase):

  @parameterized.parameters(*range(4))
  def test_last_stage_disagrees_with_all_earlier(self, index):
    """Speculative exits pick the least likely token; output is unchanged."""
    name = f'adversarial{index}'
    module, params, prompts, lengths, out = _decoded(name)
    speed, r = out['speed'], CASES[name].r
    assert_speed_equals_greedy(self, module, params, prompts, lengths, 9,
                               speed, out['greedy'])
    assert_speed_equals_greedy(self, module, params, prompts, lengths, 9,
                               out['branch'], out['greedy'])
    stats = speed.stats
    self.assertGreater(int(stats.flushes[:, -1].sum()), 0, name)
    # Nothing speculative survives: every token takes about R steps.
    self.assertTrue(np.all(stats.num_steps >= (stats.num_tokens - 1) * r),
                    name)

  def test_prompt_cache_is_never_overwritten(self):
    """Empty stages (position -1) must not write over prompt entries: the
    instrumented step poisons the output of a case whose prompt cache
    changed (every case's SPEED runs with it; with branches, their copies
    of stage 1's cache are checked too)."""
    *_, out = _decoded('prompt_cache')
    np.testing.assert_array_equal(out['speed'].tokens, out['greedy'].tokens)
    np.testing.assert_array_equal(out['branch'].tokens, out['greedy'].tokens)


class RaggedBatchTest(absltest.TestCase):

  def test_rows_end_independently(self):
    module, params = _model(2, 3, 'cycle', seed=31)
    prompts = jnp.array([[5, 6, 1, 0, 0, 0],      # prompt ends in EOS
                         [7, 8, 9, 10, 11, 12],   # long prompt
                         [3, 0, 0, 0, 0, 0]])
    lengths = jnp.array([3, 6, 1])
    # One shared buffer: the long prompt reaches the cache end first.
    inputs = inference.build_inputs(prompts, lengths, 4)

    @jax.jit
    def run(params, inputs, lengths):
      bound = steps.BoundSteps(module, params)
      cache = bound.prefill(inputs, lengths)
      kwargs = lambda fn: bound.decode_fn_kwargs(fn, inputs, cache, lengths)
      result = decoding.decode(decoding.speed_decode, eos_id=1,
                               max_speculative_rows=None,
                               **kwargs(decoding.speed_decode))
      greedy, _ = decoding.greedy_decode(eos_id=1,
                                         **kwargs(decoding.greedy_decode))
      return result.sequences, result.stats, greedy

    speed, stats, greedy = run(params, inputs, lengths)
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
