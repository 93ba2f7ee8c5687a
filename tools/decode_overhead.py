"""Per-step control overhead of speed_decode and greedy_decode.

    python -m tools.decode_overhead

Both loops run trivial step functions (a one-hot prediction that never is
EOS and never flushes, no model), so the time per loop step is the loops'
own bookkeeping: state updates, the flush logic, the while loop. Prints the
best of 20 runs per loop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from tools import common

VOCAB, WIDTH, STAGES, BATCH, LENGTH = 384, 64, 3, 1, 136


def _prediction(positions):
  """Logits predicting token (position + 2) mod (VOCAB - 2) + 2: never EOS
  (1), and every stage agrees, so nothing flushes."""
  return jax.nn.one_hot((positions + 2) % (VOCAB - 2) + 2, VOCAB) * 10.0


def _pipeline_step(tokens, carry, positions, cache):
  del tokens
  hidden = jnp.concatenate([carry, carry[:, :1]], 1) + 1e-3
  return _prediction(positions), hidden, cache + 1


def _tokens_to_logits(state):
  return _prediction(state.cur_index), state.cache + 1


def _kwargs(inputs):
  return dict(inputs=inputs, cache=jnp.zeros(()), eos_id=1,
              initial_index=jnp.zeros((BATCH,), jnp.int32),
              max_decode_steps=LENGTH - 1)


@jax.jit
def speed(inputs) -> decoding.DecodeResult:
  return decoding.decode(decoding.speed_decode,
                         pipeline_step_fn=_pipeline_step, num_stages=STAGES,
                         initial_carry=jnp.zeros((BATCH, STAGES - 1, WIDTH)),
                         **_kwargs(inputs))


@jax.jit
def greedy(inputs) -> decoding.DecodeResult:
  return decoding.decode(decoding.greedy_decode,
                         tokens_to_logits=_tokens_to_logits,
                         **_kwargs(inputs))


def main():
  inputs = jnp.zeros((BATCH, LENGTH), jnp.int32)
  for name, fn in (('speed', speed), ('greedy', greedy)):
    result = jax.block_until_ready(fn(inputs))
    seconds = common.best_time(functools.partial(fn, inputs), repeats=20)
    loop_steps = (int(np.asarray(result.stats.num_steps).max())
                  if result.stats is not None else LENGTH - 1)
    print(f'{name}: {1e3 * seconds:.2f} ms for {loop_steps} loop steps -> '
          f'{1e6 * seconds / loop_steps:.1f} us/step (best of 20)')


if __name__ == '__main__':
  main()
