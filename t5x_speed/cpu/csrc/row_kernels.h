// The few-row matmul kernels of rowmatmul.cc: the x @ w (row_kernels_kn.h)
// and x @ w.T loops over a column range, single-threaded (vector types:
// row_vectors.h).
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
//   * int8 w with per-output-channel f32 scales: each weight widens exactly
//     to f32 as it loads, enters the f32 path's chain above, and each output
//     element's finished sum is multiplied once by its channel's scale.
//
// Memory: x @ w.T keeps all rows' accumulators in registers while a few rows
// of w stream through once, up to 8 rows (12 for f32 or int8 w); more rows are
// done in such groups inside each column block, whose weights are then
// still in L2.

#ifndef T5X_SPEED_CSRC_ROW_KERNELS_H_
#define T5X_SPEED_CSRC_ROW_KERNELS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "aligned_buffer.h"
#include "row_kernels_kn.h"  // x @ w
#include "row_vectors.h"

namespace t5x_speed_kernels {

// Rows of x @ w.T whose accumulators live in registers together (a row
// group): 8, or 12 where x and w are f32 (12 rows x 2 columns). Up to 12
// rows then read each row of w once for all of them, where a second group
// would read it again from L2 while nothing streams from memory; the bf16
// forms also hold x's blocks in registers.
constexpr int kMaxGroupRows = 8;
constexpr int kMaxF32GroupRows = 12;

// int8 weights: widened to f32 as they load, so their groups are the f32
// path's (x in XBlocks, 12 rows).
template <typename W>
constexpr bool kWidened = std::is_same_v<W, float> ||
                          std::is_same_v<W, int8_t>;

template <typename W>
constexpr int MaxGroupRows() {
  return kWidened<W> ? kMaxF32GroupRows : kMaxGroupRows;
}

// ---------------------------------------------------------------------------
// out = x @ w[:N].T, w [*, K] row-major (dot-product form).

constexpr int NkColumns(int m) {
  return m <= 2 ? 8 : (m <= 3 ? 6 : (m <= 4 ? 5 : (m <= 6 ? 3 : 2)));
}

// Output columns [j, j + J) of M rows: out[r, j + c] = the horizontal sum
// of acc[r][c], times w_scale[j + c] for int8 weights, times `scale` (1
// leaves every sum's bits as they are).
template <int M, int J, typename O>
inline void NkStore(const Vec (&acc)[M][J], O* out, int64_t N, int64_t j,
                    float scale, const float* w_scale = nullptr) {
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < J; ++c) {
      float v = ReduceAdd(acc[r][c]);
      if (w_scale != nullptr) v *= w_scale[j + c];
      FromF32(v * scale, out + r * N + j + c);
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
// w is f32, or int8 with per-row scales `w_scale` (applied in NkStore).
template <int M, int J, typename W, typename O>
void NkGroup(const float* x, const W* w, O* out, int64_t K, int64_t N,
             int64_t j, float scale, const float* w_scale) {
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
  NkStore(acc, out, N, j, scale, w_scale);
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
  // int8 w only: each output column's scale (x @ w: applied where the
  // slices are summed; x @ w.T: [N'], one per row of w).
  const float* w_scale = nullptr;
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
    NkGroup<M, J>(x, p.w, out, p.K, p.N, j, p.scale, p.w_scale);
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

// Where element k of row r of an M-row x @ w.T with f32 or int8 w goes in
// x's copy ([M, Kp] floats): in RunRowGroups' row groups, each group's G
// rows as [Kp / kLanes, G, kLanes] (NkGroup).
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
