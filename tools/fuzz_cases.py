"""The fuzz's cases: random architectures, weights, prompts and limits.

Cases come in groups that share one architecture and one set of shapes
(`Group`), so that each group compiles its functions once (`Compiled`;
compilation, not decoding, dominates on a CPU). A group draws G in 1..4, R in
1..8, a sharing order, vocabulary 17..1000, width 32..256, batch 1..16 and a
buffer of 2..32 positions (`draw_group`); an encoder-decoder group also 1..3
encoder layers, applied 1 or 2 times, and 1..24 encoder positions; half the
groups with R > 1 put exit adapters of rank 0, 1, 4 or 8 on the early exits
(`t5x_speed.exit_adapters`). Each case
draws fresh weights, prompts and limits (`run_cases`):

* weights: one of four `VARIANTS`, scaling the residual branches (attention
  and MLP outputs) by 4 (`disagree`: every layer moves the prediction, the
  exits disagree and SPEED flushes often), 1 (`plain`), 0.05 (`agree`: the
  exits agree for long runs) or 0 (`identical`: the exits agree everywhere);
* prompts: ragged, lengths in [0, length - 1], with length 0 (decode from
  BOS) and the full buffer (one token left) drawn often; bidirectional
  prefix attention per row (decoder-only); encoder inputs right-padded to
  random lengths in [1, encoder length] (encoder-decoder);
* `max_decode_steps` and `eos_id` per row: steps in 1..length (often past the
  buffer end); EOS is, per row, a token greedy produces without EOS (so the
  row ends there), a random id, or -1 (never ends).

`run_cases` decodes them and hands each case to `fuzz_check.check_case`.
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from t5x_speed import decoding
from t5x_speed import encoder_decoder
from t5x_speed import exit_adapters
from t5x_speed import inference
from t5x_speed import network
from t5x_speed.cpu import build
from t5x_speed.cpu import matmul
from t5x_speed import steps
from t5x_speed import quantize
from t5x_speed.testing import RESIDUAL_OUTPUTS
from tools import fuzz_check

# (name, residual gain, probability) of the weight variants.
VARIANTS = (('disagree', 4.0, 0.35), ('plain', 1.0, 0.3),
            ('agree', 0.05, 0.25), ('identical', 0.0, 0.1))
# Cache elements (cases x batch x layers x length x width) one vmapped call
# may hold: bounds memory for the largest groups (about 0.5 GB per cache copy
# in float32).
CALL_CELLS = 2**27


@dataclasses.dataclass(frozen=True)
class Group:
  """One architecture and set of shapes: compiled once."""
  g: int
  r: int
  sharing: str
  vocab: int
  width: int
  heads: int
  mlp: int
  batch: int
  length: int
  dtype: str
  encoder_layers: int = 0     # 0: a decoder-only model
  encoder_repeats: int = 1
  encoder_length: int = 0
  exit_adapter_rank: Optional[int] = None
  branches: int = 0           # SPEED's speed_branches

  def config(self) -> network.TransformerConfig:
    return network.TransformerConfig(
        vocab_size=self.vocab, emb_dim=self.width, num_heads=self.heads,
        head_dim=self.width // self.heads, mlp_dim=self.mlp,
        num_unique_layers=self.g, num_repeats=self.r, sharing=self.sharing,
        dtype=self.dtype, relpos_num_buckets=8, relpos_max_distance=32,
        num_encoder_layers=self.encoder_layers,
        num_encoder_repeats=self.encoder_repeats,
        exit_adapter_rank=self.exit_adapter_rank)

  def cases_per_call(self) -> int:
    """Cases one vmapped call decodes (bounded by `CALL_CELLS`)."""
    per_case = self.batch * self.g * (
        self.r * self.length + self.encoder_length) * self.width
    return max(1, CALL_CELLS // per_case)


FAMILIES = ('decoder_only', 'encoder_decoder')


# How a group's candidate branches (SPEED's speed_branches) are drawn:
# 'drawn' 0..3 (0 a quarter of the time), 'on' 1..3.
BRANCHES = ('drawn', 'on')


def draw_group(rng: np.random.RandomState, dtype: str,
               family: str = 'decoder_only', branches: str = 'drawn'
               ) -> Group:
  """A random architecture and shapes (see the module docstring)."""
  width = 8 * rng.randint(4, 33)                       # 32..256
  heads = int(rng.choice([h for h in (1, 2, 4, 8) if width // h >= 8]))
  group = Group(
      g=rng.randint(1, 5), r=rng.randint(1, 9),
      sharing=str(rng.choice(['cycle', 'cycle', 'sequence', 'cycle_rev'])),
      vocab=int(np.exp(rng.uniform(np.log(17), np.log(1001)))),
      width=width, heads=heads, mlp=8 * rng.randint(width // 8, width // 4 + 1),
      batch=rng.randint(1, 17), length=rng.randint(2, 33), dtype=dtype)
  if family == 'encoder_decoder':
    group = dataclasses.replace(
        group, encoder_layers=rng.randint(1, 4),
        encoder_repeats=rng.randint(1, 3), encoder_length=rng.randint(1, 25))
  elif family != 'decoder_only':
    raise ValueError(f'family must be one of {FAMILIES}, got {family!r}.')
  adapters, rank = rng.rand() < 0.5, int(rng.choice([0, 1, 4, 8]))
  if adapters and group.r > 1:
    group = dataclasses.replace(group, exit_adapter_rank=rank)
  # Candidate branches (a one-stage model has none).
  if branches not in BRANCHES:
    raise ValueError(f'branches must be one of {BRANCHES}, got {branches!r}.')
  k = int(rng.choice(4, p=(0.25, 0.35, 0.25, 0.15)))
  if branches == 'on':
    k = max(k, 1)
  if group.r > 1:
    group = dataclasses.replace(group, branches=k)
  return group


def draw_params(shapes, rng: np.random.Generator, gains: np.ndarray):
  """Random weights of the `shapes` tree for len(gains) cases (a leading
  case axis), residual outputs scaled by each case's gain.

  Drawn on the host: a jitted draw would compile one more program per
  group, which takes longer than NumPy takes to draw the weights.
  """
  leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
  count = len(gains)
  out = []
  for path, leaf in leaves:
    names = [getattr(p, 'key', None) for p in path]
    x = rng.standard_normal((count,) + leaf.shape, dtype=np.float32)
    if 'scale' in names:
      x = 1.0 + 0.1 * x
    elif exit_adapters.SCOPE in names:   # down and up maps
      x /= np.sqrt(leaf.shape[-2])
    elif 'kernel' in names:
      x /= np.sqrt(leaf.shape[0])
      if any(n in RESIDUAL_OUTPUTS for n in names):
        x *= gains.reshape((count,) + (1,) * len(leaf.shape))
    out.append(jnp.asarray(x, leaf.dtype))
  return jax.tree_util.tree_unflatten(tree, out)


class Compiled:
  """The jitted functions of one group, each over a leading case axis:
  greedy and speed (`results.DecodeResult`s), forward (the uncached pass's
  argmax and top-2 logits); and `shapes`, its parameters' shapes, for
  `draw_params`."""

  def __init__(self, group: Group, excess_precision: bool = False):
    self.group = group
    encdec = group.encoder_layers > 0
    module = (encoder_decoder.SpeedEncoderDecoder(group.config()) if encdec
              else network.SpeedTransformer(group.config()))
    tokens = jnp.ones((1, 2), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(
        jax.random.PRNGKey(0), *(tokens,) * (3 if encdec else 2),
        enable_dropout=False))['params']
    length = group.length

    def causal(lengths, bidir):
      return ((jnp.arange(length) <= lengths[:, None]) &
              bidir[:, None]).astype(jnp.int32)

    # `encoder_inputs` [batch, encoder length] feed an encoder-decoder model
    # (a decoder-only one ignores them); its decoder attends causally.
    def decoder(name, **options):
      def run(params, inputs, lengths, bidir, encoder_inputs, max_steps, eos):
        # Looked up when traced, so that a test can replace a decode fn.
        decode_fn = getattr(decoding, name)
        bound = steps.BoundSteps(module, params)
        cache = (bound.prefill(inputs, lengths,
                               encoder_input_tokens=encoder_inputs) if encdec
                 else bound.prefill(inputs, lengths, causal(lengths, bidir)))
        return decoding.decode(
            decode_fn, eos_id=eos, max_decode_steps=max_steps, **options,
            **bound.decode_fn_kwargs(decode_fn, inputs, cache, lengths))
      return run

    def forward(params, sequence, lengths, bidir, encoder_inputs):
      if encdec:
        logits = module.apply({'params': params}, encoder_inputs, sequence,
                              jnp.ones_like(sequence), enable_dropout=False,
                              all_exits=False)
      else:
        logits = module.apply({'params': params}, sequence,
                              jnp.ones_like(sequence),
                              decoder_causal_attention=causal(lengths, bidir),
                              enable_dropout=False, all_exits=False)
      return (jnp.argmax(logits, -1).astype(jnp.int32),
              jax.lax.top_k(logits, 2)[0])

    jit = functools.partial(jax.jit, compiler_options=(
        None if excess_precision else inference.COMPILER_OPTIONS))
    # float32 decodes all the group's cases in one vmapped call, paying the
    # loops' per-step overhead once. bfloat16 decodes them one at a time,
    # each with the program a user runs: under vmap XLA batches the
    # attention's dots differently, which moves bf16 rounding in greedy's
    # program but not in SPEED's.
    one_at_a_time = group.dtype == 'bfloat16'
    self.shapes = shapes
    self.greedy = _map_cases(decoder('greedy_decode'), jit, one_at_a_time)
    # The pipeline at every batch size: by default a batch beyond the
    # backend's max_speculative_rows runs greedy's own loop.
    self.speed = _map_cases(decoder('speed_decode', max_speculative_rows=None,
                                    speed_branches=group.branches),
                            jit, one_at_a_time)
    self.forward = jit(jax.vmap(forward))
    # Where every decode-step matmul of both loops runs on the row-independent
    # kernel (SPEED's B*R rows included) in the user's program, SPEED's tokens
    # must be greedy's exactly, near-tie or not.
    self.bit_exact = (one_at_a_time and not excess_precision and
                      build.available() and
                      group.batch * (group.r + group.branches) <=
                      matmul.MAX_ROWS)


def _map_cases(fn, jit, one_at_a_time: bool):
  """jit(fn) over a leading case axis: vmapped, or by a host loop."""
  if not one_at_a_time:
    return jit(jax.vmap(fn))
  single = jit(fn)

  def mapped(*args):
    count = jax.tree.leaves(args)[0].shape[0]
    outs = [single(*jax.tree.map(lambda x, c=c: x[c], args))
            for c in range(count)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

  return mapped


def run_cases(compiled: Compiled, rng: np.random.RandomState,
              report: fuzz_check.Report, count: int, first: str,
              weights: str = 'as_given'):
  """Draws and checks `count` cases of one group, adding to `report`;
  `weights` 'int8' quantizes each case's weights (`quantize.quantize_int8`,
  per case and output channel) before any of them runs."""
  group = compiled.group
  batch, length, vocab = group.batch, group.length, group.vocab
  names, gains, probs = zip(*VARIANTS)
  variants = rng.choice(len(VARIANTS), size=count, p=probs)
  params = draw_params(compiled.shapes,
                       np.random.default_rng(rng.randint(2**31)),
                       np.array(gains, np.float32)[variants])
  if weights == 'int8':
    params = quantize.quantize_int8(params)
  # Prompt lengths in [0, length - 1], the ends drawn often.
  kind = rng.choice(3, size=(count, batch), p=(0.15, 0.15, 0.7))
  lengths = np.where(kind == 0, 0, np.where(
      kind == 1, length - 1, rng.randint(0, length, size=(count, batch))))
  inputs = rng.randint(0, vocab, size=(count, batch, length))
  inputs[np.arange(length)[None, None] > lengths[..., None]] = 0
  inputs[..., 0] = 0
  bidir = rng.rand(count, batch) < 0.5
  max_steps = rng.randint(1, length + 1, size=(count, batch))
  encoder_inputs = np.zeros((count, batch, max(group.encoder_length, 1)),
                            np.int64)
  if group.encoder_layers:
    bidir[:] = False
    width = group.encoder_length
    encoder_lengths = rng.randint(1, width + 1, size=(count, batch))
    encoder_inputs = rng.randint(1, vocab, size=(count, batch, width))
    encoder_inputs[np.arange(width)[None, None] >=
                   encoder_lengths[..., None]] = 0
  args = (params, jnp.asarray(inputs, jnp.int32),
          jnp.asarray(lengths, jnp.int32), jnp.asarray(bidir),
          jnp.asarray(encoder_inputs, jnp.int32))
  steps_j = jnp.asarray(max_steps, jnp.int32)

  # The reference: greedy without EOS.
  refs = compiled.greedy(*args, steps_j,
                         jnp.full((count, batch), -1, jnp.int32)).sequences
  refs = np.asarray(refs)[:, :, 0]
  # Tokens each row may produce.
  limits = np.minimum(length, lengths + max_steps) - lengths
  eos = np.empty((count, batch), np.int64)
  for c, b in np.ndindex(count, batch):
    u = rng.rand()
    if u < 0.5:
      eos[c, b] = rng.choice(
          refs[c, b, lengths[c, b]:lengths[c, b] + limits[c, b]])
    elif u < 0.8:
      eos[c, b] = rng.randint(vocab)
    else:
      eos[c, b] = -1
  eos_j = jnp.asarray(eos, jnp.int32)
  greedy = compiled.greedy(*args, steps_j, eos_j)
  speed = compiled.speed(*args, steps_j, eos_j)
  sequences = np.concatenate([np.zeros((count, batch, 1), refs.dtype), refs],
                             -1)[..., :length]
  fwd_argmax, fwd_top2 = compiled.forward(params, jnp.asarray(sequences),
                                          *args[2:])
  host = jax.tree.map(np.asarray, (
      greedy.sequences, greedy.scores, speed.sequences, speed.scores,
      speed.stats, fwd_argmax, fwd_top2))
  for c in range(count):
    case = jax.tree.map(lambda x, c=c: x[c], host)
    fuzz_check.check_case(
        group, report, f'{first}+{c} {names[variants[c]]}',
        compiled.bit_exact, inputs[c], lengths[c], limits[c], eos[c],
        refs[c], *case)
