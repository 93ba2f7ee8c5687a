"""The performance record: SPEED against greedy at T5-Base width, side by side.

    python -m tools.bench [--configs 4x3,2x6] [--batch_sizes 1,4,16]
                              [--lengths short,long] [--out bench_out]

Base-width training is out of reach on a CPU, so the shared models' exits are
a clearly labelled *replay*: a small model with the same number of stages R is
trained on the demo task (or reloaded from --demo_out), decodes held-out
prompts with SPEED while its schedule (live stages, positions, tokens,
predictions, flushes per step) is recorded, and the Base-width model then
runs the full computation and control logic of every step with each exit's
argmax forced to the recorded prediction. The Base model thus takes exactly
the recorded loop steps and flushes; greedy runs are forced to the same
tokens. Methods (all in --dtype, same prompts, interleaved, medians):

  greedy        greedy_decode on the GxR shared model (full depth per token)
  speed         speed_decode on the GxR shared model
  speed_short   speed_decode, speculative exits over the first K token ids
  greedy_g      greedy on the unshared G-layer model (one repetition)
  greedy_12l    greedy on the unshared 12-layer model
  t5x_sample    T5X's decoding.temperature_sample (topk=1), when T5X exists
  *_xla         with --xla_baseline: greedy, speed, greedy_g and greedy_12l
                traced with XLA's dot instead of the few-row kernel

Bytes read per token (weights, plus each virtual layer's KV cache over the
cache length) divided by a measured memory bandwidth show how close each
method is to the memory-bandwidth limit; the bandwidth is the faster of a
jitted reduction and a STREAM-like copy (read + write bytes), probed before
every timed round (a shared host's bandwidth drifts) and taken as the median,
so the share can exceed 100% only where a method reads faster than both.

Decode-step matmuls use the few-row kernel (`t5x_speed.rowmatmul`) when it
is built; run with T5X_SPEED_KERNEL=0 for XLA's dot (the JSON records which).
Each batch's prefill (XLA's dot, all layers over the prompt: the same work
for every method of a model) and its decoding are timed apart, each run to
completion; rows give both end to end and decoding alone ("decode"), and the
bandwidth bound is taken on decoding alone, whose bytes it counts.

What the replay cannot show: exactness at Base width (every method is forced
to the recorded tokens; `replay_consistent` only checks the forcing held, and
exactness is the test suite's job), and, for speed_short, extra flushes that
a shortlist of a 32k vocabulary could cause (the demo's byte ids all lie in
it). The demo task's outputs are 20-90 bytes, shorter than summaries.
"""

import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TF loads

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from tools import demo_model
from t5x_speed import inference
from t5x_speed import network
from t5x_speed import rowmatmul
from t5x_speed import sampling
from t5x_speed import steps

LENGTHS = {'short': (1, 1), 'long': (2, 2)}  # numbers per prompt
FORCE = 1e9
PROMPTS = 16  # the same prompts at every batch size


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
  """Keeps the module docstring's layout and shows every flag's default."""


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m tools.bench',
                              description=__doc__,
                              formatter_class=_HelpFormatter)
  p.add_argument('--configs', default='4x3,2x6',
                 help='comma-separated GxR shared models (G unique layers '
                 'repeated R times) at T5-Base width.')
  p.add_argument('--batch_sizes', default='1,4,16',
                 help=f'comma-separated batch sizes; each must divide the '
                 f'{PROMPTS} prompts.')
  p.add_argument('--lengths', default='short,long',
                 help='short: one number (~20-45 tokens), long: two (~50-90); '
                 f'{PROMPTS} prompts each, in batches of each batch size.')
  p.add_argument('--repeats', type=int, default=3,
                 help='timed runs of every method; the median is reported.')
  p.add_argument('--speculative_vocab', type=int, default=4096,
                 help='K of the speed_short method; 0 leaves it out.')
  p.add_argument('--out', default='bench_out',
                 help='directory bench.json and bench.md are written to.')
  p.add_argument('--dtype', default='float32',
                 choices=('float32', 'bfloat16'),
                 help='activations and weights of the Base-width models '
                 '(bfloat16: weights cast to bf16 once, logits in f32).')
  p.add_argument('--replay_steps', type=int, default=600,
                 help='training steps of the demo models whose schedules are '
                 'replayed; fewer steps leave the exits less consistent '
                 '(e.g. 150 gives flip rates near the paper\'s 6-17%%).')
  p.add_argument('--xla_baseline', action='store_true',
                 help='also time greedy, speed, greedy_g and greedy_12l with '
                 'XLA\'s dot (the few-row kernel off), side by side.')
  p.add_argument('--demo_out', default='demo_out',
                 help='where the demo models are saved / trained.')
  p.add_argument('--quick', action='store_true',
                 help='4x3, batch 1, short only, greedy vs SPEED (overrides '
                 '--configs, --batch_sizes and --lengths; no G-layer, '
                 '12-layer, shortlist or T5X baselines).')
  return p


def _flags(argv):
  return _parser().parse_args(argv)


def memory_bandwidth() -> float:
  """Bytes per second of a jitted reduction over 512 MiB (best of 5)."""
  x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return x.nbytes / float(np.min(times))


def copy_bandwidth() -> float:
  """STREAM-like copy of 256 MiB into a preallocated array, bytes read +
  written per second (best of 5; NumPy, one thread)."""
  a = np.ones(64 * 1024 * 1024, np.float32)
  b = np.empty_like(a)
  np.copyto(b, a)
  times = []
  for _ in range(5):
    start = time.perf_counter()
    np.copyto(b, a)
    times.append(time.perf_counter() - start)
  return 2 * a.nbytes / float(np.min(times))


def demo_schedule_source(repeats: int, demo_out: str,
                         train_steps: int = 600):
  """(module, params) of the trained demo model with `repeats` stages."""
  settings = demo_model.DemoSettings(num_unique_layers=max(6 // repeats, 1),
                                     num_repeats=repeats,
                                     steps=train_steps)
  params, _ = demo_model.load_or_train(settings, demo_out)
  return network.SpeedTransformer(settings.config()), params


def record(source, prompts: np.ndarray, lengths: np.ndarray) -> Dict:
  """The demo model's SPEED schedule and tokens on one batch of prompts."""
  module, params = source
  out = inference.generate(module, params, prompts, lengths,
                           max_decode_steps=demo_model.LENGTHS['targets'],
                           method='speed', bidirectional=True,
                           record_schedule=True)
  return replay_record(out, prompts, lengths)


def replay_record(out: inference.Generation, prompts: np.ndarray,
                  lengths: np.ndarray) -> Dict:
  """A `Generation` with its SPEED schedule (greedy or sampled) as the
  replay's inputs: the prompts, the produced token at each position (which
  the sequential replay forces) and each step's exit predictions."""
  produced = np.asarray(out.tokens)
  batch = prompts.shape[0]
  width = prompts.shape[1] + 1 + produced.shape[1]
  by_position = np.zeros((batch, width + 1), np.int32)   # forced tokens
  for b in range(batch):
    start = int(lengths[b]) + 1
    by_position[b, start:start + produced.shape[1]] = produced[b]
  return {'prompts': prompts, 'lengths': lengths, 'by_position': by_position,
          'predictions': np.asarray(out.schedule.predictions),
          'summary': out.stats.summary(),
          'row_tokens': np.asarray(out.stats.num_tokens),
          'tokens': int(np.asarray(out.stats.num_tokens).sum())}


def _forced_tokens_to_logits(tokens_to_logits, by_position):
  """Greedy's logits with the recorded token forced at each position."""
  def fn(state):
    logits, cache = tokens_to_logits(state)
    forced = jnp.take_along_axis(by_position, jnp.clip(
        state.cur_index + 1, 0, by_position.shape[1] - 1)[:, None], 1)[:, 0]
    hit = jax.nn.one_hot(forced, logits.shape[-1], dtype=bool)
    return jnp.where(hit, FORCE, logits), cache
  return fn


def _replayed_pipeline_step(pipeline_step_fn, predictions):
  """SPEED's step with each exit's argmax forced to the recorded one."""
  def fn(tokens, carry, positions, cache):
    kv, step = cache
    logits, hidden, kv = pipeline_step_fn(tokens, carry, positions, kv)
    forced = predictions[jnp.minimum(step, predictions.shape[0] - 1)]
    hit = jax.nn.one_hot(forced, logits.shape[-1], dtype=bool)
    return jnp.where(hit, FORCE, logits), hidden, (kv, step + 1)
  return fn


PIPELINED = ('speed', 'speed_short', 'speed_sample')


def replay_prefill(module):
  """jit fn(params, prompts, lengths) -> (inputs, cache): the prefill that
  every replayed method starts from (BOS + prompt, prefix attention)."""

  @jax.jit
  def prefill(params, prompts, lengths):
    return inference.prepare(steps.BoundSteps(module, params), prompts,
                             lengths, demo_model.LENGTHS['targets'],
                             bidirectional=True)

  return prefill


def replay_decode(method: str, module, speculative_vocab: int = 0):
  """jit fn(params, inputs, cache, lengths, by_position, predictions,
  sample=None) decoding a recorded batch from `replay_prefill`'s output;
  returns (decodes, `SpeedStats` or None). See `replay_decoder`."""
  max_steps = demo_model.LENGTHS['targets']

  @jax.jit
  def decode(params, inputs, cache, lengths, by_position, predictions,
             sample=None):
    spec = speculative_vocab if method == 'speed_short' else None
    bound = steps.BoundSteps(module, params, spec)
    kwargs = dict(inputs=inputs, eos_id=1, initial_index=lengths,
                  max_decode_steps=max_steps, **(sample or {}))
    if method in PIPELINED:
      fn = (sampling.speed_sample_decode if method == 'speed_sample' else
            decoding.speed_decode)
      decodes, _, stats = fn(
          cache=(cache, jnp.zeros((), jnp.int32)),
          pipeline_step_fn=_replayed_pipeline_step(bound.pipeline_step,
                                                   predictions),
          num_stages=module.config.num_repeats,
          initial_carry=bound.initial_carry(inputs.shape[0]),
          return_stats=True, **kwargs)
      return decodes, stats
    forced = _forced_tokens_to_logits(bound.tokens_to_logits, by_position)
    if method == 't5x_sample':
      from t5x import decoding as t5x_decoding  # pylint: disable=g-import-not-at-top
      decodes, _ = t5x_decoding.temperature_sample(
          cache=cache, tokens_to_logits=forced, topk=1, temperature=0.0,
          **kwargs)
      return decodes, None
    fn = (sampling.sample_decode if method == 'sample' else
          decoding.greedy_decode)
    decodes, _ = fn(cache=cache, tokens_to_logits=forced, **kwargs)
    return decodes, None

  return decode


def replay_decoder(method: str, module, speculative_vocab: int = 0):
  """jit fn(params, prompts, lengths, by_position, predictions, sample=None)
  replaying a recorded batch, prefill included; returns (decodes,
  `SpeedStats` or None).

  `method` is one of this module's methods (greedy, speed, speed_short,
  t5x_sample) or a sampler of `t5x_speed.sampling` (sample, speed_sample),
  which takes sample=dict(decode_rng=..., temperature=..., topp=...).
  """
  prefill = replay_prefill(module)
  decode = replay_decode(method, module, speculative_vocab)

  @jax.jit
  def run(params, prompts, lengths, by_position, predictions, sample=None):
    inputs, cache = prefill(params, prompts, lengths)
    return decode(params, inputs, cache, lengths, by_position, predictions,
                  sample)

  return run


class _BatchRun:
  """One recorded batch of one method: call() -> ((decodes, stats),
  (prefill seconds, decode seconds)), each part timed to completion."""

  def __init__(self, prefill, decode, params, rec):
    self._prefill = functools.partial(prefill, params,
                                      *(jnp.asarray(rec[k]) for k in (
                                          'prompts', 'lengths')))
    self._decode = functools.partial(decode, params)
    self._replay = tuple(jnp.asarray(rec[k]) for k in (
        'lengths', 'by_position', 'predictions'))

  def __call__(self):
    start = time.perf_counter()
    inputs, cache = jax.block_until_ready(self._prefill())
    middle = time.perf_counter()
    out = jax.block_until_ready(self._decode(inputs, cache, *self._replay))
    return out, (middle - start, time.perf_counter() - middle)


def _init(config):
  """The module and its parameters, stored in the activation dtype (bf16
  weights are cast once here, as for serving, not in every step)."""
  module = network.SpeedTransformer(config)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(lambda: module.init(jax.random.PRNGKey(0), tokens, tokens,
                                       enable_dropout=False)['params'])()
  params = jax.tree.map(lambda x: x.astype(config.dtype), params)
  return module, params


def _layer_and_classifier_bytes(config) -> Dict[str, float]:
  e, f, h = config.emb_dim, config.mlp_dim, config.num_heads * config.head_dim
  size = jnp.dtype(config.dtype).itemsize
  layer = size * (4 * e * h + (len(config.mlp_activations) + 1) * e * f)
  return {'layer': layer, 'classifier': size * config.vocab_size * e,
          'kv_per_position': size * 2 * h}  # one virtual layer's key + value


def base_config(g: int, r: int, dtype: str) -> network.TransformerConfig:
  """The T5-Base-width GxR model (the tests shrink it)."""
  return network.TransformerConfig(num_unique_layers=g, num_repeats=r,
                                   dtype=dtype)


def bench_case(g: int, r: int, batch: int, length: str, args,
               models) -> Dict[str, Any]:
  """Times every method on PROMPTS held-out prompts in batches of `batch`."""
  if PROMPTS % batch:
    raise ValueError(f'batch size {batch} must divide {PROMPTS}.')
  source = demo_schedule_source(r, args.demo_out, args.replay_steps)
  low, high = LENGTHS[length]
  prompts, lengths, _ = demo_model.held_out(PROMPTS, split='test',
                                            min_numbers=low, max_numbers=high)
  recs = [record(source, prompts[i:i + batch], lengths[i:i + batch])
          for i in range(0, PROMPTS, batch)]
  shared_cfg = base_config(g, r, args.dtype)
  configs = {'greedy': shared_cfg, 'speed': shared_cfg}
  if args.speculative_vocab:
    configs['speed_short'] = shared_cfg
  configs['greedy_g'] = base_config(g, 1, args.dtype)
  configs['greedy_12l'] = base_config(12, 1, args.dtype)
  try:
    import t5x.decoding  # pylint: disable=g-import-not-at-top,unused-import
    configs['t5x_sample'] = shared_cfg
  except ImportError:
    pass
  if args.quick:
    configs = {k: configs[k] for k in ('greedy', 'speed')}
  if args.xla_baseline and rowmatmul.available():
    for method in ('greedy', 'speed', 'greedy_g', 'greedy_12l'):
      if method in configs:
        configs[method + '_xla'] = configs[method]
  runs = {}
  for method, cfg in configs.items():
    key = (cfg.num_unique_layers, cfg.num_repeats)
    if key not in models:
      models[key] = _init(cfg)
    module, params = models[key]
    xla = method.endswith('_xla')
    prefill = replay_prefill(module)
    decode = replay_decode(method[:-4] if xla else method, module,
                           args.speculative_vocab)
    runs[method] = [_BatchRun(prefill, decode, params, rec) for rec in recs]
    # Compile and warm up; the matmul path is fixed when tracing.
    with rowmatmul.xla_scope() if xla else contextlib.nullcontext():
      runs[method][0]()
  # Seconds of (prefill, decode) over all batches, per repeat.
  times = {m: [] for m in configs}
  outputs = {}
  probes = []
  for _ in range(args.repeats):
    # A shared host's bandwidth drifts: probe it in every round, next to the
    # methods. The faster probe counts, so the share is not flattered.
    probes.append(max(memory_bandwidth(), copy_bandwidth()))
    for method, batch_runs in runs.items():
      results = [run() for run in batch_runs]
      outputs[method] = [res for res, _ in results]
      times[method].append(np.sum([t for _, t in results], axis=0))
  bandwidth = float(np.median(probes))
  sizes = _layer_and_classifier_bytes(shared_cfg)
  tokens = sum(rec['tokens'] for rec in recs)
  recorded_flushes = sum(rec['summary']['flushes'] for rec in recs)
  rows = {}
  for method, results in outputs.items():
    prefill_seconds, decode_seconds = np.median(times[method], axis=0)
    seconds = float(np.median(np.sum(times[method], axis=1)))
    cfg = configs[method]
    identical = all(np.array_equal(np.asarray(res[0]), np.asarray(ref[0]))
                    for res, ref in zip(results, outputs['greedy']))
    cache_length = prompts.shape[1] + 1 + demo_model.LENGTHS['targets']
    kv_bytes = (batch * cfg.num_layers * sizes['kv_per_position'] *
                cache_length)                      # every layer, every row
    base_method = method[:-4] if method.endswith('_xla') else method
    if base_method.startswith('speed'):
      stats = [res[1] for res in results]
      loop_steps = sum(int(np.asarray(st.num_steps).max()) for st in stats)
      steps_per_token = sum(float(np.asarray(st.num_steps).sum())
                            for st in stats) / tokens
      flushes = sum(int(np.asarray(st.flushes).sum()) for st in stats)
      assert flushes == recorded_flushes, 'replay diverged from the recording'
      classifier = sizes['classifier'] * (
          1 + args.speculative_vocab / cfg.vocab_size
          if base_method == 'speed_short' else 1)
      weight_bytes = cfg.num_unique_layers * sizes['layer'] + classifier
    else:
      loop_steps = sum(int(rec['row_tokens'].max()) for rec in recs)
      steps_per_token = 1.0
      weight_bytes = cfg.num_layers * sizes['layer'] + sizes['classifier']
    weight_bytes_per_token = weight_bytes * loop_steps / tokens
    bytes_per_token = (weight_bytes + kv_bytes) * loop_steps / tokens
    rows[method] = {
        'seconds': seconds, 'tokens': tokens,
        'tokens_per_second': tokens / seconds,
        'ms_per_token_per_sequence': 1e3 * seconds * batch / tokens,
        'prefill_seconds': float(prefill_seconds),
        'decode_seconds': float(decode_seconds),
        'decode_tokens_per_second': tokens / decode_seconds,
        'decode_ms_per_token_per_sequence': (1e3 * decode_seconds * batch /
                                             tokens),
        'replay_consistent': identical,
        'loop_steps': loop_steps, 'steps_per_token': steps_per_token,
        'rows_free_ideal_speedup': (r / steps_per_token
                                    if base_method.startswith('speed')
                                    else None),
        'weight_bytes_per_token': weight_bytes_per_token,
        'bytes_per_token': bytes_per_token,
        # The bytes are those of decoding, so the time is decoding's too.
        'bandwidth_bound_fraction': bytes_per_token / bandwidth /
                                    (decode_seconds / tokens),
    }
  for method, row in rows.items():
    # Ratios within one matmul path: *_xla rows against the *_xla baselines.
    suffix = '_xla' if method.endswith('_xla') else ''
    greedy = rows['greedy' + suffix]
    row['vs_greedy_same_model'] = (row['tokens_per_second'] /
                                   greedy['tokens_per_second'])
    row['decode_vs_greedy_same_model'] = (row['decode_tokens_per_second'] /
                                          greedy['decode_tokens_per_second'])
    row['bytes_ideal_speedup'] = (greedy['bytes_per_token'] /
                                  row['bytes_per_token'])
    if 'greedy_g' + suffix in rows:
      g_row = rows['greedy_g' + suffix]
      row['vs_unshared_g_layers'] = (row['tokens_per_second'] /
                                     g_row['tokens_per_second'])
      row['decode_vs_unshared_g_layers'] = (
          row['decode_tokens_per_second'] / g_row['decode_tokens_per_second'])
  flips = {}
  for key in recs[0]['summary']:
    if key.startswith('flip_rate'):
      flips[key] = float(np.mean([rec['summary'][key] for rec in recs]))
  return {'config': f'{g}x{r}', 'batch': batch, 'length': length,
          'dtype': args.dtype,
          'bandwidth_probes_gb_s': [p / 1e9 for p in probes],
          'replay': {'source': 'replayed exits of a demo model with '
                               f'{max(6 // r, 1)}x{r} layers trained '
                               f'{args.replay_steps} steps',
                     'flushes': recorded_flushes, 'tokens': tokens,
                     'steps_per_token': sum(
                         rec['summary']['example_steps'] for rec in recs) /
                                        tokens,
                     'flip_rate': flips},
          'methods': rows}


def _ratio(value: Optional[float]) -> str:
  """'1.23x', or '–' where a ratio does not apply: a baseline that was not
  run (the G-layer model with --quick) or greedy's rows-free ideal."""
  return '–' if value is None else f'{value:.2f}x'


def _markdown(results: List[Dict], meta: Dict) -> str:
  lines = [f'Machine: {meta["machine"]}; JAX {meta["jax"]} on '
           f'{meta["backend"]}; measured memory bandwidth '
           f'{meta["bandwidth_gb_s"]:.1f} GB/s (reduction)'
           + (f', {meta["copy_gb_s"]:.1f} GB/s (copy, r+w)'
              if 'copy_gb_s' in meta else '') + '; '
           f'{meta.get("dtype", "float32")}; few-row kernel '
           f'{meta.get("kernel", "?")}; exits: replay of '
           f'demo models trained {meta.get("replay_steps", 600)} steps (see '
           'bench.py); end-to-end time per batch, '
           f'{PROMPTS} prompts per row group. tokens/s and vs greedy: end to '
           'end, prefill included; decode columns: decoding alone. '
           'rows-free ideal = R / steps per '
           'token; bytes ideal = greedy\'s bytes per token / the method\'s '
           '(weights + KV cache); bandwidth-bound = time those bytes take at '
           'the bandwidth probed in every timed round (median, listed below) '
           '/ measured decoding time.', '',
           '| config | batch | length | method | tokens/s | vs greedy | '
           'decode tokens/s | decode ms/token/seq | decode vs greedy | '
           'decode vs G-layer | steps/token | rows-free ideal | '
           'bytes ideal | bandwidth-bound | replay consistent |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for res in results:
    for method, row in res['methods'].items():
      lines.append(
          f'| {res["config"]} | {res["batch"]} | {res["length"]} | {method} | '
          f'{row["tokens_per_second"]:.1f} | '
          f'{row["vs_greedy_same_model"]:.2f}x | '
          f'{row["decode_tokens_per_second"]:.1f} | '
          f'{row["decode_ms_per_token_per_sequence"]:.1f} | '
          f'{row["decode_vs_greedy_same_model"]:.2f}x | '
          f'{_ratio(row.get("decode_vs_unshared_g_layers"))} | '
          f'{row["steps_per_token"]:.2f} | '
          f'{_ratio(row["rows_free_ideal_speedup"])} | '
          f'{row["bytes_ideal_speedup"]:.2f}x | '
          f'{row["bandwidth_bound_fraction"]:.0%} | '
          f'{row["replay_consistent"]} |')
  lines.append('')
  lines.append('Replayed schedules (flip rate = share of tokens whose '
               'prediction changes at that stage):')
  for res in results:
    flips = ', '.join(f'{k.split("/")[1]} {v:.1%}'
                      for k, v in res['replay']['flip_rate'].items())
    lines.append(f'- {res["config"]} batch {res["batch"]} {res["length"]}: '
                 f'{res["replay"]["steps_per_token"]:.2f} steps/token, '
                 f'{res["replay"]["flushes"]:.0f} flushes; {flips}' +
                 _probes(res.get('bandwidth_probes_gb_s')))
  return '\n'.join(lines)


def _probes(gb_s: Optional[List[float]]) -> str:
  if not gb_s:  # figures from before the bench probed in every round
    return ''
  return (f'; bandwidth probes {np.median(gb_s):.1f} GB/s median '
          f'({min(gb_s):.1f}-{max(gb_s):.1f})')


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def main(argv=None):
  args = _flags(sys.argv[1:] if argv is None else argv)
  if args.quick:
    args.configs, args.batch_sizes, args.lengths = '4x3', '1', 'short'
  os.makedirs(args.out, exist_ok=True)
  bandwidth = memory_bandwidth()
  copy = copy_bandwidth()
  kernel = rowmatmul.available()
  meta = {'machine': f'{_cpu_model()}, {os.cpu_count()} cores',
          'jax': jax.__version__, 'backend': jax.default_backend(),
          'dtype': args.dtype,
          'bandwidth_gb_s': bandwidth / 1e9, 'copy_gb_s': copy / 1e9,
          'kernel': (rowmatmul._load() if kernel else 'off (XLA dot)'),  # pylint: disable=protected-access
          'replay_steps': args.replay_steps}
  print(f'Measured memory bandwidth: {bandwidth / 1e9:.1f} GB/s (reduction), '
        f'{copy / 1e9:.1f} GB/s (copy, read + write). Few-row kernel: '
        f'{meta["kernel"]}. Exits are replayed from trained demo models (see '
        '--help).')
  results, models = [], {}
  for text in args.configs.split(','):
    g, r = demo_model.parse_gxr(text)
    for batch in (int(b) for b in args.batch_sizes.split(',')):
      for length in args.lengths.split(','):
        res = bench_case(g, r, batch, length, args, models)
        results.append(res)
        m = res['methods']
        print(f'{text} batch {batch} {length}: ' + ', '.join(
            f'{k} {v["tokens_per_second"]:.1f} tok/s' for k, v in m.items()) +
            f'; SPEED {m["speed"]["vs_greedy_same_model"]:.2f}x greedy '
            f'({m["speed"]["decode_vs_greedy_same_model"]:.2f}x decoding '
            'alone), '
            f'{m["speed"]["steps_per_token"]:.2f} steps/token', flush=True)
  table = _markdown(results, meta)
  print('\n' + table)
  with open(os.path.join(args.out, 'bench.json'), 'w') as f:
    json.dump({'meta': meta, 'results': results}, f, indent=1)
  with open(os.path.join(args.out, 'bench.md'), 'w') as f:
    f.write(table + '\n')
  print(f'\nWrote {args.out}/bench.json and {args.out}/bench.md.')
  ok = all(row['replay_consistent'] for res in results
           for row in res['methods'].values())
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
