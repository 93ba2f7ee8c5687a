"""Random models for tests and tools: parameters drawn on the host.

What the test suite and the tools (benches, demo, fuzz) build their random
models with, shipped with the library as T5X ships `t5x.test_utils`:
`random_params` draws a module's parameters with the scales of its
initialisers, `draw_params` does so for a tree of shapes, and
`RESIDUAL_OUTPUTS` names the kernels that close the residual branches (scale
them to make every layer move the prediction more or less).

The weights come from NumPy's generator on the host, not from a compiled
`init`: only the shapes are traced, so a random model costs no compile.

Example:
  >>> from t5x_speed import network, testing
  >>> config = network.TransformerConfig(
  ...     vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
  ...     num_unique_layers=1, num_repeats=2)
  >>> module = network.SpeedTransformer(config)
  >>> params = testing.random_params(module, seed=0)
  >>> params['decoder']['token_embedder']['embedding'].shape
  (32, 16)
  >>> again = testing.random_params(module, seed=0)  # the same seed, the same
  >>> bool((again['decoder']['layers_0']['mlp']['wo']['kernel'] ==
  ...       params['decoder']['layers_0']['mlp']['wo']['kernel']).all())
  True

  A tree of shapes (from `jax.eval_shape`, or written out) works too:

  >>> import jax, jax.numpy as jnp
  >>> shapes = {'mlp': {'wo': {'kernel': jax.ShapeDtypeStruct(
  ...     (256, 64), jnp.float32)}}}
  >>> kernel = testing.draw_params(shapes, seed=0, head_dim=8)[
  ...     'mlp']['wo']['kernel']
  >>> round(float(kernel.var() * 256), 1)  # variance 1 / fan_in
  1.0
  >>> 'wo' in testing.RESIDUAL_OUTPUTS
  True
"""

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['RESIDUAL_OUTPUTS', 'draw_params', 'random_params']

# The kernels closing each residual branch (attention's and the MLP's
# output projections): scaling them sets how much each layer moves the
# prediction.
RESIDUAL_OUTPUTS = ('out', 'wo')


def random_params(module, seed: int):
  """Random parameters of `module` (`draw_params` of its shapes): a
  `network.SpeedTransformer` or T5X's decoder-only `DecoderWrapper`, or an
  encoder-decoder (`encoder_decoder.SpeedEncoderDecoder`, T5X's T5
  `Transformer`), which takes encoder tokens first."""
  tokens = jnp.ones((1, 4), jnp.int32)
  args = (tokens,) * (3 if hasattr(module, 'encode') else 2)
  shapes = jax.eval_shape(lambda: module.init(
      jax.random.PRNGKey(0), *args, enable_dropout=False))['params']
  return draw_params(shapes, seed, module.config.head_dim)


def draw_params(shapes, seed: int, head_dim: int):
  """Random weights of the `shapes` tree (ours or T5X's decoder-only
  parameter names), drawn from seed on the host with the scales of the
  initialisers (layers.py): scales 1, embeddings N(0, 1), kernels
  N(0, 1/fan_in) (the query's also over head_dim), the relative position
  table uniform with variance 1/fan_avg.

  Only the shapes are traced: a compiled init (every leaf's random draw)
  would be one more program to compile per configuration. The tests'
  random models come from here too.
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    if name.endswith("['scale']"):
      x = np.ones(leaf.shape)
    elif name.endswith("['embedding']"):
      x = rng.standard_normal(leaf.shape)
    elif name.endswith("['rel_embedding']"):
      limit = np.sqrt(6.0 / sum(leaf.shape))
      x = rng.uniform(-limit, limit, leaf.shape)
    else:
      x = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[0])
      if "['query']" in name:
        x /= np.sqrt(head_dim)
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)
