"""t5x_speed: SPEED decoding for parameter-shared Transformer decoders."""

__version__ = '0.1.0'
