"""The paper table's measurements of one trained model (`tools.paper_table`).

* `decode_quality`: BLEU / chrF of greedy decoding (SPEED's tokens on a
  shared model, checked equal to greedy's) and SPEED's statistics;
* `teacher_forced`: each exit's loss, accuracy and flip rate on a split;
* `curve`: quality, flips and SPEED's steps per token at every checkpoint
  of a run, kept beside its checkpoints;
* `latency` and `replay_speedup`: decoding at batch 1, on the trained model
  and with its SPEED schedules replayed at T5-Base width, each with the
  machine's load average while it was timed.
"""

import dataclasses
import functools
import json
import os
from typing import Any, Dict, List, Tuple

import numpy as np

from t5x_speed import inference
from t5x_speed.tasks import metrics
from tools import common
from tools import demo_model
from tools import paper_table_data
from tools import paper_table_train
from tools import replay
from tools import trainer

BASE_VOCAB = 32128


def generate(module, params, prompts, lengths, **kwargs):
  """`inference.generate` on the prompts: a decoder-only model continues
  them (attending to them bidirectionally, as it was trained); an
  encoder-decoder model encodes them and decodes from BOS."""
  if module.config.is_encoder_decoder:
    return inference.generate(module, params, encoder_input_tokens=prompts,
                              **kwargs)
  return inference.generate(module, params, prompts, lengths,
                            bidirectional=True, **kwargs)


def decode_quality(module, params, prompts, lengths, refs, vocab,
                   max_decode_steps: int, check_greedy: bool = True
                   ) -> Dict[str, Any]:
  """BLEU / chrF of the final exit's greedy decoding, three sample outputs
  and, on a shared model, SPEED's statistics: SPEED decodes (the
  pipeline's at every batch size), and with `check_greedy` its tokens are
  compared with greedy's ('identical_to_greedy')."""
  r = module.config.num_repeats
  decode = functools.partial(generate, module, params,
                             max_decode_steps=max_decode_steps)
  speed = functools.partial(decode, method='speed', max_speculative_rows=None)
  texts, stats, identical = [], [], True
  for start in range(0, len(prompts), 16):
    p, n = prompts[start:start + 16], lengths[start:start + 16]
    out = speed(p, n) if r > 1 else decode(p, n, method='greedy')
    tokens = np.asarray(out.tokens)
    if r > 1:
      stats.append(out.stats.summary())
      if check_greedy:
        identical &= bool(np.array_equal(
            tokens, np.asarray(decode(p, n, method='greedy').tokens)))
    texts += [vocab.decode(common.tokens_until_eos(t)) for t in tokens]
  result = {**metrics.bleu_and_chrf(refs, texts),
            'examples': [{'reference': a, 'prediction': b}
                         for a, b in zip(refs[:3], texts[:3])]}
  if r > 1:
    totals = {k: sum(s[k] for s in stats) for k in ('example_steps',
                                                     'tokens', 'flushes')}
    result['speed'] = {
        'steps_per_token': totals['example_steps'] / totals['tokens'],
        'flushes': totals['flushes'], 'tokens': totals['tokens'],
        'flip_rate': {f'stage_{i}': float(np.mean(
            [s[f'flip_rate/stage_{i}'] for s in stats]))
                      for i in range(2, r + 1)}}
    if check_greedy:
      result['speed']['identical_to_greedy'] = identical
  return result


def teacher_forced(module, params, split: str, examples: int,
                   lengths: Dict[str, int]) -> Dict[str, List[float]]:
  """Each exit's teacher-forced loss, accuracy, agreement with the final
  exit and flip rate (`trainer.exit_consistency`) on the first `examples`
  of `split`, in batches of 32."""
  batches = paper_table_data.eval_batches(
      split, lengths, 32, max(examples // 32, 1),
      encoder_decoder=module.config.is_encoder_decoder)
  return {k: v.tolist() for k, v in trainer.exit_consistency(
      module, params, batches).items()}


def curve(module, run_dir: str, steps: List[int], prompts, lengths, refs,
          vocab, max_decode_steps: int) -> List[Dict[str, Any]]:
  """`decode_quality` of each checkpoint of a run (at `steps`), on
  `prompts`: one point per step. Points are kept in `<run_dir>/curve.json`
  with what they were measured on, so a rerun measures only new ones."""
  path = os.path.join(run_dir, 'curve.json')
  on = {'examples': len(prompts), 'max_decode_steps': max_decode_steps,
        'references': refs[:3]}
  kept = {}
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    if saved['on'] == on:
      kept = saved['points']
  points = []
  for step in steps:
    if str(step) not in kept:
      params = paper_table_train.load_params(
          paper_table_train.checkpoint_path(run_dir, step))
      kept[str(step)] = decode_quality(module, params, prompts, lengths,
                                       refs, vocab, max_decode_steps,
                                       check_greedy=False)
      del kept[str(step)]['examples']
      with open(path, 'w') as f:
        json.dump({'on': on, 'points': kept}, f)
    points.append({'step': step, **kept[str(step)]})
  return points


def _timed_passes(calls, repeats, warm: bool = True):
  """`common.interleaved_passes`, and the machine's busiest one-minute load
  average around them: timings taken beside other work (a load above the
  cores JAX uses) are not the model's."""
  before = os.getloadavg()[0]
  seconds, outputs = common.interleaved_passes(calls, repeats, warm=warm)
  return seconds, outputs, max(before, os.getloadavg()[0])


def latency(models: Dict[str, Tuple[Any, Any, str]], prompts, lengths,
            max_decode_steps: int, repeats: int
            ) -> Tuple[Dict[str, float], float]:
  """ms per token of each (module, params, method) at batch 1, interleaved
  passes over the prompts, best pass; and the load average (`_timed_passes`).
  """
  calls = {name: [functools.partial(
      generate, module, params, prompts[i:i + 1], lengths[i:i + 1],
      max_decode_steps=max_decode_steps, method=method)
                  for i in range(len(prompts))]
           for name, (module, params, method) in models.items()}
  seconds, outputs, load = _timed_passes(calls, repeats)
  out = {}
  for name, passes in seconds.items():
    tokens = sum(common.produced_count(o.tokens) for o in outputs[name])
    out[name] = 1e3 * float(np.min(passes)) / tokens
  return out, load


@functools.lru_cache(maxsize=None)
def _wide_model(g: int, r: int, encoder_layers: int, width: int,
                exit_adapter_rank=None):
  """The wide GxR model and its random parameters, drawn once per shape
  (the replays of every output length share them)."""
  return replay.init_model(dataclasses.replace(
      demo_model.wide_config(g, r, width, vocab_size=BASE_VOCAB),
      num_encoder_layers=encoder_layers, exit_adapter_rank=exit_adapter_rank))


@functools.lru_cache(maxsize=None)
def _wide_replay(g: int, r: int, encoder_layers: int, width: int,
                 max_decode_steps: int, exit_adapter_rank=None,
                 xla_twins: bool = True):
  """({method: jitted replay}, params) of the wide GxR model (with an
  encoder of `encoder_layers`, if any, and exit adapters of
  `exit_adapter_rank`), built and compiled once per shape: every run of a
  configuration replays on it. 'shallow' is greedy on the model's first
  repetition (G layers, what an unshared G-layer model costs); with
  `xla_twins` greedy and 'shallow' are also timed with XLA's dot
  ('*_xla'), and each baseline is the faster of its two numerics."""
  wide, wide_params = _wide_model(g, r, encoder_layers, width,
                                  exit_adapter_rank)
  shallow = type(wide)(dataclasses.replace(wide.config, num_repeats=1,
                                           exit_adapter_rank=None))
  decoder = functools.partial(replay.replay_decoder,
                              max_decode_steps=max_decode_steps)
  runs = {'speed': decoder('speed', wide), 'greedy': decoder('greedy', wide),
          'shallow': decoder('greedy', shallow)}
  if xla_twins:
    runs.update(
        greedy_xla=decoder('greedy', replay.with_xla_matmuls(wide)),
        shallow_xla=decoder('greedy', replay.with_xla_matmuls(shallow)))
  return runs, wide_params


def replay_speedup(module, params, prompts, lengths, max_decode_steps: int,
                   width: int, repeats: int, xla_twins: bool = True
                   ) -> Dict[str, Any]:
  """SPEED against the best greedy on a `width`-wide model of the same GxR
  (vocabulary 32128), replaying `params`' SPEED schedules on the prompts at
  batch 1; 'vs_shallow' is SPEED's latency over the best greedy of the
  unshared G-layer model of that width (the paper's latency claim).
  Without `xla_twins` the baselines are timed on the decode path alone
  (the kernel's, where it is built)."""
  cfg = module.config
  if cfg.is_encoder_decoder:    # the decoder starts at BOS
    lengths = np.zeros_like(lengths)
  recs = []
  for i in range(len(prompts)):
    out = generate(module, params, prompts[i:i + 1], lengths[i:i + 1],
                   max_decode_steps=max_decode_steps, method='speed',
                   record_schedule=True)
    recs.append(replay.replay_record(out, prompts[i:i + 1], lengths[i:i + 1]))
  runs, wide_params = _wide_replay(cfg.num_unique_layers, cfg.num_repeats,
                                   cfg.num_encoder_layers, width,
                                   max_decode_steps, cfg.exit_adapter_rank,
                                   xla_twins)
  # At batch 1 every record of a split has the same shapes: each method is
  # compiled once, ahead of time, two at a time, and timed without a
  # warm-up pass (the best of the passes counts).
  args = [(wide_params, *replay.replay_args(rec)) for rec in recs]
  compiled = common.compile_all({name: (fn, args[0])
                                 for name, fn in runs.items()})
  calls = {name: [functools.partial(compiled[name], *a) for a in args]
           for name in runs}
  seconds, outputs, load = _timed_passes(calls, repeats, warm=False)
  tokens = sum(rec['tokens'] for rec in recs)
  ms = {name: 1e3 * float(np.min(t)) / tokens for name, t in seconds.items()}
  best = lambda name: min(v for k, v in ms.items() if k.startswith(name))
  return {'width': width, 'tokens': tokens, 'load_average': load,
          'ms_per_token': ms, 'speedup': best('greedy') / ms['speed'],
          'vs_shallow': ms['speed'] / best('shallow'),
          'identical': all(np.array_equal(a.sequences, b.sequences) for a, b
                           in zip(outputs['speed'], outputs['greedy']))}
