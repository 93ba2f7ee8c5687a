// The x @ w kernel of row_kernels.h (w [K, N] row-major): column chunks of
// all rows at once, in slices of K, and the slices' sums (the arithmetic
// and why each row is independent of the others: row_kernels.h).

#ifndef T5X_SPEED_CSRC_ROW_KERNELS_KN_H_
#define T5X_SPEED_CSRC_ROW_KERNELS_KN_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "aligned_buffer.h"
#include "row_vectors.h"

namespace t5x_speed_kernels {

// ---------------------------------------------------------------------------
// out = x @ w, w [K, N] row-major.
//
// A chunk of columns [n0, n1) is done for all M rows at once: KC rows of w
// are read side by side (KC contiguous streams, which the hardware
// prefetchers follow), each loaded vector serves every row, and the rows'
// partial sums live in a small f32 scratch that stays in L1 or L2 (the
// chunk's width is chosen for that, see row_dispatch.h), touched once per KC
// rows of w. Each sum is still the plain FMA chain over k = 0..K-1.

constexpr int kKc = 8;  // rows of w per pass over the chunk
// Vectors of columns per pass: each broadcast of x serves this many FMAs.
// AVX-512's 32 registers hold KC vectors of w for each; AVX2's 16, one.
#if defined(__AVX512F__)
constexpr int kKnVectors = 3;
#else
constexpr int kKnVectors = 1;
#endif

template <int KC, int J>
inline void KnRows(const float* xk, int64_t ldx, int64_t M,
                   const Vec (&wv)[J][KC], float* acc, int64_t stride) {
  for (int64_t r = 0; r < M; ++r, acc += stride) {
    Vec a[J];
    for (int j = 0; j < J; ++j) a[j] = Load(acc + j * kLanes);
    for (int i = 0; i < KC; ++i) {
      const Vec xi = Set1(xk[r * ldx + i]);
      for (int j = 0; j < J; ++j) a[j] = Fma(xi, wv[j][i], a[j]);
    }
    for (int j = 0; j < J; ++j) Store(acc + j * kLanes, a[j]);
  }
}

// Rows [k, k + KC) of w (wk: row k) over J whole vectors of columns from c.
template <int KC, int J, typename W>
inline void KnBlock(const float* xk, int64_t ldx, const W* wk, int64_t M,
                    int64_t N, int64_t c, float* acc, int64_t stride) {
  Vec wv[J][KC];
  for (int i = 0; i < KC; ++i) {
    for (int j = 0; j < J; ++j) {
      Prefetch(wk + (KC + i) * N + c + j * kLanes);
      wv[j][i] = Load(wk + i * N + c + j * kLanes);
    }
  }
  KnRows<KC, J>(xk, ldx, M, wv, acc + c, stride);
}

// Rows [k, k + KC) of w over the chunk's `full` whole vectors and `tail`
// remaining columns.
template <int KC, typename W>
inline void KnStep(const float* x, int64_t ldx, const W* w, int64_t M,
                   int64_t N, int64_t k, int64_t full, int tail, float* acc,
                   int64_t stride) {
  const W* wk = w + k * N;
  int64_t c = 0;
  for (; c + kKnVectors * kLanes <= full; c += kKnVectors * kLanes) {
    KnBlock<KC, kKnVectors>(x + k, ldx, wk, M, N, c, acc, stride);
  }
  for (; c < full; c += kLanes) {
    KnBlock<KC, 1>(x + k, ldx, wk, M, N, c, acc, stride);
  }
  if (tail > 0) {
    Vec wv[1][KC];
    for (int i = 0; i < KC; ++i) {
      wv[0][i] = LoadPartial(wk + i * N + full, tail);
    }
    KnRows<KC, 1>(x + k, ldx, M, wv, acc + full, stride);
  }
}

// Rows [k, k + KC) of bf16 w over `paired` columns (a multiple of kPair),
// decoded in pairs: each block's running sums are kept even columns first.
template <int KC>
inline void KnStepPairs(const float* x, int64_t ldx, const uint16_t* w,
                        int64_t M, int64_t N, int64_t k, int64_t paired,
                        float* acc, int64_t stride) {
  const uint16_t* wk = w + k * N;
  for (int64_t c = 0; c < paired; c += kPair) {
    Vec wv[2][KC];  // even columns, then odd: running sums in that order
    for (int i = 0; i < KC; ++i) {
      Prefetch(wk + (KC + i) * N + c);
      LoadPairs(wk + i * N + c, &wv[0][i], &wv[1][i]);
    }
    KnRows<KC, 2>(x + k, ldx, M, wv, acc + c, stride);
  }
}

#if T5X_SPEED_BF16_DOT
// Rows [k, k + 2 * KP) of bf16 w as KP pairs of rows (kAlone: row k alone,
// paired with zeros, as are x's padded columns), times bf16 x [M, ldb], over
// `paired` columns: each block's running sums kept in Interleave's order.
constexpr int kDotPairs = 4;  // pairs of rows of w per pass over the chunk

template <int KP, bool kAlone = false>
inline void KnStepDot(const uint16_t* xb, int64_t ldb, const uint16_t* w,
                      int64_t M, int64_t N, int64_t k, int64_t paired,
                      float* acc, int64_t stride) {
  const uint16_t* wk = w + k * N;
  for (int64_t c = 0; c < paired; c += kPair) {
    Pairs lo[KP], hi[KP];
    for (int i = 0; i < KP; ++i) {
      const uint16_t* a = wk + 2 * i * N + c;
      Prefetch(a + 2 * KP * N);
      Prefetch(a + (2 * KP + 1) * N);
      const Pairs b = kAlone ? _mm512_setzero_si512() : LoadPairsBf16(a + N);
      Interleave(LoadPairsBf16(a), b, &lo[i], &hi[i]);
    }
    for (int64_t r = 0; r < M; ++r) {
      float* sums = acc + r * stride + c;
      const uint16_t* xr = xb + r * ldb + k;
      Vec l = Load(sums), h = Load(sums + kLanes);
      for (int i = 0; i < KP; ++i) {
        const Pairs xp = BroadcastPair(xr + 2 * i);
        l = Dot(l, lo[i], xp);
        h = Dot(h, hi[i], xp);
      }
      Store(sums, l);
      Store(sums + kLanes, h);
    }
  }
}
#endif

// Rows [0, K) of w (row length N) times x [M, ldx] over columns [n0, n1),
// into f32 `out` (a slice's partial products, see Dispatch). With `xb` (x in
// bf16, [M, ldb], for the hardware's bf16 pairs), the paired columns are
// multiplied from it.
template <typename W>
void KnChunk(const float* x, int64_t ldx, const uint16_t* xb, int64_t ldb,
             const W* w, float* out, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  const int64_t paired =
      std::is_same_v<W, uint16_t> ? width / kPair * kPair : 0;
  const int64_t full = (width - paired) / kLanes * kLanes;
  const int tail = static_cast<int>(width - paired - full);
  const int64_t stride = paired + full + (tail > 0 ? kLanes : 0);
  thread_local AlignedVector<float> scratch;
  scratch.assign(static_cast<size_t>(M * stride), 0.0f);
  float* acc = scratch.data();
  const W* wc = w + n0;
  const bool dot = kBf16Dot && xb != nullptr;
  const auto step = [&](auto kc, int64_t k) {
    constexpr int KC = decltype(kc)::value;
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (!dot) KnStepPairs<KC>(x, ldx, wc, M, N, k, paired, acc, stride);
    }
    KnStep<KC>(x, ldx, wc + paired, M, N, k, full, tail, acc + paired,
               stride);
  };
  int64_t k = 0;
  for (; k + kKc <= K; k += kKc) step(std::integral_constant<int, kKc>(), k);
  for (; k < K; ++k) step(std::integral_constant<int, 1>(), k);
#if T5X_SPEED_BF16_DOT
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (dot) {
      k = 0;
      for (; k + 2 * kDotPairs <= K; k += 2 * kDotPairs) {
        KnStepDot<kDotPairs>(xb, ldb, wc, M, N, k, paired, acc, stride);
      }
      for (; k + 2 <= K; k += 2) {
        KnStepDot<1>(xb, ldb, wc, M, N, k, paired, acc, stride);
      }
      if (k < K) KnStepDot<1, true>(xb, ldb, wc, M, N, k, paired, acc, stride);
    }
  }
#endif
  for (int64_t r = 0; r < M; ++r) {
    const float* row = acc + r * stride;
    float* o = out + r * N + n0;
    for (int64_t c = 0; c < paired; c += kPair) {
#if T5X_SPEED_BF16_DOT
      if (dot) {
        StoreInterleaved(o + c, Load(row + c), Load(row + c + kLanes));
        continue;
      }
#endif
      StorePairs(o + c, Load(row + c), Load(row + c + kLanes));
    }
    std::copy(row + paired, row + width, o + paired);
  }
}

// x @ w in slices of kKSlice rows of w: each slice is a contiguous block of
// w, so a thread streams it as one run of memory (a column chunk of the whole
// of w would be K short runs), and the slices give the threads work even
// when w has few columns. out = sum of the slices' products, in slice order.
constexpr int64_t kKSlice = 128;

inline int64_t KnSlices(int64_t K) {
  return std::max<int64_t>(1, (K + kKSlice - 1) / kKSlice);
}

// out[i] = partials[0][i] + partials[1][i] + ... (left to right) for
// elements [i0, i1) of one product, each slice's partials [M, N] f32 `size`
// floats apart; kSumPiece elements at a time, their sums held in L1. With
// int8 weights, each sum is then multiplied by its column's `w_scale`.
constexpr int64_t kSumPiece = 2048;

template <typename O>
void KnSumSlices(const float* partials, int64_t slices, int64_t size,
                 int64_t i0, int64_t i1, O* out,
                 const float* w_scale = nullptr, int64_t N = 1) {
  alignas(kCacheLine) float sum[kSumPiece];
  for (int64_t p = i0; p < i1; p += kSumPiece) {
    const int64_t n = std::min(i1 - p, kSumPiece);
    std::copy(partials + p, partials + p + n, sum);
    for (int64_t s = 1; s < slices; ++s) {
      const float* add = partials + s * size + p;
      for (int64_t i = 0; i < n; ++i) sum[i] += add[i];
    }
    if (w_scale != nullptr) {
      for (int64_t i = 0; i < n; ++i) sum[i] *= w_scale[(p + i) % N];
    }
    for (int64_t i = 0; i < n; ++i) FromF32(sum[i], out + p + i);
  }
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_KERNELS_KN_H_
