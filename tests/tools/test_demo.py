"""The demo task, the demo's training and main job, and the bench's replay."""

import json
import os
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import seqio

from tools import demo
from tools import demo_model
from tools import replay
from t5x_speed import inference
from t5x_speed import network
from t5x_speed.testing import random_params
from t5x_speed.tasks import demo as demo_task

TINY = demo_model.DemoSettings(width=16, steps=4, batch_size=2)


class NumbersTaskTest(absltest.TestCase):

  def test_number_to_words(self):
    cases = {0: 'zero', 7: 'seven', 15: 'fifteen', 20: 'twenty',
             21: 'twenty-one', 100: 'one hundred', 101: 'one hundred one',
             999: 'nine hundred ninety-nine', 1000: 'one thousand',
             40723: 'forty thousand seven hundred twenty-three',
             99999: 'ninety-nine thousand nine hundred ninety-nine'}
    for n, words in cases.items():
      self.assertEqual(demo_task.number_to_words(n), words)
    with self.assertRaisesRegex(ValueError, 'n must be'):
      demo_task.number_to_words(1_000_000)

  def test_held_out_numbers_never_train(self):
    numbers = lambda split, n: {
        int(x) for text in demo_task.make_examples(split, n)[0]
        for x in text[len('spell: '):].split(', ')}
    train, held = numbers('train', 3000), numbers('validation', 500)
    self.assertGreater(len(held), 100)
    self.assertEmpty(train & held)

  def test_demo_model_names_the_registered_task(self):
    # tools.demo_model keeps these without importing TensorFlow.
    self.assertEqual(demo_model.TASK, demo_task.DEMO_TASK)
    self.assertEqual(demo_model.LENGTHS, demo_task.DEMO_SEQUENCE_LENGTH)
    self.assertEqual(demo_model.task().name, demo_task.DEMO_TASK)

  def test_examples_through_the_decoder_feature_converter(self):
    task = seqio.get_mixture_or_task(demo_task.DEMO_TASK)
    lengths = demo_task.DEMO_SEQUENCE_LENGTH
    ds = task.get_dataset(lengths, split='validation', shuffle=False)
    ex = next(ds.as_numpy_iterator())
    vocab = task.output_features['targets'].vocabulary
    numbers = ex['inputs_pretokenized'].decode()[len('spell: '):].split(', ')
    self.assertEqual(vocab.decode(ex['targets'].tolist()), ', '.join(
        demo_task.number_to_words(int(n)) for n in numbers))
    self.assertEqual(ex['targets'][-1], 1)  # EOS
    batch = next(seqio.DecoderFeatureConverter(pack=False)(ds, lengths).batch(
        2).as_numpy_iterator())
    self.assertEqual(batch['decoder_input_tokens'].shape, (2, 136))
    self.assertEqual(set(batch), {
        'decoder_target_tokens', 'decoder_input_tokens', 'decoder_loss_weights',
        'decoder_causal_attention'})


class DemoModelTest(absltest.TestCase):

  def test_train_save_and_reload(self):
    out = tempfile.mkdtemp()
    params, meta = demo_model.load_or_train(TINY, out, log=lambda *a: None)
    self.assertLen(meta['history'], 1)
    record = meta['history'][0]
    for key in ('exit_1/loss', 'exit_3/loss', 'exit_2/flip_rate',
                'exit_3/accuracy'):
      self.assertIn(key, record)
    again, _ = demo_model.load_or_train(TINY, out, log=lambda *a: None)
    jax.tree.map(np.testing.assert_array_equal, params, again)

  def test_demo_main_job_runs(self):
    out = tempfile.mkdtemp()
    # TINY's settings: the training step compiles once for both tests.
    code = demo.main(['--width', str(TINY.width), '--steps', str(TINY.steps),
                      '--batch_size', str(TINY.batch_size), '--prompts', '2',
                      '--repeats', '1', '--replay_width', '32',
                      '--replay_prompts', '2', '--out', out])
    self.assertEqual(code, 0)
    for name in ('consistency.png', 'latency.png', 'results.json'):
      self.assertTrue(os.path.exists(os.path.join(out, name)), name)
    with open(os.path.join(out, 'results.json')) as f:
      results = json.load(f)
    self.assertTrue(results['identical'])
    self.assertEqual(results['speed']['tokens'], results['greedy']['tokens'])
    # SPEED's speedup is over the faster of greedy's two numerics.
    for part in (results, results['replay']):
      tps = {m: part[m]['tokens_per_second'] for m in ('greedy', 'greedy_xla',
                                                       'speed')}
      self.assertAlmostEqual(part['speedup'], tps['speed'] / max(
          tps['greedy'], tps['greedy_xla']))
      self.assertEqual(part['best_greedy'], max(('greedy', 'greedy_xla'),
                                                key=tps.get))
      self.assertAlmostEqual(part['speedup_same_numerics'],
                             tps['speed'] / tps['greedy'])
    self.assertTrue(results['replay']['identical'])
    self.assertEqual(results['replay']['width'], 32)
    self.assertGreater(results['replay']['speedup'], 0)
    self.assertLen(results['consistency']['agrees_with_final'], 3)
    self.assertAlmostEqual(results['consistency']['agrees_with_final'][-1],
                           1.0)
    # Where the wall time went, imports included in the total.
    self.assertFalse(results['model_loaded'])
    wall = results['wall_seconds']
    self.assertEqual(set(wall), {'model', 'decode', 'replay', 'total'})
    self.assertGreater(wall['total'],
                       wall['model'] + wall['decode'] + wall['replay'])


class ReplayTest(absltest.TestCase):
  """A recorded SPEED run replayed on another model of the same depth."""

  @classmethod
  def setUpClass(cls):
    # Read-only in the tests: built once for both.
    super().setUpClass()
    source_settings = demo_model.DemoSettings(width=16, num_repeats=3)
    cls.source = network.SpeedTransformer(source_settings.config())
    cls.source_params = random_params(cls.source, 1)
    # Another model of the same depth, with different weights and width.
    cls.other = network.SpeedTransformer(network.TransformerConfig(
        vocab_size=demo_model.VOCAB_SIZE, emb_dim=24, num_heads=2,
        head_dim=12, mlp_dim=32, num_unique_layers=1, num_repeats=3))
    cls.other_params = random_params(cls.other, 2)
    cls.prompts, cls.lengths, _ = demo_model.held_out(3)

  def assert_replays(self, rec, sequential, speed, sample=None):
    """Both replays give the recorded tokens, SPEED the recorded schedule."""
    args = [jnp.asarray(rec[k]) for k in ('prompts', 'lengths', 'by_position',
                                          'predictions')]
    speed_result = replay.replay_decoder(speed, self.other)(
        self.other_params, *args, sample=sample)
    result = replay.replay_decoder(sequential, self.other)(
        self.other_params, *args, sample=sample)
    speed_decodes, stats = speed_result.sequences, speed_result.stats
    decodes = result.sequences
    self.assertIsNone(result.stats)
    np.testing.assert_array_equal(speed_decodes, decodes)
    self.assertEqual(int(np.sum(stats.flushes)), rec['summary']['flushes'])
    self.assertEqual(int(np.sum(stats.num_tokens)), rec['tokens'])
    self.assertEqual(int(np.sum(stats.num_steps)),
                     rec['summary']['example_steps'])
    # The forced tokens are the recorded model's output.
    produced = np.asarray(decodes)[:, 0]
    for b, length in enumerate(self.lengths):
      n = rec['row_tokens'][b]
      self.assertGreater(n, 0)
      np.testing.assert_array_equal(
          produced[b, length:length + n],
          rec['by_position'][b, length + 1:length + 1 + n])

  def test_replay_reproduces_the_recorded_schedule(self):
    rec = replay.record((self.source, self.source_params), self.prompts,
                       self.lengths)
    self.assert_replays(rec, 'greedy', 'speed')

  def test_sampled_replay_reproduces_the_sampled_schedule(self):
    # The sample_bench replay: the samplers, at temperature 1 with top-p,
    # draw the forced token (logit 1e9) whatever their noise.
    setting = dict(temperature=1.0, topp=0.9)
    out = inference.generate(
        self.source, self.source_params, self.prompts, self.lengths,
        max_decode_steps=demo_model.LENGTHS['targets'], method='speed_sample',
        bidirectional=True, record_schedule=True, rng=jax.random.PRNGKey(3),
        **setting)
    rec = replay.replay_record(out, self.prompts, self.lengths)
    self.assertGreater(rec['summary']['flushes'], 0)
    self.assert_replays(rec, 'sample', 'speed_sample', sample=dict(
        decode_rng=jax.random.PRNGKey(5),
        **{k: jnp.float32(v) for k, v in setting.items()}))


if __name__ == '__main__':
  absltest.main()
