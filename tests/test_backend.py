"""The numerics switches: which matmul, gather and scatter a traced pass uses.

Full-sequence passes must be XLA's plain dots whatever the setting (T5X
parity); a decode step follows `TransformerConfig.decode_matmul` and
`kernel_threads`. Most checks inspect the traced program (jaxpr), which
compiles nothing.
"""

import dataclasses
import doctest
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

from t5x_speed import backend
from t5x_speed import inference
from t5x_speed import layers
from t5x_speed import network
from t5x_speed import rowmatmul
from helpers import tiny_config, tiny_model

SETTINGS = ('auto', 'kernel', 'xla')
KERNEL = rowmatmul.available()
needs_kernel = absltest.skipUnless(KERNEL, 'kernel not built (no C++ compiler)')
GIN = pathlib.Path(network.__file__).parent / 'gin'


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
  is (`threads`, weights), (`threads`, 'attention') or (None, 'gather')."""
  dots, kernel_calls = [], []
  for eqn in _equations(jax.make_jaxpr(fn)(*args)):
    if eqn.primitive.name == 'dot_general':
      dots.append(tuple(eqn.invars[0].aval.shape))
    elif eqn.primitive.name == 'ffi_call':
      attributes = dict(eqn.params['attributes'])
      target = eqn.params['target_name']
      what = ('attention' if 'attention' in target else
              'gather' if 'gather' in target else len(eqn.invars) - 1)
      threads = attributes.get('threads')
      kernel_calls.append((None if threads is None else int(threads), what))
  return dots, kernel_calls


def _model(**numerics):
  """`tiny_model`'s module and parameters, with other decode numerics."""
  module, params = tiny_model(**numerics.pop('shape', {}))
  config = dataclasses.replace(module.config, **numerics)
  return network.SpeedTransformer(config), params


def _no_kernel():
  """Patches the kernel away, as without a C++ compiler."""
  return mock.patch.object(rowmatmul, 'available', return_value=False)


class ConfigTest(parameterized.TestCase):

  def test_defaults(self):
    cfg = network.TransformerConfig()
    self.assertEqual((cfg.decode_matmul, cfg.kernel_threads), ('auto', 0))
    self.assertEqual(cfg.decode_numerics, backend.DecodeNumerics('auto', 0))
    numerics = tiny_config(decode_matmul='xla', kernel_threads=2)
    self.assertEqual(numerics.decode_numerics,
                     backend.DecodeNumerics(matmul='xla', kernel_threads=2))

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
    numerics_field = {'decode_matmul': 'matmul'}.get(field, field)
    with self.assertRaisesRegex(ValueError, f'DecodeNumerics.{numerics_field}'):
      backend.DecodeNumerics(**{numerics_field: kwargs[field]})

  def test_set_from_gin(self):
    gin.clear_config()
    self.addCleanup(gin.clear_config)
    gin.parse_config_files_and_bindings(
        [str(GIN / 'architectures' / 'speed_base.gin')],
        ['NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3', 'DROPOUT_RATE = 0.0',
         "network.TransformerConfig.decode_matmul = 'xla'",
         'network.TransformerConfig.kernel_threads = 1'])
    cfg = gin.query_parameter(
        'network.SpeedTransformer.config').scoped_configurable_fn()
    self.assertEqual((cfg.decode_matmul, cfg.kernel_threads), ('xla', 1))
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        [str(GIN / 'architectures' / 'speed_base.gin')],
        ['NUM_UNIQUE_LAYERS = 2', 'NUM_REPEATS = 3', 'DROPOUT_RATE = 0.0'])
    cfg = gin.query_parameter(
        'network.SpeedTransformer.config').scoped_configurable_fn()
    self.assertEqual((cfg.decode_matmul, cfg.kernel_threads), ('auto', 0))


class ChooseMatmulTest(absltest.TestCase):
  """The decision itself, for every setting and row count."""

  def _choices(self, setting, weights=1000):
    with backend.decode_step(backend.DecodeNumerics(setting)):
      return [backend.choose_matmul(rows, weights).value
              for rows in (1, 2, 4, 5, rowmatmul.MAX_ROWS,
                           rowmatmul.MAX_ROWS + 1)]

  def test_full_sequence_passes_use_xla(self):
    for rows in (0, 1, 2, 3, 4, 64, 65, 4096):
      self.assertIs(backend.choose_matmul(rows, 1000), backend.Matmul.XLA)
    with _no_kernel():
      for rows in (2, 3, 4):
        self.assertIs(backend.choose_matmul(rows, 1000), backend.Matmul.XLA)

  def test_decode_step_without_kernel(self):
    gemv = ['xla', 'row_matvecs', 'row_matvecs', 'xla', 'xla', 'xla']
    self.assertEqual(self._choices('xla'), gemv)
    with _no_kernel():
      for setting in SETTINGS:
        self.assertEqual(self._choices(setting), gemv, setting)
    # Weights beyond the last-level cache: one dot for all rows.
    big = backend.MATVEC_MAX_WEIGHT_ELEMENTS + 1
    self.assertEqual(set(self._choices('xla', big)), {'xla'})

  @needs_kernel
  def test_decode_step_with_kernel(self):
    kernel = ['kernel'] * 5 + ['xla']
    self.assertEqual(self._choices('auto'), kernel)
    self.assertEqual(self._choices('kernel'), kernel)

  def test_docstring_example(self):
    result = doctest.testmod(backend)
    self.assertGreater(result.attempted, 0)
    self.assertEqual(result.failed, 0)

  def test_context_is_scoped(self):
    numerics = backend.DecodeNumerics('xla', 3)
    self.assertIsNone(backend.decode_numerics())
    with backend.decode_step(numerics):
      self.assertEqual(backend.decode_numerics(), numerics)
    self.assertIsNone(backend.decode_numerics())
    with self.assertRaisesRegex(TypeError, 'DecodeNumerics'):
      with backend.decode_step('xla'):
        pass


class FallbackMessageTest(absltest.TestCase):

  def test_kernel_that_cannot_load_is_logged_once(self):
    load = rowmatmul._load  # pylint: disable=protected-access
    load.cache_clear()
    # The next real load finds the built library and its registration cached.
    self.addCleanup(load.cache_clear)
    with mock.patch.object(rowmatmul, 'build',
                           side_effect=RuntimeError('no C++ compiler found')):
      with self.assertLogs('t5x_speed.rowmatmul', logging.WARNING) as logs:
        with backend.decode_step(backend.DecodeNumerics('kernel')):
          choices = {backend.choose_matmul(3, 10**8) for _ in range(3)}
        self.assertIsNone(rowmatmul.isa())
        self.assertFalse(rowmatmul.available())
    self.assertEqual(choices, {backend.Matmul.XLA})
    self.assertLen(logs.output, 1)
    self.assertIn('kernel unavailable, using XLA\'s dot', logs.output[0])
    self.assertIn('no C++ compiler found', logs.output[0])

  def test_kernel_on_another_backend_is_logged_once(self):
    with mock.patch.object(jax, 'default_backend', return_value='gpu'):
      with self.assertLogs('t5x_speed.backend', logging.WARNING) as logs:
        for setting in ('kernel', 'kernel', 'auto'):
          with backend.decode_step(backend.DecodeNumerics(setting)):
            self.assertIs(backend.choose_matmul(3, 10**8), backend.Matmul.XLA)
        logging.getLogger('t5x_speed.backend').warning('end')
    self.assertLen(logs.output, 2)
    self.assertIn('decode_matmul=\'kernel\' needs the CPU backend, not gpu',
                  logs.output[0])

  @needs_kernel
  def test_isa_names_the_loaded_kernel(self):
    self.assertIn(rowmatmul.isa(),
                  ('avx512_bf16', 'avx512', 'avx2', 'portable'))


class TracedProgramTest(parameterized.TestCase):
  """What each pass compiles to, for every setting, with and without kernel.

  The tiny model (G=2, R=3, width 32, MLP 48, 4 heads of 8) has per virtual
  layer 4 attention projections, 3 MLP projections and 2 attention products
  (9 dot_generals); a full pass runs 6 virtual layers and 3 exits: 57 dots.
  """

  def _full_pass(self, module, params, kernel):
    tokens = jnp.array([[3, 5, 7]])    # 3 rows: few enough for per-row GEMVs
    with mock.patch.object(rowmatmul, 'available', return_value=kernel):
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
    with mock.patch.object(rowmatmul, 'available', return_value=kernel):
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
      # The token's embedding row; per virtual layer: q/k/v as one call,
      # the cache writes and attention, its output projection, the two MLP
      # inputs as one, the MLP output; then the classifier. No XLA dot is
      # left.
      layer = [(threads, 3), (threads, 'attention'), (threads, 1),
               (threads, 2), (threads, 1)]
      gather, classifier = [(None, 'gather')], [(threads, 1)]
      self.assertEqual(greedy_ffi, gather + layer * 6 + classifier)
      self.assertEqual(speed_ffi, gather + layer * 2 + classifier)
      self.assertEqual((greedy, speed), ([], []))

  def test_decode_step_without_kernel_has_no_kernel_call(self):
    for setting in SETTINGS:
      module, params = _model(decode_matmul=setting)
      (_, greedy_ffi), (_, speed_ffi) = self._steps(module, params,
                                                    kernel=False)
      self.assertEqual((greedy_ffi, speed_ffi), ([], []), setting)


class DecodeResultsTest(absltest.TestCase):

  @needs_kernel
  def test_kernel_and_xla_give_the_same_tokens(self):
    rng = np.random.RandomState(0)
    prompts = jnp.asarray(rng.randint(2, 61, size=(3, 5)))
    lengths = jnp.asarray([5, 2, 3])
    tokens = {}
    for setting in ('kernel', 'xla'):
      module, params = _model(decode_matmul=setting)
      for method in ('greedy', 'speed'):
        # SPEED's pipeline even at 3 x R rows.
        tokens[setting, method] = np.asarray(inference.generate(
            module, params, prompts, lengths, max_decode_steps=12,
            method=method, eos_id=1, max_speculative_rows=None).tokens)
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
