"""Bad inputs and termination: each item of the reliability review, tested.

Concrete bad values raise `ValueError` naming the argument before tracing;
traced ones (inside `jit`, as T5X runs decode fns) cannot raise, so the
example is flagged invalid (no tokens, NaN score) and every loop still ends.
"""

import subprocess
import sys
import textwrap
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import cpu
from t5x_speed import decode_args
from t5x_speed import decoding
from t5x_speed import inference
from t5x_speed import steps
import helpers
from helpers import tiny_model

R, V, L = 3, 5, 8


def constant_pipeline(token=2, vocab=V, stages=R, width=1):
  """Step fns whose every exit predicts `token` everywhere."""

  def pipeline_step_fn(tokens, carry, positions, cache):
    del carry
    logits = 10.0 * jax.nn.one_hot(jnp.full(positions.shape, token), vocab)
    return logits, jnp.zeros(positions.shape + (width,)), cache

  def tokens_to_logits(state):
    batch = state.cur_token.shape[0]
    return 10.0 * jax.nn.one_hot(jnp.full((batch,), token), vocab), state.cache

  return pipeline_step_fn, tokens_to_logits


def unchanged(row):
  """The decodes of an example that produced nothing: its input, shifted."""
  return np.append(np.asarray(row)[1:], 0)


def decode_fns(stages=R, width=1, **kwargs):
  """{'greedy': f, 'speed': f}: f(inputs, **decode kwargs) -> T5X's
  (decodes, scores)."""
  step, to_logits = constant_pipeline(stages=stages, width=width)

  def speed(inputs, **k):
    carry = jnp.zeros((inputs.shape[0], stages - 1, width))
    return decoding.speed_decode(inputs, None, eos_id=k.pop('eos_id', 1),
                                 pipeline_step_fn=step, num_stages=stages,
                                 initial_carry=carry, **kwargs, **k)

  def greedy(inputs, **k):
    return decoding.greedy_decode(inputs, None, to_logits,
                                  k.pop('eos_id', 1), **k)

  return {'greedy': greedy, 'speed': speed}


class DocstringTest(absltest.TestCase):

  def test_decode_args_example(self):
    helpers.assert_doctests(decode_args)


class TerminationTest(parameterized.TestCase):
  """Item 1: no input makes a decode loop run forever."""

  def test_issue_reproducer_returns(self):
    # In a subprocess with a timeout: a regression must fail, not hang CI.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from t5x_speed import decoding
        R, V, L = 3, 5, 8
        step = lambda tok, carry, pos, cache: (
            jnp.zeros((tok.shape[0], R, V)), jnp.zeros((tok.shape[0], R, 1)),
            cache)
        f = jax.jit(lambda ii: decoding.decode(
            decoding.speed_decode, inputs=jnp.zeros((1, L), jnp.int32),
            cache=None, eos_id=1, initial_index=ii, max_decode_steps=4,
            pipeline_step_fn=step, num_stages=R,
            initial_carry=jnp.zeros((1, R - 1, 1))))
        result = f(jnp.array([-1]))
        print(np.asarray(result.sequences).tolist(),
              float(result.scores[0, 0]), int(result.stats.invalid[0]))
        """)
    out = subprocess.run([sys.executable, '-c', script], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    self.assertEqual(out.split(), ['[[[0,'] + ['0,'] * (L - 2) + ['0]]]',
                                   'nan',
                                   str(decode_args.INVALID_INITIAL_INDEX)])

  @parameterized.product(method=['greedy', 'speed'], index=[-5, -1, L, L + 3])
  def test_traced_initial_index_outside_range(self, method, index):
    inputs = jnp.array([[0, 3, 4, 0, 0, 0, 0, 0], [0, 3, 4, 0, 0, 0, 0, 0]])
    decode = decode_fns()[method]
    decodes, scores = jax.jit(lambda ii: decode(inputs, initial_index=ii))(
        jnp.array([index, 2]))
    # The bad example is its input unchanged (prompt not overwritten) with a
    # NaN score; the good one in the same batch decodes normally.
    np.testing.assert_array_equal(decodes[0, 0], unchanged(inputs[0]))
    self.assertTrue(np.isnan(scores[0, 0]))
    np.testing.assert_array_equal(decodes[1, 0], [3, 4, 2, 2, 2, 2, 2, 2])
    self.assertTrue(np.isfinite(scores[1, 0]))

  def test_speed_loop_is_bounded_by_steps(self):
    # A step fn that never lets anything commit cannot stall the loop: the
    # last stage's slot is always empty if positions are never valid there.
    # Emulate it by an initial_index whose pipeline would never drain and
    # check the loop count through the stats.
    step, _ = constant_pipeline()
    f = jax.jit(lambda ii: decoding.decode(
        decoding.speed_decode, inputs=jnp.zeros((2, L), jnp.int32),
        cache=None, eos_id=-1, initial_index=ii, pipeline_step_fn=step,
        num_stages=R, initial_carry=jnp.zeros((2, R - 1, 1))).stats)
    stats = f(jnp.array([0, 3]))
    # No EOS: each example runs to the end of the buffer, R - 1 fill steps
    # plus one step per token, well inside the R * (L + 1) bound.
    np.testing.assert_array_equal(stats.num_tokens, [L, L - 3])
    np.testing.assert_array_equal(stats.num_steps,
                                  [L + R - 1, L - 3 + R - 1])
    np.testing.assert_array_equal(stats.invalid, [0, 0])


class TokenIdTest(parameterized.TestCase):
  """Items 2, 3, 4 and 8: token ids and lengths are integers in range."""

  @parameterized.parameters(-4, 61, 170)
  def test_generate_rejects_ids_outside_vocabulary(self, token):
    module, params = tiny_model()
    with self.assertRaisesRegex(ValueError, rf'token id {token} .*\[0, 61\)'):
      inference.generate(module, params, np.array([[3, token]]),
                         np.array([2]), max_decode_steps=3)

  def test_generate_refuses_tracers(self):
    module, params = tiny_model()
    with self.assertRaisesRegex(ValueError, 'outside jax.jit'):
      jax.jit(lambda p: inference.generate(
          module, params, p, np.array([2]), max_decode_steps=3).tokens)(
              jnp.array([[3, 4]]))

  @parameterized.product(method=['greedy', 'speed'], token=[-4, 5, 170])
  def test_decode_fns_reject_concrete_ids_outside_vocabulary(self, method,
                                                             token):
    inputs = jnp.array([[0, 3, token, 0, 0, 0, 0, 0]])
    with self.assertRaisesRegex(ValueError, rf'token id {token} at \[0, 2\]'):
      decode_fns()[method](inputs, initial_index=jnp.array([2]))

  @parameterized.parameters('greedy', 'speed')
  def test_traced_ids_outside_vocabulary_end_the_example(self, method):
    decode = jax.jit(lambda x: decode_fns()[method](
        x, initial_index=jnp.array([2, 2])))
    inputs = jnp.array([[0, 3, 170, 0, 0, 0, 0, 0], [0, 3, 4, 0, 0, 0, 0, 0]])
    decodes, scores = decode(inputs)
    np.testing.assert_array_equal(decodes[0, 0], unchanged(inputs[0]))
    self.assertTrue(np.isnan(scores[0, 0]))
    np.testing.assert_array_equal(decodes[1, 0], [3, 4, 2, 2, 2, 2, 2, 2])
    # Ids past the prompt are padding and are not checked.
    decodes, scores = decode(inputs.at[1, 5].set(170))
    self.assertTrue(np.isfinite(scores[1, 0]))

  @parameterized.parameters('greedy', 'speed')
  def test_speed_flags_why(self, method):
    del method
    step, _ = constant_pipeline()
    f = jax.jit(lambda x, ii: decoding.decode(
        decoding.speed_decode, inputs=x, cache=None, eos_id=1,
        initial_index=ii, pipeline_step_fn=step, num_stages=R,
        initial_carry=jnp.zeros((3, R - 1, 1))).stats)
    inputs = jnp.zeros((3, L), jnp.int32).at[1, 1].set(-2)
    stats = f(inputs, jnp.array([L, 1, 1]))
    np.testing.assert_array_equal(stats.invalid, [
        decode_args.INVALID_INITIAL_INDEX, decode_args.INVALID_TOKEN_ID, 0])
    self.assertEqual(stats.summary()['invalid_examples'], 2.0)

  @parameterized.product(method=['greedy', 'speed'], arg=[
      'inputs', 'initial_index', 'max_decode_steps', 'eos_id'])
  def test_floats_are_refused_not_truncated(self, method, arg):
    kwargs = dict(inputs=jnp.zeros((1, L), jnp.int32),
                  initial_index=jnp.array([2]), max_decode_steps=3, eos_id=1)
    kwargs[arg] = jnp.asarray(kwargs[arg], jnp.float32) + 0.9
    with self.assertRaisesRegex(ValueError, f'{arg} must hold integer'):
      decode_fns()[method](**kwargs)

  @parameterized.parameters(
      ('prompts', np.array([[3.9, 4.0]]), np.array([2])),
      ('prompt_lengths', np.array([[3, 4]]), np.array([1.9])),
  )
  def test_generate_refuses_floats(self, name, prompts, lengths):
    module, params = tiny_model()
    with self.assertRaisesRegex(ValueError, f'{name} must hold integers'):
      inference.generate(module, params, prompts, lengths, max_decode_steps=3)

  def test_generate_integer_arguments(self):
    module, params = tiny_model()
    args = (module, params, np.array([[3, 4]]), np.array([2]))
    # eos_id=-1 as in NonFiniteTest: the two tests share one compiled SPEED.
    numpy_int = inference.generate(*args, max_decode_steps=np.int64(3),
                                   eos_id=-1)
    plain = inference.generate(*args, max_decode_steps=3, eos_id=-1)
    np.testing.assert_array_equal(numpy_int.tokens, plain.tokens)
    # A limit above batch x R shares the program of 'auto'.
    numpy_rows = inference.generate(*args, max_decode_steps=3, eos_id=-1,
                                    max_speculative_rows=np.int64(16))
    np.testing.assert_array_equal(numpy_rows.tokens, plain.tokens)
    with self.assertRaisesRegex(ValueError, 'max_speculative_rows must be'):
      inference.generate(*args, max_decode_steps=3,
                         max_speculative_rows=np.float64(16))
    for bad in (True, 3.0, np.array([3])):
      with self.assertRaisesRegex(ValueError, 'max_decode_steps must be an '
                                  'integer >= 1'):
        inference.generate(*args, max_decode_steps=bad)
    with self.assertRaisesRegex(ValueError, 'eos_id must be an integer'):
      inference.generate(*args, max_decode_steps=3, eos_id=True)

  def test_check_token_range_skips_padding(self):
    inputs = np.array([[3, 4, 99], [3, 99, 99]])
    decode_args.check_token_range(inputs, 61, lengths=np.array([2, 1]))
    with self.assertRaisesRegex(ValueError, r'token id 99 at \[0, 2\]'):
      decode_args.check_token_range(inputs, 61, lengths=np.array([3, 1]))
    with self.assertRaisesRegex(ValueError, r'\(and 2 more\)'):
      decode_args.check_token_range(inputs, 61)


class ArgumentTest(parameterized.TestCase):
  """Items 5 and 6."""

  @parameterized.parameters(   # the model has R = 3 stages of width 32
      (4, (1, 3, 32), r'num_stages R = 4 and initial_carry .*\(1, 3, 32\)'),
      (2, (1, 1, 32), r'num_stages R = 2 and initial_carry .*\(1, 1, 32\)'),
      (3, (1, 2, 16), r'num_stages R = 3 and initial_carry .*width 16'),
      (3, (1, 2), r'initial_carry must be \[batch=1, R-1=2, width\]'),
      (3, (1, 3, 32), r'initial_carry must be \[batch=1, R-1=2, width\]'),
      (0, (1, 2, 32), r'num_stages must be an integer >= 1, got 0'),
      (3.0, (1, 2, 32), r'num_stages must be an integer >= 1, got 3.0'),
  )
  def test_stage_count_or_carry_mismatch_names_r(self, num_stages,
                                                 carry_shape, message):
    module, params = tiny_model()
    inputs = jnp.zeros((1, L), jnp.int32)
    bound = steps.BoundSteps(module, params)
    # A cache of the prefill's shapes: the arguments are refused before any
    # step reads it, so its values need not be computed.
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
        bound.prefill, inputs, jnp.array([0])))
    with self.assertRaisesRegex(ValueError, message):
      decoding.speed_decode(inputs, cache, eos_id=1,
                            pipeline_step_fn=bound.pipeline_step,
                            num_stages=num_stages,
                            initial_carry=jnp.zeros(carry_shape))

  @parameterized.parameters(0, -3, 2.5, True)
  def test_speculative_vocab_size(self, value):
    module, params = tiny_model()
    with self.assertRaisesRegex(ValueError, 'speculative_vocab_size must be '
                                'an integer >= 1'):
      steps.BoundSteps(module, params, speculative_vocab_size=value)
    with self.assertRaisesRegex(ValueError, 'speculative_vocab_size'):
      inference.generate(module, params, np.array([[3, 4]]), np.array([2]),
                         max_decode_steps=3, speculative_vocab_size=value)

  @parameterized.parameters('greedy', 'speed')
  def test_traced_nonpositive_max_decode_steps_produce_nothing(self, method):
    inputs = jnp.array([[0, 3, 4, 0, 0, 0, 0, 0]] * 2)
    decodes, scores = jax.jit(lambda s: decode_fns()[method](
        inputs, initial_index=jnp.array([2, 2]), max_decode_steps=s))(
            jnp.array([0, -2]))
    np.testing.assert_array_equal(decodes[:, 0], [unchanged(x) for x in inputs])
    np.testing.assert_array_equal(scores[:, 0], [0.0, 0.0])

  @parameterized.parameters('greedy', 'speed')
  def test_concrete_negative_initial_index_message(self, method):
    with self.assertRaisesRegex(ValueError, r'initial_index \[-1\] must lie in '
                                r'\[0, 8\): it is .*prompt length'):
      decode_fns()[method](jnp.zeros((1, L), jnp.int32),
                           initial_index=jnp.array([-1]))

  @parameterized.parameters('greedy', 'speed')
  def test_per_example_eos_and_steps(self, method):
    inputs = jnp.zeros((3, L), jnp.int32)
    decodes, _ = decode_fns()[method](
        inputs, eos_id=jnp.array([2, -1, 9]), max_decode_steps=jnp.array([
            5, 3, 6]))
    # Row 0 ends at its first token (EOS 2); row 1 never sees EOS and stops
    # after 3 tokens; row 2's EOS is outside the vocabulary: 6 tokens.
    np.testing.assert_array_equal(decodes[:, 0], [
        [2, 0, 0, 0, 0, 0, 0, 0], [2, 2, 2, 0, 0, 0, 0, 0],
        [2, 2, 2, 2, 2, 2, 0, 0]])


class GenerateArgumentTest(parameterized.TestCase):
  """generate names the argument at fault, before it traces anything."""

  def setUp(self):
    super().setUp()
    self.module, self.params = tiny_model()
    # Every error must come from the host checks: tracing is a failure.
    patch = mock.patch.object(inference, '_generate',
                              side_effect=AssertionError('traced'))
    patch.start()
    self.addCleanup(patch.stop)

  def generate(self, prompts=((3, 4),), lengths=(2,), **kwargs):
    return inference.generate(self.module, self.params, prompts, lengths,
                              max_decode_steps=3, **kwargs)

  @parameterized.product(method=['greedy', 'speed'], settings=[
      dict(temperature=0.7, topk=40), dict(topp=0.9), dict(temperature=0.0),
      dict(rng=jax.random.PRNGKey(1))])
  def test_sampling_settings_need_a_sampling_method(self, method, settings):
    for name in settings:
      with self.assertRaisesRegex(
          ValueError, rf"method='{method}'\) does not use .*{name}=.*"
          r"sampling methods \('speed_sample', 'sample'\)"):
        self.generate(method=method, **settings)

  @parameterized.product(method=['greedy', 'sample'], settings=[
      dict(max_speculative_rows=None), dict(max_speculative_rows=4),
      dict(speculative_vocab_size=16), dict(record_schedule=True),
      dict(require_pipeline=True), dict(speed_branches=1)])
  def test_speed_settings_need_a_speed_method(self, method, settings):
    (name, value), = settings.items()
    with self.assertRaisesRegex(
        ValueError, rf"method='{method}'\) does not use {name}={value!r}.*"
        r"SPEED methods \('speed', 'speed_sample'\)"):
      self.generate(method=method, **settings)

  def test_bad_branches_name_the_argument(self):
    for bad in (-1, 'wide', 1.5):
      with self.assertRaisesRegex(ValueError, 'speed_branches'):
        self.generate(method='speed', speed_branches=bad)

  def test_defaults_are_not_settings(self):
    # Every method takes every argument at its default, so that one call
    # site can switch `method` alone.
    for method in inference.METHODS:
      with self.assertRaisesRegex(AssertionError, 'traced'):
        self.generate(method=method, record_schedule=False,
                      speculative_vocab_size=None, max_speculative_rows='auto',
                      require_pipeline=False, speed_branches='auto',
                      temperature=None, topk=None, topp=None, rng=None)

  def test_settings_that_decide_nothing_share_one_program(self):
    # `_generate` is compiled per key: where the pipeline runs anyway (2
    # examples x R = 3: 6 rows, within the CPU's 8) every spelling of the
    # limit, and require_pipeline, is the key (None, False).
    def key(batch, **settings):
      with mock.patch.object(inference, '_generate') as traced:
        self.generate(prompts=[[3, 4]] * batch, lengths=[2] * batch,
                      **settings)
      kwargs = traced.call_args.kwargs
      return kwargs['max_speculative_rows'], kwargs['require_pipeline']
    for settings in (dict(), dict(max_speculative_rows=None),
                     dict(max_speculative_rows=6),
                     dict(max_speculative_rows=100, require_pipeline=True),
                     dict(require_pipeline=True)):
      self.assertEqual(key(2, **settings), (None, False), settings)
      self.assertEqual(key(2, method='speed_sample', **settings),
                       (None, False), settings)
    self.assertEqual(key(3, method='greedy'), (None, False))
    # 9 rows: the limit (8 on CPU) decides between the pipeline and
    # greedy's step.
    self.assertEqual(cpu.dispatch.CPU_MAX_SPECULATIVE_ROWS, 8)
    self.assertEqual(key(3), (8, False))
    self.assertEqual(key(3, require_pipeline=True), (8, True))
    self.assertEqual(key(3, max_speculative_rows=5), (5, False))
    self.assertEqual(key(3, max_speculative_rows=9), (None, False))
    self.assertEqual(key(3, max_speculative_rows=None), (None, False))
    self.assertEqual(key(3, record_schedule=True), (None, False))

  def test_ragged_prompts(self):
    with self.assertRaisesRegex(ValueError, 'prompts must be a rectangular '
                                'array.*pad'):
      self.generate(prompts=[[3, 4, 5], [6, 7]], lengths=[3, 2])

  def test_rng_must_be_one_key(self):
    for rng, got in (
        (3, 'got 3'),
        (np.array([1, 2], np.int64), r'shape \(2,\) and dtype int64'),
        (np.zeros((2, 2), np.uint32), r'shape \(2, 2\) and dtype uint32'),
        (jax.random.split(jax.random.key(0)), r'shape \(2,\) and dtype key')):
      for method in ('sample', 'speed_sample'):
        with self.assertRaisesRegex(ValueError, 'rng must be one PRNG key: '
                                    rf'jax.random.PRNGKey.*{got}'):
          self.generate(method=method, rng=rng)

  def test_raw_and_typed_keys_are_keys(self):
    for key in (jax.random.PRNGKey(3), jax.random.key(3),
                np.array([0, 3], np.uint32)):
      decode_args.check_prng_key('rng', key)
      jax.jit(lambda k: decode_args.check_prng_key('rng', k))(key)

  def test_bad_prompt_id_names_prompts(self):
    with self.assertRaisesRegex(ValueError, r'prompts holds token id 61 at '
                                r'\[0, 1\]'):
      self.generate(prompts=[[3, 61]])


class NonFiniteTest(absltest.TestCase):
  """Item 7: NaN weights are caught on request; the documented output else."""

  def test_check_finite(self):
    module, params = tiny_model()
    inference.check_finite(params)
    bad = jax.tree.map(lambda x: x, params)
    bad['decoder']['layers_1']['mlp']['wo']['kernel'] = (
        bad['decoder']['layers_1']['mlp']['wo']['kernel'].at[0, 0].set(jnp.nan))
    with self.assertRaisesRegex(ValueError, r"1 leaves: \['decoder'\]"
                                r"\['layers_1'\]\['mlp'\]\['wo'\]\['kernel'\]"):
      inference.check_finite(bad)
    args = (module, bad, np.array([[3, 4]]), np.array([2]))
    with self.assertRaisesRegex(ValueError, 'non-finite'):
      inference.generate(*args, max_decode_steps=3, check_params=True)
    # Unchecked, as documented: token 0 repeated with a NaN score.
    for method in inference.METHODS:
      out = inference.generate(*args, max_decode_steps=3, method=method,
                               eos_id=-1)
      np.testing.assert_array_equal(out.tokens, [[0, 0, 0]])
      self.assertTrue(np.isnan(out.scores[0]))


if __name__ == '__main__':
  absltest.main()
