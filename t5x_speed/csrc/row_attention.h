// Attention of one query row over its key/value cache, for rowmatmul.cc's
// cached-attention handler: context = softmax(q . k_l + bias_l) @ v.
//
// Row independence: a row's context depends on its query, its bias row and
// its cache only, through one fixed sequence of float32 operations (the
// q . k dot as per-lane FMA chains and a fixed horizontal sum, then + bias;
// the max; exp(s - max) by std::exp; the weights' sum and the weighted sum
// of values in key order; one division), whatever the number of rows in
// the call or the thread that computes it. So SPEED's R rows attend exactly
// as greedy's one row does.
//
// Masked keys: a key whose bias is at most kMaskedBias (T5X masks with
// -1e10) gets weight 0, as XLA's softmax gives it (exp underflows to 0), and
// is not read. A row whose keys are all masked attends to all of them, as
// XLA's softmax does.

#ifndef T5X_SPEED_CSRC_ROW_ATTENTION_H_
#define T5X_SPEED_CSRC_ROW_ATTENTION_H_

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "row_kernels.h"

namespace t5x_speed_kernels {

constexpr float kMaskedBias = -1e9f;

// q . k over D elements (D_full whole vectors, then a tail).
template <typename C>
inline float Dot(const float* q, const C* k, int64_t D) {
  Vec acc = Zero();
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) acc = Fma(Load(q + d), Load(k + d), acc);
  if (d < D) {
    acc = Fma(Load(q + d), LoadPartial(k + d, static_cast<int>(D - d)), acc);
  }
  return ReduceAdd(acc);
}

// One row: q [D], keys and values [L, D], bias [L] -> out [D]. `scratch`
// holds at least L + 2 * Dp floats, Dp = D rounded up to kLanes.
template <typename Q, typename C, typename B>
void AttendRow(const Q* q, const C* keys, const C* values, const B* bias,
               int64_t L, int64_t D, Q* out, float* scratch) {
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  float* qf = scratch;
  float* acc = scratch + Dp;
  float* weights = scratch + 2 * Dp;
  for (int64_t d = 0; d < Dp; ++d) qf[d] = d < D ? ToF32(q[d]) : 0.0f;
  bool any_visible = false;
  for (int64_t l = 0; l < L && !any_visible; ++l) {
    any_visible = ToF32(bias[l]) > kMaskedBias;
  }
  const float masked = -std::numeric_limits<float>::infinity();
  float max = masked;
  for (int64_t l = 0; l < L; ++l) {
    const float b = ToF32(bias[l]);
    if (any_visible && b <= kMaskedBias) {
      weights[l] = masked;
      continue;
    }
    weights[l] = Dot(qf, keys + l * D, D) + b;
    max = std::max(max, weights[l]);
  }
  float sum = 0.0f;
  for (int64_t d = 0; d < Dp; d += kLanes) Store(acc + d, Zero());
  for (int64_t l = 0; l < L; ++l) {
    if (weights[l] == masked) continue;
    const float p = std::exp(weights[l] - max);
    sum += p;
    const C* v = values + l * D;
    const Vec pv = Set1(p);
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      Store(acc + d, Fma(pv, Load(v + d), Load(acc + d)));
    }
    if (d < D) {
      Store(acc + d, Fma(pv, LoadPartial(v + d, static_cast<int>(D - d)),
                         Load(acc + d)));
    }
  }
  for (int64_t d = 0; d < D; ++d) FromF32(acc[d] / sum, out + d);
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_ATTENTION_H_
