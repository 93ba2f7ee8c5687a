// Few-row matmuls for XLA:CPU that stream each weight once, behind jax.ffi.
//
// Two handlers, both out[M, N] = x[M, K] times a weight matrix, for f32 or
// bf16 operands (x, weights and out each float32 or bfloat16, independently,
// so a bf16 table can be scored into f32 logits without a converted copy;
// products and sums are f32, and a bf16 output is rounded once at the end,
// as XLA's bf16 dot does):
//
//   t5x_speed_rowmatmul     w[K, N]: out = x @ w   (Dense kernels)
//   t5x_speed_rowmatmul_nt  w[N', K]: out = x @ w[:N].T, N = attribute `cols`
//                           (the tied-embedding classifier, [vocab, emb])
//
// Both take leading batch axes (x [..., M, K], see `Batch`), so a jax.vmap
// over a decode (e.g. the exactness fuzz over random models) makes one call
// per matmul rather than one per batch element.
//
// Row independence: every output element is computed by one fixed sequence
// of operations that depends on K (and, for the nt form, on the vector
// width) only, never on M, on the column blocking or on the thread that runs
// it. So row i of an M-row call is bit-identical to the same row alone: SPEED
// (R rows per step) multiplies exactly as greedy (one row) does.
//
//   * x @ w: out[r, n] is the chain acc = fma(x[r, k], w[k, n], acc) for
//     k = 0..K-1 from acc = 0, in every code path (vector lanes and scalar
//     tails alike, since a vector FMA is a per-lane scalar FMA).
//   * x @ w.T: lane l of a vector accumulator takes k = l (mod lanes) in
//     order, then one fixed horizontal sum.
//
// Memory: M <= 8 rows keep all their accumulators in registers while a
// column block of w streams through once; more rows are done in groups of 8
// inside each column block, whose weights are then still in L2.
//
// Threads: output columns are cut into chunks claimed from an atomic counter
// by the calling thread and by helpers scheduled on XLA's intra-op thread
// pool. The caller claims whatever the helpers have not started, so the call
// never waits on a helper that has not been scheduled yet (no deadlock when
// the pool is busy), and a late helper finds nothing left and returns.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroupRows = 8;  // rows whose accumulators live in registers

// ---------------------------------------------------------------------------
// Scalars: bf16 <-> f32.

inline float Bf16ToF32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as XLA's f32 -> bf16 convert; NaN stays a quiet NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t v) { return Bf16ToF32(v); }
inline void FromF32(float v, float* out) { *out = v; }
inline void FromF32(float v, uint16_t* out) { *out = F32ToBf16(v); }

// ---------------------------------------------------------------------------
// One vector type per instruction set, chosen at compile time (the library
// is built with -march=native on the machine that runs it). All loads are
// unaligned: XLA's buffers carry no alignment promise we rely on.

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float v) { return _mm512_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline float ReduceAdd(Vec v) {
  // Fixed tree: 16 -> 8 -> 4 -> 2 -> 1.
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(
      _mm512_castps_pd(v), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8),
                               _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float v) { return _mm256_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float ReduceAdd(Vec v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v),
                               _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
constexpr const char* kIsa = "avx2";
#else
// Portable path: one lane, std::fma, same arithmetic contract.
constexpr int kLanes = 1;
using Vec = float;
inline Vec Zero() { return 0.0f; }
inline Vec Set1(float v) { return v; }
inline Vec Fma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }
inline Vec Load(const float* p) { return *p; }
inline Vec Load(const uint16_t* p) { return Bf16ToF32(*p); }
inline void Store(float* p, Vec v) { *p = v; }
inline float ReduceAdd(Vec v) { return v; }
constexpr const char* kIsa = "portable";
#endif

// Loads n < kLanes elements, zero-filling the rest, without reading past p+n.
template <typename T>
inline Vec LoadPartial(const T* p, int n) {
  T buf[kLanes] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return Load(buf);
}

// Stores the first n lanes of v (n <= kLanes) to out, converting to T.
template <typename T>
inline void StoreOut(T* out, Vec v, int n) {
  float buf[kLanes];
  Store(buf, v);
  for (int i = 0; i < n; ++i) FromF32(buf[i], out + i);
}

// ---------------------------------------------------------------------------
// out = x @ w, w [K, N] row-major.
//
// A chunk of columns [n0, n1) is done for all M rows at once: KC rows of w
// are read side by side (KC contiguous streams, which the hardware
// prefetchers follow), each loaded vector serves every row, and the rows'
// partial sums live in a small f32 scratch that stays in L1, touched once per
// KC rows of w. Each sum is still the plain FMA chain over k = 0..K-1.

constexpr int kKc = 8;  // rows of w per pass over the chunk

template <int KC>
inline void KnRows(const float* xk, int64_t K, int64_t M, const Vec* wv,
                   float* acc, int64_t stride) {
  for (int64_t r = 0; r < M; ++r, acc += stride) {
    Vec a = Load(acc);
    for (int i = 0; i < KC; ++i) a = Fma(Set1(xk[r * K + i]), wv[i], a);
    Store(acc, a);
  }
}

// Rows [k, k + KC) of w over the chunk's `full` whole vectors and `tail`
// remaining columns.
template <int KC, typename W>
inline void KnStep(const float* x, const W* w, int64_t M, int64_t K,
                   int64_t N, int64_t k, int64_t full, int tail, float* acc,
                   int64_t stride) {
  const W* wk = w + k * N;
  for (int64_t c = 0; c < full; c += kLanes) {
    Vec wv[KC];
    for (int i = 0; i < KC; ++i) wv[i] = Load(wk + i * N + c);
    KnRows<KC>(x + k, K, M, wv, acc + c, stride);
  }
  if (tail > 0) {
    Vec wv[KC];
    for (int i = 0; i < KC; ++i) wv[i] = LoadPartial(wk + i * N + full, tail);
    KnRows<KC>(x + k, K, M, wv, acc + full, stride);
  }
}

template <typename W, typename O>
void KnChunk(const float* x, const W* w, O* out, int64_t M, int64_t K,
             int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  const int64_t full = width / kLanes * kLanes;
  const int tail = static_cast<int>(width - full);
  const int64_t stride = full + (tail > 0 ? kLanes : 0);
  thread_local std::vector<float> scratch;
  scratch.assign(static_cast<size_t>(M * stride), 0.0f);
  float* acc = scratch.data();
  const W* wc = w + n0;
  int64_t k = 0;
  for (; k + kKc <= K; k += kKc)
    KnStep<kKc>(x, wc, M, K, N, k, full, tail, acc, stride);
  for (; k < K; ++k) KnStep<1>(x, wc, M, K, N, k, full, tail, acc, stride);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < width; ++c)
      FromF32(acc[r * stride + c], out + r * N + n0 + c);
}

// ---------------------------------------------------------------------------
// out = x @ w[:N].T, w [*, K] row-major (dot-product form).

constexpr int NkColumns(int m) {
  return m <= 2 ? 8 : (m <= 3 ? 6 : (m <= 4 ? 5 : (m <= 6 ? 3 : 2)));
}

// Output columns [j, j + J) of M rows. `x` is [M, Kp] f32, zero-padded to
// Kp = K rounded up to kLanes, so the K tail is one more lane-wise FMA.
template <int M, int J, typename W, typename O>
void NkGroup(const float* x, int64_t Kp, const W* w, O* out, int64_t K,
             int64_t N, int64_t j) {
  Vec acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < J; ++c) acc[r][c] = Zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[J];
    for (int c = 0; c < J; ++c) wv[c] = Load(w + (j + c) * K + k);
    for (int r = 0; r < M; ++r) {
      const Vec xv = Load(x + r * Kp + k);
      for (int c = 0; c < J; ++c) acc[r][c] = Fma(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const int tail = static_cast<int>(K - k);
    Vec wv[J];
    for (int c = 0; c < J; ++c) wv[c] = LoadPartial(w + (j + c) * K + k, tail);
    for (int r = 0; r < M; ++r) {
      const Vec xv = Load(x + r * Kp + k);
      for (int c = 0; c < J; ++c) acc[r][c] = Fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < J; ++c) FromF32(ReduceAdd(acc[r][c]), out + r * N + j + c);
}

template <int M, typename W, typename O>
void NkRange(const float* x, int64_t Kp, const W* w, O* out, int64_t K,
             int64_t N, int64_t n0, int64_t n1) {
  constexpr int J = NkColumns(M);
  int64_t j = n0;
  for (; j + J <= n1; j += J) NkGroup<M, J>(x, Kp, w, out, K, N, j);
  for (; j < n1; ++j) NkGroup<M, 1>(x, Kp, w, out, K, N, j);
}

// ---------------------------------------------------------------------------
// Row-group dispatch: rows [0, M) in groups of up to kMaxGroupRows.

template <typename W, typename O>
struct Problem {
  const float* x;  // [M, Kp] f32
  int64_t Kp;
  const W* w;
  O* out;          // [M, N]
  int64_t M, K, N;
  bool transposed;
};

template <int G, typename W, typename O>
void RunGroup(const Problem<W, O>& p, int64_t r0, int64_t n0, int64_t n1) {
  const float* x = p.x + r0 * p.Kp;
  O* out = p.out + r0 * p.N;
  NkRange<G>(x, p.Kp, p.w, out, p.K, p.N, n0, n1);
}

template <typename W, typename O>
void RunColumns(const Problem<W, O>& p, int64_t n0, int64_t n1) {
  if (!p.transposed) {  // x has row stride Kp == K here
    KnChunk(p.x, p.w, p.out, p.M, p.K, p.N, n0, n1);
    return;
  }
  for (int64_t r0 = 0; r0 < p.M; r0 += kMaxGroupRows) {
    switch (std::min<int64_t>(kMaxGroupRows, p.M - r0)) {
      case 1: RunGroup<1>(p, r0, n0, n1); break;
      case 2: RunGroup<2>(p, r0, n0, n1); break;
      case 3: RunGroup<3>(p, r0, n0, n1); break;
      case 4: RunGroup<4>(p, r0, n0, n1); break;
      case 5: RunGroup<5>(p, r0, n0, n1); break;
      case 6: RunGroup<6>(p, r0, n0, n1); break;
      case 7: RunGroup<7>(p, r0, n0, n1); break;
      default: RunGroup<8>(p, r0, n0, n1); break;
    }
  }
}

// ---------------------------------------------------------------------------
// Threads.

int NumThreads() {
  static const int n = [] {
    if (const char* env = std::getenv("T5X_SPEED_KERNEL_THREADS")) {
      const int v = std::atoi(env);
      if (v >= 1) return v;
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

// Chunks claimed by the caller and by pool helpers; kept alive by the
// helpers' shared_ptr in case one starts after the call has returned.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
  const void* body = nullptr;  // valid while done < chunks
  void (*run)(const void* body, int64_t chunk) = nullptr;
#if defined(__SSE__)
  unsigned int csr = 0;        // caller's MXCSR (denormal modes) for helpers
#endif

  // Runs chunks until none is left.
  void Drain() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      run(body, c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t chunks, int threads,
                 const F& fn) {
  if (threads <= 1 || chunks <= 1) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  work->body = &fn;
  work->run = [](const void* body, int64_t c) {
    (*static_cast<const F*>(body))(c);
  };
#if defined(__SSE__)
  work->csr = _mm_getcsr();
#endif
  const int helpers = static_cast<int>(std::min<int64_t>(threads, chunks) - 1);
  for (int i = 0; i < helpers; ++i) {
    pool.Schedule([work] {
#if defined(__SSE__)
      // Same flush-to-zero / denormals-are-zero modes as the caller, so a
      // column's result does not depend on the thread that computes it.
      const unsigned int saved = _mm_getcsr();
      _mm_setcsr(work->csr);
      work->Drain();
      _mm_setcsr(saved);
#else
      work->Drain();
#endif
    });
  }
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < chunks) {
#if defined(__SSE2__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }
}

// Weights below this size run on the calling thread: a helper's wake-up
// costs more than it saves.
constexpr int64_t kMinParallelBytes = 256 * 1024;

// Columns per chunk. x @ w: the rows' partial sums (M x width f32) must stay
// in L1, and each thread gets at least one chunk. x @ w.T: 64 output columns
// (64 streamed rows of w) per chunk, a few chunks per thread for balance.
template <typename W, typename O>
int64_t ChunkColumns(const Problem<W, O>& p, int threads) {
  if (p.transposed) {
    const int64_t units = (p.N + 63) / 64;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(units, 4 * threads));
    return (units + chunks - 1) / chunks * 64;
  }
  const int64_t l1 = std::max<int64_t>(kLanes, 4096 / p.M / kLanes * kLanes);
  const int64_t per_thread = (p.N + threads - 1) / threads;
  return std::min(l1, (per_thread + kLanes - 1) / kLanes * kLanes);
}

template <typename W, typename O>
void Run(ffi::ThreadPool& pool, const Problem<W, O>& p) {
  const int64_t bytes = p.K * p.N * static_cast<int64_t>(sizeof(W));
  int threads = bytes >= kMinParallelBytes ? NumThreads() : 1;
  if (threads > 1 && pool.num_threads() <= 0) threads = 1;
  const int64_t per = ChunkColumns(p, threads);
  const int64_t chunks = (p.N + per - 1) / per;
  ParallelFor(pool, chunks, threads, [&](int64_t c) {
    RunColumns(p, c * per, std::min(p.N, (c + 1) * per));
  });
}

// ---------------------------------------------------------------------------
// FFI entry points.

bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
}

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

// x is converted to f32 once (exactly: bf16 -> f32 is a shift), zero-padded
// to Kp for the dot-product form's vector tail; W and O are the weight and
// output element types (float or uint16_t for bf16).
template <typename W, typename O>
ffi::Error Dispatch(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                    const ffi::AnyBuffer& w, ffi::AnyBuffer& out,
                    const Batch& batch, int64_t M, int64_t K, int64_t N,
                    bool transposed) {
  const int64_t Kp = transposed ? (K + kLanes - 1) / kLanes * kLanes : K;
  const int64_t rows = batch.x_count * M;
  std::vector<float> xf(static_cast<size_t>(rows * Kp), 0.0f);
  if (x.element_type() == ffi::DataType::F32) {
    const float* xs = static_cast<const float*>(x.untyped_data());
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(&xf[r * Kp], xs + r * K, K * sizeof(float));
  } else {
    const uint16_t* xs = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) xf[r * Kp + k] = Bf16ToF32(xs[r * K + k]);
  }
  const auto wd = w.dimensions();
  const int64_t w_matrix = wd[wd.size() - 2] * wd[wd.size() - 1];
  const W* ws = static_cast<const W*>(w.untyped_data());
  O* os = static_cast<O*>(out.untyped_data());
  auto problem = [&](int64_t t) {
    int64_t xi, wi;
    batch.Offsets(t, &xi, &wi);
    return Problem<W, O>{xf.data() + xi * M * Kp, Kp, ws + wi * w_matrix,
                         os + t * M * N, M, K, N, transposed};
  };
  const int64_t bytes = K * N * static_cast<int64_t>(sizeof(W));
  if (batch.count == 1 || bytes >= kMinParallelBytes) {
    for (int64_t t = 0; t < batch.count; ++t) Run(pool, problem(t));
  } else {  // many small matrices: one per chunk
    int threads = batch.count * bytes >= kMinParallelBytes ? NumThreads() : 1;
    if (pool.num_threads() <= 0) threads = 1;
    ParallelFor(pool, batch.count, threads,
                [&](int64_t t) { RunColumns(problem(t), 0, N); });
  }
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

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                ffi::Result<ffi::AnyBuffer> out, bool transposed) {
  Batch batch;
  int64_t M, K, N;
  if (ffi::Error e = Check(x, w, *out, transposed, &batch, &M, &K, &N);
      e.failure()) {
    return e;
  }
  if (M == 0 || N == 0 || batch.count == 0) return ffi::Error::Success();
  const bool w32 = w.element_type() == ffi::DataType::F32;
  const bool o32 = out->element_type() == ffi::DataType::F32;
  if (w32 && o32)
    return Dispatch<float, float>(pool, x, w, *out, batch, M, K, N, transposed);
  if (w32)
    return Dispatch<float, uint16_t>(pool, x, w, *out, batch, M, K, N, transposed);
  if (o32)
    return Dispatch<uint16_t, float>(pool, x, w, *out, batch, M, K, N, transposed);
  return Dispatch<uint16_t, uint16_t>(pool, x, w, *out, batch, M, K, N, transposed);
}

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                     ffi::Result<ffi::AnyBuffer> out) {
  return Impl(pool, x, w, out, /*transposed=*/false);
}

ffi::Error RowMatmulNT(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
  return Impl(pool, x, w, out, /*transposed=*/true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRowMatmulNT, RowMatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// For the Python side's log line: which vector path this build uses.
extern "C" const char* T5xSpeedRowMatmulIsa() { return kIsa; }
