"""The numerics switches: which implementation each pass of a model uses.

Full-sequence passes must be XLA's plain dots whatever the setting (T5X
parity); a decode step follows the `DecodeNumerics` that
`TransformerConfig.decode_matmul` and `kernel_threads` resolve to
(`cpu.dispatch.decode_numerics`), or that a caller passes explicitly; a
decode loop's token choice follows its decode fn's `token_choice`. Most
checks inspect the traced program (jaxpr), which compiles nothing.
"""

import dataclasses
import functools
import logging
import pathlib
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import gin
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import inference
from t5x_speed import layers
from t5x_speed import network
from t5x_speed import steps
from t5x_speed.cpu import build
from t5x_speed.cpu import dispatch
from t5x_speed.cpu import matmul
from t5x_speed.cpu.dispatch import DecodeNumerics
import helpers
from helpers import tiny_config, tiny_model

SETTINGS = ('auto', 'kernel', 'xla')
KERNEL = build.available()
needs_kernel = absltest.skipUnless(KERNEL, 'kernel not built (no C++ compiler)')
PACKAGE = pathlib.Path(network.__file__).parent
GIN = PACKAGE / 'gin'


def _equations(jaxpr):
  """Every equation of a (closed) jaxpr, sub-jaxprs included, in order."""
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else (value,)):
        if hasattr(sub, 'eqns') or hasattr(getattr(sub, 'jaxpr', None),
                                           'eqns'):
          yield from _equations(sub)


def _ops(fn, *args):
  """(dot_general lhs shapes, kernel calls) of fn's program; a kernel call
  is (`threads`, weights), (`threads`, 'attention'), (None, 'gather'),
  (None, 'norm') or (`threads`, 'sample')."""
  dots, kernel_calls = [], []
  for eqn in _equations(jax.make_jaxpr(fn)(*args)):
    if eqn.primitive.name == 'dot_general':
      dots.append(tuple(eqn.invars[0].aval.shape))
    elif eqn.primitive.name == 'ffi_call':
      attributes = dict(eqn.params['attributes'])
      target = eqn.params['target_name']
      what = ('attention' if 'attention' in target else
              'gather' if 'gather' in target else
              'norm' if 'norm' in target else
              'sample' if 'sample' in target else len(eqn.invars) - 1)
      threads = attributes.get('threads')
      kernel_calls.append((None if threads is None else int(threads), what))
  return dots, kernel_calls


def _model(**numerics):
  """`tiny_model`'s module and parameters, with other decode numerics."""
  module, params = tiny_model(**numerics.pop('shape', {}))
  config = dataclasses.replace(module.config, **numerics)
  return network.SpeedTransformer(config), params


def _no_kernel():
  """Patches the kernels away, as without a C++ compiler."""
  return mock.patch.object(build, 'available', return_value=False)


class ConfigTest(parameterized.TestCase):

  def test_defaults(self):
    cfg = network.TransformerConfig()
    self.assertEqual((cfg.decode_matmul, cfg.kernel_threads), ('auto', 0))
    self.assertEqual(network.step_numerics(cfg),
                     DecodeNumerics(kernel=KERNEL,
                                    row_matvecs=0 if KERNEL else 4))
    self.assertEqual(
        network.step_numerics(tiny_config(decode_matmul='xla',
                                          kernel_threads=2)),
        DecodeNumerics(kernel=False, row_matvecs=4, threads=2))

  @parameterized.parameters(
      ('decode_matmul', dict(decode_matmul='gemv')),
      ('decode_matmul', dict(decode_matmul='XLA')),
      ('decode_matmul', dict(decode_matmul=None)),
      ('kernel_threads', dict(kernel_threads=-1)),
      ('kernel_threads', dict(kernel_threads=1.5)),
      ('kernel_threads', dict(kernel_threads=True)),
  )
  def test_bad_value_names_the_field(self, field, kwargs):
    with self.assertRaisesRegex(ValueError, f'TransformerConfig.{field}'):
      network.TransformerConfig(**kwargs)
    with self.assertRaisesRegex(ValueError, field):
      dispatch.decode_numerics(**kwargs)

  @parameterized.parameters(
      ('kernel', dict(kernel=1)), ('row_matvecs', dict(row_matvecs=-1)),
      ('threads', dict(threads=2.0)), ('threads', dict(threads=False)))
  def test_bad_numerics_name_the_field(self, field, kwargs):
    with self.assertRaisesRegex(ValueError, f'DecodeNumerics.{field}'):
      DecodeNumerics(**kwargs)

  def test_set_from_gin(self):
    gin.clear_config()
    self.addCleanup(gin.clear_config)
    gin.parse_config_files_and_bindings(
        [str(GIN / 'architectures' / 'decoder_only.gin')],
        ['NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3', 'DROPOUT_RATE = 0.0',
         "network.TransformerConfig.decode_matmul = 'xla'",
         'network.TransformerConfig.kernel_threads = 1'])
    cfg = gin.query_parameter(
        'network.SpeedTransformer.config').scoped_configurable_fn()
    self.assertEqual((cfg.decode_matmul, cfg.kernel_threads), ('xla', 1))
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        [str(GIN / 'architectures' / 'decoder_only.gin')],
        ['NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3', 'DROPOUT_RATE = 0.0'])
    cfg = gin.query_parameter(
        'network.SpeedTransformer.config').scoped_configurable_fn()
    self.assertEqual((cfg.decode_matmul, cfg.kernel_threads), ('auto', 0))

  def test_no_ambient_state(self):
    # Numerics and results travel as arguments and return values: nothing
    # in the library keeps them in a context variable.
    for path in PACKAGE.rglob('*.py'):
      self.assertNotIn('contextvars', path.read_text(), path)


class MatmulPathTest(absltest.TestCase):
  """The decision itself, for every setting and row count."""

  ROWS = (1, 2, 4, 5, matmul.MAX_ROWS, matmul.MAX_ROWS + 1)

  def _choices(self, setting, weights=1000):
    numerics = dispatch.decode_numerics(setting)
    return [numerics.matmul_path(rows, weights).value for rows in self.ROWS]

  def test_decode_step_without_kernel(self):
    gemv = ['xla', 'row_matvecs', 'row_matvecs', 'xla', 'xla', 'xla']
    self.assertEqual(self._choices('xla'), gemv)
    with _no_kernel():
      for setting in SETTINGS:
        self.assertEqual(self._choices(setting), gemv, setting)
    # Weights beyond the last-level cache: one dot for all rows.
    big = dispatch.MATVEC_MAX_WEIGHT_ELEMENTS + 1
    self.assertEqual(set(self._choices('xla', big)), {'xla'})
    # Per-row GEMVs switched off.
    plain = DecodeNumerics(kernel=False, row_matvecs=0)
    self.assertEqual({plain.matmul_path(r, 1000).value for r in self.ROWS},
                     {'xla'})

  @needs_kernel
  def test_decode_step_with_kernel(self):
    kernel = ['kernel'] * 5 + ['xla']
    self.assertEqual(self._choices('auto'), kernel)
    self.assertEqual(self._choices('kernel'), kernel)

  def test_docstring_example(self):
    helpers.assert_doctests(dispatch)

  def test_max_speculative_rows(self):
    self.assertEqual(jax.default_backend(), 'cpu')
    self.assertEqual(dispatch.max_speculative_rows('auto'),
                     dispatch.CPU_MAX_SPECULATIVE_ROWS)
    self.assertIsNone(dispatch.max_speculative_rows(None))
    self.assertEqual(dispatch.max_speculative_rows(5), 5)
    with mock.patch.object(jax, 'default_backend', return_value='gpu'):
      self.assertIsNone(dispatch.max_speculative_rows('auto'))
    for bad in (0, 'none', 2.0, True):
      with self.assertRaisesRegex(ValueError, 'max_speculative_rows'):
        dispatch.max_speculative_rows(bad)


class FallbackMessageTest(absltest.TestCase):

  def test_kernel_that_cannot_load_is_logged_once(self):
    load = build._load  # pylint: disable=protected-access
    load.cache_clear()
    # The next real load finds the built library and its registration cached.
    self.addCleanup(load.cache_clear)
    with mock.patch.object(build, 'build',
                           side_effect=RuntimeError('no C++ compiler found')):
      with self.assertLogs('t5x_speed.cpu.build', logging.WARNING) as logs:
        numerics = {dispatch.decode_numerics('kernel') for _ in range(3)}
        self.assertIsNone(build.isa())
        self.assertFalse(build.available())
    self.assertEqual(numerics, {DecodeNumerics(kernel=False, row_matvecs=4)})
    self.assertLen(logs.output, 1)
    self.assertIn('CPU kernels unavailable, using XLA\'s ops', logs.output[0])
    self.assertIn('no C++ compiler found', logs.output[0])

  def test_kernel_on_another_backend_is_logged_once(self):
    dispatch._notice.cache_clear()  # pylint: disable=protected-access
    with mock.patch.object(jax, 'default_backend', return_value='gpu'):
      with self.assertLogs('t5x_speed.cpu.dispatch', logging.WARNING) as logs:
        for setting in ('kernel', 'kernel', 'auto'):
          self.assertEqual(dispatch.decode_numerics(setting),
                           DecodeNumerics(kernel=False, row_matvecs=0))
        logging.getLogger('t5x_speed.cpu.dispatch').warning('end')
    self.assertLen(logs.output, 2)
    self.assertIn('decode_matmul=\'kernel\' needs the CPU backend, not gpu',
                  logs.output[0])

  @needs_kernel
  def test_isa_names_the_loaded_kernel(self):
    self.assertIn(build.isa(), ('avx512_bf16', 'avx512', 'avx2', 'portable'))


class TracedProgramTest(parameterized.TestCase):
  """What each pass compiles to, for every setting, with and without kernel.

  The tiny model (G=2, R=3, width 32, MLP 48, 4 heads of 8) has per virtual
  layer 4 attention projections, 3 MLP projections and 2 attention products
  (9 dot_generals); a full pass runs 6 virtual layers and 3 exits: 57 dots.
  """

  def _full_pass(self, module, params, kernel):
    tokens = jnp.array([[3, 5, 7]])    # 3 rows: few enough for per-row GEMVs
    with mock.patch.object(build, 'available', return_value=kernel):
      train = _ops(lambda p: module.apply({'params': p}, tokens, tokens,
                                          enable_dropout=False), params)
      prefill = _ops(lambda p: module.apply({'params': p}, tokens,
                                            jnp.array([3]),
                                            method='prefill'), params)
    return train, prefill

  @parameterized.product(setting=SETTINGS, kernel=(False, True))
  def test_full_sequence_pass_is_plain_dots(self, setting, kernel):
    module, params = _model(decode_matmul=setting)
    (train, train_ffi), (prefill, prefill_ffi) = self._full_pass(
        module, params, kernel)
    self.assertEqual((train_ffi, prefill_ffi), ([], []))
    self.assertLen(train, 57)
    # Every projection multiplies all 3 rows at once.
    self.assertTrue(all(len(s) >= 2 for s in train), train)
    # Prefill: 6 layers over the 3 rows, and each exit scores one row.
    self.assertLen(prefill, 6 * 9 + 3)
    self.assertTrue(all(len(s) >= 2 for s in prefill), prefill)

  def _steps(self, module, params, kernel):
    """Programs of decode_step (1 row) and speed_step (3 rows) at batch 1."""
    _, cache = jax.eval_shape(lambda p: module.apply(
        {'params': p}, jnp.ones((1, 8), jnp.int32), jnp.array([4]),
        method='prefill'), params)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
    apply = lambda p, *a, **k: module.apply({'params': p}, *a, **k)
    with mock.patch.object(build, 'available', return_value=kernel):
      greedy = _ops(lambda p: apply(p, jnp.array([3]), jnp.array([4]), cache,
                                    method='decode_step'), params)
      speed = _ops(lambda p: apply(p, jnp.array([3]), jnp.zeros((1, 2, 32)),
                                   jnp.array([[4, 3, 2]]), cache,
                                   method='speed_step'), params)
    return greedy, speed

  def test_decode_step_with_xla_has_no_kernel_call(self):
    module, params = tiny_model(decode_matmul='xla')
    (greedy, greedy_ffi), (speed, speed_ffi) = self._steps(module, params,
                                                           kernel=KERNEL)
    self.assertEqual((greedy_ffi, speed_ffi), ([], []))
    self.assertLen(greedy, 6 * 9 + 1)
    # SPEED's 3 rows: the 7 projections of each of the 2 unique layers and
    # the classifier are one GEMV per row; the attention products are not
    # weight matmuls.
    self.assertLen(speed, 2 * (7 * 3 + 2) + 3)
    # A row of the one-axis inputs (all but the output projection) is 1-D.
    self.assertEqual(sum(len(s) == 1 for s in speed), 2 * 6 * 3)

  @needs_kernel
  def test_decode_step_with_auto_calls_the_kernel(self):
    for setting, threads in (('auto', 0), ('kernel', 0), ('auto', 3)):
      module, params = _model(decode_matmul=setting, kernel_threads=threads)
      (greedy, greedy_ffi), (speed, speed_ffi) = self._steps(module, params,
                                                             kernel=True)
      # The token's embedding row; per virtual layer: its norm, q/k/v as
      # one call, the cache writes and attention, its output projection,
      # the MLP's norm, its two inputs as one, its output; then the final
      # norm and the classifier. No XLA dot is left.
      norm = (None, 'norm')
      layer = [norm, (threads, 3), (threads, 'attention'), (threads, 1),
               norm, (threads, 2), (threads, 1)]
      gather, classifier = [(None, 'gather')], [norm, (threads, 1)]
      self.assertEqual(greedy_ffi, gather + layer * 6 + classifier)
      self.assertEqual(speed_ffi, gather + layer * 2 + classifier)
      self.assertEqual((greedy, speed), ([], []))

  def test_decode_step_without_kernel_has_no_kernel_call(self):
    for setting in SETTINGS:
      module, params = _model(decode_matmul=setting)
      (_, greedy_ffi), (_, speed_ffi) = self._steps(module, params,
                                                    kernel=False)
      self.assertEqual((greedy_ffi, speed_ffi), ([], []), setting)


  def test_explicit_numerics_decide(self):
    # The config says 'xla'; numerics passed to the step (as BoundSteps
    # passes its own) decide, per-row GEMVs included.
    module, params = tiny_model(decode_matmul='xla')
    _, cache = jax.eval_shape(lambda p: module.apply(
        {'params': p}, jnp.ones((1, 8), jnp.int32), jnp.array([4]),
        method='prefill'), params)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)

    def speed(numerics):
      return _ops(lambda p: module.apply(
          {'params': p}, jnp.array([3]), jnp.zeros((1, 2, 32)),
          jnp.array([[4, 3, 2]]), cache, None, numerics,
          method='speed_step'), params)

    # One dot per projection over all 3 rows, 2 attention products per
    # layer, one classifier dot.
    dots, calls = speed(DecodeNumerics(row_matvecs=0))
    self.assertLen(dots, 2 * (7 + 2) + 1)
    self.assertEqual(calls, [])
    dots, _ = speed(DecodeNumerics(row_matvecs=4))
    self.assertLen(dots, 2 * (7 * 3 + 2) + 3)
    if KERNEL:
      dots, calls = speed(DecodeNumerics(kernel=True, threads=2))
      self.assertEqual(dots, [])
      self.assertIn((2, 'attention'), calls)
      self.assertEqual({t for t, what in calls
                        if what not in ('gather', 'norm')}, {2})

  def test_bound_steps_resolve_once_and_pass_their_numerics(self):
    module, params = tiny_model(decode_matmul='xla', kernel_threads=1)
    bound = steps.BoundSteps(module, params)
    self.assertEqual(bound.numerics, network.step_numerics(module.config))
    mine = DecodeNumerics(row_matvecs=0)
    bound = steps.BoundSteps(module, params, numerics=mine)
    inputs = jnp.array([[0, 3, 4, 0, 0, 0]])
    cache = bound.prefill(inputs, jnp.array([2]))
    dots, _ = _ops(lambda c: bound.decode_step(jnp.array([4]), jnp.array([2]),
                                               c), cache)
    self.assertLen(dots, 6 * 9 + 1)
    with self.assertRaisesRegex(ValueError, 'numerics'):
      steps.BoundSteps(module, params, numerics='xla')

  @parameterized.parameters('greedy', 'speed')
  def test_token_choice_reaches_the_loop(self, method):
    module, params = tiny_model()
    bound = steps.BoundSteps(module, params)
    inputs = jnp.array([[0, 3, 4, 0, 0, 0, 0]])
    lengths = jnp.array([2])
    fn = {'greedy': decoding.greedy_decode,
          'speed': decoding.speed_decode}[method]

    def run(choice):
      cache = bound.prefill(inputs, lengths)
      return fn(**bound.decode_fn_kwargs(fn, inputs, cache, lengths),
                eos_id=1, token_choice=choice)

    samples = {choice: sum(what == 'sample' for _, what in _ops(
        lambda: run(choice))[1]) for choice in SETTINGS}
    self.assertEqual(samples['xla'], 0)
    self.assertEqual(samples['auto'], int(KERNEL))
    self.assertEqual(samples['kernel'], int(KERNEL))
    xla, auto = jax.jit(lambda: run('xla'))(), jax.jit(lambda: run('auto'))()
    np.testing.assert_array_equal(xla.sequences, auto.sequences)
    np.testing.assert_allclose(xla.scores, auto.scores, rtol=1e-5)
    with self.assertRaisesRegex(ValueError, 'token_choice'):
      run('fast')


class DecodeResultsTest(absltest.TestCase):

  @needs_kernel
  def test_kernel_and_xla_give_the_same_tokens(self):
    rng = np.random.RandomState(0)
    prompts = jnp.asarray(rng.randint(2, 61, size=(3, 5)))
    lengths = jnp.asarray([5, 2, 3])
    tokens = {}
    for setting in ('kernel', 'xla'):
      module, params = _model(decode_matmul=setting)
      for method, kw in (('greedy', {}),
                         # SPEED's pipeline even at 3 x R rows.
                         ('speed', dict(max_speculative_rows=None))):
        tokens[setting, method] = np.asarray(inference.generate(
            module, params, prompts, lengths, max_decode_steps=12,
            method=method, eos_id=1, **kw).tokens)
    for method in ('greedy', 'speed'):
      np.testing.assert_array_equal(tokens['kernel', method],
                                    tokens['xla', method], method)

  @needs_kernel
  def test_kernel_threads_do_not_change_a_decode_step(self):
    # Weights of 256 x 512 float32 (512 KiB) are split across threads.
    shape = dict(emb_dim=256, mlp_dim=512, num_heads=4, head_dim=64)
    module, params = _model(shape=shape)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, 61, (2, 8)), jnp.int32)
    _, cache = jax.jit(lambda p: module.apply(
        {'params': p}, tokens, jnp.array([4, 6]), method='prefill'))(params)
    carry = jnp.asarray(rng.standard_normal((2, 2, 256)), jnp.float32)
    positions = jnp.array([[4, 3, 2], [6, 5, -1]])
    logits = []
    for threads in (1, 0):
      module, _ = _model(shape=shape, kernel_threads=threads)
      step = jax.jit(functools.partial(module.apply, method='speed_step'))
      out, hidden, _ = step({'params': params}, tokens[:, 4], carry,
                            positions, cache)
      logits.append((np.asarray(out).view(np.uint32),
                     np.asarray(hidden).view(np.uint32)))
    for a, b in zip(*logits):
      np.testing.assert_array_equal(a, b)


class MovedValuesTest(parameterized.TestCase):
  """16-bit gathers and scatters move bits, and differentiate as plain ones."""

  @parameterized.parameters('float32', 'bfloat16')
  def test_embedding_gradient_is_the_plain_gathers(self, dtype):
    embed = layers.Embed(num_embeddings=7, features=3, dtype=dtype)
    params = embed.init(jax.random.PRNGKey(0), jnp.zeros((1,), jnp.int32))
    tokens = jnp.asarray([[3, 0, 3], [6, 3, 1]])
    weight = jnp.arange(18.0).reshape(2, 3, 3)
    loss = lambda table: jnp.sum(weight * table.astype(jnp.float32))
    # Jitted: op by op, each gather, scatter and cast compiles on its own.
    got = jax.jit(jax.grad(lambda p: loss(embed.apply(p, tokens))))(params)
    plain = jax.jit(jax.grad(lambda p: loss(jnp.asarray(
        p['params']['embedding'], dtype)[tokens])))(params)
    grad = np.asarray(got['params']['embedding'])
    np.testing.assert_array_equal(grad, plain['params']['embedding'])
    # Row 3 is gathered three times: weights 0-2, 6-8 and 12-14 summed.
    np.testing.assert_array_equal(grad[3], [18.0, 21.0, 24.0])
    np.testing.assert_array_equal(grad[[2, 4, 5]], 0.0)

  def test_cache_write_gradient_is_the_plain_scatters(self):
    cache = jnp.ones((2, 1, 1, 4, 2), jnp.bfloat16)
    update = jnp.full((1, 1, 1, 2), 3.0, jnp.bfloat16)
    weight = jnp.arange(16.0).reshape(2, 1, 1, 4, 2)

    def loss(cache, update):
      written = layers.write_cache(cache, (1,), jnp.array([[2]]), update)
      return jnp.sum(weight * written.astype(jnp.float32))

    # One compiled program: run op by op, each of the write's ops and their
    # transposes compiles on its own.
    d_cache, d_update = jax.jit(jax.grad(loss, argnums=(0, 1)))(cache, update)
    want = np.asarray(weight, np.float32).copy()
    want[1, 0, 0, 2] = 0.0      # overwritten entries pass no gradient back
    np.testing.assert_array_equal(np.asarray(d_cache, np.float32), want)
    np.testing.assert_array_equal(np.asarray(d_update, np.float32),
                                  [[[[12.0, 13.0]]]])


if __name__ == '__main__':
  absltest.main()
