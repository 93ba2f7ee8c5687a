"""CTranslate2 built from our weights computes our model: a GxR model's
virtual layers as an unshared CTranslate2 decoder give greedy's tokens and
the final exit's logits; the int8 build runs, and timing runs in a fresh
process."""

import tempfile

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from t5x_speed import inference
from tools import ctranslate2_engine as engine
import helpers


class CTranslate2EngineTest(absltest.TestCase):

  def test_unshared_equivalent_is_the_shared_models_final_exit(self):
    self.assertIsNotNone(engine.available())
    module, params = helpers.random_model(2, 2, 'cycle', 3, 61)
    config = module.config
    path = engine.save_model(params, config, [0, 1, 0, 1], tempfile.mkdtemp())
    gen = engine.generator(path, 'float32')
    names = engine.token_names(config.vocab_size)
    sequence = [0, 5, 9, 17, 3, 44]
    logits = np.asarray(gen.forward_batch([[names[t] for t in sequence]]))
    ours = module.apply({'params': params}, jnp.asarray([sequence]),
                        jnp.asarray([sequence[1:] + [7]]),
                        enable_dropout=False)[-1]
    np.testing.assert_allclose(logits, ours, atol=1e-4)
    prompt = sequence[1:]
    greedy = inference.generate(module, params, jnp.asarray([prompt]),
                                jnp.asarray([len(prompt)]),
                                max_decode_steps=12, method='greedy',
                                eos_id=-1)
    self.assertEqual(engine.greedy(gen, prompt, 12, config.vocab_size,
                                   force_length=True),
                     np.asarray(greedy.tokens[0]).tolist())
    # int8: built, decodes the requested length, times in a subprocess.
    int8 = engine.save_model(params, config, [0, 1], tempfile.mkdtemp(),
                             'int8')
    tokens = engine.greedy(engine.generator(int8, 'int8'), prompt, 5,
                           config.vocab_size, force_length=True)
    self.assertLen(tokens, 5)
    ms = engine.time_decode(int8, 'int8', prompt_length=4,
                            vocab_size=config.vocab_size, steps=8, repeats=1)
    self.assertGreater(ms, 0.0)

  def test_refuses_what_it_cannot_express(self):
    module, params = helpers.tiny_model(mlp_activations=('relu',))
    with self.assertRaisesRegex(ValueError, 'gated GeLU'):
      engine.save_model(params, module.config, [0], tempfile.mkdtemp())


if __name__ == '__main__':
  absltest.main()
