"""Exits trained to agree in the tools' trainer (`tools.finetune_agree`):
both routes lower the flips of a tiny model; the adapters leave every other
parameter, and so the final exit, bit for bit; the sweep's verdicts."""

import dataclasses
import itertools

from absl.testing import absltest
import jax
import numpy as np

from t5x_speed import exit_adapters
from tools import agreement_sweep
from tools import finetune_agree
from tools import trainer
from tools.finetune_agree import Setting
import helpers

VOCAB = 29


def _batches(count=4, batch=8, length=24, seed=0):
  """Fixed prefix-LM batches (as seqio's DecoderFeatureConverter makes
  them) of random tokens: prompts of 4-8 tokens, targets of 6-12."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(count):
    fields = {k: np.zeros((batch, length), np.int32) for k in (
        'decoder_target_tokens', 'decoder_input_tokens',
        'decoder_causal_attention', 'decoder_loss_weights')}
    for b in range(batch):
      n_in, n_tg = rng.randint(4, 9), rng.randint(6, 13)
      seq = list(rng.randint(2, VOCAB, n_in + n_tg))
      fields['decoder_target_tokens'][b, :len(seq)] = seq
      fields['decoder_input_tokens'][b, 1:len(seq)] = seq[:-1]
      fields['decoder_causal_attention'][b, :n_in + 1] = 1
      fields['decoder_loss_weights'][b, n_in:len(seq)] = 1
    out.append(fields)
  return out


def _finetune(module, params, batches, route, steps=40, lr=1e-2):
  recipe = trainer.Recipe(steps=steps, learning_rate=lr, exit_agreement=1.0,
                          exit_agreement_target='argmax')
  return trainer.train(
      module, itertools.cycle(batches), recipe, progress_bar=False,
      init_params=params,
      trainable=exit_adapters.is_adapter_param if route == 'adapters'
      else None)[0]


class FinetuneAgreeTest(absltest.TestCase):

  def test_both_routes_lower_the_flips(self):
    module, params = helpers.random_model(2, 3, 'cycle', 1, VOCAB)
    batches = _batches()
    consistency = lambda m, p: trainer.exit_consistency(m, p, batches)
    before = consistency(module, params)
    adapted = type(module)(dataclasses.replace(module.config,
                                               exit_adapter_rank=8))
    tuned = _finetune(adapted, params, batches, 'adapters')
    # Every parameter but the adapters' is the original's, bit for bit.
    kept = {k: v for k, v in tuned['decoder'].items()
            if k != exit_adapters.SCOPE}
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, b)
    after = consistency(adapted, tuned)
    self.assertEqual(after['loss'][-1], before['loss'][-1])
    self.assertLess(after['flip_rate'][1:].sum(),
                    0.8 * before['flip_rate'][1:].sum())
    # The whole model: flips fall, and the final exit's loss, trained on
    # these batches by the paper's loss too, does not rise.
    whole = consistency(module, _finetune(module, params, batches, 'model',
                                          lr=3e-3))
    self.assertLess(whole['flip_rate'][1:].sum(),
                    0.8 * before['flip_rate'][1:].sum())
    self.assertLessEqual(whole['loss'][-1], before['loss'][-1])

  def test_settings_and_the_sweeps_verdicts(self):
    helpers.assert_doctests(finetune_agree)
    self.assertEqual(Setting('adapters', 1.0, 'argmax', 1e-3, rank=16).name,
                     'adapters16_argmax1_lr1e-03_300steps_seed1')
    self.assertEqual(agreement_sweep.CONTROL.name,
                     'model_control_lr3e-04_300steps_seed1')
    for bad, message in ((dict(route='heads'), 'route must be one of'),
                         (dict(route='adapters', exit_agreement=0.0),
                          'needs exit_agreement > 0'),
                         (dict(target='kl'), 'exit_agreement_target'),
                         (dict(rank=-1), 'rank must be'),
                         (dict(steps=0), 'steps must be')):
      with self.assertRaisesRegex(ValueError, message):
        Setting(**bad)

    def record(setting, lost, bleu):
      return {'setting': setting and dataclasses.asdict(setting),
              'measures': {'bleu': bleu,
                           'speed': {'steps_lost_per_token': lost}}}
    model = Setting('model', 1.0, 'argmax', 3e-4)
    adapters = Setting('adapters', 1.0, 'argmax', 1e-3)
    records = {agreement_sweep.ORIGINAL: record(None, 0.30, 38.0),
               agreement_sweep.CONTROL.name: record(agreement_sweep.CONTROL,
                                                    0.40, 37.0),
               model.name: record(model, 0.25, 36.6),
               adapters.name: record(adapters, 0.27, 38.0)}
    verdicts = agreement_sweep.judge(records)
    # Whole-model runs against the control, adapters against the original.
    self.assertAlmostEqual(verdicts[model.name]['cut'], 1 - 0.25 / 0.40)
    self.assertAlmostEqual(verdicts[model.name]['bleu_change'], -0.4)
    self.assertTrue(verdicts[model.name]['adopt'])
    self.assertAlmostEqual(verdicts[adapters.name]['cut'], 0.1)
    self.assertFalse(verdicts[adapters.name]['adopt'])
    self.assertEqual(agreement_sweep.recommended(records, verdicts),
                     model.name)
    records[model.name]['measures']['bleu'] = 36.4   # beyond the tolerance
    verdicts = agreement_sweep.judge(records)
    self.assertEqual(agreement_sweep.recommended(records, verdicts),
                     adapters.name)


if __name__ == '__main__':
  absltest.main()
