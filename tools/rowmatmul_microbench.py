"""The few-row kernel against XLA's dot at T5-Base width, matmul by matmul.

    python -m tools.rowmatmul_microbench

Times a chain of 24 weight products (8 gated MLP blocks: two [768, 2048]
matrices and one [2048, 768] each) and the tied classifier ([32128, 768],
read transposed in place) at 1 to 48 rows, in float32 and bfloat16, with
`rowmatmul.matmul` (the kernel where it is built) and with `force_xla=True`
(XLA's dot). Prints the kernel's instruction set, then per case both times
(best of 15) and the weight bytes the kernel reads per second.

Then the decode step's attention (`rowattention.attention`, against its
XLA reference): 12 calls in a chain, as one token's 12 layers, each of
1 x 3 and 4 x 3 slots (batch x R) with T5-Base's 12 heads of 64 over a
512-position cache of which the first 128 are visible; the rate is of the
visible keys and values read.
"""

import functools

import jax
import jax.numpy as jnp

from t5x_speed import rowattention
from t5x_speed import rowmatmul
from tools import common

WIDTH, MLP, VOCAB = 768, 2048, 32128
ROWS = (1, 2, 3, 4, 12, 48)
CLASSIFIER_ROWS = (1, 3, 12)
HEADS, HEAD_DIM, CACHE, VISIBLE, STAGES = 12, 64, 512, 128, 3
LAYERS = 12  # attention calls per chain, one per layer of a token
ATTENTION_BATCH = (1, 4)


def _chain(x, weights, force_xla: bool):
  """x through each block's two [WIDTH, MLP] products, then its [MLP, WIDTH]
  one on their sum, scaled so the values stay bounded. Every product feeds
  the result: one left unused would be dropped from the program, and its
  bytes counted but never read."""
  y, hidden = x, None
  for w in weights:
    if w.shape[0] == WIDTH:
      product = rowmatmul.matmul(y, w, force_xla=force_xla)
      hidden = product if hidden is None else hidden + product
    else:
      y = rowmatmul.matmul(hidden, w, force_xla=force_xla) * 0.01
      hidden = None
  return y


def _classifier(x, table, force_xla: bool):
  return rowmatmul.matmul(x, table, transpose_w=True, force_xla=force_xla)


def _attention(query, cache, force_xla: bool):
  """LAYERS attention calls in a chain, each slot over its stage's
  cache."""
  keys, values, bias = cache
  for _ in range(LAYERS):
    query = rowattention.attention(query, keys, values, bias,
                                   stages=tuple(range(STAGES)),
                                   force_xla=force_xla)
  return query


def _compare(fn, x, w, nbytes: int) -> str:
  """'kernel T ms (G GB/s) xla T ms' for fn(x, w, force_xla)."""
  kernel = common.best_time(functools.partial(
      jax.jit(functools.partial(fn, force_xla=False)), x, w), repeats=15)
  xla = common.best_time(functools.partial(
      jax.jit(functools.partial(fn, force_xla=True)), x, w), repeats=15)
  return (f'kernel {1e3 * kernel:.2f} ms ({nbytes / kernel / 1e9:.1f} GB/s) '
          f'xla {1e3 * xla:.2f} ms')


def main():
  print(f'few-row kernel: {rowmatmul.isa() or "not available (XLA dot)"}')
  key = jax.random.PRNGKey(0)
  for dtype in (jnp.float32, jnp.bfloat16):
    weights = [jax.random.normal(jax.random.fold_in(key, i),
                                 (MLP, WIDTH) if i % 3 == 2 else
                                 (WIDTH, MLP),
                                 dtype) for i in range(24)]
    nbytes = sum(w.nbytes for w in weights)
    for rows in ROWS:
      x = jnp.ones((rows, WIDTH), dtype)
      print(jnp.dtype(dtype).name, rows, _compare(_chain, x, weights, nbytes))
    table = jax.random.normal(key, (VOCAB, WIDTH), dtype)
    for rows in CLASSIFIER_ROWS:
      x = jnp.ones((rows, WIDTH), dtype)
      print(jnp.dtype(dtype).name, 'classifier', rows,
            _compare(_classifier, x, table, table.nbytes))
    for batch in ATTENTION_BATCH:
      cache_shape = (STAGES, batch, HEADS, CACHE, HEAD_DIM)
      keys, values = (jax.random.normal(jax.random.fold_in(key, i),
                                        cache_shape, dtype) for i in (1, 2))
      bias = jnp.where(jnp.arange(CACHE) < VISIBLE, 0.0, -1e10).astype(
          dtype) * jnp.ones((batch, STAGES, HEADS, 1), dtype)
      query = jax.random.normal(key, (batch, STAGES, HEADS, HEAD_DIM), dtype)
      nbytes = LAYERS * 2 * keys.nbytes * VISIBLE // CACHE
      print(jnp.dtype(dtype).name, f'attention {batch}x{STAGES} slots',
            _compare(_attention, query, (keys, values, bias), nbytes))


if __name__ == '__main__':
  main()
