"""Exit adapters: small per-exit parameters that teach the early exits to
agree with the final exit, leaving the final exit, and with it the model's
output, bit for bit as it was.

SPEED flushes when an early exit predicts another token than a later one.
In a trained shared model the exits are about equally accurate yet choose
differently on about a tenth of the tokens; training the whole model toward
agreement reaches the final exit through the shared layers and costs
quality. Exit adapters (beyond the paper) act only on exits 1..R-1, between
the shared final norm and the shared classifier:

  y_i = norm(x_i) * scale_i                (scale_i [emb], initialised to 1)
  y_i = y_i + (y_i @ down_i) @ up_i        (rank k > 0; up_i initialised to 0)

so a model with freshly added adapters computes exactly what it did without
them. Trained with every other parameter frozen (`is_adapter_param` labels
them for an optimizer), on the agreement term (`losses.exit_agreement`),
they change where SPEED speculates, never what it commits: the final exit
has no adapter, and greedy decoding never evaluates an early exit.

`TransformerConfig.exit_adapter_rank` turns them on: None (the default) is
the paper's model, with no adapter parameters at all; 0 adds the scales
only; k >= 1 adds the rank-k maps too. A decode step reads (R - 1) * emb *
(1 + 2k) extra parameters: rank 16 at T5-Base width is 0.1% of a 4x3
SPEED step's weight bytes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> adapters = ExitAdapters(num_exits=3, rank=2)
  >>> y = jnp.ones((5, 3, 8))                      # [batch, exits, emb]
  >>> params = adapters.init(jax.random.PRNGKey(0), y, 'slots')['params']
  >>> sorted(params), params['down'].shape, params['up'].shape
  (['down', 'scale', 'up'], (2, 8, 2), (2, 2, 8))
  >>> bool((adapters.apply({'params': params}, y, 'slots') == y).all())
  True
  >>> final = y[:, 2]
  >>> adapters.apply({'params': params}, final, 2) is final   # no adapter
  True
"""

from typing import Any, Callable, Dict, Optional, Tuple, Union

from flax import linen as nn
from flax import traverse_util
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['ExitAdapters', 'SCOPE', 'is_adapter_param', 'trainable_labels',
           'param_labels', 'check_exit_adapter_rank', 'adapter_params',
           'TRAINABLE']

Array = jax.Array
param_with_axes = nn_partitioning.param_with_axes
# The module's name inside the decoder: parameters under `decoder/<SCOPE>/`.
SCOPE = 'exit_adapters'
# Labels of `trainable_labels`, for `optax.multi_transform`.
TRAIN, FREEZE = 'train', 'freeze'
# What `param_labels` lets a fine-tune train.
TRAINABLE = ('exit_adapters', 'all')


def check_exit_adapter_rank(value: Any, name: str = 'exit_adapter_rank'
                            ) -> Optional[int]:
  """`value` if it is None or an integer >= 0; else ValueError naming
  `name`."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f'{name} must be None (no adapters) or an integer >= 0 '
                     f'(0: per-exit norm scales only), got {value!r}.')
  return value


class ExitAdapters(nn.Module):
  """Per-exit scale and low-rank map before the shared classifier, for
  exits 0..R-2 (exit R-1, the final one, has none).

  Attributes:
    num_exits: R.
    rank: k, the rank of each exit's map; 0 for the scales alone.
    dtype: the activations' dtype.
  """

  num_exits: int
  rank: int = 0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, y: Array,
               exit_index: Union[int, str, Tuple[int, ...]]) -> Array:
    """Adapts normalised hidden states to their exit.

    Args:
      y: the final norm's output: [..., emb] for one exit, or [..., S, emb]
        with exit s in slot s (S <= R) for `exit_index` 'slots', or with
        slot s's exit given by a tuple `exit_index`.
      exit_index: the exit (0..R-1) of every row of `y`, 'slots', or a
        tuple of each slot's exit (SPEED's branch slots run exit 0).

    Returns:
      `y` adapted; rows of the final exit are returned as they are.
    """
    early = self.num_exits - 1
    emb = y.shape[-1]
    if isinstance(exit_index, int) and exit_index == early:
      return y
    # Logical axes for T5X's partitioner: the exits and the small rank axis
    # are replicated ('layers', 'kv'), the width follows 'embed'.
    scale = param_with_axes('scale', nn.initializers.ones, (early, emb),
                            jnp.float32, axes=('layers', 'embed'))
    maps = None
    if self.rank:
      down = param_with_axes('down', nn.initializers.normal(emb ** -0.5),
                             (early, emb, self.rank), jnp.float32,
                             axes=('layers', 'embed', 'kv'))
      up = param_with_axes('up', nn.initializers.zeros,
                           (early, self.rank, emb), jnp.float32,
                           axes=('layers', 'kv', 'embed'))
      maps = (down, up)
    if isinstance(exit_index, tuple):
      exits = np.asarray([min(e, early - 1) for e in exit_index])
      adapted = self._adapt(y, exits, scale, maps)
      final = np.asarray([e == early for e in exit_index])[:, None]
      return jnp.where(final, y, adapted)
    if exit_index == 'slots':
      slots = min(y.shape[-2], early)
      adapted = self._adapt(y[..., :slots, :], slice(0, slots), scale, maps)
      return jnp.concatenate([adapted, y[..., slots:, :]], axis=-2)
    if not 0 <= exit_index < early:
      raise ValueError(f'exit_index must be in [0, {self.num_exits}) or '
                       f"'slots', got {exit_index!r}.")
    return self._adapt(y, exit_index, scale, maps)

  def _adapt(self, y: Array, exits: Union[int, slice, np.ndarray],
             scale: Array,
             maps: Optional[Tuple[Array, Array]]) -> Array:
    """y * scale[exits] (+ the low-rank map), in the activations' dtype;
    `exits` a slice or an index array puts the exits on axis -2 of `y`."""
    cast = lambda w: jnp.asarray(w, self.dtype)
    y = y * cast(scale[exits])
    if maps is None:
      return y
    down, up = (cast(w[exits]) for w in maps)
    if not isinstance(exits, int):
      low = jnp.einsum('...se,sek->...sk', y, down)
      return y + jnp.einsum('...sk,ske->...se', low, up)
    return y + (y @ down) @ up


def is_adapter_param(path: Tuple[str, ...]) -> bool:
  """Whether the parameter at `path` (names from the root of the params)
  belongs to the exit adapters."""
  return SCOPE in path


def trainable_labels(params: Any) -> Any:
  """`params`' structure (dict or FrozenDict) with TRAIN on the exit
  adapters' leaves and FREEZE elsewhere: `optax.multi_transform`'s labels for training the adapters
  alone (gin/runs/finetune_agree.gin)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: TRAIN if is_adapter_param(
          tuple(getattr(k, 'key', None) for k in path)) else FREEZE, params)


def param_labels(trainable: str) -> Callable[[Any], Any]:
  """`optax.multi_transform`'s labels for what a fine-tune trains:
  'exit_adapters' (`trainable_labels`) or 'all' (every parameter TRAIN).

  Raises:
    ValueError: naming `trainable` for another value; the returned function
      raises where 'exit_adapters' finds no adapter in the parameters.
  """
  if trainable not in TRAINABLE:
    raise ValueError(f'trainable must be one of {TRAINABLE}, got '
                     f'{trainable!r}.')

  def labels(params):
    out = trainable_labels(params)
    if trainable == 'all':
      return jax.tree.map(lambda _: TRAIN, out)
    if TRAIN not in jax.tree.leaves(out):
      raise ValueError(
          "trainable='exit_adapters', but the model has no exit adapters: "
          'set TransformerConfig.exit_adapter_rank (gin: EXIT_ADAPTER_RANK).')
    return out

  return labels


def adapter_params(params: Any) -> Dict[str, Any]:
  """The exit adapters' parameters of a model's `params`, {} if none."""
  if hasattr(params, 'unfreeze'):
    params = params.unfreeze()
  flat = traverse_util.flatten_dict(dict(params))
  return traverse_util.unflatten_dict(
      {p: v for p, v in flat.items() if is_adapter_param(p)})
