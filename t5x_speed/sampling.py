r"""Exact SPEED sampling: temperature, top-k, top-p, position-keyed noise.

T5X's `temperature_sample` splits its RNG at every loop step, so a token's
randomness depends on when it is computed. Here the randomness of the token
at position p of decode d of example b depends only on (decode_rng, b, d, p):
it is Gumbel noise over the vocabulary drawn from
`fold_in(fold_in(fold_in(decode_rng, b), d), p)`, and the token is

  argmax(filtered_logits / temperature + noise)

(the Gumbel-max trick: a sample from softmax(filtered_logits / temperature),
where top-k / top-p filtering sets the excluded logits to -inf, as T5X's
masks do). Sampling position p is then a deterministic function of the
logits that predict it, like greedy's argmax, and SPEED speculates, flushes
and commits exactly as for greedy: every stage samples its token's next
position with that position's noise from its own exit's logits, the last
stage's sample is committed, and a mismatch flushes the later tokens. So

  speed_sample_decode(...) == sample_decode(...)   token for token,

where `sample_decode` is the plain sequential full-depth sampler with the
same noise: "exact" means identical to that sampler, sample by sample, and
distributed as T5X's `temperature_sample` (whose draws differ). Because the
speculative and the final stage share their noise, they agree about as often
as greedy's argmaxes do: the speedup carries over to sampling.

Both are T5X decode fns (`(decodes [batch, num_decodes, length], log_probs
[batch, num_decodes])`, sorted by increasing log-probability as T5X's
sampler sorts them) taking T5X's sampling arguments: `decode_rng`,
`temperature` (a number, or one per example), `topk`, `topp`,
`num_decodes`, `rescale_log_probs`, `max_decode_steps` and
`max_decode_steps_hard_limit`. At temperature <= 1e-4 a row decodes
greedily: the same tokens as `greedy_decode` / `speed_decode`.

Example (SPEED sampling equals sequential sampling, sample by sample):
  >>> import jax, jax.numpy as jnp
  >>> from t5x_speed import network, steps
  >>> cfg = network.TransformerConfig(vocab_size=16, emb_dim=8, num_heads=2,
  ...     head_dim=4, mlp_dim=16, num_unique_layers=2, num_repeats=3)
  >>> module = network.SpeedTransformer(cfg)
  >>> tokens = jnp.ones((1, 4), jnp.int32)
  >>> params = module.init(jax.random.PRNGKey(0), tokens, tokens,
  ...                      enable_dropout=False)['params']
  >>> bound = steps.BoundSteps(module, params)
  >>> inputs = jnp.array([[0, 3, 4, 0, 0, 0, 0, 0]])   # BOS, prompt, room
  >>> lengths = jnp.array([2])
  >>> cache = bound.prefill(inputs, lengths)
  >>> results = {fn.__name__: fn(
  ...     **bound.decode_fn_kwargs(fn, inputs, cache, lengths), eos_id=1,
  ...     decode_rng=jax.random.PRNGKey(7), temperature=1.0, num_decodes=2)
  ...            for fn in (sample_decode, speed_sample_decode)}
  >>> speed, sequential = (results['speed_sample_decode'],
  ...                      results['sample_decode'])
  >>> speed.sequences.shape, speed.pipelined   # 2 samples x R = 6 rows
  ((1, 2, 8), True)
  >>> bool((speed.sequences == sequential.sequences).all())
  True
"""

import dataclasses
from typing import Any, Optional, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from t5x_speed import cpu
from t5x_speed import decode_args
from t5x_speed import decoding
from t5x_speed import sequential_loop
from t5x_speed import speed_loop
from t5x_speed import token_rules
from t5x_speed.results import DecodeResult
from t5x_speed.results import SpeedStats

__all__ = ['speed_sample_decode', 'sample_decode', 'PositionKeyedSampler',
           'topp_filter', 'row_keys', 'check_settings', 'MIN_TEMPERATURE']

Array = jax.Array
# T5X's: at or below this temperature a row decodes greedily.
MIN_TEMPERATURE = decode_args.MIN_TEMPERATURE


@flax.struct.dataclass
class PositionKeyedSampler:
  """A `token_rules.TokenRule` sampling each (row, position) with its own noise.

  Attributes:
    row_keys: [rows] PRNG keys, one per decoded row (example and decode
      index), raw ([rows, 2] uint32) or typed.
    temperature: [rows] float32; rows at or below `MIN_TEMPERATURE` take
      the argmax.
    topp: [] float32 top-p mass (used when `use_topp`).
    topk: keep the `topk` largest logits (0: all); static.
    use_topp: whether to apply top-p (False when topp is a concrete 0).
    rescale_log_probs: `log_prob` under the filtered, tempered distribution
      (T5X's default; 0 for greedy rows) instead of the model's.
    token_choice: 'auto', 'kernel' or 'xla': sample with `cpu.sample`'s
      kernel or XLA's ops (`cpu.dispatch.token_kernel` resolves it). The
      two draw the same bits; their logarithms and exponentials differ in
      the last ulps.
  """

  row_keys: Array
  temperature: Array
  topp: Array
  topk: int = flax.struct.field(pytree_node=False, default=0)
  use_topp: bool = flax.struct.field(pytree_node=False, default=False)
  rescale_log_probs: bool = flax.struct.field(pytree_node=False,
                                              default=True)
  token_choice: str = flax.struct.field(pytree_node=False, default='auto')

  def _per_row(self, x: Array, ndim: int) -> Array:
    return x.reshape(x.shape + (1,) * (ndim - 1))

  def filtered(self, logits: Array) -> Array:
    """Tempered logits [rows, ..., vocab], -inf outside top-k / top-p."""
    temperature = jnp.maximum(self.temperature, MIN_TEMPERATURE)
    scaled = logits.astype(jnp.float32) / self._per_row(temperature,
                                                        logits.ndim)
    if self.topk:
      k = min(self.topk, logits.shape[-1])
      kth = lax.top_k(scaled, k)[0][..., -1:]
      scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    if self.use_topp:
      scaled = topp_filter(scaled, self.topp)
    return scaled

  def noise(self, positions: Array, vocab: int) -> Array:
    """Gumbel noise [rows, S, vocab] for each row's S positions [rows, S]."""

    def one(key, position):
      return jax.random.gumbel(jax.random.fold_in(key, position), (vocab,))

    return jax.vmap(jax.vmap(one, (None, 0)))(self.row_keys, positions)

  def tokens(self, logits: Array, positions: Array) -> Array:
    """Sampled tokens [rows, S] from logits [rows, S, vocab]."""
    sampled = token_rules.argmax(self.filtered(logits) +
                                 self.noise(positions, logits.shape[-1]))
    greedy = token_rules.argmax(logits)
    hot = self.temperature > MIN_TEMPERATURE
    return jnp.where(hot[:, None], sampled, greedy).astype(jnp.int32)

  def pick(self, logits: Array, positions: Array) -> Tuple[Array, Array]:
    """Samples tokens [rows, S] from logits [rows, S, vocab] at positions
    [rows, S]; returns them and the last slot's log-probability [rows].

    `token_rules.TokenRule.pick`, through `cpu.sample` or XLA's ops as
    `token_choice` says.
    """
    if not cpu.dispatch.token_kernel(self.token_choice, logits.dtype,
                                     self.row_keys):
      tokens = self.tokens(logits, positions)
      return tokens, self.log_prob(logits[:, -1], tokens[:, -1])
    return cpu.sample.pick(
        logits, self.row_keys, positions, self.temperature,
        jnp.broadcast_to(jnp.where(self.use_topp, self.topp, 0.0),
                         self.temperature.shape),
        topk=self.topk, rescale=self.rescale_log_probs)

  def log_prob(self, logits: Array, tokens: Array) -> Array:
    """Log-probability [rows] of `tokens` [rows] under logits [rows, vocab]."""
    pick = lambda lp: jnp.take_along_axis(lp, tokens[:, None], -1)[:, 0]
    if not self.rescale_log_probs:
      return pick(jax.nn.log_softmax(logits.astype(jnp.float32)))
    rescaled = pick(jax.nn.log_softmax(self.filtered(logits)))
    return jnp.where(self.temperature > MIN_TEMPERATURE, rescaled, 0.0)


def topp_filter(logits: Array, topp: Array) -> Array:
  """Keeps the smallest set of largest-probability tokens whose mass is at
  least `topp` (ties at the cut kept), -inf elsewhere; topp <= 0 keeps all.

  [..., vocab] -> [..., vocab]. The cut, the largest probability t with
  mass(probabilities >= t) >= topp, is found exactly by bisection over the
  bits of a non-negative float32 (31 masked sums over the vocabulary), as
  T5X's `binary_search.topp_mask` does: cheaper on a CPU than sorting the
  vocabulary.
  """
  probs = jax.nn.softmax(logits, -1)

  def bisect_body_fn(bit, cut_bits):
    # Non-negative float32s order as their bit patterns: set bits from the
    # top while the mass at or above the candidate still reaches topp.
    trial = cut_bits | (jnp.uint32(1) << (30 - bit).astype(jnp.uint32))
    cut = lax.bitcast_convert_type(trial, jnp.float32)[..., None]
    mass = jnp.sum(jnp.where(probs >= cut, probs, 0.0), -1)
    return jnp.where(mass >= topp, trial, cut_bits)

  cut_bits = lax.fori_loop(0, 31, bisect_body_fn,
                           jnp.zeros(probs.shape[:-1], jnp.uint32))
  cut = lax.bitcast_convert_type(cut_bits, jnp.float32)[..., None]
  keep = (probs >= cut) | (topp <= 0)
  return jnp.where(keep, logits, -jnp.inf)


def row_keys(decode_rng: Optional[Array], batch: int,
             num_decodes: int) -> Array:
  """Keys of the batch * num_decodes rows (example-major, as T5X expands):
  fold_in(fold_in(decode_rng, example), decode index)."""
  rng = jax.random.PRNGKey(0) if decode_rng is None else decode_rng
  examples = jnp.repeat(jnp.arange(batch), num_decodes)
  decodes = jnp.tile(jnp.arange(num_decodes), batch)
  return jax.vmap(lambda e, d: jax.random.fold_in(
      jax.random.fold_in(rng, e), d))(examples, decodes)


@dataclasses.dataclass(frozen=True)
class _Expanded:
  """A decode's arguments repeated num_decodes times per example."""
  inputs: Array
  cache: Any
  checked: decode_args.Checked
  sampler: PositionKeyedSampler
  repeat: Any                  # x -> x repeated per decode along axis 0


def check_settings(fn_name: str, batch: int, temperature: Any, topk: Any,
                   topp: Any, rescale_log_probs: bool = True
                   ) -> Tuple[Array, int, bool]:
  """Checks sampling settings; returns (temperature [batch], topk, use_topp).

  Concrete values are checked; a traced temperature or topp is used as is
  (topk must be concrete: it fixes shapes).
  """
  if not decode_args.is_concrete(topk):
    raise ValueError(f'{fn_name} needs a concrete topk (an integer >= 0), '
                     'got a traced value.')
  topk = decode_args.check_int('topk', topk, 0)
  use_topp = not decode_args.is_concrete(topp) or bool(np.asarray(topp) != 0)
  if decode_args.is_concrete(topp) and not 0 <= float(np.asarray(topp)) <= 1:
    raise ValueError(f'topp must lie in [0, 1] (0: off), got {topp}.')
  if topk and decode_args.is_concrete(topp) and use_topp:
    raise ValueError(f'topk={topk} and topp={topp}: at most one of them may '
                     'be non-zero (as in T5X).')
  temperature = jnp.asarray(temperature, jnp.float32)
  if temperature.shape not in ((), (batch,)):
    raise ValueError(f'temperature must be a number or one per example '
                     f'([batch={batch}]), got shape {temperature.shape}.')
  if decode_args.is_concrete(temperature) and not np.all(
      np.asarray(temperature) >= 0):
    raise ValueError(f'temperature must be >= 0, got {temperature}.')
  if not isinstance(rescale_log_probs, (bool, np.bool_)):
    raise ValueError('rescale_log_probs must be a bool, got '
                     f'{rescale_log_probs!r}.')
  return jnp.broadcast_to(temperature, (batch,)), topk, use_topp


def _sampler_and_expand(fn_name, inputs, cache, checked, cache_offset,
                        decode_rng, num_decodes, temperature, topk, topp,
                        rescale_log_probs, token_choice) -> _Expanded:
  """Checks the sampling arguments; repeats everything per decode."""
  cpu.dispatch.check_token_choice(token_choice)
  batch = inputs.shape[0]
  num_decodes = decode_args.check_int('num_decodes', num_decodes, 1)
  temperature, topk, use_topp = check_settings(
      fn_name, batch, temperature, topk, topp, rescale_log_probs)
  # One decode per example leaves everything as it is (any cache structure).
  repeat = lambda x, axis=0: (x if num_decodes == 1 else
                              jnp.repeat(x, num_decodes, axis=axis))
  return _Expanded(
      inputs=repeat(inputs),
      cache=jax.tree.map(lambda x: repeat(x, cache_offset), cache),
      checked=decode_args.Checked(*map(repeat, checked)),
      sampler=PositionKeyedSampler(
          row_keys=row_keys(decode_rng, batch, num_decodes),
          temperature=repeat(temperature),
          topp=jnp.asarray(topp, jnp.float32), topk=topk, use_topp=use_topp,
          rescale_log_probs=bool(rescale_log_probs),
          token_choice=token_choice),
      repeat=repeat)


def _sorted(sequences: Array, scores: Array, lengths: Array, batch: int,
            num_decodes: int) -> Tuple[Array, Array, Array]:
  """[rows, length + 1], [rows] and [rows] -> [batch, num_decodes, length],
  [batch, num_decodes] and [batch, num_decodes], by increasing
  log-probability (T5X's order)."""
  decodes = sequences[:, 1:].reshape(batch, num_decodes, -1)
  scores = scores.reshape(batch, num_decodes)
  lengths = lengths.reshape(batch, num_decodes)
  order = jnp.argsort(scores, -1)
  return (jnp.take_along_axis(decodes, order[..., None], 1),
          jnp.take_along_axis(scores, order, -1),
          jnp.take_along_axis(lengths, order, -1))


def _per_example(stats: SpeedStats, batch: int,
                 num_decodes: int) -> SpeedStats:
  """Stats of the batch * num_decodes rows -> one row per example: the
  counters summed over its decodes, the invalid flags or-ed, the pipeline
  and branch settings (the same for every decode) kept."""
  split = lambda x: x.reshape((batch, num_decodes) + x.shape[1:])
  summed = jax.tree.map(lambda x: split(x).sum(1), stats)
  return summed.replace(
      invalid=lax.reduce(split(stats.invalid), np.int32(0), lax.bitwise_or,
                         (1,)),
      pipelined=split(stats.pipelined).max(1),
      branches=split(stats.branches).max(1))


@decoding.declare_decode_fn(pipelined=False)
def sample_decode(inputs: Array,
                  cache: Any,
                  tokens_to_logits,
                  eos_id: decode_args.IntOrArray,
                  decode_rng: Optional[Array] = None,
                  num_decodes: int = 1,
                  temperature: Any = 1.0,
                  topk: int = 0,
                  topp: Any = 0.0,
                  cache_offset: int = 0,
                  initial_index: Optional[Array] = None,
                  max_decode_steps: Optional[decode_args.IntOrArray] = None,
                  max_decode_steps_hard_limit: Optional[int] = None,
                  rescale_log_probs: bool = True,
                  token_choice: str = 'auto') -> DecodeResult:
  """Sequential full-depth sampling with position-keyed noise.

  One full-depth token per loop step, as `decoding.greedy_decode`, sampled
  as the module docstring says. `speed_sample_decode` gives the same output.

  Args:
    inputs: [batch, length] BOS-shifted prompts, zeros after the prompt.
    cache: cache prefilled for positions < initial_index.
    tokens_to_logits: `DecodingState` -> (logits [rows, vocab], new cache).
    eos_id: end-of-sequence id, an integer or [batch] integers.
    decode_rng: PRNG key, raw (`jax.random.PRNGKey`) or typed
      (`jax.random.key`); None means PRNGKey(0), as in T5X.
    num_decodes: samples per example (>= 1).
    temperature: >= 0, a number or [batch].
    topk: sample among the topk most likely tokens; 0 for all.
    topp: sample among the smallest set of most likely tokens holding at
      least this mass (0: off). At most one of topk and topp is non-zero
      (a traced topp with topk > 0 applies both, top-k first, as T5X).
    cache_offset: the batch axis of the cache's leaves, where they are
      repeated for num_decodes > 1.
    initial_index: [batch] prompt lengths, in [0, length); defaults to 0.
    max_decode_steps: optional limit on produced tokens per example (>= 1),
      an integer or [batch] integers.
    max_decode_steps_hard_limit: as T5X's: if > 0, caps `max_decode_steps`.
    rescale_log_probs: score under the tempered, filtered distribution (True,
      T5X's default) or the model's (False).
    token_choice: 'auto', 'kernel' or 'xla': sample with the CPU kernel or
      XLA's ops (`PositionKeyedSampler.token_choice`).

  Returns:
    A `DecodeResult` (no stats) that unpacks as T5X's (decodes [batch,
    num_decodes, length], log_probs [batch, num_decodes]), each example's
    samples by increasing log-probability; NaN for an invalid example (see
    `decoding`).

  Raises:
    ValueError: for bad arguments (see `decoding`), a decode_rng that is not
      a PRNG key, a negative temperature, a traced or negative topk, topp
      outside [0, 1], or both set.
  """
  decode_args.check_prng_key('decode_rng', decode_rng)
  max_decode_steps = decode_args.apply_hard_limit(
      max_decode_steps, max_decode_steps_hard_limit)
  checked = sequential_loop.check_sequential(
      inputs, cache, tokens_to_logits, initial_index, max_decode_steps,
      eos_id, cache_offset)
  x = _sampler_and_expand('sample_decode', inputs, cache, checked,
                          cache_offset, decode_rng, num_decodes, temperature,
                          topk, topp, rescale_log_probs, token_choice)
  final, scores = sequential_loop.sequential_loop(
      x.inputs, x.cache, tokens_to_logits, x.checked, x.sampler)
  sequences, scores, lengths = _sorted(
      final.sequences, scores, final.cur_index - x.checked.initial_index,
      inputs.shape[0], num_decodes)
  return DecodeResult(sequences=sequences, scores=scores, lengths=lengths)


@decoding.declare_decode_fn(pipelined=True)
def speed_sample_decode(inputs: Array,
                        cache: Any,
                        tokens_to_logits=None,
                        eos_id: decode_args.IntOrArray = 1,
                        decode_rng: Optional[Array] = None,
                        num_decodes: int = 1,
                        temperature: Any = 1.0,
                        topk: int = 0,
                        topp: Any = 0.0,
                        cache_offset: int = 0,
                        initial_index: Optional[Array] = None,
                        max_decode_steps: Optional[
                            decode_args.IntOrArray] = None,
                        max_decode_steps_hard_limit: Optional[int] = None,
                        rescale_log_probs: bool = True,
                        *,
                        pipeline_step_fn: Optional[
                            speed_loop.PipelineStepFn] = None,
                        num_stages: Optional[int] = None,
                        initial_carry: Optional[Array] = None,
                        max_speculative_rows: Any = 'auto',
                        require_pipeline: bool = False,
                        record_schedule: bool = False,
                        token_choice: str = 'auto',
                        speed_branches: Any = 'auto') -> DecodeResult:
  """SPEED sampling: `sample_decode`'s output from SPEED's pipeline.

  The pipeline of `decoding.speed_decode`, each stage sampling its token's
  next position with that position's noise (module docstring).

  Args:
    inputs, cache, eos_id, decode_rng, num_decodes, temperature, topk, topp,
      cache_offset, initial_index, max_decode_steps,
      max_decode_steps_hard_limit, rescale_log_probs: as `sample_decode`.
    tokens_to_logits, pipeline_step_fn, num_stages, initial_carry,
      max_speculative_rows, require_pipeline, record_schedule,
      speed_branches: as `decoding.speed_decode`
      (`steps.BoundSteps.decode_fn_kwargs` supplies the first four); rows
      are batch x num_decodes x R. A branch holds the most likely tokens
      other than the one sampled, and is taken only where the next exit's
      draw (the same position's noise) names it. A batch beyond
      `max_speculative_rows` samples with `sample_decode`'s loop: the same
      samples.
    token_choice: as `sample_decode`'s.

  Returns:
    As `sample_decode`, with the `SpeedStats`, one row per example summed
    over its num_decodes samples, and the `SpeedSchedule` when asked to
    record it, whose rows are the batch * num_decodes decoded rows
    (example-major).

  Raises:
    ValueError: as `sample_decode` and `decoding.speed_decode`.
  """
  decode_args.check_prng_key('decode_rng', decode_rng)
  max_decode_steps = decode_args.apply_hard_limit(
      max_decode_steps, max_decode_steps_hard_limit)
  max_rows = cpu.dispatch.max_speculative_rows(max_speculative_rows)
  decode_args.check_bool('require_pipeline', require_pipeline)
  decode_args.check_bool('record_schedule', record_schedule)
  stages, initial_carry, checked = speed_loop.check_pipeline(
      inputs, cache, pipeline_step_fn, num_stages, initial_carry,
      initial_index, max_decode_steps, eos_id, cache_offset,
      fn_name='speed_sample_decode')
  x = _sampler_and_expand('speed_sample_decode', inputs, cache, checked,
                          cache_offset, decode_rng, num_decodes, temperature,
                          topk, topp, rescale_log_probs, token_choice)
  branches = cpu.dispatch.speed_branches(
      speed_branches, x.inputs.shape[0], stages, initial_carry.dtype)
  out = speed_loop.speed_or_sequential(
      x.inputs, x.cache, pipeline_step_fn, tokens_to_logits, stages,
      x.repeat(initial_carry), x.checked, x.sampler, max_rows,
      record_schedule, require_pipeline, fn_name='speed_sample_decode',
      branches=branches)
  sequences, scores, lengths = _sorted(out.sequences, out.scores, out.lengths,
                                       inputs.shape[0], num_decodes)
  return DecodeResult(
      sequences=sequences, scores=scores, lengths=lengths,
      stats=_per_example(out.stats, inputs.shape[0], num_decodes),
      schedule=out.schedule, pipelined=out.pipelined)
