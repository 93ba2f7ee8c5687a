"""Where a Base-width decode step's time goes: the weight matmuls alone
against the whole step (output: decode_step_split.txt).

    python figures/decode_step_split.py [float32|bfloat16]

For greedy's 12-layer model (one row) and SPEED's 4x3 step (3 rows), times
(best of 30, inside one jit each, batch 1, at the bench's cache
length with 40 positions filled):
  step      the model's decode step (network.SpeedTransformer.decode_step /
            speed_step): every op of one loop step;
  matmuls   the same weight products alone, in the same order and shapes,
            through the same path (few-row kernel, or XLA's dot with
            T5X_SPEED_KERNEL=0);
  rest      step - matmuls: norms, attention over the cache, the relative
            position bias, cache writes, log-softmax and argmax, call costs.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import bench
from t5x_speed import demo_model
from t5x_speed import inference
from t5x_speed import rowmatmul
from t5x_speed import steps

FILLED = 40


def best_ms(fn, *args, n=30):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(n):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * min(times)


def weight_chain(params, rows, g, dtype):
  """The step's weight products alone: G layers, then the classifier."""
  x = jnp.ones((rows, 768), dtype)
  decoder = params['decoder']
  y = x
  for i in range(g):
    layer = decoder[f'layers_{i}']
    att, mlp = layer['self_attention'], layer['mlp']
    q = sum(rowmatmul.matmul(y, att[n]['kernel']) for n in ('query', 'key',
                                                            'value'))
    y = y + 1e-3 * rowmatmul.matmul(q, att['out']['kernel'])
    h = (rowmatmul.matmul(y, mlp['wi_0']['kernel']) *
         rowmatmul.matmul(y, mlp['wi_1']['kernel']))
    y = y + 1e-3 * rowmatmul.matmul(h, mlp['wo']['kernel'])
  return rowmatmul.matmul(y, decoder['token_embedder']['embedding'],
                          transpose_w=True)


def main(dtype):
  print(f'# kernel: {rowmatmul._load() if rowmatmul.available() else "off"}; '  # pylint: disable=protected-access
        f'JAX {jax.__version__}; {dtype}')
  length = 1 + 24 + demo_model.LENGTHS['targets']
  for name, (g, r) in (('greedy 12x1', (12, 1)), ('SPEED 4x3', (4, 3))):
    module, params = bench._init(bench.base_config(g, r, dtype))  # pylint: disable=protected-access
    bound = steps.BoundSteps(module, params)
    prompts = jnp.full((1, FILLED - 1), 5, jnp.int32)
    lengths = jnp.asarray([FILLED - 1], jnp.int32)
    _, cache = jax.jit(lambda p: inference.prepare(  # pylint: disable=g-long-lambda
        steps.BoundSteps(module, p), prompts, lengths,
        length - FILLED))(params)
    positions = jnp.asarray([FILLED], jnp.int32)
    tokens = jnp.asarray([7], jnp.int32)
    if r == 1:
      step = jax.jit(lambda p, c: steps.BoundSteps(module, p).decode_step(  # pylint: disable=g-long-lambda
          tokens, positions, c)[0])
    else:
      carry = bound.initial_carry(1) + 0.5
      stage_positions = positions[:, None] - jnp.arange(r)[None]  # [1, R]
      step = jax.jit(lambda p, c: steps.BoundSteps(module, p).pipeline_step(  # pylint: disable=g-long-lambda
          tokens, carry, stage_positions, c)[0])
    with rowmatmul.decode_scope():
      chain = jax.jit(lambda p: weight_chain(p, r, g, dtype))
    step_ms = best_ms(step, params, cache)
    chain_ms = best_ms(chain, params)
    print(f'{name}: step {step_ms:.2f} ms, matmuls {chain_ms:.2f} ms, '
          f'rest {step_ms - chain_ms:.2f} ms ({1 - chain_ms / step_ms:.0%})')


if __name__ == '__main__':
  np.set_printoptions(precision=3)
  main(sys.argv[1] if len(sys.argv) > 1 else 'float32')
