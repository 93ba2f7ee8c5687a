"""Train and infer under T5X's PjitPartitioner on a 2-device CPU mesh.

conftest.py gives the session four host devices, here a 2 x 2 mesh of
'data' and 'model' axes (T5X's default mesh on CPU puts every device on
'model'), so one partitioned run shards the batch and the parameters at
once. It must
reproduce the unpartitioned single-device run, for the decoder-only and the
encoder-decoder model. Skipped when T5X is absent.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.sharding import Mesh
import numpy as np
import pytest

pytest.importorskip('t5x')

import seqio  # pylint: disable=g-import-not-at-top
from t5x import adafactor
from t5x import partitioning
from t5x import trainer
from t5x import utils
from t5x_speed import encoder_decoder
from t5x_speed import models
from t5x_speed import network
import t5x_helpers as th

STEPS = 3
LEARNING_RATE = 0.05


class MeshPartitioner(partitioning.PjitPartitioner):
  """T5X's partitioner on the first `rows` x `columns` devices, as a
  ('data', 'model') mesh."""

  def __init__(self, rows, columns, **kwargs):
    super().__init__(num_partitions=columns, **kwargs)
    self._shape = (rows, columns)

  @property
  def mesh(self):
    devices = jax.devices()[:self._shape[0] * self._shape[1]]
    return Mesh(np.array(devices).reshape(self._shape), ('data', 'model'))


def _even_model(family):
  """A tiny 2x3 model whose sharded dimensions (vocab, heads, mlp) divide by
  2, and a batch for it."""
  vocab = seqio.PassThroughVocabulary(38, 1)
  config = network.TransformerConfig(
      **{**th.TINY, 'vocab_size': 38}, num_unique_layers=2, num_repeats=3,
      num_encoder_layers=2 if family == 'encoder_decoder' else 0)
  if family == 'encoder_decoder':
    return (models.SpeedEncoderDecoderModel(
        encoder_decoder.SpeedEncoderDecoder(config), vocab, vocab,
        adafactor.Adafactor(), decode_fn=th.SPEED_PIPELINE),
            th.encdec_batch(seed=9, batch=4, inputs_length=14,
                            targets_length=16))
  return (models.SpeedDecoderOnlyModel(
      network.SpeedTransformer(config), vocab, adafactor.Adafactor(),
      inputs_bidirectional_attention=True, decode_fn=th.SPEED_PIPELINE),
          th.prefix_lm_batch(seed=9, batch=4, length=16))


def _train_and_predict(family, partitioned):
  """Trains STEPS steps and predicts, on the 2 x 2 mesh or unpartitioned."""
  model, batch = _even_model(family)
  shapes = {k: v.shape for k, v in batch.items()}
  types = {k: v.dtype for k, v in batch.items()}
  step_fn = functools.partial(trainer.train_with_lr, model=model,
                              num_microbatches=None)
  rng = jax.random.PRNGKey(0)
  if not partitioned:
    initializer = utils.TrainStateInitializer(
        model.optimizer_def, model.get_initial_variables, shapes,
        MeshPartitioner(1, 1), types)
    state = jax.device_get(initializer.from_scratch(rng))
    state = jax.device_put(state, jax.devices()[0])
    train_step = jax.jit(step_fn)
    predict = jax.jit(model.predict_batch_with_aux)
  else:
    partitioner = MeshPartitioner(
        2, 2, logical_axis_rules=partitioning.standard_logical_axis_rules())
    assert dict(partitioner.mesh.shape) == {'data': 2, 'model': 2}
    initializer = utils.TrainStateInitializer(
        model.optimizer_def, model.get_initial_variables, shapes, partitioner,
        types)
    axes = initializer.train_state_axes
    state = initializer.from_scratch(rng)
    data = partitioner.data_partition_spec
    assert data == jax.sharding.PartitionSpec('data'), data
    train_step = partitioner.partition(
        step_fn, in_axis_resources=(axes, data, None, None),
        out_axis_resources=(axes, None))
    predict = partitioner.partition(
        model.predict_batch_with_aux, in_axis_resources=(axes.params, data),
        out_axis_resources=None)
  losses = []
  for step in range(STEPS):
    state, metrics = train_step(state, batch, LEARNING_RATE,
                                jax.random.PRNGKey(step))
    losses.append(float(jax.device_get(metrics['loss'].compute())))
  decodes, aux = predict(state.params, batch)
  wi = state.params['decoder']['layers_0']['mlp']['wi_0']['kernel']
  return (jax.device_get(state.params), losses, np.asarray(decodes),
          jax.device_get(aux), wi.sharding.shard_shape(wi.shape))


class PartitioningTest(parameterized.TestCase):

  @parameterized.parameters('decoder_only', 'encoder_decoder')
  def test_matches_single_device(self, family):
    ref_params, ref_losses, ref_decodes, ref_aux, _ = _train_and_predict(
        family, partitioned=False)
    params, losses, decodes, aux, shard = _train_and_predict(
        family, partitioned=True)
    # Model parallelism splits the MLP's hidden dimension over 2 devices.
    self.assertEqual(shard, (32, 48 // 2))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    self.assertLess(ref_losses[-1], ref_losses[0])  # it did train
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                         atol=1e-6),
                 params, ref_params)
    np.testing.assert_array_equal(decodes, ref_decodes)
    np.testing.assert_array_equal(aux['speed/num_steps'],
                                  ref_aux['speed/num_steps'])


if __name__ == '__main__':
  absltest.main()
