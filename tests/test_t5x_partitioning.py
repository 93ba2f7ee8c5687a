"""Train and infer under T5X's PjitPartitioner on a 2-device CPU mesh.

conftest.py gives the session two host devices. Data parallelism
(num_partitions=1) and model parallelism (num_partitions=2) must reproduce
the unpartitioned single-device run, for the decoder-only and the
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


class DataParallelPartitioner(partitioning.PjitPartitioner):
  """On CPU, T5X's default mesh puts every local device on the 'model' axis;
  this one puts them on 'data'."""

  @property
  def mesh(self):
    return Mesh(np.array(jax.devices()).reshape(-1, 1), ('data', 'model'))


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


def _train_and_predict(family, num_partitions):
  """Trains STEPS steps and predicts; None means unpartitioned jit."""
  model, batch = _even_model(family)
  shapes = {k: v.shape for k, v in batch.items()}
  types = {k: v.dtype for k, v in batch.items()}
  step_fn = functools.partial(trainer.train_with_lr, model=model,
                              num_microbatches=None)
  rng = jax.random.PRNGKey(0)
  if num_partitions is None:
    assert jax.device_count() == 2
    initializer = utils.TrainStateInitializer(
        model.optimizer_def, model.get_initial_variables, shapes,
        partitioning.PjitPartitioner(num_partitions=1), types)
    state = jax.device_get(initializer.from_scratch(rng))
    state = jax.device_put(state, jax.devices()[0])
    train_step = jax.jit(step_fn)
    predict = jax.jit(model.predict_batch_with_aux)
  else:
    cls = (partitioning.PjitPartitioner if num_partitions > 1 else
           DataParallelPartitioner)
    partitioner = cls(
        num_partitions=num_partitions,
        logical_axis_rules=partitioning.standard_logical_axis_rules())
    assert partitioner.mesh.shape['model'] == num_partitions
    initializer = utils.TrainStateInitializer(
        model.optimizer_def, model.get_initial_variables, shapes, partitioner,
        types)
    axes = initializer.train_state_axes
    state = initializer.from_scratch(rng)
    data = partitioner.data_partition_spec
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

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.reference = {}

  @parameterized.product(family=('decoder_only', 'encoder_decoder'),
                         num_partitions=(1, 2))
  def test_matches_single_device(self, family, num_partitions):
    if family not in self.reference:
      self.reference[family] = _train_and_predict(family, None)
    params, losses, decodes, aux, shard = _train_and_predict(family,
                                                             num_partitions)
    ref_params, ref_losses, ref_decodes, ref_aux, _ = self.reference[family]
    # Model parallelism splits the MLP's hidden dimension over 2 devices.
    self.assertEqual(shard, (32, 48 // num_partitions))
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
