"""Training throughput of the paper table's configurations (`make
train-throughput`; docs/real_data.md#training-throughput).

For each configuration, on the table's own batches (gettext en->fr, packed,
the table's batch and lengths), times the training step as `tools.trainer`
ran it before and as it runs now, in interleaved rounds:
* before: one device, XLA's default compile, the exits' statistics on
  every step, each batch converted as the step waits for it;
* now (`trainer.train`): data parallel over the CPU cores
  (`common.use_cores_as_devices`), `trainer.CPU_COMPILER_OPTIONS`, the
  statistics only at log points, batches prepared ahead on a thread.
It reports positions per second, the step's FLOPs (XLA's cost analysis of
the compiled step) and the GFLOP/s achieved, beside the host's rate for
the step's own matmul shapes (a probe: each product timed alone, forward
shapes, XLA's dot), and checks that both steps compute the same loss and
gradients to float tolerance.

Example:
  python -m tools.train_throughput --configs 4x3,12L --out /tmp/throughput
  python -m tools.train_throughput --tiny --out /tmp/t   # seconds: a smoke run
"""

import argparse
import functools
import itertools
import os
import sys
import time
from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import optax
import seqio

from tools import common
from tools import paper_table
from tools import paper_table_data
from tools import paper_table_train
from tools import trainer


def matmul_shapes(config, batch_size: int, lengths: Dict[str, int],
                  exit_rows: int) -> Dict[str, tuple]:
  """(M, K, N) of the training step's forward products at `config`: the
  layers' projections over every position, the exits' logits over the
  scored ones."""
  rows = batch_size * sum(lengths.values())
  heads = config.num_heads * config.head_dim
  return {'attention projections': (rows, config.emb_dim, heads),
          'mlp in': (rows, config.emb_dim, config.mlp_dim),
          'mlp out': (rows, config.mlp_dim, config.emb_dim),
          'logits': (exit_rows, config.emb_dim, config.vocab_size)}


def matmul_rate(shapes: Dict[str, tuple], repeats: int = 5) -> Dict[str, Any]:
  """GFLOP/s of XLA's dot at each (M, K, N), float32, best of `repeats`."""
  out = {}
  for name, (m, k, n) in shapes.items():
    a = jnp.ones((m, k), jnp.float32)
    b = jnp.ones((k, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    seconds = common.best_time(lambda: dot(a, b).block_until_ready(),
                               repeats)
    out[name] = {'shape': [m, k, n], 'gflops': 2 * m * k * n / seconds / 1e9}
  return out


def _gradients(module, recipe, params, batch, compiler_options):
  """The training objective's gradients (and aux) of `batch`, compiled
  with `compiler_options`."""
  fn = jax.jit(jax.grad(functools.partial(
      trainer.loss_and_statistics, module, recipe), has_aux=True),
               compiler_options=compiler_options)
  return fn(params, batch)


def measure(name: str, settings: paper_table.TableSettings, steps: int,
            rounds: int) -> Dict[str, Any]:
  """Both steps of configuration `name`, timed over `rounds` interleaved
  rounds of `steps` steps each."""
  vocab_size = seqio.get_mixture_or_task(paper_table_data.TASK
                                        ).output_features['targets'
                                                          ].vocabulary.vocab_size
  config = paper_table.model_config(name, settings, vocab_size)
  module = paper_table_train.module_of(config)
  recipe = paper_table.recipe(settings, 0)
  batches = list(itertools.islice(paper_table_data.batches(
      'train', settings.lengths, settings.batch_size, pack=True,
      shuffle=True, encoder_decoder=config.is_encoder_decoder
  ).as_numpy_iterator(), steps + 1))
  inputs = (['encoder_input_tokens'] if config.is_encoder_decoder else []
            ) + ['decoder_input_tokens', 'decoder_target_tokens']
  params = module.init(paper_table_train.t5x_init_rng(0),
                       *(batches[0][k][:1] for k in inputs),
                       enable_dropout=False)['params']
  # On the host: each timed run places (and donates) its own copy.
  params = jax.device_get(params)
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(
      **trainer.schedule_settings(recipe)), weight_decay=trainer.WEIGHT_DECAY)
  devices = trainer.data_parallel_devices(settings.batch_size)
  replicated, rows = trainer.data_parallel_shardings(devices)
  options = trainer.default_compiler_options()
  before = trainer.train_step_fn(module, recipe, optimizer, True, None)
  now = {s: trainer.train_step_fn(module, recipe, optimizer, s, options)
         for s in (False, True)}
  one = jax.devices()[0]

  def run_before():
    p, o = jax.device_put((params, optimizer.init(params)), one)
    start = time.perf_counter()
    for step, batch in enumerate(batches[1:], 1):
      p, o, logs, _ = before(p, o, trainer.with_exit_positions(batch), {})
      if step % recipe.log_every == 0:   # its host syncs, as before
        float(logs['loss'][-1])
    float(logs['loss'][-1])
    return time.perf_counter() - start

  def run_now():
    p, o = jax.device_put((params, optimizer.init(params)), replicated)
    placed = trainer.placed_batches(iter(batches[1:]), rows)
    start = time.perf_counter()
    for step in range(1, steps + 1):
      logged = step % recipe.log_every == 0
      p, o, logs, _ = now[logged](p, o, next(placed), {})
      if logged:
        float(logs['loss'][-1])
    float(logs['loss'][-1])
    placed.close()
    return time.perf_counter() - start

  run_before(), run_now()       # compiles
  seconds = {'before': [], 'now': []}
  for _ in range(rounds):
    seconds['before'].append(run_before())
    seconds['now'].append(run_now())
  positions = steps * settings.batch_size * sum(settings.lengths.values())
  batch = trainer.with_exit_positions(batches[0])
  flops = before.lower(params, optimizer.init(params), batch,
                       {}).compile().cost_analysis()['flops']
  # The same loss and gradients: XLA's default on one device against the
  # options and the data-parallel placement.
  ref, ref_aux = _gradients(module, recipe, params, batch, None)
  got, got_aux = _gradients(module, recipe,
                            jax.device_put(params, replicated),
                            jax.device_put(batch, rows), options)
  gradient_error = max(
      float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
      for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)))
  del ref_aux, got_aux
  row = {'config': name, 'steps': steps, 'rounds': rounds,
         'devices': len(devices), 'seconds': seconds,
         'positions_per_step': positions // steps,
         'flops_per_step': flops,
         'max_relative_gradient_error': gradient_error}
  for which in ('before', 'now'):
    best = min(seconds[which])
    row[which] = {'positions_per_second': positions / best,
                  'gflops': flops * steps / best / 1e9}
  row['speedup'] = (row['now']['positions_per_second'] /
                    row['before']['positions_per_second'])
  exit_rows = settings.batch_size * batch['exit_positions'].shape[1]
  row['matmul_rate'] = matmul_rate(matmul_shapes(
      config, settings.batch_size, settings.lengths, exit_rows))
  return row


def markdown(results: Dict[str, Any]) -> str:
  """The report: a row per configuration, with its conditions."""
  lines = [
      '## Training throughput: the table\'s step before and now', '',
      f'{results["cpu"]}, {results["cores"]} cores; the table\'s recipe '
      f'(width {results["width"]}, batch {results["batch_size"]} packed '
      f'sequences of {results["positions"]} positions, float32); best of '
      f'{results["rounds"]} interleaved rounds of {results["steps"]} steps. '
      'Before: one device, XLA\'s default compile, exit statistics every '
      'step. Now (`tools.trainer`): data parallel over '
      f'{results["devices"]} CPU devices, YNNPACK fusions, statistics at '
      'log points, batches prepared ahead.', '',
      '| config | positions/s before | now | speedup | GFLOP/s before | now '
      '| host matmul GFLOP/s (projections / MLP in / MLP out / logits) '
      '| max relative gradient difference |',
      '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for row in results['rows']:
    rate = ' / '.join(f'{v["gflops"]:.0f}'
                      for v in row['matmul_rate'].values())
    lines.append(
        f'| {row["config"]} | {row["before"]["positions_per_second"]:,.0f} '
        f'| {row["now"]["positions_per_second"]:,.0f} | '
        f'{row["speedup"]:.2f}x | {row["before"]["gflops"]:.0f} | '
        f'{row["now"]["gflops"]:.0f} | {rate} | '
        f'{row["max_relative_gradient_error"]:.1e} |')
  lines += ['', 'GFLOP/s: the FLOPs of the step with statistics on one '
            'device (XLA\'s cost analysis) per second. The host rate times each forward product of the '
            'step alone at its shape (M x K x N), XLA\'s dot. The gradient '
            'difference: both compiles\' gradients of one batch, the '
            'largest difference over a parameter\'s largest gradient.']
  return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=common.HelpFormatter)
  parser.add_argument('--configs', default='4x3,12L')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--out', default='train_throughput_out',
                      help='where the report goes (and the gettext set is '
                      'built, without --data_dir).')
  parser.add_argument('--data_dir', default=None,
                      help='a set built earlier (paper_table_out/data).')
  parser.add_argument('--tiny', action='store_true',
                      help='toy sizes: a smoke run.')
  args = parser.parse_args(argv)
  common.use_cores_as_devices()
  settings = paper_table.TINY if args.tiny else paper_table.TableSettings()
  paper_table_data.prepare_data(
      args.out, settings.vocab_size, args.data_dir,
      lambda m: print(m, file=sys.stderr),
      vocabulary=paper_table.table_vocabulary(settings, paper_table.GETTEXT))
  rows = [measure(name, settings, args.steps, args.rounds)
          for name in args.configs.split(',')]
  results = {'cpu': common.cpu_model(),
             'cores': len(os.sched_getaffinity(0)),
             'devices': rows[0]['devices'], 'width': settings.width,
             'batch_size': settings.batch_size,
             'positions': sum(settings.lengths.values()),
             'steps': args.steps, 'rounds': args.rounds, 'rows': rows}
  text = markdown(results)
  common.write_report(args.out, 'train_throughput', results, text)
  print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
