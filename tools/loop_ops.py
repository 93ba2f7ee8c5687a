"""Ops per step of the compiled decode loops at the demo model's shape.

    python -m tools.loop_ops [--config 2x3] [--width 64]

Compiles `inference.generate`'s program (batch 1, a 12-token prompt, the
demo's 112 decode steps, prefix-LM prompts) for greedy and SPEED on the GxR
model and for greedy on its G-layer model (its first repetition). The
weights are random: the program does not depend on them. Counts the
top-level instructions of each decode loop's body by kind: XLA's fusions,
custom calls (the kernel library's weight products, attention, token choice
and embedding rows) and copies; bitcasts, tuples, parameters and constants
run nothing and are not counted. At width 64 these ops, not weight reads,
are what a step costs (docs/performance.md).
"""

import argparse
import collections
import re
from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import inference
from t5x_speed import network
from tools import common
from tools import demo_model

PROMPT_LENGTH = 12
COUNTED = ('fusion', 'custom-call', 'copy')
_FREE = ('bitcast', 'tuple', 'parameter', 'constant', 'get-tuple-element')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$')
_WHILE_BODY = re.compile(r' while\(.*body=%?([\w.\-]+)')


def _opcode(instruction: str) -> str:
  """The opcode of one HLO instruction line ('%x = f32[2]{0} add(...)')."""
  rhs = instruction.split(' = ', 1)[1]
  if rhs.startswith('('):  # a tuple shape: skip to its closing parenthesis
    depth = 0
    for i, c in enumerate(rhs):
      depth += {'(': 1, ')': -1}.get(c, 0)
      if depth == 0:
        rhs = rhs[i + 1:].lstrip()
        break
  else:
    rhs = rhs.split(' ', 1)[1]
  return rhs.split('(', 1)[0]


def loop_body_ops(hlo: str) -> Dict[str, int]:
  """{opcode: count} of the largest while loop body in compiled HLO text."""
  computations, current = {}, None
  for line in hlo.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = computations.setdefault(match.group(1), [])
    elif line.startswith('}'):
      current = None
    elif current is not None and ' = ' in line:
      current.append(line.strip())
  bodies = [match.group(1) for lines in computations.values()
            for match in map(_WHILE_BODY.search, lines) if match]
  if not bodies:
    raise ValueError('no while loop in the program')
  body = max(bodies, key=lambda name: len(computations[name]))
  ops = collections.Counter(_opcode(line) for line in computations[body])
  return {op: n for op, n in ops.items() if op not in _FREE}


def count(config: str = '2x3', width: int = 64) -> Dict[str, Dict[str, int]]:
  """Ops per loop step of greedy and SPEED on the GxR model and of greedy
  on its G-layer model: {method: {opcode: count}}."""
  g, r = demo_model.parse_gxr(config)
  settings = demo_model.DemoSettings(num_unique_layers=g, num_repeats=r,
                                     width=width)
  prompts = np.arange(2, 2 + PROMPT_LENGTH, dtype=np.int32)[None]
  lengths = np.array([PROMPT_LENGTH], np.int32)
  out = {}
  for name, repeats, method in (('greedy', r, 'greedy'),
                                ('speed', r, 'speed'),
                                ('greedy_g_layers', 1, 'greedy')):
    module = network.SpeedTransformer(settings.config(num_repeats=repeats))
    params = module.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
                         jnp.ones((1, 4), jnp.int32),
                         enable_dropout=False)['params']
    hlo = inference._generate.lower(  # pylint: disable=protected-access
        module, params, prompts, lengths, None, None, None, None,
        max_decode_steps=demo_model.LENGTHS['targets'], method=method,
        eos_id=1, bidirectional=True, record_schedule=False,
        speculative_vocab_size=None, topk=0,
        max_speculative_rows='auto').compile().as_text()
    out[name] = loop_body_ops(hlo)
  return out


def main(argv: Optional[Sequence[str]] = None):
  p = argparse.ArgumentParser(prog='python -m tools.loop_ops',
                              description=__doc__,
                              formatter_class=common.HelpFormatter)
  p.add_argument('--config', default='2x3', help='GxR of the model.')
  p.add_argument('--width', type=int, default=64, help='model width.')
  args = p.parse_args(argv)
  for name, ops in count(args.config, args.width).items():
    counted = ', '.join(f'{ops.get(op, 0)} {op}' for op in COUNTED)
    other = {op: n for op, n in ops.items() if op not in COUNTED}
    print(f'{name:16s} {sum(ops.values()):4d} ops per loop step: {counted}'
          + (f'; other {other}' if other else ''))


if __name__ == '__main__':
  main()
