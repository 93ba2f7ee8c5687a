"""Tiny models shared by the tests."""

import functools

import jax
import jax.numpy as jnp

from t5x_speed import network


def tiny_config(**overrides) -> network.TransformerConfig:
  kwargs = dict(vocab_size=61, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
                num_unique_layers=2, num_repeats=3, dtype='float32')
  kwargs.update(overrides)
  return network.TransformerConfig(**kwargs)


@functools.lru_cache(maxsize=None)
def tiny_model(**overrides):
  """(module, params) of a randomly initialised tiny model."""
  cfg = tiny_config(**overrides)
  module = network.SpeedTransformer(cfg)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = module.init(jax.random.PRNGKey(cfg.num_unique_layers * 7 +
                                          cfg.num_repeats), tokens, tokens,
                       enable_dropout=False)['params']
  return module, params
