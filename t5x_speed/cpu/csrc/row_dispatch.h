// How rowmatmul.cc runs one call: the operands' batch axes, the call's
// (batch element, weight, column chunk) tasks on the threads, and the x @ w
// slices' sums (the kernels themselves: row_kernels.h).

#ifndef T5X_SPEED_CSRC_ROW_DISPATCH_H_
#define T5X_SPEED_CSRC_ROW_DISPATCH_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "aligned_buffer.h"
#include "ffi_threads.h"
#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace t5x_speed_kernels {

namespace ffi = xla::ffi;

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
  const ffi::AnyBuffer* w_scale = nullptr;  // int8 w: [.., N] or [.., N']

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
    Problem<W, O> p{x + xi * M * Kp, Kp,
                    xb == nullptr ? nullptr : xb + xi * M * Kb, Kb,
                    static_cast<const W*>(w->untyped_data()) + wi * w_matrix,
                    static_cast<O*>(out->untyped_data()) + t * M * N, M, K, N,
                    transposed};
    if (w_scale != nullptr) {
      p.w_scale = static_cast<const float*>(w_scale->untyped_data()) +
                  wi * wd[wd.size() - (transposed ? 2 : 1)];
    }
    return p;
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
// W and O are the weight and output element types (float, uint16_t for
// bf16, int8_t for int8 w). Every (batch element, weight, column chunk) is
// one task, and all tasks of the call share one ParallelFor, so a call with
// several weights (q, k and v) waits on its threads once.
template <typename W, typename O>
ffi::Error Dispatch(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                    const std::vector<Operand>& operands, int64_t M,
                    int64_t K, bool transposed, float scale,
                    int max_threads) {
  const bool paired = transposed && std::is_same_v<W, uint16_t>;
  const bool blocked = transposed && kWidened<W>;
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
    const float* w_scale;
    int64_t N;
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
      sums.push_back({next, M * o.N, p.out, p.w_scale, o.N});
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
                            std::min(sum.size, i0 + kSumPiece), sum.out,
                            sum.w_scale, sum.N);
              });
  return ffi::Error::Success();
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_DISPATCH_H_
