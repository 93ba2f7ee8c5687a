// The few-row matmul kernels of rowmatmul.cc: vector types per instruction
// set and the x @ w and x @ w.T loops over a column range, single-threaded.
//
// Row independence: every output element is computed by one fixed sequence
// of operations that depends on K (and, for the nt form, on the vector
// width) only, never on M, on the column blocking or on the thread that runs
// it. So row i of an M-row call is bit-identical to the same row alone: SPEED
// (R rows per step) multiplies exactly as greedy (one row) does, and the
// result does not depend on `threads`.
//
//   * x @ w: for each slice of kKSlice rows of w, the chain
//     acc = fma(x[r, k], w[k, n], acc) over the slice's k from acc = 0, in
//     every code path (vector lanes and scalar tails alike, since a vector
//     FMA is a per-lane scalar FMA); out[r, n] is the slices' sum, left to
//     right.
//   * x @ w.T: lane l of a vector accumulator takes k = l (mod lanes) in
//     order, then one fixed horizontal sum.
//
// Memory: M <= 8 rows keep all their accumulators in registers while a
// column block of w streams through once; more rows are done in groups of 8
// inside each column block, whose weights are then still in L2.

#ifndef T5X_SPEED_CSRC_ROW_KERNELS_H_
#define T5X_SPEED_CSRC_ROW_KERNELS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace t5x_speed_kernels {

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
inline void KnRows(const float* xk, int64_t ldx, int64_t M, const Vec* wv,
                   float* acc, int64_t stride) {
  for (int64_t r = 0; r < M; ++r, acc += stride) {
    Vec a = Load(acc);
    for (int i = 0; i < KC; ++i) a = Fma(Set1(xk[r * ldx + i]), wv[i], a);
    Store(acc, a);
  }
}

// Rows [k, k + KC) of w over the chunk's `full` whole vectors and `tail`
// remaining columns.
template <int KC, typename W>
inline void KnStep(const float* x, int64_t ldx, const W* w, int64_t M,
                   int64_t N, int64_t k, int64_t full, int tail, float* acc,
                   int64_t stride) {
  const W* wk = w + k * N;
  for (int64_t c = 0; c < full; c += kLanes) {
    Vec wv[KC];
    for (int i = 0; i < KC; ++i) wv[i] = Load(wk + i * N + c);
    KnRows<KC>(x + k, ldx, M, wv, acc + c, stride);
  }
  if (tail > 0) {
    Vec wv[KC];
    for (int i = 0; i < KC; ++i) wv[i] = LoadPartial(wk + i * N + full, tail);
    KnRows<KC>(x + k, ldx, M, wv, acc + full, stride);
  }
}

// Rows [0, K) of w (row length N) times x [M, ldx] over columns [n0, n1).
template <typename W, typename O>
void KnChunk(const float* x, int64_t ldx, const W* w, O* out, int64_t M,
             int64_t K, int64_t N, int64_t n0, int64_t n1) {
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
    KnStep<kKc>(x, ldx, wc, M, N, k, full, tail, acc, stride);
  for (; k < K; ++k) KnStep<1>(x, ldx, wc, M, N, k, full, tail, acc, stride);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < width; ++c)
      FromF32(acc[r * stride + c], out + r * N + n0 + c);
}

// x @ w in slices of kKSlice rows of w: each slice is a contiguous block of
// w, so a thread streams it as one run of memory (a column chunk of the whole
// of w would be K short runs), and the slices give the threads work even
// when w has few columns. out = sum of the slices' products, in slice order.
constexpr int64_t kKSlice = 128;

inline int64_t KnSlices(int64_t K) {
  return std::max<int64_t>(1, (K + kKSlice - 1) / kKSlice);
}

// out[i] = partials[0][i] + partials[1][i] + ... (left to right) for the
// `size` elements of one product, each slice's partials [M, N] f32; sums in
// place in slice 0.
template <typename O>
void KnSumSlices(float* partials, int64_t slices, int64_t size, O* out) {
  for (int64_t s = 1; s < slices; ++s) {
    const float* add = partials + s * size;
    for (int64_t i = 0; i < size; ++i) partials[i] += add[i];
  }
  for (int64_t i = 0; i < size; ++i) FromF32(partials[i], out + i);
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
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < J; ++c) {
      FromF32(ReduceAdd(acc[r][c]), out + r * N + j + c);
    }
  }
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

// Output columns per block when the rows come in several groups: the block's
// weights (kNtBlock x K) stay in L2 while every group reads them, instead of
// each group streaming the whole range from memory. A multiple of every
// NkColumns(m), so blocking adds no single-column tails.
constexpr int64_t kNtBlock = 120;

template <typename W, typename O>
void RunRowGroups(const Problem<W, O>& p, int64_t n0, int64_t n1) {
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

template <typename W, typename O>
void RunColumns(const Problem<W, O>& p, int64_t n0, int64_t n1) {
  if (!p.transposed) {  // x has row stride Kp == K here
    KnChunk(p.x, p.Kp, p.w, p.out, p.M, p.K, p.N, n0, n1);
    return;
  }
  if (p.M <= kMaxGroupRows) {
    RunRowGroups(p, n0, n1);
    return;
  }
  for (int64_t b0 = n0; b0 < n1; b0 += kNtBlock) {
    RunRowGroups(p, b0, std::min(n1, b0 + kNtBlock));
  }
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_KERNELS_H_
