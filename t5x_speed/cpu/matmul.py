"""Few-row matmuls at memory speed on CPU: a C++ kernel behind `jax.ffi`.

A decode step multiplies a few token rows by every weight matrix. XLA:CPU
runs one row as a memory-speed GEMV but several rows through a GEMM that
packs the weights first, so a few rows cost well over one weight read, which
defeats SPEED's premise that R rows cost about one. The kernel in
`csrc/rowmatmul.cc` streams each weight once for all rows (register-held
accumulators, AVX-512 / AVX2+FMA / portable, on `threads` threads), and
computes every row with the same arithmetic whatever the number of rows, so
a token's weight products are bit-identical in greedy (1 row) and SPEED (R
rows). Weights may also be int8 with float32 scales per output channel
(`t5x_speed.quantize`): widened exactly as they load, multiplied as float32
weights are, each finished sum times its channel's scale. `gather_rows`
copies embedding rows as they are.

Where the library is not built (`build.available()`), every function here is
XLA's op. Which of a model's matmuls come here is decided by the decode
step's `dispatch.DecodeNumerics`.

Example:
  >>> x, w = jnp.ones((3, 768)), jnp.ones((768, 2048))
  >>> matmul(x, w).shape      # x @ w, by the kernel for <= MAX_ROWS rows
  (3, 2048)
  >>> matmul(x, jnp.ones((32128, 768)), transpose_w=True).shape  # x @ w.T
  (3, 32128)
  >>> [o.shape for o in matmuls(x, [jnp.ones((768, 64)), w])]  # one call
  [(3, 64), (3, 2048)]
  >>> q = jnp.ones((768, 2048), jnp.int8)    # int8, one scale per column
  >>> float(matmul(x, q, w_scale=jnp.full((2048,), 0.5))[0, 0])
  384.0
"""

import functools
from typing import Optional, Sequence, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from t5x_speed.cpu import build

__all__ = ['MAX_ROWS', 'KERNEL_DTYPES', 'matmul', 'matmuls', 'gather_rows',
           'check_threads', 'check_int8']

Array = jax.Array

# Rows up to which `matmul` uses the kernel. The kernel's advantage, one
# weight read for all rows, shrinks as rows grow while XLA's GEMM amortises
# its weight packing over them (in float32 it catches up first). The bound
# still covers SPEED's batch * R rows at the batch sizes it serves, where the
# kernel's row independence keeps SPEED's products bit-identical to greedy's.
MAX_ROWS = 64

_TARGETS = {False: 't5x_speed_rowmatmul', True: 't5x_speed_rowmatmul_nt'}
# Operand dtypes the library's kernels take as they are.
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _ffi(x: Array, ws: Tuple[Array, ...], ns: Tuple[int, ...],
         transpose_w: bool, dtype, threads: int,
         scale: float, w_scales: Tuple[Array, ...] = ()) -> Tuple[Array, ...]:
  call = jax.ffi.ffi_call(
      _TARGETS[transpose_w] + ('_q8' if w_scales else ''),
      tuple(jax.ShapeDtypeStruct((x.shape[0], n), dtype) for n in ns),
      # One call for all vmapped matrices: the kernel takes leading batch
      # axes (size 1 = broadcast).
      vmap_method='expand_dims')
  attrs = {'threads': np.int64(threads)}
  if transpose_w:
    attrs['scale'] = np.float32(scale)
  return tuple(call(x, *ws, *w_scales, **attrs))


# The kernel is a forward-only custom call; the backward pass (if a few-row
# matmul is ever differentiated, e.g. a decode step under grad) uses XLA's
# dots, in f32 for mixed operands, each gradient cast to its operand's dtype.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _kernel(x: Array, ws: Tuple[Array, ...], ns: Tuple[int, ...],
            transpose_w: bool, dtype, threads: int,
            scale: float) -> Tuple[Array, ...]:
  return _ffi(x, ws, ns, transpose_w, dtype, threads, scale)


def _kernel_fwd(x, ws, ns, transpose_w, dtype, threads, scale):
  return _ffi(x, ws, ns, transpose_w, dtype, threads, scale), (x, ws)


def _kernel_bwd(ns, transpose_w, dtype, threads, scale, res, gs):
  del dtype, threads
  x, ws = res
  f32 = lambda a: a.astype(jnp.float32)
  dx = jnp.zeros(x.shape, jnp.float32)
  dws = []
  for w, n, g in zip(ws, ns, gs):
    g = f32(g) * np.float32(scale)
    if transpose_w:
      dx = dx + jnp.dot(g, f32(w[:n]))
      dws.append(jnp.zeros(w.shape, jnp.float32).at[:n].set(
          jnp.dot(g.T, f32(x))).astype(w.dtype))
    else:
      dx = dx + jnp.dot(g, f32(w).T)
      dws.append(jnp.dot(f32(x).T, g).astype(w.dtype))
  return dx.astype(x.dtype), tuple(dws)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def check_threads(threads) -> None:
  """Raises ValueError unless `threads` (a kernel call's) is an int >= 0."""
  if (isinstance(threads, bool) or
      not isinstance(threads, (int, np.integer)) or threads < 0):
    raise ValueError(f'threads must be an integer >= 0, got {threads!r}.')


def _kernel_takes(x: Array, ws: Sequence[Array], rows: int) -> bool:
  """Whether the kernel computes x times every w of `ws` (else XLA's dot)."""
  if ws[0].dtype == jnp.int8:
    weights_ok = all(w.dtype == jnp.int8 for w in ws)
  else:
    weights_ok = (jnp.result_type(x.dtype, *(w.dtype for w in ws))
                  in KERNEL_DTYPES and
                  all(w.dtype == ws[0].dtype for w in ws) and
                  ws[0].dtype in KERNEL_DTYPES)
  return (weights_ok and x.dtype in KERNEL_DTYPES and x.shape[-1] > 0 and
          0 < rows <= MAX_ROWS and build.available())


def check_int8(w: Array, w_scale: Optional[Array], channels: int,
               name: str = 'w_scale') -> None:
  """Raises ValueError unless `w_scale` suits `w`: float32 [..., channels]
  for an int8 `w` (with w's leading axes), None for any other."""
  if w.dtype != jnp.int8:
    if w_scale is not None:
      raise ValueError(f'{name} is for int8 weights only, got {w.dtype} '
                       'weights.')
    return
  want = w.shape[:-2] + (channels,)
  if (w_scale is None or w_scale.dtype != jnp.float32 or
      w_scale.shape != want):
    got = None if w_scale is None else (w_scale.shape, str(w_scale.dtype))
    raise ValueError(f'int8 weights {w.shape} need {name}: float32 {want}, '
                     f'got {got}.')


def _int8_dot(x: Array, w: Array, w_scale: Array, transpose_w: bool,
              n: int, scale: float) -> Array:
  """XLA's x @ w for int8 w: float32 products of the widened weights, each
  times its channel's scale (and `scale`), rounded once to x's dtype."""
  wf = (w[:n] if transpose_w else w).astype(jnp.float32)
  out = lax.dot_general(x.astype(jnp.float32), wf,
                        (((x.ndim - 1,), (1 if transpose_w else 0,)),
                         ((), ())))
  out = out * w_scale[:n]
  if scale != 1.0:
    out = out * np.float32(scale)
  return out.astype(x.dtype)


def matmul(x: Array, w: Array, *, transpose_w: bool = False,
           cols: Optional[int] = None, scale: float = 1.0,
           w_scale: Optional[Array] = None,
           force_xla: bool = False, threads: int = 0) -> Array:
  """x @ w (or x @ w[:cols].T * scale) with the kernel for few rows on CPU.

  The kernel takes up to `MAX_ROWS` rows where `build.available()`;
  otherwise this is XLA's dot.

  Args:
    x: [..., K] activations; leading axes are rows.
    w: [K, N] weights, or [N', K] with `transpose_w` (e.g. an embedding
      table scored by dot products, read in place without a transpose).
    transpose_w: contract over w's last axis instead of its first.
    cols: with `transpose_w`, score only rows [0, cols) of w (default all),
      without copying the slice.
    scale: with `transpose_w` and a float32 result, multiply the products
      by float32(scale), as XLA multiplies them (the kernel scales each
      product as it stores it, saving a pass over the result).
    w_scale: for int8 `w` only (and then required): float32 scales, one per
      output channel, [N] (w's columns, or its rows with `transpose_w`).
    force_xla: always use XLA's dot (reference / A-B).
    threads: threads the kernel uses, 0 for one per core. The result does
      not depend on it.

  Returns:
    [..., N] in the promoted dtype of x and w, as XLA's dot of the promoted
    operands gives (x's dtype for int8 w). The kernel takes float32,
    bfloat16 and int8 weights as they are (no converted copy of w) and
    computes in float32, rounding a bfloat16 result once; other dtypes, an
    empty contraction or zero rows use XLA's dot.

  Raises:
    ValueError: on rank or shape mismatch, a bad `cols`, `scale` or
      `w_scale`, or negative `threads`.
  """
  check_threads(threads)
  x, w = jnp.asarray(x), jnp.asarray(w)
  w_scale = None if w_scale is None else jnp.asarray(w_scale)
  if w.ndim != 2 or x.ndim < 1:
    raise ValueError(f'matmul needs x [..., K] and a 2-D w, got {x.shape} and '
                     f'{w.shape}.')
  k_axis = 1 if transpose_w else 0
  if x.shape[-1] != w.shape[k_axis]:
    raise ValueError(f'contraction mismatch: x {x.shape} vs w {w.shape} '
                     f'(transpose_w={transpose_w}).')
  n = w.shape[1 - k_axis]
  if cols is not None:
    if not transpose_w or not 0 < cols <= n:
      raise ValueError(f'cols={cols} needs transpose_w and 0 < cols <= {n}.')
    n = cols
  check_int8(w, w_scale, w.shape[1 - k_axis])
  dtype = (x.dtype if w_scale is not None else
           jnp.result_type(x.dtype, w.dtype))
  scale = float(scale)
  if scale != 1.0 and not (transpose_w and dtype == jnp.float32):
    raise ValueError(f'scale={scale} needs transpose_w and a float32 result, '
                     f'got transpose_w={transpose_w} and {dtype}.')
  rows = int(np.prod(x.shape[:-1]))
  if w_scale is not None:
    if force_xla or n == 0 or not _kernel_takes(x, (w,), rows):
      return _int8_dot(x, w, w_scale, transpose_w, n, scale)
    out, = _ffi(x.reshape(rows, x.shape[-1]), (w,), (n,), transpose_w,
                dtype, int(threads), scale, (w_scale,))
    return out.reshape(x.shape[:-1] + (n,))
  if force_xla or n == 0 or not _kernel_takes(x, (w,), rows):
    wn = w[:n] if transpose_w else w
    out = lax.dot_general(x.astype(dtype), wn.astype(dtype),
                          (((x.ndim - 1,), (k_axis,)), ((), ())))
    return out if scale == 1.0 else out * np.float32(scale)
  out, = _kernel(x.reshape(rows, x.shape[-1]), (w,), (n,), transpose_w,
                 dtype, int(threads), scale)
  return out.reshape(x.shape[:-1] + (n,))


def matmuls(x: Array, ws: Sequence[Array], *,
            w_scales: Optional[Sequence[Array]] = None,
            force_xla: bool = False, threads: int = 0) -> Tuple[Array, ...]:
  """(x @ w for w in ws), in one kernel call for few rows on CPU.

  A decode step multiplies the same rows by q, k and v (and by an MLP's
  input projections): one call streams all of them with one wait on its
  threads, where separate calls each wait on theirs. Every output is
  bit-identical to `matmul(x, w)`.

  Args:
    x: [..., K] activations; leading axes are rows.
    ws: [K, N_j] weights, at least one.
    w_scales: for int8 `ws` only (and then required): each one's float32
      scales [N_j].
    force_xla: always use XLA's dot (reference / A-B).
    threads: threads the kernel uses, 0 for one per core.

  Returns:
    One [..., N_j] per weight, as `matmul(x, w)` gives. Weights of different
    dtypes are multiplied one call each.

  Raises:
    ValueError: on an empty `ws`, rank or shape mismatch, bad `w_scales`,
      or negative `threads`.
  """
  check_threads(threads)
  x, ws = jnp.asarray(x), tuple(jnp.asarray(w) for w in ws)
  if not ws:
    raise ValueError('matmuls needs at least one weight.')
  scales = ((None,) * len(ws) if w_scales is None else
            tuple(jnp.asarray(s) for s in w_scales))
  if len(scales) != len(ws):
    raise ValueError(f'matmuls needs one w_scales entry per weight, got '
                     f'{len(scales)} for {len(ws)}.')
  for w in ws:
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
      raise ValueError(f'matmuls needs x [..., K] and 2-D weights [K, N], got '
                       f'{x.shape} and {[w.shape for w in ws]}.')
  for w, s in zip(ws, scales):
    check_int8(w, s, w.shape[1], 'w_scales')
  rows = int(np.prod(x.shape[:-1]))
  quantized = scales[0] is not None
  if (force_xla or len(ws) == 1 or any(w.shape[1] == 0 for w in ws) or
      any((s is not None) != quantized for s in scales) or
      not _kernel_takes(x, ws, rows)):
    return tuple(matmul(x, w, w_scale=s, force_xla=force_xla, threads=threads)
                 for w, s in zip(ws, scales))
  flat = x.reshape(rows, x.shape[-1])
  ns = tuple(w.shape[1] for w in ws)
  if quantized:
    outs = _ffi(flat, ws, ns, False, x.dtype, int(threads), 1.0, scales)
  else:
    outs = _kernel(flat, ws, ns, False, jnp.result_type(x.dtype, ws[0].dtype),
                   int(threads), 1.0)
  return tuple(o.reshape(x.shape[:-1] + (o.shape[-1],)) for o in outs)


def gather_rows(table: Array, ids: Array, *,
                row_scale: Optional[Array] = None,
                force_xla: bool = False) -> Array:
  """table[ids]: the rows of `table` at `ids`, copied as they are; for an
  int8 table with `row_scale`, each row widened to float32 times its scale.

  XLA:CPU gathers bfloat16 through a float32 or uint16 copy of the whole
  table, which a decode step's embedding would pay per step; the kernel
  copies the rows' bits. The kernel also scales int8 rows: as XLA ops the
  multiply could be fused into a consumer's add as an FMA in one program
  and not in another (greedy's and SPEED's steps), rounding differently.
  Ids out of range are handled as jnp indexing does (negative ones from the
  end, then clamped).

  Args:
    table: [V, E] of any dtype.
    ids: integer array of any shape.
    row_scale: for an int8 table only (and then required): float32 [V].
    force_xla: always use XLA's gather.

  Returns:
    ids.shape + (E,), table's dtype (float32 with `row_scale`). XLA's gather
    where the kernel is not available.
  """
  table, ids = jnp.asarray(table), jnp.asarray(ids)
  if table.ndim != 2:
    raise ValueError(f'gather_rows needs a 2-D table, got {table.shape}.')
  row_scale = None if row_scale is None else jnp.asarray(row_scale)
  check_int8(table, row_scale, table.shape[0], 'row_scale')
  if (force_xla or ids.size == 0 or table.shape[0] == 0 or
      not jnp.issubdtype(ids.dtype, jnp.integer) or not build.available()):
    if row_scale is None:
      return table[ids]
    return table[ids].astype(jnp.float32) * row_scale[ids][..., None]
  flat = ids.reshape(-1).astype(jnp.int32)
  if row_scale is None:
    rows = _gather(table, flat)
  else:
    rows = jax.ffi.ffi_call(
        't5x_speed_gather_rows_q8',
        jax.ShapeDtypeStruct((flat.size, table.shape[1]), jnp.float32),
        vmap_method='broadcast_all')(table, row_scale, flat)
  return rows.reshape(ids.shape + (table.shape[1],))


@jax.custom_vjp
def _gather(table: Array, ids: Array) -> Array:
  call = jax.ffi.ffi_call(
      't5x_speed_gather_rows',
      jax.ShapeDtypeStruct((ids.size, table.shape[1]), table.dtype),
      vmap_method='broadcast_all')
  return call(table, ids)


def _gather_fwd(table, ids):
  return _gather(table, ids), (table, ids)


def _gather_bwd(res, g):
  table, ids = res  # the derivative of XLA's gather
  _, vjp = jax.vjp(lambda t: t[ids], table)
  return (*vjp(g), np.zeros(ids.shape, jax.dtypes.float0))


_gather.defvjp(_gather_fwd, _gather_bwd)
