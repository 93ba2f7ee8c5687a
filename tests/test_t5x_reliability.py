"""SpeedDecoderOnlyModel.predict_batch with token ids outside the vocabulary.

Concrete batches raise; under `jit`, as T5X's binaries call it, our decode
fns end such an example with no tokens and a NaN score, and SPEED says why in
aux['speed/invalid'] (skipped when T5X is absent).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import pytest

pytest.importorskip('t5x')

from t5x_speed import decode_args  # pylint: disable=g-import-not-at-top
from t5x_speed import decoding  # pylint: disable=g-import-not-at-top
import t5x_helpers as th


class PredictBatchTokenRangeTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.batch = th.prefix_lm_batch(seed=4, batch=3)
    # Example 0's first prompt token: 170 in a vocabulary of 37.
    self.bad = dict(self.batch, decoder_input_tokens=self.batch[
        'decoder_input_tokens'].at[0, 1].set(170))

  @parameterized.parameters(decoding.speed_decode, decoding.greedy_decode)
  def test_concrete_batch_raises(self, decode_fn):
    model = th.speed_model(decode_fn=decode_fn)
    params = th.init_params(model, self.batch)
    with self.assertRaisesRegex(ValueError, r'token id 170 at \[0, 1\].*'
                                r'\[0, 37\)'):
      model.predict_batch(params, self.bad)

  @parameterized.parameters(decoding.speed_decode, decoding.greedy_decode)
  def test_traced_batch_flags_the_example(self, decode_fn):
    model = th.speed_model(decode_fn=decode_fn)
    params = th.init_params(model, self.batch)
    predict = jax.jit(model.predict_batch_with_aux)
    decodes, aux = predict(params, self.bad)
    good, good_aux = predict(params, self.batch)
    scores = np.asarray(aux['scores'])
    self.assertTrue(np.isnan(scores[0]))
    np.testing.assert_array_equal(decodes[1:], good[1:])
    np.testing.assert_allclose(scores[1:], good_aux['scores'][1:], rtol=1e-6)
    if decode_fn is decoding.speed_decode:
      np.testing.assert_array_equal(aux['speed/invalid'],
                                    [decode_args.INVALID_TOKEN_ID, 0, 0])


if __name__ == '__main__':
  absltest.main()
