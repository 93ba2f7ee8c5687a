"""SPEED decoding: the worked example, the traps, exactness against greedy."""

import doctest
import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import t5x_speed
from t5x_speed import decoding
from t5x_speed import inference
from t5x_speed import results
from t5x_speed import steps
from t5x_speed import token_rules
from t5x_speed.cpu import build
from t5x_speed.cpu import dispatch
import helpers
from helpers import tiny_model

VOCAB = 13


def toy_pipeline(table, vocab=VOCAB):
  """A pipeline whose stage-r exit at position p predicts table[r][p].

  Returns (pipeline_step_fn, tokens_to_logits, initial carry, cache).
  """
  table = jnp.asarray(table, jnp.int32)
  stages = table.shape[0]

  def predict(stage_rows, positions):
    safe = jnp.clip(positions, 0, table.shape[1] - 1)
    return 10.0 * jax.nn.one_hot(table[stage_rows, safe], vocab)

  def pipeline_step_fn(tokens, carry, positions, cache):
    del tokens
    logits = predict(jnp.arange(stages)[None, :], positions)
    return logits, jnp.zeros(positions.shape + (1,)), cache

  def tokens_to_logits(state):
    return predict(stages - 1, state.cur_index), state.cache

  return pipeline_step_fn, tokens_to_logits, jnp.zeros((1, stages - 1, 1))


def _speed(table, length, **kwargs) -> decoding.DecodeResult:
  step, _, carry = toy_pipeline(table)
  inputs = jnp.zeros((1, length), jnp.int32)
  return decoding.decode(decoding.speed_decode, record_schedule=True,
                         inputs=inputs, cache=jnp.zeros(()), eos_id=1,
                         pipeline_step_fn=step,
                         num_stages=carry.shape[1] + 1, initial_carry=carry,
                         **kwargs)


def _parse_worked_example():
  """The schedule table of speed_decode's docstring, row by row."""
  rows = []
  for line in decoding.speed_decode.__doc__.splitlines():
    match = re.match(r'\s+(\d+) \|(.*)', line)
    if match:
      cells = [c.strip() for c in match.group(2).split('|')]
      stages = [None if c == '-' else tuple(map(int, c.split(':')))
                for c in cells[:3]]
      commit = int(cells[3]) if cells[3] else None
      flush = int(cells[4].split()[1]) - 1 if cells[4] else None
      rows.append((int(match.group(1)), stages, commit, flush))
  return rows


class WorkedExampleTest(absltest.TestCase):

  def test_docstring_table_is_what_speed_does(self):
    final = [5, 6, 7, 8, 1, 0, 0, 0, 0, 0]   # prediction of position p
    first = list(final)
    first[2] = 9
    rows = _parse_worked_example()
    self.assertLen(rows, 8)
    result = _speed([first, final, final], length=10)
    decodes, stats, schedule = result.sequences, result.stats, result.schedule
    self.assertEqual(int(schedule.num_steps), len(rows))
    for step, stages, commit, flush in rows:
      t = step - 1
      for r, cell in enumerate(stages):
        position = int(schedule.positions[t, 0, r])
        if cell is None:
          self.assertEqual(position, -1, (step, r))
        else:
          self.assertEqual((position, int(schedule.tokens[t, 0, r])), cell,
                           (step, r))
      got_commit = (int(schedule.predictions[t, 0, -1])
                    if schedule.positions[t, 0, -1] >= 0 else None)
      self.assertEqual(got_commit, commit, step)
      flushed = np.flatnonzero(np.asarray(schedule.flushes[t, 0]))
      self.assertEqual(flushed.tolist(), [] if flush is None else [flush],
                       step)
    np.testing.assert_array_equal(decodes[0, 0, :6], [5, 6, 7, 8, 1, 0])
    self.assertEqual(int(stats.num_tokens[0]), 5)
    self.assertEqual(int(stats.num_steps[0]), 8)
    self.assertEqual(stats.flushes[0].tolist(), [0, 1, 0])


class DecodeResultTest(absltest.TestCase):
  """T5X's (decodes, scores) from the decode fns; `decode`'s DecodeResult."""

  TABLE = [[5, 6, 9, 8, 1, 0, 0, 0], [5, 6, 7, 8, 1, 0, 0, 0],
           [5, 6, 7, 8, 1, 0, 0, 0]]
  EXPECTED = [5, 6, 7, 8, 1, 0, 0, 0]

  def setUp(self):
    super().setUp()
    step, to_logits, carry = toy_pipeline(self.TABLE)
    self.kwargs = dict(inputs=jnp.zeros((1, 8), jnp.int32), cache=jnp.zeros(()),
                       tokens_to_logits=to_logits, eos_id=1)
    self.pipeline = dict(pipeline_step_fn=step, num_stages=3,
                         initial_carry=carry)

  def test_decode_fns_return_t5x_pairs_and_decode_the_whole_result(self):
    greedy = decoding.greedy_decode(**self.kwargs)
    speed = decoding.speed_decode(**self.kwargs, **self.pipeline)
    greedy_decodes, _ = greedy
    for out in (greedy, speed):
      self.assertIsInstance(out, results.DecodeResult)
      decodes, scores = out      # T5X's (decodes, scores)
      self.assertEqual((decodes.shape, scores.shape), ((1, 1, 8), (1, 1)))
      np.testing.assert_array_equal(decodes[0, 0], self.EXPECTED)
    result = decoding.decode(decoding.speed_decode, **self.kwargs,
                             **self.pipeline)
    speed_decodes, speed_scores = speed
    np.testing.assert_array_equal(result.sequences, speed_decodes)
    np.testing.assert_array_equal(result.scores, speed_scores)
    self.assertEqual(int(result.stats.num_tokens[0]), 5)
    self.assertEqual(result.stats.flushes[0].tolist(), [0, 1, 0])
    self.assertIsNone(result.schedule)
    result = decoding.decode(decoding.greedy_decode, **self.kwargs)
    np.testing.assert_array_equal(result.sequences, greedy_decodes)
    self.assertIsNone(result.stats)
    self.assertIsNone(result.schedule)
    with self.assertRaisesRegex(ValueError, 'record_schedule needs a SPEED'):
      decoding.decode(decoding.greedy_decode, record_schedule=True,
                      **self.kwargs)

  def test_decode_wraps_undeclared_decode_fns(self):
    def t5x_like(**kwargs):   # declares nothing, as T5X's decode fns
      del kwargs
      return jnp.ones((1, 2, 8), jnp.int32), jnp.zeros((1, 2))

    result = decoding.decode(t5x_like, **self.kwargs)
    self.assertEqual(result.sequences.shape, (1, 2, 8))
    self.assertEqual(result.scores.shape, (1, 2))
    self.assertIsNone(result.stats)
    self.assertIsNone(decoding.decode_fn_spec(t5x_like))
    self.assertIsNone(decoding.decode_fn_spec(
        functools.partial(t5x_like, eos_id=1)))
    with self.assertRaisesRegex(ValueError, 'record_schedule'):
      decoding.decode(t5x_like, record_schedule=True)

  def test_declarations_are_attributes_of_the_fn(self):
    speed = decoding.DecodeFnSpec(pipelined=True, kv_cache=True)
    greedy = decoding.DecodeFnSpec(pipelined=False, kv_cache=True)

    @functools.wraps(decoding.speed_decode)
    def wrapper(*args, **kwargs):   # as gin's configurable wraps it
      return decoding.speed_decode(*args, **kwargs)

    for fn, spec in (
        (decoding.speed_decode, speed), (decoding.greedy_decode, greedy),
        (wrapper, speed),             # functools.wraps copies the attribute
        (functools.partial(decoding.speed_decode, max_decode_steps=2), speed),
        (jax.tree_util.Partial(decoding.greedy_decode, eos_id=1), greedy),
        (functools.partial(functools.partial(wrapper, eos_id=1)), speed)):
      self.assertEqual(decoding.decode_fn_spec(fn), spec, fn)
    # A partial of a partial that Python does not flatten (it has attributes
    # of its own) binds the same fn.
    tagged = functools.partial(decoding.speed_decode, max_decode_steps=2)
    tagged.note = 'tagged'
    self.assertEqual(decoding.decode_fn_spec(functools.partial(tagged)), speed)
    # Nothing is looked for beyond the fn itself: a wrapper that does not
    # carry the declaration declares nothing.
    bare = lambda **kwargs: decoding.speed_decode(**kwargs)
    bare.__wrapped__ = decoding.speed_decode
    self.assertIsNone(decoding.decode_fn_spec(bare))
    # Arguments bound in a partial apply, and the result is its value.
    result = decoding.decode(
        functools.partial(wrapper, max_decode_steps=2), record_schedule=True,
        **self.kwargs, **self.pipeline)
    np.testing.assert_array_equal(result.sequences[0, 0],
                                  [5, 6, 0, 0, 0, 0, 0, 0])
    self.assertEqual(int(result.stats.num_tokens[0]), 2)
    self.assertEqual(result.lengths.tolist(), [[2]])
    self.assertGreater(int(result.schedule.num_steps), 2)

  def test_result_unpacks_as_t5x_decode_fns_return(self):
    result = decoding.speed_decode(**self.kwargs, **self.pipeline)
    decodes, scores = result   # T5X's contract
    self.assertIs(decodes, result.sequences)
    self.assertIs(scores, result.scores)
    greedy = decoding.greedy_decode(**self.kwargs)
    np.testing.assert_array_equal(greedy.sequences, decodes)
    self.assertEqual(greedy.lengths.tolist(), result.lengths.tolist())
    self.assertIsNone(greedy.stats)
    self.assertIsNone(greedy.pipelined)
    self.assertTrue(result.pipelined)


class GenerateDocstringTest(absltest.TestCase):

  def test_inference_docstring_example(self):
    helpers.assert_doctests(inference)

  def test_decoding_docstring_examples(self):
    helpers.assert_doctests(decoding, results, t5x_speed, build)


class ArgmaxTest(parameterized.TestCase):

  def test_docstring_example(self):
    runner = doctest.DocTestRunner()
    globs = {'jnp': jnp, 'argmax': token_rules.argmax}
    for test in doctest.DocTestFinder().find(token_rules.argmax, 'argmax',
                                             globs=globs):
      runner.run(test)
    self.assertGreater(runner.tries, 0)
    self.assertEqual(runner.failures, 0)

  @parameterized.parameters('float32', 'bfloat16')
  def test_picks_what_jnp_argmax_picks(self, dtype):
    # Few distinct values, so ties are everywhere; NaN, +inf and all -inf
    # rows, as NaN-producing bugs and masked exits give.
    fast = jax.jit(token_rules.argmax)
    reference = jax.jit(lambda x: jnp.argmax(x, -1))
    for trial in range(60):
      rng = np.random.RandomState(trial)
      shape = [(1, 3, 4099), (5, 1000), (2, 2, 37)][trial % 3]
      x = rng.randint(-3, 3, size=shape).astype(np.float32)
      rows = x.reshape(-1, shape[-1])
      for row in rows[rng.rand(len(rows)) < 0.3]:
        row[rng.randint(shape[-1], size=2)] = np.nan
      rows[rng.rand(len(rows)) < 0.2] = -np.inf
      rows[rng.rand(len(rows)) < 0.2, rng.randint(shape[-1])] = np.inf
      x = jnp.asarray(rows.reshape(shape), dtype)
      got = fast(x)
      self.assertEqual(got.dtype, jnp.int32)
      np.testing.assert_array_equal(got, reference(x), err_msg=str(trial))


class ControlLogicTest(absltest.TestCase):

  def test_oldest_mismatch_wins(self):
    # Step 4 holds positions 3, 2, 1 in stages 1..3. Stage 2 (position 2)
    # and stage 3 (position 1) both disagree with their successors: the
    # older one (position 1) must win and restart position 2 with its 6.
    final = [5, 6, 7, 8, 1, 0, 0, 0, 0, 0]
    first = [5, 4, 9, 8, 1, 0, 0, 0, 0, 0]
    middle = [5, 4, 3, 8, 1, 0, 0, 0, 0, 0]
    result = _speed([first, middle, final], length=10)
    decodes, stats, schedule = result.sequences, result.stats, result.schedule
    np.testing.assert_array_equal(decodes[0, 0, :5], [5, 6, 7, 8, 1])
    self.assertEqual(schedule.flushes[3, 0].tolist(), [False, False, True])
    self.assertEqual(schedule.positions[4, 0].tolist(), [2, -1, -1])
    self.assertEqual(int(schedule.tokens[4, 0, 0]), 6)
    self.assertEqual(int(stats.num_tokens[0]), 5)

  def test_successor_found_by_position_across_a_gap(self):
    # After a flush a token and its restarted successor sit two stages apart.
    final = [5, 6, 7, 8, 9, 10, 1, 0, 0, 0, 0, 0]
    first = [5, 3, 7, 8, 9, 10, 1, 0, 0, 0, 0, 0]
    result = _speed([first, final, final, final], length=12)
    decodes, schedule = result.sequences, result.schedule
    np.testing.assert_array_equal(decodes[0, 0, :7], [5, 6, 7, 8, 9, 10, 1])
    gaps = [schedule.positions[t, 0].tolist() for t in
            range(int(schedule.num_steps))]
    self.assertIn([2, -1, 1, 0], gaps)

  def test_only_a_final_stage_eos_ends(self):
    final = [5, 6, 7, 8, 1, 0, 0, 0, 0, 0]
    first = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]   # speculates EOS everywhere
    result = _speed([first, first, final], length=10)
    decodes, stats = result.sequences, result.stats
    np.testing.assert_array_equal(decodes[0, 0, :6], [5, 6, 7, 8, 1, 0])
    self.assertEqual(int(stats.num_tokens[0]), 5)

  def test_length_limit(self):
    final = [5, 6, 7, 8, 9, 10, 11, 12, 3, 4]
    result = _speed([final, final, final], length=10, max_decode_steps=4)
    decodes, stats = result.sequences, result.stats
    np.testing.assert_array_equal(decodes[0, 0], [5, 6, 7, 8, 0, 0, 0, 0, 0, 0])
    self.assertEqual(int(stats.num_tokens[0]), 4)
    # No flushes: 4 tokens after R - 1 = 2 fill steps.
    self.assertEqual(int(stats.num_steps[0]), 6)


class BranchTest(absltest.TestCase):

  def test_worked_example_with_one_branch(self):
    # speed_decode's worked example, the first exit's runner-up at position
    # 3 being 7: at step 4 the middle exit's verdict (7) names the branch
    # that ran beside 3:9, so nothing is flushed and 7 commits one step
    # earlier: 5 6 7 8 1 in 7 steps (8 without the branch).
    final = [5, 6, 7, 8, 1, 0, 0, 0, 0, 0]
    first = list(final)
    first[2] = 9
    table = jnp.asarray([first, final, final])
    second = jnp.full_like(table, 11).at[0, 2].set(7)

    def step(tokens, carry, positions, cache):
      del tokens
      rows = jnp.asarray([0, 1, 2] + [0] * (positions.shape[1] - 3))[None]
      safe = jnp.clip(positions, 0, table.shape[1] - 1)
      logits = (10.0 * jax.nn.one_hot(table[rows, safe], VOCAB) +
                5.0 * jax.nn.one_hot(second[rows, safe], VOCAB))
      return logits, jnp.zeros(positions.shape + (1,)), cache

    result = decoding.decode(
        decoding.speed_decode, record_schedule=True,
        inputs=jnp.zeros((1, 10), jnp.int32), cache=jnp.zeros(()), eos_id=1,
        pipeline_step_fn=step, num_stages=3,
        initial_carry=jnp.zeros((1, 2, 1)), speed_branches=1)
    stats, schedule = result.stats, result.schedule
    np.testing.assert_array_equal(result.sequences[0, 0, :6],
                                  [5, 6, 7, 8, 1, 0])
    self.assertEqual(int(stats.num_steps[0]), 7)
    self.assertEqual(stats.flushes[0].tolist(), [0, 0, 0])
    self.assertEqual(int(stats.branch_hits[0]), 1)
    self.assertEqual(stats.stage_flips[0].tolist(), [0, 1, 0])
    self.assertEqual(stats.summary()['rows_per_step'], 4.0)
    # Step 4 (index 3) ran 3:9 with the branch 3:7; step 5 holds 4:8, 3:7.
    self.assertEqual(schedule.positions[3, 0].tolist(), [3, 2, 1])
    self.assertEqual(schedule.tokens[3, 0].tolist(), [9, 6, 5])
    self.assertEqual(schedule.candidates[3, 0, 3].tolist(), [8, 11])
    self.assertEqual(schedule.positions[4, 0].tolist(), [4, 3, 2])
    self.assertEqual(schedule.tokens[4, 0].tolist(), [8, 7, 6])
    # Without the branch: the docstring's 8 steps and one flush.
    plain = _speed([first, final, final], length=10)
    self.assertEqual(int(plain.stats.num_steps[0]), 8)
    self.assertEqual(int(plain.stats.branch_hits[0]), 0)


class LargeBatchTest(absltest.TestCase):
  """Beyond max_speculative_rows (batch x R) SPEED runs greedy's loop."""

  TABLE = [[5, 6, 9, 8, 1, 0, 0, 0], [5, 6, 7, 8, 1, 0, 0, 0],
           [5, 6, 7, 8, 1, 0, 0, 0]]

  def setUp(self):
    super().setUp()
    step, to_logits, carry = toy_pipeline(self.TABLE)
    batch = 5   # 15 rows: beyond the CPU's limit
    self.kwargs = dict(
        inputs=jnp.zeros((batch, 8), jnp.int32), cache=jnp.zeros((batch,)),
        tokens_to_logits=to_logits, eos_id=1,
        max_decode_steps=jnp.array([5, 2, 3, 5, 4]))
    self.pipeline = dict(pipeline_step_fn=step, num_stages=3,
                         initial_carry=jnp.zeros((batch, 2, 1)))
    self.greedy = decoding.decode(decoding.greedy_decode, **self.kwargs)

  def _speed(self, **kwargs):
    result = decoding.decode(decoding.speed_decode, **self.kwargs,
                             **self.pipeline, **kwargs)
    np.testing.assert_array_equal(result.sequences, self.greedy.sequences)
    np.testing.assert_array_equal(result.scores, self.greedy.scores)
    return result

  def test_default_on_cpu_decodes_sequentially(self):
    self.assertEqual(jax.default_backend(), 'cpu')
    self.assertLess(dispatch.CPU_MAX_SPECULATIVE_ROWS, 15)
    result = self._speed()
    self.assertIs(result.pipelined, False)
    stats = result.stats
    produced = [5, 2, 3, 5, 4]
    self.assertEqual(result.lengths[:, 0].tolist(), produced)
    self.assertEqual(stats.pipelined.tolist(), [0] * 5)
    self.assertEqual(stats.num_tokens.tolist(), produced)
    self.assertEqual(stats.num_steps.tolist(), produced)
    self.assertEqual(stats.occupied_slots.tolist(), [3 * p for p in produced])
    self.assertEqual(stats.flushes.tolist(), [[0, 0, 0]] * 5)
    self.assertEqual(stats.stage_evaluations.tolist(), [[0, 0, 0]] * 5)
    self.assertEqual(stats.invalid.tolist(), [0] * 5)
    summary = stats.summary()
    self.assertEqual(summary['pipelined_examples'], 0.0)
    self.assertEqual(summary['steps_per_token'], 1.0)

  def test_limits_and_the_schedule_choose_the_pipeline(self):
    for rows, pipelined in ((None, 1), (15, 1), (14, 0), ('auto', 0)):
      result = self._speed(max_speculative_rows=rows)
      stats = result.stats
      self.assertEqual(result.pipelined, bool(pipelined), rows)
      self.assertEqual(stats.pipelined.tolist(), [pipelined] * 5, rows)
      self.assertEqual(result.lengths[:, 0].tolist(), [5, 2, 3, 5, 4])
      # Example 0 flushes once at stage 2 in the pipeline (TABLE).
      self.assertEqual(int(stats.flushes[0].sum()), pipelined, rows)
    result = self._speed(record_schedule=True)
    self.assertEqual(result.stats.pipelined.tolist(), [1] * 5)
    self.assertIsNotNone(result.schedule)
    # Without a full-depth step there is nothing to fall back on.
    kwargs = dict(self.kwargs, tokens_to_logits=None)
    result = decoding.decode(decoding.speed_decode, **kwargs, **self.pipeline)
    self.assertEqual(result.stats.pipelined.tolist(), [1] * 5)

  def test_bad_limits_name_the_argument(self):
    for bad in (0, -1, 'always', True, 2.0):
      with self.assertRaisesRegex(ValueError, 'max_speculative_rows'):
        decoding.speed_decode(**self.kwargs, **self.pipeline,
                              max_speculative_rows=bad)
    for name in ('require_pipeline', 'record_schedule'):
      with self.assertRaisesRegex(ValueError, name):
        decoding.speed_decode(**self.kwargs, **self.pipeline, **{name: 1})
    for bad in (-1, 'some', True, 1.0):
      with self.assertRaisesRegex(ValueError, 'speed_branches'):
        decoding.speed_decode(**self.kwargs, **self.pipeline,
                              speed_branches=bad)

  def test_auto_branches(self):
    # 'auto' resolves per backend, batch and dtype before tracing; a
    # one-stage model and batches beyond 1 get none.
    resolve = dispatch.speed_branches
    for dtype in ('float32', 'bfloat16'):
      self.assertEqual(resolve('auto', 1, 3, dtype),
                       dispatch.CPU_AUTO_BRANCHES[dtype])
      self.assertEqual(resolve('auto', 2, 3, dtype), 0)
    self.assertEqual(resolve(2, 4, 3, 'float32'), 2)
    self.assertEqual(resolve(np.int64(2), 1, 1, 'float32'), 0)

  def test_required_pipeline_refuses_instead_of_falling_back(self):
    for rows in ('auto', 14):
      with self.assertRaisesRegex(ValueError,
                                  'max_speculative_rows.*require_pipeline'):
        self._speed(max_speculative_rows=rows, require_pipeline=True)
    # Where the pipeline runs anyway, the flag changes nothing.
    result = self._speed(max_speculative_rows=15, require_pipeline=True)
    self.assertTrue(result.pipelined)


class BadInputTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.step, self.to_logits, self.carry = toy_pipeline([[0] * 6] * 3)
    self.inputs = jnp.zeros((1, 6), jnp.int32)

  @parameterized.parameters(
      ('initial_index', dict(initial_index=jnp.array([6]))),
      ('max_decode_steps', dict(max_decode_steps=0)),
      ('num_decodes', dict(num_decodes=2)),
  )
  def test_bad_arguments(self, name, kwargs):
    for decode in (
        lambda **k: decoding.greedy_decode(self.inputs, None, self.to_logits,
                                           1, **k),
        lambda **k: decoding.speed_decode(self.inputs, None, eos_id=1,
                                          pipeline_step_fn=self.step,
                                          num_stages=self.carry.shape[1] + 1,
                                          initial_carry=self.carry, **k)):
      with self.assertRaisesRegex(ValueError, name):
        decode(**kwargs)

  def test_empty_batch(self):
    with self.assertRaisesRegex(ValueError, 'empty'):
      decoding.greedy_decode(jnp.zeros((0, 6), jnp.int32), None,
                             self.to_logits, 1)

  def test_model_without_shared_exits(self):
    with self.assertRaisesRegex(ValueError, 'shared exits'):
      decoding.speed_decode(self.inputs, None, self.to_logits, 1)

  def test_tokens_outside_vocabulary(self):
    module, params = tiny_model()
    with self.assertRaisesRegex(ValueError, 'vocabulary'):
      inference.generate(module, params, jnp.array([[3, 61]]),
                         jnp.array([2]), max_decode_steps=3)

  def test_cache_shorter_than_inputs(self):
    module, params = tiny_model()
    bound = steps.BoundSteps(module, params)
    cache = bound.prefill(jnp.zeros((1, 4), jnp.int32), jnp.array([2]))
    kwargs = bound.decode_fn_kwargs(decoding.speed_decode,
                                    jnp.zeros((1, 8), jnp.int32), cache,
                                    jnp.array([2]))
    with self.assertRaisesRegex(ValueError, 'cache'):
      decoding.speed_decode(eos_id=1, **kwargs)


if __name__ == '__main__':
  absltest.main()
