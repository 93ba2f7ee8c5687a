"""Architecture hyperparameters of a parameter-shared Transformer.

One frozen dataclass holds every architecture choice; gin binds it once
(`gin/architectures/*.gin`) and every module reads it.
"""

import dataclasses
import enum
from typing import Any, Optional, Sequence, Tuple

import jax.numpy as jnp

from t5x_speed.exit_adapters import check_exit_adapter_rank

__all__ = ['TransformerConfig', 'SharingOrder', 'DECODE_MATMULS']

# Values of `TransformerConfig.decode_matmul` (see `t5x_speed.cpu.dispatch`).
DECODE_MATMULS = ('auto', 'kernel', 'xla')


def check_decode_matmul(value: str, name: str = 'decode_matmul') -> None:
  """Raises ValueError, naming `name`, unless `value` is in DECODE_MATMULS."""
  if not isinstance(value, str) or value not in DECODE_MATMULS:
    raise ValueError(f'{name} must be one of {list(DECODE_MATMULS)}, got '
                     f'{value!r}.')


def check_kernel_threads(value: int, name: str = 'kernel_threads') -> None:
  """Raises ValueError, naming `name`, unless `value` is an integer >= 0."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f'{name} must be an integer >= 0 (0: one per core), got '
                     f'{value!r}.')


class SharingOrder(str, enum.Enum):
  """How the R*G virtual layers map onto the G unique layers.

  Orders as in Takase & Kiyono (2021), "Lessons on Parameter Sharing across
  Layers in Transformers", with M = G*R virtual and N = G unique layers:

  * CYCLE:     0123 0123 0123  (virtual layer i uses unique layer i mod G)
  * SEQUENCE:  000 111 222 333 (each unique layer repeated R times in a row)
  * CYCLE_REV: 0123 0123 3210  (cycle, with the last repetition reversed)

  Only CYCLE lets a SPEED step serve every stage from one weight load; the
  other orders decode exactly but read several unique layers per pass.
  """

  CYCLE = 'cycle'
  SEQUENCE = 'sequence'
  CYCLE_REV = 'cycle_rev'


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters of a decoder of G unique layers repeated R times, and
  of the encoder of an encoder-decoder model.

  Defaults reproduce T5X's decoder-only Base (t5x/examples/decoder_only,
  models/base.gin) as a 4x3 cyclic-shared model. With `num_encoder_layers`
  > 0 the decoder's layers also attend to an encoder's output, as T5 1.1's
  (t5x/examples/t5/network.py): `encoder_decoder.SpeedEncoderDecoder`.

  Attributes:
    vocab_size: vocabulary size (32128 = T5's 32100 rounded up to 128).
    dtype: activation dtype, e.g. 'float32' or 'bfloat16'. Parameters are
      always stored in float32, as in T5X.
    emb_dim: model width.
    num_heads: attention heads.
    head_dim: width of one head; None means emb_dim // num_heads.
    mlp_dim: hidden width of the feed-forward block.
    mlp_activations: one activation per input projection; ('gelu', 'linear')
      is T5.1.1's gated GeLU.
    dropout_rate: dropout after the embedding, attention weights, each
      sub-block and the final norm (training only).
    logits_via_embedding: tie the classifier to the input embedding.
    num_unique_layers: G, the number of distinct layers.
    num_repeats: R, how many times the G layers are applied; also the number
      of exits (one after each repetition) and of SPEED pipeline stages.
    sharing: a `SharingOrder` (or its string value).
    relpos_num_buckets: T5 relative-position buckets.
    relpos_max_distance: distance beyond which all positions share a bucket.
    decode_matmul: how a decode step computes its weight products, cache
      writes, attention and embedding gathers: 'auto' = the CPU kernels of
      `t5x_speed.cpu` where they are built on a CPU backend, else XLA's
      ops; 'kernel' = the kernels, falling back to XLA's ops with one logged
      message where they cannot run; 'xla' = XLA's ops. Full-sequence
      passes (training, scoring, prefill) always use XLA's ops. Resolved by
      `t5x_speed.cpu.dispatch.decode_numerics`.
    kernel_threads: threads one kernel call uses, 0 for one per core. It
      does not change the results.
    num_encoder_layers: unique layers of the encoder; 0 (the default) for a
      decoder-only model.
    num_encoder_repeats: how many times the encoder applies its unique
      layers, cyclically (1: an unshared encoder, as T5's).
    exit_adapter_rank: None (the paper's model), or adapters on the early
      exits (`t5x_speed.exit_adapters`): 0 for a norm scale per early exit,
      k >= 1 for a rank-k map too. The final exit has none.
  """

  vocab_size: int = 32128
  dtype: Any = 'float32'
  emb_dim: int = 768
  num_heads: int = 12
  head_dim: Optional[int] = 64
  mlp_dim: int = 2048
  mlp_activations: Sequence[str] = ('gelu', 'linear')
  dropout_rate: float = 0.0
  logits_via_embedding: bool = True
  num_unique_layers: int = 4
  num_repeats: int = 3
  sharing: SharingOrder = SharingOrder.CYCLE
  relpos_num_buckets: int = 32
  relpos_max_distance: int = 128
  decode_matmul: str = 'auto'
  kernel_threads: int = 0
  num_encoder_layers: int = 0
  num_encoder_repeats: int = 1
  exit_adapter_rank: Optional[int] = None

  def __post_init__(self):
    def positive(name):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'TransformerConfig.{name} must be an integer >= 1, '
                         f'got {value!r}.')

    for name in ('vocab_size', 'emb_dim', 'num_heads', 'mlp_dim',
                 'num_unique_layers', 'num_repeats', 'relpos_num_buckets',
                 'relpos_max_distance', 'num_encoder_repeats'):
      positive(name)
    if (not isinstance(self.num_encoder_layers, int) or
        isinstance(self.num_encoder_layers, bool) or
        self.num_encoder_layers < 0):
      raise ValueError('TransformerConfig.num_encoder_layers must be an '
                       f'integer >= 0, got {self.num_encoder_layers!r}.')
    if self.head_dim is None:
      if self.emb_dim % self.num_heads:
        raise ValueError(
            f'TransformerConfig.head_dim is None, so emb_dim ({self.emb_dim}) '
            f'must be divisible by num_heads ({self.num_heads}); set head_dim '
            'explicitly or change num_heads.')
      object.__setattr__(self, 'head_dim', self.emb_dim // self.num_heads)
    positive('head_dim')
    try:
      object.__setattr__(self, 'sharing', SharingOrder(self.sharing))
    except ValueError:
      raise ValueError(
          f'TransformerConfig.sharing must be one of '
          f'{[o.value for o in SharingOrder]}, got {self.sharing!r}.') from None
    try:
      object.__setattr__(self, 'dtype', jnp.dtype(self.dtype))
    except TypeError:
      raise ValueError(f'TransformerConfig.dtype {self.dtype!r} is not a '
                       'dtype.') from None
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError('TransformerConfig.dropout_rate must be in [0, 1), got '
                       f'{self.dropout_rate!r}.')
    if isinstance(self.mlp_activations, str) or not self.mlp_activations:
      raise ValueError('TransformerConfig.mlp_activations must be a non-empty '
                       f'sequence of names, got {self.mlp_activations!r}.')
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    check_decode_matmul(self.decode_matmul, 'TransformerConfig.decode_matmul')
    check_exit_adapter_rank(self.exit_adapter_rank,
                            'TransformerConfig.exit_adapter_rank')
    check_kernel_threads(self.kernel_threads,
                         'TransformerConfig.kernel_threads')

  @property
  def is_encoder_decoder(self) -> bool:
    """Whether the decoder attends to an encoder (`num_encoder_layers` > 0)."""
    return self.num_encoder_layers > 0

  @property
  def num_layers(self) -> int:
    """Depth of the unrolled network, G*R virtual layers."""
    return self.num_unique_layers * self.num_repeats

  @property
  def layer_order(self) -> Tuple[int, ...]:
    """Unique layer used by each of the G*R virtual layers.

    Example:
      >>> TransformerConfig(num_unique_layers=4, num_repeats=3,
      ...                   sharing='cycle_rev').layer_order
      (0, 1, 2, 3, 0, 1, 2, 3, 3, 2, 1, 0)
    """
    g, r = self.num_unique_layers, self.num_repeats
    if self.sharing == SharingOrder.CYCLE:
      return tuple(i % g for i in range(g * r))
    if self.sharing == SharingOrder.SEQUENCE:
      return tuple(i // r for i in range(g * r))
    cycle = tuple(i % g for i in range(g * (r - 1)))
    return cycle + tuple(reversed(range(g)))
