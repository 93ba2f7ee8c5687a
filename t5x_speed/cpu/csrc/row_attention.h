// Attention of one query row over its key/value cache, for rowmatmul.cc's
// cached-attention handler: context = softmax(q . k_l + bias_l) @ v.
//
// Row independence: a row's context depends on its query, its bias row and
// its cache only, through one fixed sequence of float32 operations (the
// q . k dot as per-lane FMA chains and a fixed horizontal sum, then + bias;
// the max; exp(s - max) by the vector Exp of row_vectors.h; the weights'
// sum in per-lane sums over the keys and a fixed horizontal sum; the
// weighted sum of values as one FMA chain per element in key order; one
// division), whatever the number of rows in the call or the thread that
// computes it. So SPEED's R rows attend exactly as greedy's one row does.
// Vectors span keys where the work per key is small (dots' horizontal sums,
// bias, max, exp), so a narrow head (16 or 64 elements) is not bound by
// scalar work per key.
//
// Masked keys: a key whose bias is at most kMaskedBias (T5X masks with
// -1e10) gets weight 0, as XLA's softmax gives it (exp underflows to 0),
// whatever its key and value hold: its value is not read, nor its key where
// it lies before the first visible key or after the last (a causal mask's
// unwritten end of the cache). A row whose keys are all masked attends to
// all of them, as XLA's softmax does.

#ifndef T5X_SPEED_CSRC_ROW_ATTENTION_H_
#define T5X_SPEED_CSRC_ROW_ATTENTION_H_

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "row_kernels.h"

namespace t5x_speed_kernels {

constexpr float kMaskedBias = -1e9f;

// q . k over D elements as a vector of per-lane sums (D_full whole vectors,
// then a tail); the dot is ReduceAdd of it.
template <typename C>
inline Vec DotLanes(const float* q, const C* k, int64_t D) {
  Vec acc = Zero();
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) acc = Fma(Load(q + d), Load(k + d), acc);
  if (d < D) {
    acc = Fma(Load(q + d), LoadPartial(k + d, static_cast<int>(D - d)), acc);
  }
  return acc;
}

// scores[l] = q . k_l for keys [first, last]: kLanes keys at a time, their
// horizontal sums in one ReduceAddLanes (the same sums as one ReduceAdd per
// key), the rest one by one.
template <typename C>
void Scores(const float* q, const C* keys, int64_t first, int64_t last,
            int64_t D, float* scores) {
  int64_t l = first;
  for (; l + kLanes <= last + 1; l += kLanes) {
    Vec acc[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      acc[i] = DotLanes(q, keys + (l + i) * D, D);
    }
    Store(scores + l, ReduceAddLanes(acc));
  }
  for (; l <= last; ++l) scores[l] = ReduceAdd(DotLanes(q, keys + l * D, D));
}

// acc[0, D) = sum over the visible keys l in [first, last] of p[l] * v_l:
// one FMA chain per element in key order. NV > 0: the row as NV vectors
// held in registers (the last one partial where kLanes does not divide D);
// NV = 0: any D, the sums kept in acc.
template <int NV, typename C, typename B>
void WeightedValues(const C* values, const float* p, const B* bias,
                    bool any_visible, int64_t first, int64_t last, int64_t D,
                    float* acc) {
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  const int tail = static_cast<int>(D - (Dp - kLanes));
  Vec a[NV > 0 ? NV : 1];
  for (int j = 0; j < NV; ++j) a[j] = Zero();
  for (int64_t d = 0; NV == 0 && d < Dp; d += kLanes) Store(acc + d, Zero());
  for (int64_t l = first; l <= last; ++l) {
    if (any_visible && ToF32(bias[l]) <= kMaskedBias) continue;
    const C* v = values + l * D;
    const Vec pv = Set1(p[l]);
    if (NV > 0) {
      for (int j = 0; j + 1 < NV; ++j) {
        a[j] = Fma(pv, Load(v + j * kLanes), a[j]);
      }
      const C* end = v + (NV - 1) * kLanes;
      a[NV - 1] = Fma(pv, tail == kLanes ? Load(end) : LoadPartial(end, tail),
                      a[NV - 1]);
      continue;
    }
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      Store(acc + d, Fma(pv, Load(v + d), Load(acc + d)));
    }
    if (d < D) {
      Store(acc + d, Fma(pv, LoadPartial(v + d, static_cast<int>(D - d)),
                         Load(acc + d)));
    }
  }
  for (int j = 0; j < NV; ++j) Store(acc + j * kLanes, a[j]);
}

// One row: q [D], keys and values [L, D], bias [L] -> out [D]. `scratch`
// holds at least L + kLanes + 2 * Dp floats, Dp = D rounded up to kLanes.
template <typename Q, typename C, typename B>
void AttendRow(const Q* q, const C* keys, const C* values, const B* bias,
               int64_t L, int64_t D, Q* out, float* scratch) {
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  float* qf = scratch;
  float* acc = scratch + Dp;
  float* weights = scratch + 2 * Dp;
  for (int64_t d = 0; d < Dp; ++d) qf[d] = d < D ? ToF32(q[d]) : 0.0f;
  // Keys [first, last]: the first visible one to the last.
  int64_t first = 0, last = L - 1;
  while (first < L && ToF32(bias[first]) <= kMaskedBias) ++first;
  const bool any_visible = first < L;
  if (!any_visible) first = 0;
  while (any_visible && ToF32(bias[last]) <= kMaskedBias) --last;
  const float masked = -std::numeric_limits<float>::infinity();
  Scores(qf, keys, first, last, D, weights);
  // s + bias (-inf for masked keys) and the max, kLanes keys at a time, the
  // last block's lanes past `last` -inf (the exps below take whole vectors
  // too). A NaN score does not enter the max (as std::max).
  const int64_t end = first + (last - first + kLanes) / kLanes * kLanes;
  for (int64_t l = last + 1; l < end; ++l) weights[l] = masked;
  Vec maxes = Set1(masked);
  for (int64_t l = first; l < end; l += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, last + 1 - l));
    const Vec b = n == kLanes ? Load(bias + l) : LoadPartial(bias + l, n);
    Vec s = Add(Load(weights + l), b);
    if (any_visible) s = MaskedWhere(s, b, kMaskedBias);
    Store(weights + l, s);
    maxes = Max(s, maxes);
  }
  const float max = ReduceMax(maxes);
  // The weights exp(s - max) (0 for masked keys) and their sum, lane i of
  // the sums taking keys first + i (mod kLanes).
  Vec sums = Zero();
  for (int64_t l = first; l < end; l += kLanes) {
    const Vec p = Exp(Sub(Load(weights + l), Set1(max)));
    Store(weights + l, p);
    sums = Add(sums, p);
  }
  const float sum = ReduceAdd(sums);
  switch (kLanes > 1 ? Dp / kLanes : 0) {
#define T5X_SPEED_WEIGHTED_VALUES(NV)                                        \
  case NV:                                                                   \
    WeightedValues<NV>(values, weights, bias, any_visible, first, last, D, \
                       acc);                                               \
    break;
    T5X_SPEED_WEIGHTED_VALUES(1)
    T5X_SPEED_WEIGHTED_VALUES(2)
    T5X_SPEED_WEIGHTED_VALUES(3)
    T5X_SPEED_WEIGHTED_VALUES(4)
    T5X_SPEED_WEIGHTED_VALUES(5)
    T5X_SPEED_WEIGHTED_VALUES(6)
    T5X_SPEED_WEIGHTED_VALUES(7)
    T5X_SPEED_WEIGHTED_VALUES(8)
#undef T5X_SPEED_WEIGHTED_VALUES
    default:
      WeightedValues<0>(values, weights, bias, any_visible, first, last, D,
                        acc);
  }
  for (int64_t d = 0; d < D; ++d) FromF32(acc[d] / sum, out + d);
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_ATTENTION_H_
