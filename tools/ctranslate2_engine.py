"""CTranslate2 beside t5x_speed: the same weights, decoded by the engine a CPU
user would otherwise pick.

    python -m tools.ctranslate2_engine --time MODEL_DIR --compute_type int8

CTranslate2 is an optional extra (`pip install -e '.[ctranslate2]'`); without
it `available()` is None and the bench says so and goes on. `save_model`
builds a CTranslate2 decoder from a t5x_speed decoder-only model's
parameters through its model-spec API, as its own T5 converter does:
pre-norm RMSNorm layers, the tanh GeLU gated MLP, T5's relative position
bias (each layer given the model's one table), tied embeddings with logits
scaled by emb_dim ** -0.5, no query scaling. `layers` picks the unique
layers in order, so a GxR model's G*R virtual layers become the unshared
G*R-layer model of the same weights (the function greedy computes on the
GxR model), and its first G the G-layer model. nothing is downloaded.

What differs from our decoder: CTranslate2 runs causal attention over the
prompt (our prefix-LM attends bidirectionally when asked) and its own
kernels (oneDNN on x86; its int8 quantizes activations too, per row); the
numbers it is timed on are its decode steps alone.

`time_decode` runs one model in a fresh process (a model loaded earlier in
the same process slows a later one) and returns ms per token of greedy
decoding at batch 1: the time between its first and its last generated token
over the decode steps between them (CTranslate2 reports each position as it
decodes it), the best of `repeats` rounds.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from tools import common

COMPUTE_TYPES = ('float32', 'int8')
# CTranslate2's quantization at save time for each compute type.
_QUANTIZATION = {'float32': 'float32', 'int8': 'int8_float32'}
SPECIAL = ('<s>', '</s>', '<unk>')  # our ids 0 (BOS / pad), 1 (EOS), 2


def available() -> Optional[str]:
  """CTranslate2's version, or None where it is not installed."""
  try:
    import ctranslate2  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return ctranslate2.__version__


def token_names(vocab_size: int):
  """CTranslate2's vocabulary: our token ids as names."""
  return list(SPECIAL) + [f't{i}' for i in range(len(SPECIAL), vocab_size)]


def save_model(params: Dict[str, Any], config, layers: Sequence[int],
               out_dir: str, compute_type: str = 'float32') -> str:
  """Writes a CTranslate2 decoder of `params`' unique layers `layers` (in
  that order) to `out_dir`, quantized for `compute_type`; returns out_dir."""
  from ctranslate2.specs import common_spec  # pylint: disable=g-import-not-at-top
  from ctranslate2.specs import transformer_spec  # pylint: disable=g-import-not-at-top
  if config.is_encoder_decoder or not config.logits_via_embedding:
    raise ValueError('save_model takes decoder-only models with tied '
                     'embeddings.')
  if tuple(config.mlp_activations) != ('gelu', 'linear'):
    raise ValueError('save_model takes the gated GeLU MLP, got '
                     f'{config.mlp_activations}.')
  # Copies: CTranslate2 quantizes the arrays it is given in place.
  f32 = lambda x: np.array(x, np.float32)
  dec = params['decoder']
  spec = transformer_spec.TransformerDecoderSpec(
      len(layers), config.num_heads, pre_norm=True,
      activation=common_spec.Activation.GELUTanh,
      with_encoder_attention=False, relative_attention_bias=True,
      ffn_glu=True, rms_norm=True, head_dim=config.head_dim)
  bias = f32(dec['relpos_bias']['rel_embedding']).T  # [buckets, heads]
  for target, unique in zip(spec.layer, layers):
    layer = dec[f'layers_{unique}']
    att = layer['self_attention']
    target.self_attention.linear[0].weight = np.concatenate(
        [f32(att[n]['kernel']).T for n in ('query', 'key', 'value')])
    target.self_attention.linear[1].weight = f32(att['out']['kernel']).T
    target.self_attention.queries_scale = 1.0
    target.self_attention.relative_attention_bias = bias
    target.self_attention.relative_attention_max_distance = np.dtype(
        'int32').type(config.relpos_max_distance)
    target.self_attention.layer_norm.gamma = f32(
        layer['pre_self_attention_layer_norm']['scale'])
    mlp = layer['mlp']
    target.ffn.layer_norm.gamma = f32(layer['pre_mlp_layer_norm']['scale'])
    target.ffn.linear_0.weight = f32(mlp['wi_0']['kernel']).T
    target.ffn.linear_0_noact.weight = f32(mlp['wi_1']['kernel']).T
    target.ffn.linear_1.weight = f32(mlp['wo']['kernel']).T
  table = dec['token_embedder']['embedding']
  spec.embeddings.weight = f32(table)
  spec.projection.weight = f32(table)
  spec.scale_embeddings = False
  spec.scale_outputs = config.emb_dim ** -0.5
  spec.layer_norm.gamma = f32(dec['decoder_norm']['scale'])
  model = transformer_spec.TransformerDecoderModelSpec(spec)
  model.config.layer_norm_epsilon = 1e-6
  model.config.bos_token, model.config.eos_token, model.config.unk_token = (
      SPECIAL)
  model.register_vocabulary(token_names(config.vocab_size))
  model.validate()
  model.optimize(quantization=_QUANTIZATION[compute_type])
  os.makedirs(out_dir, exist_ok=True)
  model.save(out_dir)
  return out_dir


def generator(model_dir: str, compute_type: str, threads: int = 0):
  """A CTranslate2 Generator of `model_dir` on the CPU (0 threads: one per
  core)."""
  import ctranslate2  # pylint: disable=g-import-not-at-top
  return ctranslate2.Generator(
      model_dir, device='cpu', compute_type=_QUANTIZATION[compute_type],
      intra_threads=threads or os.cpu_count(), inter_threads=1)


def greedy(gen, prompt: Sequence[int], steps: int, vocab_size: int,
           force_length: bool = False,
           callback: Optional[Callable[[Any], bool]] = None):
  """Greedy token ids after BOS + `prompt`, at most `steps` (exactly, with
  `force_length`: EOS is then never chosen). `callback`, CTranslate2's, is
  called once per position as it is decoded, the prompt's included."""
  names = token_names(vocab_size)
  # With the prompt in the result (its lengths count the prompt): without,
  # this CTranslate2 build repeats the prompt's last token on T5's relative
  # bias.
  total = len(prompt) + steps
  out = gen.generate_batch(
      [[SPECIAL[0]] + [names[t] for t in prompt]], max_length=total,
      min_length=total if force_length else 0, sampling_topk=1, beam_size=1,
      include_prompt_in_result=True, callback=callback)
  return [names.index(t) for t in out[0].sequences[0][len(prompt):]]


def _time_in_process(model_dir: str, compute_type: str, prompt_length: int,
                     steps: int, repeats: int, vocab_size: int) -> float:
  gen = generator(model_dir, compute_type)
  prompt = list(range(len(SPECIAL), len(SPECIAL) + prompt_length))

  def decode_seconds():
    # The intervals between the generated tokens' callbacks are its decode
    # steps.
    stamps = []

    def stamp(unused_step) -> bool:
      stamps.append(time.perf_counter())
      return False  # go on decoding

    greedy(gen, prompt, steps + 1, vocab_size, force_length=True,
           callback=stamp)
    generated = stamps[prompt_length:]
    if len(generated) != steps + 1:
      raise RuntimeError(f'CTranslate2 reported {len(stamps)} positions, '
                         f'expected {prompt_length + steps + 1}.')
    return generated[-1] - generated[0]

  decode_seconds()
  return 1e3 * min(decode_seconds() for _ in range(repeats)) / steps


def time_decode(model_dir: str, compute_type: str, prompt_length: int,
                vocab_size: int, steps: int = 128, repeats: int = 3) -> float:
  """Greedy decode ms/token of the model in `model_dir` at batch 1, in a
  fresh process (see the module docstring)."""
  result = subprocess.run(
      [sys.executable, '-m', 'tools.ctranslate2_engine', '--time', model_dir,
       '--compute_type', compute_type, '--prompt_length', str(prompt_length),
       '--steps', str(steps), '--repeats', str(repeats),
       '--vocab_size', str(vocab_size)],
      capture_output=True, text=True, check=False,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if result.returncode:
    raise RuntimeError(f'timing {model_dir} failed:\n{result.stderr[-2000:]}')
  return json.loads(result.stdout.strip().splitlines()[-1])['ms_per_token']


def bench_rows(configs: Dict[str, Any], out_dir: str, prompt_length: int,
               repeats: int, log=print) -> List[Dict[str, Any]]:
  """CTranslate2's greedy on the unshared equivalents of the bench's shared
  models, f32 and int8: for each (module, params) of `configs` (GxR label:
  its float weights), the G*R-layer model of its virtual layers and its
  first G layers (the unshared G-layer model's shape), each saved under
  `out_dir` and timed in a fresh process."""
  rows = []
  for label, (module, params) in configs.items():
    config = module.config
    g, r = config.num_unique_layers, config.num_repeats
    for name, layers in ((f'{g * r} layers ({label} unrolled)',
                          [i % g for i in range(g * r)]),
                         (f'{g} layers', list(range(g)))):
      for compute_type in COMPUTE_TYPES:
        path = os.path.join(out_dir, f'{label}_{len(layers)}l_{compute_type}')
        save_model(params, config, layers, path, compute_type)
        log(f'timing CTranslate2 {name} {compute_type}')
        rows.append({'config': label, 'model': name, 'layers': len(layers),
                     'compute_type': compute_type,
                     'ms_per_token': time_decode(
                         path, compute_type, prompt_length,
                         config.vocab_size, repeats=repeats)})
  return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog='python -m tools.ctranslate2_engine',
                              description=__doc__,
                              formatter_class=common.HelpFormatter)
  p.add_argument('--time', required=True, metavar='MODEL_DIR',
                 help='a model saved by save_model')
  p.add_argument('--compute_type', default='float32', choices=COMPUTE_TYPES)
  p.add_argument('--prompt_length', type=int, default=8)
  p.add_argument('--steps', type=int, default=128)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--vocab_size', type=int, required=True)
  args = p.parse_args(argv)
  ms = _time_in_process(args.time, args.compute_type, args.prompt_length,
                        args.steps, args.repeats, args.vocab_size)
  print(json.dumps({'ms_per_token': ms}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
