"""The tools' trainer runs its step faster without changing what it computes:
data parallel over the devices with YNNPACK's fusions, against one device
with XLA's default compile (the step as it ran before)."""

from absl.testing import absltest
import jax
import numpy as np

from tools import trainer
import helpers
import test_finetune_agree

VOCAB = test_finetune_agree.VOCAB


class TrainerTest(absltest.TestCase):

  def test_data_parallel_devices(self):
    helpers.assert_doctests(trainer, min_examples=2)
    four = ['d0', 'd1', 'd2', 'd3']
    self.assertEqual(trainer.data_parallel_devices(8, four), four)
    self.assertEqual(trainer.data_parallel_devices(6, four), four[:3])
    self.assertEqual(trainer.data_parallel_devices(5, four), four[:1])
    self.assertEqual(trainer.data_parallel_devices(
        8, jax.devices()), jax.devices()[:4])

  def test_fast_step_computes_the_same_loss_and_gradients(self):
    module, _ = helpers.random_model(2, 3, 'cycle', 1, VOCAB)
    batches = test_finetune_agree._batches(count=3)
    recipe = trainer.Recipe(steps=3, learning_rate=1e-2, exit_agreement=0.5)
    devices = jax.devices()
    self.assertLen(devices, 4)       # tests/conftest.py: 4 host devices
    # What the step computes: loss, per-exit logs, statistics and
    # gradients of one batch, on one device with XLA's own compile and
    # sharded over 4 with the trainer's options.
    params = module.init(jax.random.PRNGKey(0),
                         batches[0]['decoder_input_tokens'][:1],
                         batches[0]['decoder_target_tokens'][:1],
                         enable_dropout=False)['params']
    batch = trainer.with_exit_positions(batches[0])
    replicated, rows = trainer.data_parallel_shardings(devices)

    def value_and_grad(options, params, batch):
      return jax.jit(jax.value_and_grad(
          lambda p, b: trainer.loss_and_statistics(module, recipe, p, b),
          has_aux=True), compiler_options=options)(params, batch)
    before = value_and_grad(None, params, batch)
    now = value_and_grad(trainer.CPU_COMPILER_OPTIONS,
                         jax.device_put(params, replicated),
                         jax.device_put(batch, rows))
    self.assertEqual(jax.tree.structure(before), jax.tree.structure(now))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(now)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    (_, (logs, stats)), _ = before
    self.assertLen(logs['loss'], 3)
    self.assertIn('exit_2/flip_rate', stats)
    # Without statistics only the logs (the steps between log points).
    # Without statistics (the steps between log points): the same loss,
    # logs and gradients, and no statistics.
    (loss, (logs_only, none)), grads = jax.jit(jax.value_and_grad(
        lambda p, b: trainer.loss_and_statistics(module, recipe, p, b,
                                                 statistics=False),
        has_aux=True))(params, batch)
    self.assertEqual(none, {})
    (ref_loss, (ref_logs, _)), ref_grads = before
    for a, b in zip(jax.tree.leaves((loss, logs_only, grads)),
                    jax.tree.leaves((ref_loss, ref_logs, ref_grads))):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

  def test_placed_batches(self):
    devices = jax.devices()
    _, rows = trainer.data_parallel_shardings(devices)
    batches = test_finetune_agree._batches(count=5, batch=4)
    read = []

    def source():
      for batch in batches:
        read.append(1)
        yield batch
    placed = trainer.placed_batches(source(), rows, depth=2)
    first = next(placed)
    self.assertLessEqual(len(read), 3)       # at most `depth` ahead
    np.testing.assert_array_equal(first['exit_positions'],
                                  trainer.with_exit_positions(
                                      batches[0])['exit_positions'])
    self.assertEqual(first['decoder_input_tokens'].sharding, rows)
    self.assertLen(list(placed), 4)           # the rest, in order
    odd = trainer.placed_batches(iter(test_finetune_agree._batches(
        count=1, batch=6)), rows)
    with self.assertRaisesRegex(ValueError, '6 rows does not split over 4'):
      next(odd)


if __name__ == '__main__':
  absltest.main()
