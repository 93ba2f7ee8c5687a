// Few-row matmuls for XLA:CPU that stream each weight once, behind jax.ffi.
//
// Two handlers, both out[M, N] = x[M, K] times a weight matrix, for f32 or
// bf16 operands (x, weights and out each float32 or bfloat16, independently,
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
// writes and attention) and t5x_speed_gather_rows below (embedding rows).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ffi_threads.h"
#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace t5x_speed_kernels;  // NOLINT(build/namespaces)


// Output columns per chunk of x @ w.T: 64 (64 streamed rows of w) at least,
// a few chunks per thread for balance.
template <typename W, typename O>
int64_t ChunkColumns(const Problem<W, O>& p, int threads) {
  const int64_t units = (p.N + 63) / 64;
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(units, 4 * threads));
  return (units + chunks - 1) / chunks * 64;
}

// ---------------------------------------------------------------------------
// FFI entry points.

// Leading (batch) axes, as jax.vmap passes them (vmap_method='expand_dims'):
// x [..., M, K], w [..., K, N] or [..., N', K] and out [..., M, N] have one
// rank, and each leading axis of x and of w is out's or 1 (broadcast). Each
// batch element is an independent few-row matmul with the same arithmetic
// as an unbatched call.
struct Batch {
  int64_t count = 1;     // matrices in out
  int64_t x_count = 1;   // matrices in x
  std::vector<int64_t> dims, x_stride, w_stride;  // per leading axis

  void Offsets(int64_t t, int64_t* xi, int64_t* wi) const {
    *xi = *wi = 0;
    for (int64_t i = static_cast<int64_t>(dims.size()) - 1; i >= 0; --i) {
      const int64_t c = t % dims[i];
      t /= dims[i];
      *xi += c * x_stride[i];
      *wi += c * w_stride[i];
    }
  }
};

// One weight of a call: the buffers and the batch axes it shares with x.
struct Operand {
  const ffi::AnyBuffer* w;
  ffi::AnyBuffer* out;
  Batch batch;
  int64_t N;

  // The product of batch element t, x being the call's f32 rows [.., M, Kp]
  // (and its bf16 rows [.., M, Kb], or null).
  template <typename W, typename O>
  Problem<W, O> At(int64_t t, const float* x, int64_t M, int64_t Kp,
                   const uint16_t* xb, int64_t Kb, bool transposed) const {
    const auto wd = w->dimensions();
    const int64_t w_matrix = wd[wd.size() - 2] * wd[wd.size() - 1];
    int64_t xi, wi;
    batch.Offsets(t, &xi, &wi);
    const int64_t K = transposed ? wd[wd.size() - 1] : wd[wd.size() - 2];
    return Problem<W, O>{x + xi * M * Kp, Kp,
                         xb == nullptr ? nullptr : xb + xi * M * Kb, Kb,
                         static_cast<const W*>(w->untyped_data()) +
                             wi * w_matrix,
                         static_cast<O*>(out->untyped_data()) + t * M * N, M,
                         K, N, transposed};
  }
};

// Columns [n0, n1) of one product.
template <typename W, typename O>
struct Task {
  Problem<W, O> p;
  int64_t n0, n1;
};

template <typename W, typename O>
void RunTasks(ffi::ThreadPool& pool, const std::vector<Task<W, O>>& tasks,
              int threads) {
  ParallelFor(pool, static_cast<int64_t>(tasks.size()), threads,
              [&](int64_t i) {
                RunColumns(tasks[i].p, tasks[i].n0, tasks[i].n1);
              });
}

// The most running sums (M x chunk width, f32) of an x @ w task: 96 KiB,
// half of it in L1 on current cores, the rest in L2.
constexpr int64_t kChunkFloats = 24576;

// x serves every weight as f32 rows [.., Kp] (x @ w.T with f32 w takes them
// in NkGroup's blocks): f32 x as it is where that is already its layout,
// else copied once (bf16 converted exactly: bf16 -> f32 is a shift),
// zero-padded to Kp for the dot-product form's vector tail (where x and w
// are both bf16 and the CPU multiplies bf16 pairs, x is also copied as
// bf16, zero-padded to whole pairs or blocks of them). The copies live in
// buffers kept from call to call: a fresh allocation of this size goes back
// to the system when freed, and each call would fault its pages in again.
// W and O are the weight and output element types (float or uint16_t for
// bf16). Every (batch element, weight, column chunk) is one task, and all
// tasks of the call share one ParallelFor, so a call with several weights
// (q, k and v) waits on its threads once.
template <typename W, typename O>
ffi::Error Dispatch(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                    const std::vector<Operand>& operands, int64_t M,
                    int64_t K, bool transposed, float scale,
                    int max_threads) {
  const bool paired = transposed && std::is_same_v<W, uint16_t>;
  const bool blocked = transposed && std::is_same_v<W, float>;
  const int64_t block = paired ? kPair : kLanes;
  const int64_t Kp = transposed ? (K + block - 1) / block * block : K;
  const int64_t rows = operands[0].batch.x_count * M;
  const bool x32 = x.element_type() == ffi::DataType::F32;
  const float* xs32 = static_cast<const float*>(x.untyped_data());
  const uint16_t* xs16 = static_cast<const uint16_t*>(x.untyped_data());
  const float* xf = xs32;
  thread_local AlignedVector<float> x_copy;
  if (!x32 || paired || blocked || Kp != K) {
    x_copy.assign(static_cast<size_t>(rows * Kp), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t matrix = r / M * M * Kp;  // one batch element's rows
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = r * K + k;
        const int64_t slot =
            paired    ? r * Kp + PairedSlot(k)
            : blocked ? matrix + XBlocks(M, Kp, r % M, k)
                      : r * Kp + k;
        x_copy[slot] = x32 ? xs32[i] : Bf16ToF32(xs16[i]);
      }
    }
    xf = x_copy.data();
  }
  const bool dot = kBf16Dot && std::is_same_v<W, uint16_t> && !x32;
  const int64_t Kb = transposed ? (K + kPair - 1) / kPair * kPair : K + K % 2;
  thread_local AlignedVector<uint16_t> xb;
  xb.assign(dot ? static_cast<size_t>(rows * Kb) : 0, 0);
  for (int64_t r = 0; dot && r < rows; ++r) {
    std::copy(xs16 + r * K, xs16 + (r + 1) * K, xb.data() + r * Kb);
  }
  const uint16_t* xbp = dot ? xb.data() : nullptr;
  int64_t total_bytes = 0;
  for (const Operand& o : operands) {
    total_bytes += o.batch.count * K * o.N * static_cast<int64_t>(sizeof(W));
  }
  const int threads = ThreadsFor(pool, total_bytes, max_threads);
  if (transposed) {
    std::vector<Task<W, O>> tasks;
    for (const Operand& o : operands) {
      // A small matrix is one task: splitting it costs more than it saves.
      const bool split = K * o.N * static_cast<int64_t>(sizeof(W)) >=
                         kMinParallelBytes;
      for (int64_t t = 0; t < o.batch.count; ++t) {
        Problem<W, O> p = o.At<W, O>(t, xf, M, Kp, xbp, Kb, true);
        p.scale = scale;
        const int64_t per = split ? ChunkColumns(p, threads) : o.N;
        for (int64_t n0 = 0; n0 < o.N; n0 += per) {
          tasks.push_back({p, n0, std::min(o.N, n0 + per)});
        }
      }
    }
    RunTasks(pool, tasks, threads);
    return ffi::Error::Success();
  }
  // x @ w: each (matrix, K slice, column chunk) is a task writing the
  // slice's f32 partial products; then each matrix's slices are summed.
  // Chunks are as wide as kChunkFloats running sums allow: a slice read in
  // whole rows of w is one run of memory, a narrower chunk one short run
  // per row, which the prefetchers follow worse. A matrix's chunks share
  // its columns about equally (each rounded up to whole vectors) rather
  // than leaving a narrow remainder. With the bf16 pair products, chunks
  // are whole blocks of kPair columns, so the columns that take them (all
  // but N's last N mod kPair) do not depend on M.
  const int64_t slices = KnSlices(K);
  const int64_t align = dot ? kPair : kLanes;
  const auto chunk_width = [&](int64_t N) {
    const int64_t chunks =
        std::max<int64_t>(1, (M * N + kChunkFloats - 1) / kChunkFloats);
    const int64_t width = (N + chunks - 1) / chunks;
    return (width + align - 1) / align * align;
  };
  int64_t floats = 0;
  for (const Operand& o : operands) floats += o.batch.count * slices * M * o.N;
  // Every partial is written by its task before it is summed: the buffer is
  // kept from call to call, not cleared (nor its pages faulted in afresh).
  thread_local AlignedVector<float> partials;
  if (partials.size() < static_cast<size_t>(floats)) {
    partials.resize(static_cast<size_t>(floats));
  }
  // Each product's sum waits for its slices (`pending` of them) and is cut
  // into pieces of kSumPiece elements. Pieces are claimed after every slice
  // task in the same ParallelFor, so a thread that runs out of slices sums
  // while the others finish theirs, and a piece only ever waits on slice
  // tasks already under way.
  struct Sum {
    float* partials;
    int64_t size;
    O* out;
  };
  std::vector<Sum> sums;
  std::vector<Task<W, float>> tasks;
  std::vector<int64_t> task_sum;  // tasks[i] adds to sums[task_sum[i]]
  float* next = partials.data();
  for (const Operand& o : operands) {
    const int64_t width = chunk_width(o.N);
    for (int64_t t = 0; t < o.batch.count; ++t) {
      const Problem<W, O> p =
          o.At<W, O>(t, xf, M, Kp, xbp, Kb, false);
      sums.push_back({next, M * o.N, p.out});
      for (int64_t s = 0; s < slices; ++s, next += M * o.N) {
        const int64_t k0 = s * kKSlice;
        const Problem<W, float> slice{
            p.x + k0, Kp, p.xb == nullptr ? nullptr : p.xb + k0, Kb,
            p.w + k0 * o.N, next, M, std::min(kKSlice, K - k0), o.N, false};
        for (int64_t n0 = 0; n0 < o.N; n0 += width) {
          tasks.push_back({slice, n0, std::min(o.N, n0 + width)});
          task_sum.push_back(static_cast<int64_t>(sums.size()) - 1);
        }
      }
    }
  }
  std::unique_ptr<std::atomic<int64_t>[]> pending(
      new std::atomic<int64_t>[sums.size()]);
  for (size_t i = 0; i < sums.size(); ++i) pending[i] = 0;
  for (const int64_t i : task_sum) ++pending[i];
  std::vector<std::pair<int64_t, int64_t>> pieces;  // (sum, first element)
  for (size_t i = 0; i < sums.size(); ++i) {
    for (int64_t i0 = 0; i0 < sums[i].size; i0 += kSumPiece) {
      pieces.emplace_back(static_cast<int64_t>(i), i0);
    }
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  ParallelFor(pool, n_tasks + static_cast<int64_t>(pieces.size()), threads,
              [&](int64_t i) {
                if (i < n_tasks) {
                  RunColumns(tasks[i].p, tasks[i].n0, tasks[i].n1);
                  pending[task_sum[i]].fetch_sub(1, std::memory_order_release);
                  return;
                }
                const auto [which, i0] = pieces[i - n_tasks];
                while (pending[which].load(std::memory_order_acquire) > 0) {
                  Pause();
                }
                const Sum& sum = sums[which];
                KnSumSlices(sum.partials, slices, sum.size, i0,
                            std::min(sum.size, i0 + kSumPiece), sum.out);
              });
  return ffi::Error::Success();
}

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
  if (!IsFloat(x.element_type()) || !IsFloat(w.element_type()) ||
      !IsFloat(out.element_type())) {
    return ffi::Error::InvalidArgument(
        "rowmatmul: x, w and out must each be float32 or bfloat16");
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

// out_j = x @ w_j (or x @ w_j.T times scale) for every weight j. The
// weights share one element type, as do the outputs.
ffi::Error Impl(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                const std::vector<const ffi::AnyBuffer*>& weights,
                const std::vector<ffi::AnyBuffer*>& outs, int64_t threads,
                bool transposed, float scale) {
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
    empty = empty || o.N == 0 || o.batch.count == 0;
  }
  if (M == 0 || empty) return ffi::Error::Success();
  const int n = NumThreads(threads);
  const bool w32 = weights[0]->element_type() == ffi::DataType::F32;
  const bool o32 = outs[0]->element_type() == ffi::DataType::F32;
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

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x,
                     ffi::RemainingArgs ws, ffi::RemainingRets os,
                     int64_t threads) {
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
  std::vector<const ffi::AnyBuffer*> weights;
  std::vector<ffi::AnyBuffer*> outs;
  for (const ffi::AnyBuffer& w : w_held) weights.push_back(&w);
  for (ffi::AnyBuffer& o : o_held) outs.push_back(&o);
  return Impl(pool, x, weights, outs, threads, /*transposed=*/false,
              /*scale=*/1.0f);
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

// ---------------------------------------------------------------------------
// Row gather: out[..., n, :] = table[..., ids[..., n], :], the bits of any
// element type copied as they are (XLA:CPU gathers bfloat16 through a
// float32 or uint16 copy of the whole table). Ids out of range are clamped
// after negative ones are counted from the end, as jnp indexing does.
// Leading axes are equal in every operand (jax.vmap's broadcast_all).

ffi::Error GatherRows(ffi::AnyBuffer table, ffi::AnyBuffer ids,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto td = table.dimensions(), id = ids.dimensions(),
             od = out->dimensions();
  const int64_t rank = static_cast<int64_t>(td.size());
  if (rank < 2 || static_cast<int64_t>(id.size()) != rank - 1 ||
      static_cast<int64_t>(od.size()) != rank ||
      ids.element_type() != ffi::DataType::S32 ||
      out->element_type() != table.element_type()) {
    return ffi::Error::InvalidArgument(
        "gather_rows: table [..., V, E], int32 ids [..., N], out [..., N, E]");
  }
  int64_t lead = 1;
  for (int64_t i = 0; i < rank - 2; ++i) {
    if (id[i] != td[i] || od[i] != td[i]) {
      return ffi::Error::InvalidArgument(
          "gather_rows: leading axes must be equal");
    }
    lead *= td[i];
  }
  const int64_t V = td[rank - 2], E = td[rank - 1], N = id[rank - 2];
  if (od[rank - 2] != N || od[rank - 1] != E) {
    return ffi::Error::InvalidArgument("gather_rows: shape mismatch");
  }
  if (lead * N * E == 0) return ffi::Error::Success();
  if (V == 0) return ffi::Error::InvalidArgument("gather_rows: empty table");
  const int64_t row = E * static_cast<int64_t>(
      ffi::ByteWidth(table.element_type()));
  const char* src = static_cast<const char*>(table.untyped_data());
  const int32_t* idx = static_cast<const int32_t*>(ids.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  for (int64_t t = 0; t < lead; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      int64_t i = idx[t * N + n];
      if (i < 0) i += V;
      i = std::min(std::max<int64_t>(i, 0), V - 1);
      std::memcpy(dst + (t * N + n) * row, src + (t * V + i) * row, row);
    }
  }
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// For the Python side's log line: which vector path this build uses.
extern "C" const char* T5xSpeedRowMatmulIsa() { return kIsa; }
