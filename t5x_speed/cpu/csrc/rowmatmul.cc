// Few-row matmuls for XLA:CPU that stream each weight once, behind jax.ffi.
//
// Handlers of out[M, N] = x[M, K] times a weight matrix, for f32 or bf16
// operands (x, weights and out each float32 or bfloat16, independently,
// so a bf16 table can be scored into f32 logits without a converted copy;
// products and sums are f32, and a bf16 output is rounded once at the end,
// as XLA's bf16 dot does):
//
//   t5x_speed_rowmatmul     w_j[K, N_j]: out_j = x @ w_j for one or more
//                           weights sharing x (Dense kernels; q, k and v, or
//                           an MLP's input projections, in one call)
//   t5x_speed_rowmatmul_nt  w[N', K]: out = x @ w[:N].T * scale, N <= N'
//                           taken from out's shape (the tied-embedding
//                           classifier, [vocab, emb], scored over a
//                           vocabulary prefix without copying it)
//
// and their forms for int8 weights with float32 per-output-channel scales
// (t5x_speed_rowmatmul_q8: the weights, then one scale vector [..., N_j]
// per weight; t5x_speed_rowmatmul_nt_q8: w, then its scales [..., N'], one
// per row): each output element is the f32 path's sum over the widened
// weights, times its channel's scale.
//
// Both take the attribute `threads` (int64): how many threads share a call,
// 0 meaning one per hardware thread. It is part of the traced program, so a
// compiled decode step always runs with the count it was traced with. The
// _nt handler also takes `scale` (float32; 1 for a bfloat16 out).
//
// Both take leading batch axes (x [..., M, K], see `Batch`), so a jax.vmap
// over a decode (e.g. the exactness fuzz over random models) makes one call
// per matmul rather than one per batch element.
//
// The arithmetic, and why each row is bit-identical to the same row alone:
// row_kernels.h.
//
// Threads: output columns (of every weight) are cut into chunks shared out
// by ParallelFor (ffi_threads.h).
//
// The library's other handlers: row_attention.cc (a decode step's cache
// writes and attention) and gather_rows.cc (embedding rows).

#include <cstdint>
#include <vector>

#include "ffi_threads.h"
#include "row_dispatch.h"
#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace t5x_speed_kernels;  // NOLINT(build/namespaces)

ffi::Error Check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                 const ffi::AnyBuffer& out, bool transposed, Batch* batch,
                 int64_t* M, int64_t* K, int64_t* N) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out.dimensions();
  const int64_t rank = static_cast<int64_t>(od.size());
  if (rank < 2 || static_cast<int64_t>(xd.size()) != rank ||
      static_cast<int64_t>(wd.size()) != rank) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: x, w and out must have one rank >= 2");
  }
  if (!IsFloat(x.element_type()) || !IsFloat(out.element_type()) ||
      !(IsFloat(w.element_type()) || w.element_type() == ffi::DataType::S8)) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: x and out must each be float32 or bfloat16, w also int8");
  }
  *M = xd[rank - 2];
  *K = xd[rank - 1];
  *N = od[rank - 1];
  const int64_t wk = transposed ? wd[rank - 1] : wd[rank - 2];
  const int64_t wn = transposed ? wd[rank - 2] : wd[rank - 1];
  if (wk != *K || (transposed ? wn < *N : wn != *N) || od[rank - 2] != *M) {
    return ffi::Error::InvalidArgument("rowmatmul: shape mismatch");
  }
  batch->dims.assign(rank - 2, 0);
  batch->x_stride.assign(rank - 2, 0);
  batch->w_stride.assign(rank - 2, 0);
  int64_t ws = 1;
  for (int64_t i = rank - 3; i >= 0; --i) {
    const int64_t d = od[i];
    if ((xd[i] != d && xd[i] != 1) || (wd[i] != d && wd[i] != 1)) {
      return ffi::Error::InvalidArgument(
          "rowmatmul: each batch axis of x and w must be out's or 1");
    }
    batch->dims[i] = d;
    batch->x_stride[i] = xd[i] == 1 ? 0 : batch->x_count;
    batch->w_stride[i] = wd[i] == 1 ? 0 : ws;
    batch->x_count *= xd[i];
    ws *= wd[i];
    batch->count *= d;
  }
  return ffi::Error::Success();
}

// An int8 weight's scales: float32, w's leading axes then one per output
// channel (w's last axis for x @ w, its rows for x @ w.T).
ffi::Error CheckScale(const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_scale,
                      bool transposed) {
  const auto wd = w.dimensions(), sd = w_scale.dimensions();
  const size_t rank = wd.size();
  bool ok = w.element_type() == ffi::DataType::S8 &&
            w_scale.element_type() == ffi::DataType::F32 &&
            sd.size() + 1 == rank &&
            sd[rank - 2] == wd[rank - (transposed ? 2 : 1)];
  for (size_t i = 0; ok && i + 2 < rank; ++i) ok = sd[i] == wd[i];
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: int8 weights take float32 scales [..., channels]");
  }
  return ffi::Error::Success();
}

// out_j = x @ w_j (or x @ w_j.T times scale) for every weight j; int8
// weights take `w_scales` (one per weight), the others none. The weights
// share one element type, as do the outputs.
ffi::Error Impl(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                const std::vector<const ffi::AnyBuffer*>& weights,
                const std::vector<ffi::AnyBuffer*>& outs, int64_t threads,
                bool transposed, float scale,
                const std::vector<const ffi::AnyBuffer*>& w_scales = {}) {
  if (threads < 0) {
    return ffi::Error::InvalidArgument("rowmatmul: threads must be >= 0");
  }
  if (weights.empty() || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: one result per weight, at least one weight");
  }
  std::vector<Operand> operands(weights.size());
  int64_t M = 0, K = 0;
  bool empty = false;
  for (size_t j = 0; j < weights.size(); ++j) {
    Operand& o = operands[j];
    o.w = weights[j];
    o.out = outs[j];
    if (ffi::Error e = Check(x, *o.w, *o.out, transposed, &o.batch, &M, &K,
                             &o.N);
        e.failure()) {
      return e;
    }
    if (o.w->element_type() != weights[0]->element_type() ||
        o.out->element_type() != outs[0]->element_type()) {
      return ffi::Error::InvalidArgument(
          "rowmatmul: the weights share one dtype, as do the results");
    }
    const bool int8 = o.w->element_type() == ffi::DataType::S8;
    if (int8 != (w_scales.size() == weights.size())) {
      return ffi::Error::InvalidArgument(
          "rowmatmul: int8 weights, and only they, take scales");
    }
    if (int8) {
      if (ffi::Error e = CheckScale(*o.w, *w_scales[j], transposed);
          e.failure()) {
        return e;
      }
      o.w_scale = w_scales[j];
    }
    empty = empty || o.N == 0 || o.batch.count == 0;
  }
  if (M == 0 || empty) return ffi::Error::Success();
  const int n = NumThreads(threads);
  const bool w32 = weights[0]->element_type() == ffi::DataType::F32;
  const bool o32 = outs[0]->element_type() == ffi::DataType::F32;
  if (!w_scales.empty()) {
    return o32 ? Dispatch<int8_t, float>(pool, x, operands, M, K, transposed,
                                         scale, n)
               : Dispatch<int8_t, uint16_t>(pool, x, operands, M, K,
                                            transposed, scale, n);
  }
  if (w32 && o32)
    return Dispatch<float, float>(pool, x, operands, M, K, transposed, scale,
                                   n);
  if (w32)
    return Dispatch<float, uint16_t>(pool, x, operands, M, K, transposed,
                                      scale, n);
  if (o32)
    return Dispatch<uint16_t, float>(pool, x, operands, M, K, transposed,
                                      scale, n);
  return Dispatch<uint16_t, uint16_t>(pool, x, operands, M, K, transposed,
                                      scale, n);
}

// `quantized`: the arguments are the int8 weights, then their scales.
ffi::Error RowMatmulAny(ffi::ThreadPool pool, ffi::AnyBuffer x,
                        ffi::RemainingArgs ws, ffi::RemainingRets os,
                        int64_t threads, bool quantized) {
  // AnyBuffer is a handle: the copies refer to XLA's buffers.
  std::vector<ffi::AnyBuffer> w_held, o_held;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    if (w.has_error()) return w.error();
    w_held.push_back(*w);
  }
  for (size_t j = 0; j < os.size(); ++j) {
    auto o = os.get<ffi::AnyBuffer>(j);
    if (o.has_error()) return o.error();
    o_held.push_back(**o);
  }
  std::vector<const ffi::AnyBuffer*> weights, w_scales;
  std::vector<ffi::AnyBuffer*> outs;
  for (const ffi::AnyBuffer& w : w_held) weights.push_back(&w);
  for (ffi::AnyBuffer& o : o_held) outs.push_back(&o);
  if (quantized) {
    if (weights.size() != 2 * outs.size()) {
      return ffi::Error::InvalidArgument(
          "rowmatmul_q8: one int8 weight and one scale vector per result");
    }
    w_scales.assign(weights.begin() + outs.size(), weights.end());
    weights.resize(outs.size());
  }
  return Impl(pool, x, weights, outs, threads, /*transposed=*/false,
              /*scale=*/1.0f, w_scales);
}

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x,
                     ffi::RemainingArgs ws, ffi::RemainingRets os,
                     int64_t threads) {
  return RowMatmulAny(pool, x, ws, os, threads, /*quantized=*/false);
}

ffi::Error RowMatmulQ8(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::RemainingArgs ws, ffi::RemainingRets os,
                       int64_t threads) {
  return RowMatmulAny(pool, x, ws, os, threads, /*quantized=*/true);
}

// out = (x @ w.T) * scale, each float32 product scaled before it is
// stored: the multiply XLA would apply to the stored products, without a
// second pass over them. A bfloat16 result takes scale 1 only (scaling
// before its rounding would not be XLA's multiply of the rounded product).
ffi::Error RowMatmulNT(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                       int64_t threads, float scale) {
  if (scale != 1.0f && out->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: scale != 1 needs a float32 result");
  }
  return Impl(pool, x, {&w}, {&*out}, threads, /*transposed=*/true, scale);
}

ffi::Error RowMatmulNTQ8(ffi::ThreadPool pool, ffi::AnyBuffer x,
                         ffi::AnyBuffer w, ffi::AnyBuffer w_scale,
                         ffi::Result<ffi::AnyBuffer> out, int64_t threads,
                         float scale) {
  if (scale != 1.0f && out->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: scale != 1 needs a float32 result");
  }
  return Impl(pool, x, {&w}, {&*out}, threads, /*transposed=*/true, scale,
              {&w_scale});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRowMatmulNT, RowMatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("threads")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRowMatmulQ8, RowMatmulQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRowMatmulNTQ8, RowMatmulNTQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("threads")
                                  .Attr<float>("scale"));

// For the Python side's log line: which vector path this build uses.
extern "C" const char* T5xSpeedRowMatmulIsa() { return kIsa; }
