"""T5X's decoder parameters on the greedy-exact decode fns (SPEED, greedy)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from test_decoding import toy_pipeline

# Final exit predicts 5 6 7 8 9 10 1 for positions 1..7; the first exit
# differs at position 3, so SPEED flushes once.
TABLE = [[5, 6, 9, 8, 9, 10, 1, 0], [5, 6, 7, 8, 9, 10, 1, 0],
         [5, 6, 7, 8, 9, 10, 1, 0]]
EXPECTED = [5, 6, 7, 8, 9, 10, 1, 0, 0, 0]


def _decoders():
  step, to_logits, carry = toy_pipeline(TABLE)
  inputs = jnp.zeros((1, 10), jnp.int32)
  return {
      'greedy': lambda **k: decoding.greedy_decode(inputs, None, to_logits, 1,
                                                   **k),
      'speed': lambda **k: decoding.speed_decode(
          inputs, None, eos_id=1, pipeline_step_fn=step,
          num_stages=carry.shape[1] + 1, initial_carry=carry, **k),
  }


class DecodeParamsTest(parameterized.TestCase):

  @parameterized.product(
      name=('greedy', 'speed'),
      params=(dict(temperature=0.7, topk=40), dict(temperature=1.0, topk=0),
              dict(temperature=0.5, topk=0, topp=0.9),
              dict(temperature=jnp.array([0.0, 0.8]), topk=0)))
  def test_sampling_parameters_raise(self, name, params):
    with self.assertRaisesRegex(ValueError, 'would sample.*temperature_sample'):
      _decoders()[name](**params)

  @parameterized.product(
      name=('greedy', 'speed'),
      params=(dict(), dict(temperature=0.0, topk=40),
              dict(temperature=0.9, topk=1), dict(temperature=0.0, topp=0.9),
              dict(decode_rng=jax.random.PRNGKey(3)),
              dict(max_decode_steps_hard_limit=0)))
  def test_greedy_equivalent_parameters_decode_greedily(self, name, params):
    decodes, _ = _decoders()[name](**params)
    np.testing.assert_array_equal(decodes[0, 0], EXPECTED)

  @parameterized.parameters('greedy', 'speed')
  def test_hard_limit_caps_max_decode_steps(self, name):
    decode = _decoders()[name]
    for kwargs in (dict(max_decode_steps_hard_limit=2),
                   dict(max_decode_steps=5, max_decode_steps_hard_limit=2),
                   dict(max_decode_steps=jnp.array([5]),
                        max_decode_steps_hard_limit=2)):
      decodes, _ = decode(**kwargs)
      expected = EXPECTED[:2] + [0] * 8
      if 'max_decode_steps' not in kwargs:  # no limit to cap: T5X ignores it
        expected = EXPECTED
      np.testing.assert_array_equal(decodes[0, 0], expected)
    with self.assertRaisesRegex(ValueError, 'max_decode_steps_hard_limit'):
      decode(max_decode_steps=3, max_decode_steps_hard_limit=2.5)

  @parameterized.parameters('greedy', 'speed')
  def test_other_parameters_are_refused(self, name):
    with self.assertRaisesRegex(TypeError, 'alpha'):
      _decoders()[name](alpha=0.6)

  def test_traced_temperature_cannot_be_checked(self):
    decode = _decoders()['greedy']
    with self.assertRaisesRegex(ValueError, 'concrete temperature'):
      jax.jit(lambda t: decode(temperature=t))(0.0)


if __name__ == '__main__':
  absltest.main()
