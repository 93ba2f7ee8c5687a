"""Replaying a trained demo model's SPEED schedule on another model.

Base-width training is out of reach on a CPU, so `tools.bench`,
`tools.sample_bench` and `tools.demo` time wide models by *replay*: a small
model with R stages, trained on the demo task (`demo_schedule_source`),
decodes prompts with SPEED while its schedule is recorded (`record`,
`replay_record`); a wide model of the same R then runs the full computation
and control logic of every step with each exit's argmax forced to the recorded
prediction (`replay_decoder`, or `replay_prefill` and `replay_decode` to time
the two parts apart). The wide model thus takes exactly the recorded loop
steps and flushes; sequential decoding is forced to the same tokens.

Every replay returns a `results.DecodeResult` (stats None for the
sequential methods). Recorded schedules can be saved to a JSON file and
replayed elsewhere (`save_records`, `load_records`): on a machine without
seqio or TensorFlow, or to time a GPU on a CPU's recording.
"""

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import encoder_decoder
from t5x_speed import inference
from t5x_speed import network
from t5x_speed import quantize
from t5x_speed import sampling
from t5x_speed import steps
from t5x_speed import testing
from tools import demo_model

# The logit a forced token gets: far above any the model produces.
FORCE = 1e9
# Methods that run SPEED's pipeline (the others decode token by token).
PIPELINED = ('speed', 'speed_short', 'speed_sample')
# Methods a replay decodes with (see `replay_decode`).
METHODS = PIPELINED + ('greedy', 'sample', 't5x_sample')


def demo_schedule_source(repeats: int, demo_out: str,
                         train_steps: int = demo_model.REPLAY_STEPS,
                         log: Callable[[str], None] = print,
                         quiet: bool = False
                         ) -> Tuple[network.SpeedTransformer, Any]:
  """(module, params) of the trained demo model with `repeats` stages and
  max(6 // repeats, 1) unique layers, reloaded from `demo_out` or trained
  there (`demo_model.replay_settings`); `quiet` hides the training's
  progress bar."""
  settings = demo_model.replay_settings(repeats, train_steps)
  params, _ = demo_model.load_or_train(settings, demo_out, log=log,
                                       progress_bar=not quiet)
  return network.SpeedTransformer(settings.config()), params


def init_model(config: network.TransformerConfig, seed: int = 0,
               weights: str = 'as_given'
               ) -> Tuple[network.SpeedTransformer, Any]:
  """The module and random parameters (`testing.random_params`), stored in
  the activation dtype (bf16 weights are cast once here, as for serving, not
  in every step), or with `weights` 'int8' quantized once
  (`quantize.quantize_int8`)."""
  quantize.check_decode_weights(weights, 'weights')
  module = (encoder_decoder.SpeedEncoderDecoder(config)
            if config.is_encoder_decoder else network.SpeedTransformer(config))
  params = testing.random_params(module, seed)
  if weights == 'int8':
    return module, quantize.quantize_int8(params)
  return module, jax.tree.map(lambda x: x.astype(config.dtype), params)


def with_xla_matmuls(module):
  """The same model (same parameters) decoding with XLA's dot instead of the
  few-row kernel: the A/B baseline."""
  return type(module)(dataclasses.replace(module.config, decode_matmul='xla'))


def record(source: Tuple[network.SpeedTransformer, Any], prompts: np.ndarray,
           lengths: np.ndarray,
           max_decode_steps: int = demo_model.LENGTHS['targets'],
           branches: int = 0) -> Dict[str, Any]:
  """The source model's SPEED schedule (with `branches` candidate branches)
  and tokens on one batch of prompts."""
  module, params = source
  out = inference.generate(module, params, prompts, lengths,
                           max_decode_steps=max_decode_steps,
                           method='speed', bidirectional=True,
                           record_schedule=True, speed_branches=branches)
  return replay_record(out, prompts, lengths)


def replay_record(out: inference.Generation, prompts: np.ndarray,
                  lengths: np.ndarray) -> Dict[str, Any]:
  """A `Generation` with its SPEED schedule (greedy or sampled) as the
  replay's inputs: the prompts, the produced token at each position (which
  the sequential replay forces), each step's exit predictions and the
  decode's `max_decode_steps` (the produced width), which the replay's
  cache and limit follow. With candidate branches the predictions are
  the schedule's candidates, [steps, batch, R+K, 1+K] (each row's pick and
  runners-up, all forced in the replay), and 'branches' is K."""
  produced = np.asarray(out.tokens)
  batch = prompts.shape[0]
  width = prompts.shape[1] + 1 + produced.shape[1]
  by_position = np.zeros((batch, width + 1), np.int32)   # forced tokens
  for b in range(batch):
    start = int(lengths[b]) + 1
    by_position[b, start:start + produced.shape[1]] = produced[b]
  return {'prompts': prompts, 'lengths': lengths, 'by_position': by_position,
          'produced': produced,
          'predictions': np.asarray(
              out.schedule.predictions if out.schedule.candidates is None
              else out.schedule.candidates),
          'branches': (0 if out.schedule.candidates is None else
                       out.schedule.candidates.shape[-1] - 1),
          'summary': out.stats.summary(),
          'row_tokens': np.asarray(out.stats.num_tokens),
          'tokens': int(np.asarray(out.stats.num_tokens).sum()),
          'max_decode_steps': produced.shape[1]}


def encoder_decoder_record(rec: Dict[str, Any]) -> Dict[str, Any]:
  """`rec` (a decoder-only schedule) as an encoder-decoder model replays it:
  the prompts become the encoder's inputs and the decoder starts from BOS
  (prompt length 0), so the produced tokens move to positions 1, 2, ...;
  the recorded steps, predictions and flushes are unchanged."""
  by_position = np.zeros_like(rec['by_position'])
  for b, length in enumerate(rec['lengths']):
    moved = rec['by_position'][b, int(length) + 1:]
    by_position[b, 1:1 + len(moved)] = moved
  return {**rec, 'lengths': np.zeros_like(rec['lengths']),
          'by_position': by_position}


def _force(logits, forced):
  """`logits` [..., vocab] with FORCE at each row's `forced` id ([...]; an
  id outside the vocabulary forces nothing), or, with `forced` [..., C],
  FORCE / (c + 1) at its c-th id: the ranking a branching schedule
  recorded. Writes C elements per row: a mask over the vocabulary would be
  a pass over every row's logits, which the decode being timed does not
  make."""
  vocab = logits.shape[-1]
  flat = logits.reshape(-1, vocab)
  ids = forced.reshape(flat.shape[0], -1)
  ids = jnp.where((ids < 0) | (ids >= vocab), vocab, ids)
  values = FORCE / jnp.arange(1, ids.shape[1] + 1, dtype=flat.dtype)
  rows = jnp.arange(flat.shape[0])[:, None]
  flat = flat.at[rows, ids].set(
      jnp.broadcast_to(values, ids.shape), mode='drop')
  return flat.reshape(logits.shape)


def _forced_tokens_to_logits(tokens_to_logits, by_position):
  """Sequential decoding's logits with the recorded token forced at each
  position."""
  def fn(state):
    logits, cache = tokens_to_logits(state)
    forced = jnp.take_along_axis(by_position, jnp.clip(
        state.cur_index + 1, 0, by_position.shape[1] - 1)[:, None], 1)[:, 0]
    return _force(logits, forced), cache
  return fn


def _with_step_count(tokens_to_logits):
  """`tokens_to_logits` on the replayed pipeline's (cache, step) pair."""
  def fn(state):
    kv, step = state.cache
    logits, kv = tokens_to_logits(state.replace(cache=kv))
    return logits, (kv, step)
  return fn


def _replayed_pipeline_step(pipeline_step_fn, predictions):
  """SPEED's step with each exit's argmax forced to the recorded one."""
  def fn(tokens, carry, positions, cache):
    kv, step = cache
    logits, hidden, kv = pipeline_step_fn(tokens, carry, positions, kv)
    forced = predictions[jnp.minimum(step, predictions.shape[0] - 1)]
    # The decode fn's argument check calls this step without branches.
    forced = forced[:, :logits.shape[1]]
    return _force(logits, forced), hidden, (kv, step + 1)
  return fn


def replay_prefill(module,
                   max_decode_steps: int = demo_model.LENGTHS['targets']):
  """jit fn(params, prompts, lengths) -> (inputs, cache): the prefill that
  every replayed method starts from (BOS + prompt, prefix attention, room
  for the recording's `max_decode_steps`). An encoder-decoder model
  (`encoder_decoder_record`'s lengths, all 0) encodes the prompts instead
  and starts its decoder from BOS."""

  @jax.jit
  def prefill(params, prompts, lengths):
    bound = steps.BoundSteps(module, params)
    if module.config.is_encoder_decoder:
      return inference.prepare(
          bound, jnp.zeros((prompts.shape[0], 0), jnp.int32), lengths,
          max_decode_steps, encoder_input_tokens=prompts)
    return inference.prepare(bound, prompts, lengths, max_decode_steps,
                             bidirectional=True)

  return prefill


def _decode_fn(method: str):
  if method == 't5x_sample':
    # T5X is optional: imported only for this method.
    # pylint: disable-next=g-import-not-at-top
    from t5x import decoding as t5x_decoding
    return t5x_decoding.temperature_sample
  return {'speed': decoding.speed_decode,
          'speed_short': decoding.speed_decode,
          'speed_sample': sampling.speed_sample_decode,
          'greedy': decoding.greedy_decode,
          'sample': sampling.sample_decode}[method]


def replay_decode(method: str, module: network.SpeedTransformer,
                  speculative_vocab: int = 0,
                  max_speculative_rows: Any = None,
                  max_decode_steps: int = demo_model.LENGTHS['targets'],
                  speed_branches: int = 0):
  """jit fn(params, inputs, cache, lengths, by_position, predictions,
  sample=None) -> `DecodeResult`, decoding a recorded batch from
  `replay_prefill`'s output. See `replay_decoder`; `speed_branches`: the
  SPEED methods' candidate branches, those of the recording."""
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')
  decode_fn = _decode_fn(method)
  max_steps = max_decode_steps

  @jax.jit
  def run(params, inputs, cache, lengths, by_position, predictions,
          sample=None):
    spec = speculative_vocab if method == 'speed_short' else None
    bound = steps.BoundSteps(module, params, spec)
    kwargs = dict(inputs=inputs, eos_id=1, initial_index=lengths,
                  max_decode_steps=max_steps, **(sample or {}))
    forced = _forced_tokens_to_logits(bound.tokens_to_logits, by_position)
    if method in PIPELINED:
      # The cache carries the step count that indexes the recording.
      return decoding.decode(
          decode_fn, cache=(cache, jnp.zeros((), jnp.int32)),
          tokens_to_logits=_with_step_count(forced),
          pipeline_step_fn=_replayed_pipeline_step(bound.pipeline_step,
                                                   predictions),
          num_stages=module.config.num_repeats,
          initial_carry=bound.initial_carry(inputs.shape[0]),
          max_speculative_rows=max_speculative_rows,
          speed_branches=speed_branches, **kwargs)
    if method == 't5x_sample':
      kwargs.update(topk=1, temperature=0.0)
    return decoding.decode(decode_fn, cache=cache, tokens_to_logits=forced,
                           **kwargs)

  return run


def replay_decoder(method: str, module: network.SpeedTransformer,
                   speculative_vocab: int = 0,
                   max_speculative_rows: Any = None,
                   max_decode_steps: int = demo_model.LENGTHS['targets'],
                   speed_branches: int = 0):
  """jit fn(params, prompts, lengths, by_position, predictions, sample=None)
  -> `DecodeResult`, replaying a recorded batch, prefill included.

  `method`: greedy, speed, speed_short (SPEED whose speculative exits score
  only the first `speculative_vocab` token ids), t5x_sample (T5X's
  temperature_sample with topk=1, where T5X is installed) or a sampler of
  `t5x_speed.sampling` (sample, speed_sample), which takes
  sample=dict(decode_rng=..., temperature=..., topp=...).
  `max_speculative_rows` of the SPEED methods: None replays the recorded
  pipeline at any batch; 'auto' decodes as users get it (sequentially
  beyond the backend's limit, `decoding.speed_decode`).
  `max_decode_steps`: the recording's (the demo's by default).
  `speed_branches`: the recording's candidate branches (its 'branches').
  """
  prefill = replay_prefill(module, max_decode_steps)
  decode_batch = replay_decode(method, module, speculative_vocab,
                               max_speculative_rows, max_decode_steps,
                               speed_branches)

  @jax.jit
  def run(params, prompts, lengths, by_position, predictions, sample=None):
    inputs, cache = prefill(params, prompts, lengths)
    return decode_batch(params, inputs, cache, lengths, by_position,
                        predictions, sample)

  return run


def replay_args(rec: Dict[str, Any]) -> Tuple[jax.Array, ...]:
  """A record's (prompts, lengths, by_position, predictions) as arrays, in
  the order `replay_decoder`'s function takes them."""
  return tuple(jnp.asarray(rec[k]) for k in (
      'prompts', 'lengths', 'by_position', 'predictions'))


def replay_sample_args(setting: Optional[Dict[str, float]], seed: int
                       ) -> Optional[Dict[str, Any]]:
  """`sample=` of a replayed sampler: position-keyed noise from PRNGKey(seed)
  at the setting's temperature and top-p; None for greedy (no setting)."""
  if setting is None:
    return None
  return dict(decode_rng=jax.random.PRNGKey(seed),
              temperature=jnp.float32(setting['temperature']),
              topp=jnp.float32(setting['topp']))


def _encode(value):
  """A record's value as JSON: arrays keep their dtype."""
  if isinstance(value, dict):
    return {k: _encode(v) for k, v in value.items()}
  if isinstance(value, (np.ndarray, jax.Array)):
    value = np.asarray(value)
    return {'array': value.tolist(), 'dtype': str(value.dtype)}
  if isinstance(value, np.generic):
    return value.item()
  return value


def _decode(value):
  if isinstance(value, dict):
    if set(value) == {'array', 'dtype'}:
      return np.asarray(value['array'], value['dtype'])
    return {k: _decode(v) for k, v in value.items()}
  return value


def load_records(path: str, key: str) -> Optional[List[Dict[str, Any]]]:
  """The records saved under `key` in the JSON file `path`; None where the
  file or the key does not exist."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  if key not in saved:
    return None
  return [_decode(rec) for rec in saved[key]]


def save_records(path: str, key: str, records: List[Dict[str, Any]]) -> None:
  """Adds `records` (`record`'s dicts) under `key` to the JSON file `path`,
  keeping the other keys it holds."""
  saved = {}
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
  saved[key] = [_encode(rec) for rec in records]
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(saved, f)
  os.replace(tmp, path)
