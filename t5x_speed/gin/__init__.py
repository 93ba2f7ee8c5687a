"""Gin configs, importable so that gin resolves `t5x_speed/gin/...` from any
working directory."""
