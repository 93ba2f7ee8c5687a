"""Per-step control overhead of speed_decode / greedy_decode: trivial step fns."""
import time, jax, jax.numpy as jnp, numpy as np
from t5x_speed import decoding
V, E, R, B, L = 384, 64, 3, 1, 136
inputs = jnp.zeros((B, L), jnp.int32)
def pred(pos):  # never EOS(1); stages agree -> no flush
  return jax.nn.one_hot((pos + 2) % (V - 2) + 2, V) * 10.0
def pipeline(tokens, carry, positions, cache):
  hidden = jnp.concatenate([carry, carry[:, :1]], 1) + 1e-3
  return pred(positions), hidden, cache + 1
def to_logits(state):
  return pred(state.cur_index), state.cache + 1
@jax.jit
def speed(inputs):
  d, _, st = decoding.speed_decode(inputs=inputs, cache=jnp.zeros(()), pipeline_step_fn=pipeline, num_stages=R,
      initial_carry=jnp.zeros((B, R - 1, E)), eos_id=1, initial_index=jnp.zeros((B,), jnp.int32),
      max_decode_steps=L - 1, return_stats=True)
  return d, st.num_steps
@jax.jit
def greedy(inputs):
  return decoding.greedy_decode(inputs=inputs, cache=jnp.zeros(()), tokens_to_logits=to_logits,
      eos_id=1, initial_index=jnp.zeros((B,), jnp.int32), max_decode_steps=L - 1)[0]
for name, f in (('speed', speed), ('greedy', greedy)):
  out = jax.block_until_ready(f(inputs)); ts = []
  for _ in range(20):
    t = time.perf_counter(); jax.block_until_ready(f(inputs)); ts.append(time.perf_counter() - t)
  steps = int(np.asarray(out[1]).max()) if name == 'speed' else L - 1
  print(f'{name}: {min(ts)*1e3:.2f} ms for {steps} loop steps -> {min(ts)/steps*1e6:.1f} us/step (best of 20)')
