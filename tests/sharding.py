"""The order in which the suite's modules start, and its split into shards.

`make test TEST_SHARD=K/N` (pytest's `--shard K/N`) runs the K-th of N
disjoint parts of the suite, so that N CI jobs on N machines run it
together: every test module belongs to exactly one shard. Modules are
assigned whole (a test class shares its setup), by their measured cost,
each to the shard with the least cost so far (longest first), so that the
shards take about equally long.

Example:
  >>> shards = assign(['test_a.py', 'test_b.py', 'test_c.py'], 2,
  ...                 cost={'test_a.py': 5, 'test_b.py': 3, 'test_c.py': 3})
  >>> shards['test_a.py'], shards['test_b.py'], shards['test_c.py']
  (1, 2, 2)
"""

import re
from typing import Dict, Iterable, Mapping, Tuple

# Each module's CPU-seconds in one full run (both pytest-xdist workers and
# the processes they start; AVX-512 AMD EPYC, 2 cores). Only the ratios
# matter: they order the modules slowest first, so that neither worker is
# left running a long one alone at the end, and they balance the shards.
# Every test module has an entry (tests/test_sharding.py checks).
MODULE_SECONDS = {
    'test_paper_table.py': 112,
    'test_t5x_binaries.py': 90,
    'test_cpu_matmul.py': 85,
    'test_t5x_model.py': 73,
    'test_t5x_binaries_encoder_decoder.py': 69,
    'test_bench.py': 67,
    'test_fuzz.py': 66,
    'test_encoder_decoder.py': 64,
    'test_gin_configs.py': 57,
    'test_readme_commands.py': 43,
    'test_network.py': 41,
    'test_t5x_partitioning.py': 41,
    'test_demo.py': 39,
    'test_sampling.py': 38,
    'test_t5x_encoder_decoder_model.py': 34,
    'test_cpu_attention.py': 33,
    'test_speed_exactness.py': 31,
    'test_quantize.py': 30,
    'test_exit_adapters.py': 20,
    'test_cpu_dispatch.py': 25,
    'test_reliability.py': 17,
    'test_finetune_agree.py': 16,
    'test_tasks.py': 15,
    'test_decoding.py': 14,
    'test_t5x_parity.py': 13,
    'test_losses.py': 11,
    'test_trainer.py': 11,
    'test_cpu_sample.py': 10,
    'test_readme_example.py': 9,
    'test_install.py': 7,
    'test_cpu_norm.py': 6,
    'test_ctranslate2_engine.py': 5,
    'test_gettext_data.py': 5,
    'test_t5x_reliability.py': 3,
    'test_paper_table_records.py': 3,
    'test_task_functions.py': 2,
    'test_decode_params.py': 2,
    'test_task_data.py': 1,
    'test_sharding.py': 1,
}

# Modules that share a build made once per session (the wheel installed
# apart from the checkout, `helpers.installed_package`) run in one shard,
# which then builds it once.
TOGETHER = (('test_t5x_binaries.py', 'test_t5x_binaries_encoder_decoder.py',
             'test_install.py'),)


def parse_shard(text: str) -> Tuple[int, int]:
  """(K, N) of 'K/N', 1 <= K <= N.

  Raises:
    ValueError: `text` is not of that form, naming --shard.
  """
  match = re.fullmatch(r'\s*(\d+)\s*/\s*(\d+)\s*', text)
  if not match or not 1 <= int(match[1]) <= int(match[2]):
    raise ValueError(f'--shard must be K/N with 1 <= K <= N, got {text!r}.')
  return int(match[1]), int(match[2])


def assign(names: Iterable[str], num_shards: int,
           cost: Mapping[str, float] = MODULE_SECONDS) -> Dict[str, int]:
  """{module file name: its shard, 1..num_shards}, each module in one.

  The groups of `TOGETHER` that occur in `names` count as one module.
  Ties go to the lower shard, so every process that collects the same
  modules computes the same split.
  """
  names = list(dict.fromkeys(names))
  units = [tuple(n for n in group if n in names) for group in TOGETHER]
  grouped = {n for unit in units for n in unit}
  units = [u for u in units if u] + [(n,) for n in sorted(names)
                                      if n not in grouped]
  weight = lambda unit: sum(cost.get(n, 1) for n in unit)
  load = [0.0] * num_shards
  shards = {}
  for unit in sorted(units, key=lambda u: (-weight(u), u)):
    shard = min(range(num_shards), key=lambda i: (load[i], i))
    load[shard] += weight(unit)
    for name in unit:
      shards[name] = shard + 1
  return shards
