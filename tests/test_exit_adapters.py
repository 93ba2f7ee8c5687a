"""Exit adapters: a model with fresh adapters computes what it computed
without them; trained (here: random) adapters move the early exits only, so
greedy's and SPEED's tokens and scores stay the adapter-free model's, bit
for bit, in both families, while SPEED's flips change."""

import dataclasses

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import encoder_decoder
from t5x_speed import exit_adapters
from t5x_speed import inference
from t5x_speed import network
from t5x_speed import testing
import helpers
from helpers import random_model

RANK = 3
VOCAB = 40


def _with_adapters(module, params, rank=RANK, seed=None):
  """`module` with exit adapters of `rank`, and `params` with the adapters
  added: at their initialisation (seed None) or random (`testing`'s draw:
  scales 1, maps N(0, 1/fan_in))."""
  module = type(module)(dataclasses.replace(module.config,
                                            exit_adapter_rank=rank))
  if seed is None:
    tokens = jnp.ones((1, 4), jnp.int32)
    args = (tokens,) * (3 if module.config.is_encoder_decoder else 2)
    adapters = exit_adapters.adapter_params(module.init(
        jax.random.PRNGKey(0), *args, enable_dropout=False)['params'])
  else:
    drawn = exit_adapters.adapter_params(testing.random_params(module, seed))
    adapters = jax.tree.map(
        lambda x: x + 0.3 * jnp.asarray(np.random.RandomState(seed)
                                        .standard_normal(x.shape), x.dtype),
        drawn)   # scales away from 1 too
  params = {'decoder': {**params['decoder'], **adapters['decoder']},
            **{k: v for k, v in params.items() if k != 'decoder'}}
  return module, params


def _encoder_decoder(seed):
  module = encoder_decoder.SpeedEncoderDecoder(helpers.tiny_config(
      vocab_size=VOCAB, num_encoder_layers=2, logits_via_embedding=False))
  return module, testing.random_params(module, seed)


class ExitAdaptersTest(absltest.TestCase):

  def test_docstring_example_and_settings(self):
    helpers.assert_doctests(exit_adapters)
    for bad in (-1, 1.5, True, '4'):
      with self.assertRaisesRegex(ValueError, 'exit_adapter_rank must be'):
        helpers.tiny_config(exit_adapter_rank=bad)
    module, params = _with_adapters(*random_model(2, 3, 'cycle', 1, VOCAB))
    labels = jax.tree.leaves(exit_adapters.trainable_labels(params))
    self.assertEqual(labels.count(exit_adapters.TRAIN), 3)   # scale, maps
    self.assertEqual(set(jax.tree.leaves(exit_adapters.param_labels('all')(
        params))), {exit_adapters.TRAIN})
    self.assertEqual(module.config.exit_adapter_rank, RANK)

  def test_fresh_adapters_change_no_exit(self):
    module, params = random_model(2, 3, 'cycle', 1, VOCAB)
    adapted, with_fresh = _with_adapters(module, params)
    tokens = helpers.random_tokens(0, (2, 7), VOCAB)
    run = lambda m, p: m.apply({'params': p}, tokens, tokens,
                               enable_dropout=False)
    np.testing.assert_array_equal(run(adapted, with_fresh),
                                  run(module, params))

  def test_decodes_as_without_adapters_both_families(self):
    """Random adapters: every exit but the last moves; greedy and SPEED
    give the adapter-free model's greedy tokens and scores, bit for bit
    (decoder-only: SPEED sampling the sampler's tokens too); SPEED's flips
    differ from the adapter-free model's (the adapters act in its step)."""
    prompts = helpers.random_tokens(3, (2, 5), VOCAB)
    lengths = jnp.asarray([5, 2])
    for family in ('decoder_only', 'encoder_decoder'):
      module, params = (random_model(2, 3, 'cycle', 2, VOCAB)
                        if family == 'decoder_only' else _encoder_decoder(4))
      adapted, adapted_params = _with_adapters(module, params, seed=5)
      kwargs = (dict(prompts=prompts, prompt_lengths=lengths)
                if family == 'decoder_only' else
                dict(encoder_input_tokens=prompts))

      def run(m, p, method, **settings):
        return inference.generate(m, p, max_decode_steps=12, method=method,
                                  eos_id=-1, **kwargs, **settings)

      reference = run(module, params, 'greedy')
      for method in ('greedy', 'speed'):
        out = run(adapted, adapted_params, method)
        np.testing.assert_array_equal(out.tokens, reference.tokens)
        np.testing.assert_array_equal(
            np.asarray(out.scores).view(np.uint32),
            np.asarray(reference.scores).view(np.uint32))
      if family == 'encoder_decoder':
        self.assertFalse(np.array_equal(
            out.stats.stage_flips,
            run(module, params, 'speed').stats.stage_flips))
        continue
      logits = [m.apply({'params': p}, prompts, prompts,
                        enable_dropout=False)
                for m, p in ((module, params), (adapted, adapted_params))]
      np.testing.assert_array_equal(logits[0][-1], logits[1][-1])
      for early in range(2):
        self.assertGreater(
            float(jnp.abs(logits[0][early] - logits[1][early]).max()), 0.1)
      sample = dict(temperature=0.8, topp=0.9, rng=jax.random.PRNGKey(6))
      np.testing.assert_array_equal(
          run(adapted, adapted_params, 'speed_sample', **sample).tokens,
          run(module, params, 'sample', **sample).tokens)

if __name__ == '__main__':
  absltest.main()
