"""t5x_speed: SPEED decoding for parameter-shared Transformer decoders.

The names a user needs; the modules hold the rest:

  >>> import t5x_speed
  >>> cfg = t5x_speed.TransformerConfig(num_unique_layers=4, num_repeats=3)
  >>> cfg.num_layers
  12

`t5x_speed.SpeedDecoderOnlyModel` and `t5x_speed.SpeedEncoderDecoderModel`
(T5X models) are imported on first use: they need T5X, which nothing else
here does (so `from t5x_speed import *` leaves them out).
"""

import importlib

from t5x_speed.config import TransformerConfig
from t5x_speed.decoding import greedy_decode
from t5x_speed.decoding import speed_decode
from t5x_speed.encoder_decoder import SpeedEncoderDecoder
from t5x_speed.inference import Generation
from t5x_speed.inference import generate
from t5x_speed.network import SpeedTransformer
from t5x_speed.results import DecodeResult
from t5x_speed.results import SpeedStats
from t5x_speed.sampling import sample_decode
from t5x_speed.sampling import speed_sample_decode

__version__ = '0.1.0'

__all__ = ['TransformerConfig', 'SpeedTransformer', 'SpeedEncoderDecoder',
           'generate', 'Generation', 'DecodeResult', 'SpeedStats',
           'speed_decode', 'greedy_decode', 'speed_sample_decode',
           'sample_decode']

_T5X_MODELS = ('SpeedDecoderOnlyModel', 'SpeedEncoderDecoderModel')


def __getattr__(name):
  if name in _T5X_MODELS:
    return getattr(importlib.import_module('t5x_speed.models'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
