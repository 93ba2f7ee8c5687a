"""Gin settings shared by the decoder-only and encoder-decoder model files."""
