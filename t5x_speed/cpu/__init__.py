"""The CPU backend: native kernels for the few rows of a decode step.

* `build`: compiles the native library (`csrc/`) into a build directory and
  loads it (`python -m t5x_speed.cpu` builds it ahead of time);
* `matmul`: few-row weight products at memory speed, embedding gathers;
* `attention`: a decode step's cache writes and attention, row by row;
* `norm`: a decode step's RMSNorms, row by row;
* `sample`: position-keyed token choice (greedy or sampled), row by row;
* `dispatch`: which of these a decode uses, resolved from explicit settings
  (`TransformerConfig.decode_matmul`, `kernel_threads`, a decode fn's
  `token_choice`) into the values the model code and loops take.

Every kernel computes each row with one fixed sequence of operations
whatever the number of rows, which is what keeps SPEED's R-row steps
bit-identical to greedy's one-row steps. Without a compiler everything here
falls back to XLA's ops, with one logged message.
"""

from t5x_speed.cpu import attention
from t5x_speed.cpu import build
from t5x_speed.cpu import dispatch
from t5x_speed.cpu import matmul
from t5x_speed.cpu import norm
from t5x_speed.cpu import sample
from t5x_speed.cpu.dispatch import DecodeNumerics

__all__ = ['attention', 'build', 'dispatch', 'matmul', 'norm', 'sample',
           'DecodeNumerics']
