"""The bench's measurements: bandwidth probes, timed replays, per-method rows.

`bench_case` times every method of one row group (a GxR model, a batch size
and a prompt length) on `PROMPTS` held-out prompts and derives each method's
row: throughput end to end and for decoding alone, loop steps per token,
bytes read per token and their share of the memory bandwidth. See
`tools.bench` for what the methods are and how the replay works.
"""

import functools
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import network
from t5x_speed.cpu import build
from t5x_speed.cpu import dispatch
from tools import common
from tools import demo_model
from tools import replay

LENGTHS = {'short': (1, 1), 'long': (2, 2)}  # numbers per prompt
PROMPTS = 16  # the same prompts at every batch size
XLA_SUFFIX = '_xla'
PIPELINE_SUFFIX = '_pipeline'
# With --weights int8: greedy on the same model's float weights (in --dtype).
FLOAT_SUFFIX = '_float'
# Methods that --xla_baseline times a second time with XLA's dot.
XLA_BASELINES = ('greedy', 'speed', 'greedy_g', 'greedy_12l',
                 'greedy' + FLOAT_SUFFIX, 't5x_sample')
# The best greedy is the fastest of these (and of their _xla twins): ours,
# and T5X's own decode fn at top-k 1 where T5X is installed.
GREEDY_BASELINES = ('greedy', 't5x_sample')
# SPEED with K candidate branches is the method f'{BRANCH_PREFIX}{K}'.
BRANCH_PREFIX = 'speed_b'


def memory_bandwidth() -> float:
  """Bytes per second of a jitted reduction over 512 MiB (best of 5)."""
  x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
  return x.nbytes / common.best_time(functools.partial(jax.jit(jnp.sum), x))


def copy_bandwidth() -> float:
  """STREAM-like copy of 256 MiB into a preallocated array, bytes read +
  written per second (best of 5; NumPy, one thread)."""
  a = np.ones(64 * 1024 * 1024, np.float32)
  b = np.empty_like(a)
  return 2 * a.nbytes / common.best_time(lambda: np.copyto(b, a))


def base_config(g: int, r: int, dtype: str, encoder_layers: int = 0
                ) -> network.TransformerConfig:
  """The T5-Base-width GxR model (the tests shrink it); with
  `encoder_layers`, T5 1.1 Base's encoder-decoder (its separate classifier)
  with a GxR decoder."""
  return network.TransformerConfig(
      num_unique_layers=g, num_repeats=r, dtype=dtype,
      num_encoder_layers=encoder_layers,
      logits_via_embedding=not encoder_layers)


def method_configs(g: int, r: int, args,
                   batch: int = 1) -> Dict[str, network.TransformerConfig]:
  """The methods a row group times, each with its model's config.

  Where `batch` x R rows exceed the backend's `max_speculative_rows`, SPEED
  decodes sequentially by default; speed_pipeline (and speed_short_pipeline)
  then time the pipeline itself.
  """
  base = functools.partial(base_config, dtype=args.dtype,
                           encoder_layers=args.encoder_layers)
  shared = base(g, r)
  configs = {'greedy': shared, 'speed': shared}
  if args.weights == 'int8':
    configs['greedy' + FLOAT_SUFFIX] = shared
  limit = dispatch.max_speculative_rows('auto')
  falls_back = limit is not None and batch * r > limit
  if falls_back:
    configs['speed' + PIPELINE_SUFFIX] = shared
  if r > 1 and not args.quick:
    # Where SPEED falls back, its branches would too: time the pipeline.
    for k in branch_counts(args):
      configs[f'{BRANCH_PREFIX}{k}' +
              (PIPELINE_SUFFIX if falls_back else '')] = shared
  if not args.quick:
    if args.speculative_vocab:
      configs['speed_short'] = shared
      if falls_back:
        configs['speed_short' + PIPELINE_SUFFIX] = shared
    configs['greedy_g'] = base(g, 1)
    configs['greedy_12l'] = base(12, 1)
    if t5x_available():
      configs['t5x_sample'] = shared
  if (args.xla_baseline and jax.default_backend() == 'cpu' and
      build.available()):
    for method in XLA_BASELINES:
      if method in configs:
        configs[method + XLA_SUFFIX] = configs[method]
  if getattr(args, 'budget', False):
    # The budget's methods: SPEED (on the kernels' path), and the greedy
    # baselines and the G-layer model on both paths.
    configs = {m: c for m, c in configs.items()
               if m == 'speed' or branches_of(m) or m.removesuffix(XLA_SUFFIX)
               in GREEDY_BASELINES + ('greedy_g',)}
  return configs


def t5x_available() -> bool:
  """Whether T5X is installed: its decode fn is then a greedy baseline."""
  try:
    import t5x.decoding  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def branch_counts(args) -> List[int]:
  """The K of the speed_bK methods (--branches), for R > 1 only."""
  text = getattr(args, 'branches', '')
  return [int(k) for k in text.split(',') if k.strip() and int(k) > 0]


def branches_of(method: str) -> int:
  """K of a speed_bK (or speed_bK_pipeline) method, else 0."""
  k = method.removesuffix(PIPELINE_SUFFIX)[len(BRANCH_PREFIX):]
  return int(k) if method.startswith(BRANCH_PREFIX) and k.isdigit() else 0


def replayed_method(method: str) -> str:
  """The decode method a bench method replays ('speed_xla' -> 'speed',
  'speed_pipeline' -> 'speed', 'speed_b2' -> 'speed' with branches,
  'greedy_g' -> 'greedy': the unshared models decode greedily)."""
  if branches_of(method):
    return 'speed'
  method = method.removesuffix(XLA_SUFFIX).removesuffix(
      FLOAT_SUFFIX).removesuffix(PIPELINE_SUFFIX)
  return 'greedy' if method in ('greedy_g', 'greedy_12l') else method


def weights_of(method: str, args) -> str:
  """The weights a bench method decodes: --weights, but float for the
  *_float baselines."""
  return 'as_given' if FLOAT_SUFFIX in method else args.weights


def max_speculative_rows(method: str):
  """SPEED's limit for a bench method: the pipeline at any batch for
  *_pipeline, else the default users get."""
  return None if method.endswith(PIPELINE_SUFFIX) else 'auto'


class BatchRun:
  """One recorded batch of one method: call() -> (`DecodeResult`, (prefill
  seconds, decode seconds)), each part timed to completion."""

  def __init__(self, prefill, decode, params, rec: Dict[str, Any]):
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

  def call_overhead(self) -> float:
    """Seconds of a decode call of this batch that runs no loop step: each
    row's prompt length past the buffer flags it invalid, so what remains
    is the call's dispatch, argument handling and the loop's entry and exit
    (best of 5; the same compiled program). For this package's decode fns
    only: T5X's do not check their inputs."""
    inputs, cache = jax.block_until_ready(self._prefill())
    lengths, *replayed = self._replay
    invalid = jnp.full_like(lengths, inputs.shape[1] + 1)
    return common.best_time(
        lambda: self._decode(inputs, cache, invalid, *replayed))


def layer_and_classifier_bytes(config, weights: str = 'as_given'
                               ) -> Dict[str, float]:
  """Bytes of one unique decoder layer's weights read per step (with an
  encoder, its cross-attention query and output too), of the classifier,
  and of one virtual layer's key + value at one position. int8 `weights`
  are one byte each plus a float32 scale per output channel."""
  e, f, h = config.emb_dim, config.mlp_dim, config.num_heads * config.head_dim
  size = jnp.dtype(config.dtype).itemsize
  acts = len(config.mlp_activations)
  matrices = (6 if config.is_encoder_decoder else 4) * e * h + (
      acts + 1) * e * f
  channels = 3 * h + e + (h + e if config.is_encoder_decoder else 0) + (
      acts * f + e)
  if weights == 'int8':
    return {'layer': matrices + 4 * channels,
            'classifier': config.vocab_size * (e + 4),
            'kv_per_position': size * 2 * h}
  return {'layer': size * matrices, 'classifier': size * config.vocab_size * e,
          'kv_per_position': size * 2 * h}


def _time_methods(runs: Dict[str, List[BatchRun]], repeats: int,
                  log: Callable[[str], None], advance: Callable[[], None]):
  """Interleaved rounds over every method's batches (every other round in
  reverse order), a bandwidth probe leading each round. Returns ({method:
  [per-round (prefill, decode) seconds]}, {method: last round's results},
  probes in bytes/s)."""
  times = {m: [] for m in runs}
  outputs = {}
  probes = []
  for round_index in range(repeats):
    # A shared host's bandwidth drifts: probe it in every round, next to the
    # methods. The faster probe counts, so the share is not flattered.
    log(f'round {round_index + 1}/{repeats}: memory bandwidth probe')
    probes.append(max(memory_bandwidth(), copy_bandwidth()))
    # Every other round in reverse order: no method always follows the probe
    # (which empties the caches) or the same neighbour.
    order = list(runs.items())
    for method, batch_runs in order if round_index % 2 == 0 else order[::-1]:
      log(f'round {round_index + 1}/{repeats}: {method}')
      results = [run() for run in batch_runs]
      outputs[method] = [res for res, _ in results]
      times[method].append(np.sum([t for _, t in results], axis=0))
      advance()
  return times, outputs, probes


def _method_row(method, cfg, results, times, recs, reference, sizes, args,
                batch: int, cache_length: int, bandwidth: float
                ) -> Dict[str, Any]:
  """One method's row of a row group (see `tools.bench_report`)."""
  tokens = sum(rec['tokens'] for rec in recs)
  prefill_seconds, decode_seconds = np.median(times, axis=0)
  seconds = float(np.median(np.sum(times, axis=1)))
  identical = all(np.array_equal(np.asarray(res.sequences),
                                 np.asarray(ref.sequences))
                  for res, ref in zip(results, reference))
  kv_bytes = (batch * cfg.num_layers * sizes['kv_per_position'] *
              cache_length)                      # every layer, every row
  stats = [res.stats for res in results]
  # SPEED's methods may decode sequentially beyond max_speculative_rows.
  pipelined = (replayed_method(method) in replay.PIPELINED and
               all(np.asarray(st.pipelined).all() for st in stats))
  if pipelined:
    loop_steps = sum(int(np.asarray(st.num_steps).max()) for st in stats)
    steps_per_token = sum(float(np.asarray(st.num_steps).sum())
                          for st in stats) / tokens
    flushes = sum(int(np.asarray(st.flushes).sum()) for st in stats)
    recorded = sum(rec['summary']['flushes'] for rec in recs)
    assert flushes == recorded, 'replay diverged from the recording'
    branch_hits = sum(int(np.asarray(st.branch_hits).sum()) for st in stats)
    flushes_per_stage = [int(sum(np.asarray(st.flushes)[:, s].sum()
                                 for st in stats))
                         for s in range(cfg.num_repeats)]
    classifier = sizes['classifier'] * (
        1 + args.speculative_vocab / cfg.vocab_size
        if replayed_method(method) == 'speed_short' else 1)
    weight_bytes = cfg.num_unique_layers * sizes['layer'] + classifier
  else:
    loop_steps = sum(int(rec['row_tokens'].max()) for rec in recs)
    steps_per_token = 1.0
    weight_bytes = cfg.num_layers * sizes['layer'] + sizes['classifier']
  bytes_per_token = (weight_bytes + kv_bytes) * loop_steps / tokens
  return {
      'seconds': seconds, 'tokens': tokens,
      'tokens_per_second': tokens / seconds,
      'ms_per_token_per_sequence': 1e3 * seconds * batch / tokens,
      'prefill_seconds': float(prefill_seconds),
      'decode_seconds': float(decode_seconds),
      'decode_tokens_per_second': tokens / decode_seconds,
      'decode_ms_per_token_per_sequence': (1e3 * decode_seconds * batch /
                                           tokens),
      'replay_consistent': identical,
      'pipelined': pipelined,
      'loop_steps': loop_steps, 'steps_per_token': steps_per_token,
      'branches': branches_of(method),
      'rows_per_step': (cfg.num_repeats + branches_of(method)) * batch
                       if pipelined else batch,
      'flushes': flushes if pipelined else None,
      'flushes_per_stage': flushes_per_stage if pipelined else None,
      'branch_hits': branch_hits if pipelined else None,
      'rows_free_ideal_speedup': (cfg.num_repeats / steps_per_token
                                  if pipelined else None),
      'weight_bytes_per_token': weight_bytes * loop_steps / tokens,
      'bytes_per_token': bytes_per_token,
      # The bytes are those of decoding, so the time is decoding's too.
      'bandwidth_bound_fraction': bytes_per_token / bandwidth /
                                  (decode_seconds / tokens),
  }


def best_row(rows: Dict[str, Dict[str, Any]], names: Sequence[str],
             key: str = 'decode_tokens_per_second'
             ) -> Optional[Tuple[str, Dict[str, Any]]]:
  """(method, row) of the fastest by `key` of the rows of `names` and their
  `_xla` twins (the kernel's and XLA's dot) that ran, else None.

  >>> best_row({'greedy': {'tokens_per_second': 2.0},
  ...           'greedy_xla': {'tokens_per_second': 3.0}}, ['greedy'],
  ...          'tokens_per_second')[0]
  'greedy_xla'
  """
  found = [(m, rows[m]) for name in names
           for m in (name, name + XLA_SUFFIX) if m in rows]
  return max(found, key=lambda item: item[1][key]) if found else None


def _add_ratios(rows: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
  """Each row against greedy and the G-layer model of its matmul path, and
  against the best greedy (`GREEDY_BASELINES`, `best_row`), decoding alone
  and end to end. Returns which method was the best greedy, each way."""
  best_name, best_decode = best_row(rows, GREEDY_BASELINES)
  best_e2e_name, best_e2e = best_row(rows, GREEDY_BASELINES,
                                     'tokens_per_second')
  best = best_decode['decode_tokens_per_second']
  best_float = best_row(rows, ['greedy' + FLOAT_SUFFIX])
  best_float = best_float and best_float[1]
  best_g = best_row(rows, ['greedy_g'], 'tokens_per_second')
  for method, row in rows.items():
    row['decode_vs_best_greedy'] = row['decode_tokens_per_second'] / best
    row['vs_best_greedy'] = (row['tokens_per_second'] /
                             best_e2e['tokens_per_second'])
    if best_float is not None:
      row['decode_vs_best_float_greedy'] = (
          row['decode_tokens_per_second'] /
          best_float['decode_tokens_per_second'])
    # *_xla rows against the *_xla baselines.
    suffix = XLA_SUFFIX if method.endswith(XLA_SUFFIX) else ''
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
    if best_g is not None:
      # Latency against the faster path of the unshared G-layer model.
      row['latency_vs_best_g_layers'] = (best_g[1]['tokens_per_second'] /
                                         row['tokens_per_second'])
  return {'decode': best_name, 'end_to_end': best_e2e_name,
          'g_layers': best_g and best_g[0]}


def records_key(r: int, batch: int, length: str, args) -> str:
  """Where a row group's recorded schedules are kept in --records."""
  if args.exits == 'demo':
    return f'R{r}_batch{batch}_{length}_steps{args.replay_steps}'
  with open(os.path.join(args.models_dir, 'manifest.json')) as f:
    manifest = json.load(f)
  shared = manifest['shared']
  digest = manifest['models'][shared]['sha256'][:10]
  return f'trained_{shared}_{digest}_batch{batch}_{length}'


def _record(r: int, batch: int, length: str, args, sources, log, quiet,
            branches: int = 0) -> List[Dict[str, Any]]:
  """A row group's schedules, recorded from its source: the committed
  trained model (--exits trained) or the demo model of R stages, with
  `branches` candidate branches."""
  if args.exits == 'trained':
    from tools import trained_exits  # pylint: disable=g-import-not-at-top
    src = trained_exits.source(args.models_dir, args.out)
    stages = src.module.config.num_repeats
    if stages != r:
      raise ValueError(
          f'--exits trained replays {src.name} ({stages} stages) on models '
          f'of as many stages; --configs asks for R = {r}: use --exits demo '
          'for it.')
    log(f'recording {src.name}\'s SPEED schedules on '
        f'{trained_exits.prompt_count(length, batch)} {length} prompts')
    return trained_exits.record_group(src, length, batch, branches)
  if PROMPTS % batch:
    raise ValueError(f'batch size {batch} must divide {PROMPTS}.')
  if r not in sources:
    sources[r] = replay.demo_schedule_source(
        r, args.demo_out, args.replay_steps, log=log, quiet=quiet)
  low, high = LENGTHS[length]
  prompts, lengths, targets = demo_model.held_out(
      PROMPTS, split='test', min_numbers=low, max_numbers=high)
  log(f'recording the demo model\'s SPEED schedules ({PROMPTS} prompts)')
  recs = [replay.record(sources[r], prompts[i:i + batch],
                        lengths[i:i + batch], branches=branches)
          for i in range(0, PROMPTS, batch)]
  # What the replayed model learned: its outputs on these prompts.
  recs[0]['exact_match'] = demo_model.exact_match(
      [row for rec in recs for row in rec['produced']], targets)
  return recs


def bench_case(g: int, r: int, batch: int, length: str, args, models,
               progress: Optional[common.Progress] = None,
               sources: Optional[Dict[int, Any]] = None) -> Dict[str, Any]:
  """Times every method on a row group's held-out prompts in batches of
  `batch` (`--exits`: the committed trained model's schedules or the demo
  model's).

  `models` caches (module, params) by (G, R) across row groups, `sources`
  the trained demo models by R; `progress` gets a line per compile and per
  timed pass and one unit per timed pass.
  """
  progress = progress or common.Progress('bench', 0, quiet=True)
  log = lambda m: progress.log(f'{g}x{r} batch {batch} {length}: {m}')
  sources = {} if sources is None else sources
  configs = method_configs(g, r, args, batch)
  by_branches = {}
  for k in sorted({branches_of(m) for m in configs}):
    key = records_key(r, batch, length, args) + (f'_branches{k}' if k else '')
    recs = replay.load_records(args.records, key) if args.records else None
    if recs is not None:
      log(f'replaying the schedules saved in {args.records}')
    else:
      recs = _record(r, batch, length, args, sources, log, progress.quiet, k)
      if args.records:
        replay.save_records(args.records, key, recs)
    if args.encoder_layers:
      recs = [replay.encoder_decoder_record(rec) for rec in recs]
    by_branches[k] = recs
  recs = by_branches[0]
  steps = int(recs[0].get('max_decode_steps', demo_model.LENGTHS['targets']))
  runs = {}
  for method, cfg in configs.items():
    weights = weights_of(method, args)
    key = (cfg.num_unique_layers, cfg.num_repeats, weights)
    if key not in models:
      log(f'initialising the {key[0]}x{key[1]} model ({weights} weights)')
      models[key] = replay.init_model(cfg, weights=weights)
    module, params = models[key]
    if method.endswith(XLA_SUFFIX):
      module = replay.with_xla_matmuls(module)
    prefill = replay.replay_prefill(module, steps)
    decode = replay.replay_decode(replayed_method(method), module,
                                  args.speculative_vocab,
                                  max_speculative_rows(method), steps,
                                  branches_of(method))
    runs[method] = [BatchRun(prefill, decode, params, rec)
                    for rec in by_branches[branches_of(method)]]
    log(f'compiling {method}')
    runs[method][0]()
    progress.advance()
  times, outputs, probes = _time_methods(runs, args.repeats, log,
                                         progress.advance)
  overheads = {}
  if getattr(args, 'budget', False):
    for method, batch_runs in runs.items():
      if not method.startswith('t5x'):
        log(f'the per-call overhead of {method}')
        overheads[method] = batch_runs[0].call_overhead()
  bandwidth = float(np.median(probes))
  sizes = {w: layer_and_classifier_bytes(configs['greedy'], w)
           for w in ('as_given', args.weights)}
  # Positions each row attends to per virtual layer: BOS, prompt and targets
  # (decoder-only), or BOS and targets plus the encoded prompt.
  cache_length = recs[0]['prompts'].shape[1] + 1 + steps
  rows = {method: _method_row(method, configs[method], results, times[method],
                              by_branches[branches_of(method)],
                              outputs['greedy'],
                              sizes[weights_of(method, args)], args, batch,
                              cache_length, bandwidth)
          for method, results in outputs.items()}
  for method, seconds in overheads.items():
    rows[method]['call_overhead_seconds'] = seconds
  best = _add_ratios(rows)
  tokens = sum(rec['tokens'] for rec in recs)
  # Each call's rate weighted by its tokens: a long call (e.g. a repetition
  # loop) counts for its tokens, not as one prompt among many.
  flips = {}
  for key in recs[0]['summary']:
    if key.startswith('flip_rate'):
      flips[key] = float(np.average(
          [rec['summary'][key] for rec in recs],
          weights=[rec['summary']['tokens'] for rec in recs]))
  flushes_per_stage = [sum(rec['summary'][f'flushes/stage_{s}'] for rec in
                           recs) for s in range(1, r + 1)]
  label = f'enc{args.encoder_layers}+{g}x{r}' if args.encoder_layers else (
      f'{g}x{r}')
  if args.exits == 'demo':
    demo_settings = demo_model.replay_settings(r, args.replay_steps)
    source = ('replayed exits of a demo model with '
              f'{demo_settings.num_unique_layers}x{r} layers trained '
              f'{args.replay_steps} steps (low flips)')
  else:
    source = f'replayed exits of {recs[0]["learned"]["model"]}'
  return {'config': label, 'batch': batch, 'length': length,
          'exits': args.exits, 'best_greedy': best,
          'prompts': sum(len(rec['lengths']) for rec in recs),
          'dtype': args.dtype, 'weights': args.weights,
          'bandwidth_probes_gb_s': [p / 1e9 for p in probes],
          'replay': {'source': source,
                     'learned': recs[0].get('learned'),
                     'flushes': sum(rec['summary']['flushes']
                                    for rec in recs),
                     'flushes_per_stage': flushes_per_stage,
                     'calls': len(recs),
                     'tokens': tokens,
                     'steps_per_token': sum(
                         rec['summary']['example_steps'] for rec in recs) /
                                        tokens,
                     'flip_rate': flips,
                     'exact_match': recs[0].get('exact_match')},
          'methods': rows}
