// The few-row matmul kernels of rowmatmul.cc: the x @ w and x @ w.T loops
// over a column range, single-threaded (vector types: row_vectors.h).
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
//     order (for bf16 w, decoded in pairs: k = 2l then 2l + 1 of each block
//     of 2 * lanes), then one fixed horizontal sum.
//   * x and w both bf16 on a CPU with AVX512_BF16 (kBf16Dot): each pair
//     (k, k + 1), k even, enters as acc = fma(x[k + 1], w[k + 1], acc), then
//     acc = fma(x[k], w[k], acc) (vdpbf16ps; bf16 products are exact in f32,
//     so these are the f32 path's FMAs in another order), with denormal
//     operands and results flushed to zero; for x @ w the pairs run over each
//     slice's k, in every column but N's last N mod (2 * lanes), which keep
//     the FMA chain (the column chunks are whole blocks of 2 * lanes, so
//     which columns these are does not depend on M); for x @ w.T lane l
//     takes pairs 2l, 2l + 1 of each block of 2 * lanes.
//
// Memory: x @ w.T keeps all rows' accumulators in registers while a few rows
// of w stream through once, up to 8 rows (12 for f32 x and w); more rows are
// done in such groups inside each column block, whose weights are then
// still in L2.

#ifndef T5X_SPEED_CSRC_ROW_KERNELS_H_
#define T5X_SPEED_CSRC_ROW_KERNELS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "aligned_buffer.h"
#include "row_vectors.h"

namespace t5x_speed_kernels {

// Rows of x @ w.T whose accumulators live in registers together (a row
// group): 8, or 12 where x and w are f32 (12 rows x 2 columns). Up to 12
// rows then read each row of w once for all of them, where a second group
// would read it again from L2 while nothing streams from memory; the bf16
// forms also hold x's blocks in registers.
constexpr int kMaxGroupRows = 8;
constexpr int kMaxF32GroupRows = 12;

template <typename W>
constexpr int MaxGroupRows() {
  return std::is_same_v<W, float> ? kMaxF32GroupRows : kMaxGroupRows;
}

// ---------------------------------------------------------------------------
// out = x @ w, w [K, N] row-major.
//
// A chunk of columns [n0, n1) is done for all M rows at once: KC rows of w
// are read side by side (KC contiguous streams, which the hardware
// prefetchers follow), each loaded vector serves every row, and the rows'
// partial sums live in a small f32 scratch that stays in L1 or L2 (the
// chunk's width is chosen for that, see rowmatmul.cc), touched once per KC
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
// floats apart; kSumPiece elements at a time, their sums held in L1.
constexpr int64_t kSumPiece = 2048;

template <typename O>
void KnSumSlices(const float* partials, int64_t slices, int64_t size,
                 int64_t i0, int64_t i1, O* out) {
  alignas(kCacheLine) float sum[kSumPiece];
  for (int64_t p = i0; p < i1; p += kSumPiece) {
    const int64_t n = std::min(i1 - p, kSumPiece);
    std::copy(partials + p, partials + p + n, sum);
    for (int64_t s = 1; s < slices; ++s) {
      const float* add = partials + s * size + p;
      for (int64_t i = 0; i < n; ++i) sum[i] += add[i];
    }
    for (int64_t i = 0; i < n; ++i) FromF32(sum[i], out + p + i);
  }
}

// ---------------------------------------------------------------------------
// out = x @ w[:N].T, w [*, K] row-major (dot-product form).

constexpr int NkColumns(int m) {
  return m <= 2 ? 8 : (m <= 3 ? 6 : (m <= 4 ? 5 : (m <= 6 ? 3 : 2)));
}

// Output columns [j, j + J) of M rows: out[r, j + c] = the horizontal sum
// of acc[r][c] times `scale` (1 leaves every sum's bits as they are).
template <int M, int J, typename O>
inline void NkStore(const Vec (&acc)[M][J], O* out, int64_t N, int64_t j,
                    float scale) {
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < J; ++c) {
      FromF32(ReduceAdd(acc[r][c]) * scale, out + r * N + j + c);
    }
  }
}

// Rows [j, j + J) of bf16 w in blocks of kPair elements, in k order:
// block(k, wp) gets each row's block (the last one zero-filled past K).
template <int J, typename Block>
inline void NkPairBlocks(const uint16_t* w, int64_t K, int64_t j,
                         const Block& block) {
  const uint16_t* wp[J];
  int64_t k = 0;
  for (; k + kPair <= K; k += kPair) {
    for (int c = 0; c < J; ++c) {
      Prefetch(w + (j + J + c) * K + k);
      wp[c] = w + (j + c) * K + k;
    }
    block(k, wp);
  }
  if (k < K) {
    uint16_t tails[J][kPair] = {};
    for (int c = 0; c < J; ++c) {
      std::memcpy(tails[c], w + (j + c) * K + k, (K - k) * sizeof(uint16_t));
      wp[c] = tails[c];
    }
    block(k, wp);
  }
}

// Output columns [j, j + J) of M rows. `x` holds the M rows of one row group
// (see RunRowGroups), zero-padded to Kp = K rounded up to kLanes (so the K
// tail is one more lane-wise FMA), in blocks of kLanes columns: block b of
// row r at x + (b * M + r) * kLanes (XBlocks). The rows' offsets within a
// block are constants, so the loop holds one pointer to x, not one per row.
template <int M, int J, typename O>
void NkGroup(const float* x, const float* w, O* out, int64_t K, int64_t N,
             int64_t j, float scale) {
  Vec acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < J; ++c) acc[r][c] = Zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes, x += M * kLanes) {
    Vec wv[J];
    for (int c = 0; c < J; ++c) {
      Prefetch(w + (j + J + c) * K + k);
      wv[c] = Load(w + (j + c) * K + k);
    }
    for (int r = 0; r < M; ++r) {
      const Vec xv = Load(x + r * kLanes);
      for (int c = 0; c < J; ++c) acc[r][c] = Fma(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const int tail = static_cast<int>(K - k);
    Vec wv[J];
    for (int c = 0; c < J; ++c) wv[c] = LoadPartial(w + (j + c) * K + k, tail);
    for (int r = 0; r < M; ++r) {
      const Vec xv = Load(x + r * kLanes);
      for (int c = 0; c < J; ++c) acc[r][c] = Fma(xv, wv[c], acc[r][c]);
    }
  }
  NkStore(acc, out, N, j, scale);
}

// As NkGroup for bf16 w, decoded in pairs: `x` holds each block of kPair
// elements of a row even-indexed first (PairedSlot), zero-padded to Kp, so
// lane l of an accumulator takes k = 2l, then k = 2l + 1, of each block.
template <int M, int J, typename O>
void NkGroupPairs(const float* x, int64_t Kp, const uint16_t* w, O* out,
                  int64_t K, int64_t N, int64_t j, float scale) {
  Vec acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < J; ++c) acc[r][c] = Zero();
  const auto block = [&](int64_t k, const uint16_t* const* wp) {
    Vec xe[M], xo[M];
    for (int r = 0; r < M; ++r) {
      xe[r] = Load(x + r * Kp + k);
      xo[r] = Load(x + r * Kp + k + kLanes);
    }
    for (int c = 0; c < J; ++c) {
      Vec we, wo;
      LoadPairs(wp[c], &we, &wo);
      for (int r = 0; r < M; ++r) {
        acc[r][c] = Fma(xe[r], we, acc[r][c]);
        acc[r][c] = Fma(xo[r], wo, acc[r][c]);
      }
    }
  };
  NkPairBlocks<J>(w, K, j, block);
  NkStore(acc, out, N, j, scale);
}

#if T5X_SPEED_BF16_DOT
// As NkGroup for bf16 x and w, with the hardware's pairs: `xb` [M, Kb] bf16,
// zero-padded to Kb = K rounded up to kPair, so lane l of an accumulator
// takes the pair k = 2l, 2l + 1 of each block.
template <int M, int J, typename O>
void NkGroupDot(const uint16_t* xb, int64_t Kb, const uint16_t* w, O* out,
                int64_t K, int64_t N, int64_t j, float scale) {
  Vec acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < J; ++c) acc[r][c] = Zero();
  const auto block = [&](int64_t k, const uint16_t* const* wp) {
    Pairs xv[M];
    for (int r = 0; r < M; ++r) xv[r] = LoadPairsBf16(xb + r * Kb + k);
    for (int c = 0; c < J; ++c) {
      const Pairs wv = LoadPairsBf16(wp[c]);
      for (int r = 0; r < M; ++r) acc[r][c] = Dot(acc[r][c], xv[r], wv);
    }
  };
  NkPairBlocks<J>(w, K, j, block);
  NkStore(acc, out, N, j, scale);
}
#endif

// ---------------------------------------------------------------------------
// Row-group dispatch: rows [0, M) in groups of up to MaxGroupRows<W>().

template <typename W, typename O>
struct Problem {
  // x in f32, [M, Kp]; for x @ w.T with f32 w, each row group's rows in
  // NkGroup's blocks (XBlocks).
  const float* x;
  int64_t Kp;
  // x in bf16 for the hardware's bf16 pairs ([M, Kb], see NkGroupDot and
  // KnStepDot), or null: set only where x and w are both bf16 and kBf16Dot.
  const uint16_t* xb;
  int64_t Kb;
  const W* w;
  O* out;          // [M, N]
  int64_t M, K, N;
  bool transposed;
  // x @ w.T only: each product times this before its rounding to O.
  float scale = 1.0f;
};

template <int M, int J, typename W, typename O>
inline void NkColumnsAt(const Problem<W, O>& p, int64_t r0, int64_t j) {
  const float* x = p.x + r0 * p.Kp;
  O* out = p.out + r0 * p.N;
  if constexpr (std::is_same_v<W, uint16_t>) {
#if T5X_SPEED_BF16_DOT
    if (p.xb != nullptr) {
      NkGroupDot<M, J>(p.xb + r0 * p.Kb, p.Kb, p.w, out, p.K, p.N, j,
                       p.scale);
      return;
    }
#endif
    NkGroupPairs<M, J>(x, p.Kp, p.w, out, p.K, p.N, j, p.scale);
  } else {
    NkGroup<M, J>(x, p.w, out, p.K, p.N, j, p.scale);
  }
}

// Output columns [n0, n1) of rows [r0, r0 + G).
template <int G, typename W, typename O>
void RunGroup(const Problem<W, O>& p, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int J = NkColumns(G);
  int64_t j = n0;
  for (; j + J <= n1; j += J) NkColumnsAt<G, J>(p, r0, j);
  for (; j < n1; ++j) NkColumnsAt<G, 1>(p, r0, j);
}

// Output columns per block when the rows come in several groups: the block's
// weights (kNtBlock x K) stay in L2 while every group reads them, instead of
// each group streaming the whole range from memory. A multiple of every
// NkColumns(m), so blocking adds no single-column tails.
constexpr int64_t kNtBlock = 120;

template <typename W, typename O>
void RunRowGroups(const Problem<W, O>& p, int64_t n0, int64_t n1) {
  constexpr int kRows = MaxGroupRows<W>();
  static_assert(kRows == 8 || kRows == 12, "RunRowGroups' cases");
  for (int64_t r0 = 0; r0 < p.M; r0 += kRows) {
    switch (std::min<int64_t>(kRows, p.M - r0)) {
      case 1: RunGroup<1>(p, r0, n0, n1); break;
      case 2: RunGroup<2>(p, r0, n0, n1); break;
      case 3: RunGroup<3>(p, r0, n0, n1); break;
      case 4: RunGroup<4>(p, r0, n0, n1); break;
      case 5: RunGroup<5>(p, r0, n0, n1); break;
      case 6: RunGroup<6>(p, r0, n0, n1); break;
      case 7: RunGroup<7>(p, r0, n0, n1); break;
      case 8: RunGroup<8>(p, r0, n0, n1); break;
      case 9: if constexpr (kRows > 8) RunGroup<9>(p, r0, n0, n1); break;
      case 10: if constexpr (kRows > 8) RunGroup<10>(p, r0, n0, n1); break;
      case 11: if constexpr (kRows > 8) RunGroup<11>(p, r0, n0, n1); break;
      default: if constexpr (kRows > 8) RunGroup<12>(p, r0, n0, n1); break;
    }
  }
}

// Where element k of row r of an M-row x @ w.T with f32 w goes in x's copy
// ([M, Kp] floats): in RunRowGroups' row groups, each group's G rows as
// [Kp / kLanes, G, kLanes] (NkGroup).
inline int64_t XBlocks(int64_t M, int64_t Kp, int64_t r, int64_t k) {
  const int64_t r0 = r / kMaxF32GroupRows * kMaxF32GroupRows;
  const int64_t G = std::min<int64_t>(kMaxF32GroupRows, M - r0);
  return r0 * Kp + (k / kLanes * G + r - r0) * kLanes + k % kLanes;
}

template <typename W, typename O>
void RunColumns(const Problem<W, O>& p, int64_t n0, int64_t n1) {
  if (!p.transposed) {  // x has row stride Kp == K here
    // Dispatch runs x @ w as slices with f32 partial products only.
    if constexpr (std::is_same_v<O, float>) {
      KnChunk(p.x, p.Kp, p.xb, p.Kb, p.w, p.out, p.M, p.K, p.N, n0, n1);
    }
    return;
  }
  if (p.M <= MaxGroupRows<W>()) {
    RunRowGroups(p, n0, n1);
    return;
  }
  for (int64_t b0 = n0; b0 < n1; b0 += kNtBlock) {
    RunRowGroups(p, b0, std::min(n1, b0 + kNtBlock));
  }
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_KERNELS_H_
