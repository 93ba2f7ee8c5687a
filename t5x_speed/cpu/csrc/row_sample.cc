// A decode step's token choice for XLA:CPU, behind jax.ffi
// (t5x_speed/cpu/sample.py): the handler t5x_speed_sample samples each row
// of logits with position-keyed Gumbel noise (t5x_speed/sampling.py), in
// place of XLA's passes over the vocabulary (noise, temperature, top-k /
// top-p masks, argmax, log-softmax).
//
// Operands: logits [N, V] (float32 or bfloat16), keys [N, 2] uint32 (each
// row's raw threefry key), positions [N] int32, temperature [N] float32,
// topp [N] float32 (0: off). Attributes: topk (int64, 0: off), rescale
// (int64: score under the tempered, filtered distribution), threads (int64,
// 0: one per hardware thread). Results: tokens [N] int32 and the log-
// probability of each token [N] float32.
//
// Row r's token: at temperature <= 1e-4 the first maximum of its logits;
// else the first maximum of logits / T + g over the ids kept by top-k (the
// topk largest) and top-p (the smallest set of largest probabilities holding
// at least topp, ties at the cut kept, found by bisection over the bits of
// a float32), where g_i = -log(-log(u_i)) and u_i is jax.random.uniform's
// float from the 32 bits jax.random.bits draws at index i with the key
// fold_in(keys[r], positions[r]) (threefry2x32, jax_threefry_partitionable).
// So the bits are jax.random's; the logarithms and exponentials are this
// file's polynomials (within a few ulps of the exact values), so a token can
// differ from XLA's only where two perturbed logits lie that close, or a
// probability lies within rounding of the top-p cut. A row with a NaN logit
// gets the first NaN's id and a NaN log-probability (0 for a greedy row
// with `rescale`, as XLA's sampler).
//
// Every row runs one fixed sequence of operations (16 accumulator lanes
// whatever the vector width), so a row's token does not depend on the other
// rows of the call or on `threads`.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "aligned_buffer.h"
#include "ffi_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace t5x_speed_kernels;  // NOLINT(build/namespaces)

// Every reduction keeps kLanes partial results, lane l summing the
// elements l, l + kLanes, ..., so a row's result has one lane order
// whatever the vector width. Passes run on GCC vector-extension vectors of
// the widest width the build has registers for (kWidth floats: one
// AVX-512, AVX or SSE register); a wider vector type than the registers
// would be lowered to scalar code. A block of kLanes floats is kSub such
// vectors.
constexpr int64_t kLanes = 16;
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
#elif defined(__AVX__)
constexpr int64_t kWidth = 8;
#else
constexpr int64_t kWidth = 4;
#endif
constexpr int64_t kSub = kLanes / kWidth;
typedef float F __attribute__((vector_size(4 * kWidth)));
typedef uint32_t U __attribute__((vector_size(4 * kWidth)));
typedef int32_t I __attribute__((vector_size(4 * kWidth)));

// T5X's: at or below this temperature a row decodes greedily.
constexpr float kMinTemperature = 1e-4f;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline F Load(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, F v) { std::memcpy(p, &v, sizeof v); }

inline F Splat(float x) { return F{} + x; }

// The threefry2x32 block cipher (20 rounds), as jax.random's primitive.
template <typename V>
inline void Threefry(uint32_t k0, uint32_t k1, V& x0, V& x1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  x0 += ks[0];
  x1 += ks[1];
#pragma GCC unroll 5
  for (int i = 0; i < 5; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int r = kRot[i % 2][j];
      x0 += x1;
      x1 = ((x1 << r) | (x1 >> (32 - r))) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
}

// log(x) for positive normal floats (Cephes' logf polynomial).
inline F Log(F x) {
  const U bits = (U)x;
  F e = __builtin_convertvector((I)(bits >> 23) - 126, F);
  F m = (F)((bits & 0x007fffffu) | 0x3f000000u);  // [0.5, 1)
  const I low = m < 0.707106781186547524f;
  e = low ? e - 1.0f : e;
  m = low ? m + m - 1.0f : m - 1.0f;
  const F z = m * m;
  F y = Splat(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// exp(x) for x <= 0, -inf included (Cephes' expf polynomial); 0 below
// float's normal range.
inline F Exp(F x) {
  const I under = x < -87.0f;
  x = under ? Splat(-87.0f) : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  I k = __builtin_convertvector(t, I);                   // toward zero
  k += (I)(__builtin_convertvector(k, F) > t);           // -1: floor
  const F n = __builtin_convertvector(k, F);
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  const F z = x * x;
  F y = Splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  y *= (F)((U)(k + 127) << 23);
  return under ? Splat(0.0f) : y;
}

// Gumbel noise -log(-log(u)) of jax.random.gumbel's uniform u from `bits`.
inline F Gumbel(U bits) {
  const F f = (F)((bits >> 9) | 0x3f800000u) - 1.0f;
  const F u = f > 0.0f ? f : Splat(std::numeric_limits<float>::min());
  return -Log(-Log(u));
}

// Sum over the padded row of term(vector start) -> F, in kLanes lanes
// added in lane order.
template <typename T>
float BlockSum(int64_t n, const T& term) {
  F lanes[kSub] = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int64_t j = 0; j < kSub; ++j) lanes[j] += term(i + j * kWidth);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < kSub; ++j) {
    for (int64_t l = 0; l < kWidth; ++l) total += lanes[j][l];
  }
  return total;
}

// Maximum and the first index of it in x[0..n), n a multiple of kLanes,
// NaN-free.
inline int64_t ArgMax(const float* x, int64_t n, float* max) {
  F best[kSub];
  I at[kSub] = {};
  I idx[kSub];
  for (int64_t j = 0; j < kSub; ++j) {
    best[j] = Splat(-kInf);
    for (int64_t l = 0; l < kWidth; ++l) {
      idx[j][l] = static_cast<int32_t>(j * kWidth + l);
    }
  }
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int64_t j = 0; j < kSub; ++j) {
      const F v = Load(x + i + j * kWidth);
      const I better = v > best[j];
      best[j] = better ? v : best[j];
      at[j] = better ? idx[j] : at[j];
      idx[j] += kLanes;
    }
  }
  float top = -kInf;
  int64_t first = n;
  for (int64_t j = 0; j < kSub; ++j) {
    for (int64_t l = 0; l < kWidth; ++l) {
      if (best[j][l] > top || (best[j][l] == top && at[j][l] < first)) {
        top = best[j][l];
        first = at[j][l];
      }
    }
  }
  *max = top;
  return first;
}

// log_softmax(x)[token] of a NaN-free padded row whose maximum is `top`.
inline float LogSoftmaxAt(const float* x, int64_t n, int64_t token,
                          float top) {
  const float sum = BlockSum(n, [&](int64_t i) {
    return Exp(Load(x + i) - top);
  });
  return x[token] - top - std::log(sum);
}

// Appends the elements of p[0..n) in [lo, hi) to c, in order; returns
// their count.
inline int64_t Compact(const float* p, int64_t n, float lo, float hi,
                       float* c) {
  int64_t m = 0;
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    const __mmask16 in =
        _mm512_cmp_ps_mask(v, _mm512_set1_ps(lo), _CMP_GE_OQ) &
        _mm512_cmp_ps_mask(v, _mm512_set1_ps(hi), _CMP_LT_OQ);
    _mm512_mask_compressstoreu_ps(c + m, in, v);
    m += __builtin_popcount(in);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    c[m] = p[i];
    m += (p[i] >= lo) & (p[i] < hi);
  }
#endif
  return m;
}

// mass(t) = sum of the p[i] >= t. The top-p cut is the largest float t with
// mass(t) >= topp, found by bisection over the 31 bits of a non-negative
// float32: first its exponent over the whole row, then its mantissa over
// the row's elements in that binade (c: scratch of n floats), the
// larger ones' mass added as one term.
float TopPCut(const float* p, int64_t n, float topp, float* c) {
  auto as_float = [](uint32_t bits) {
    float t;
    std::memcpy(&t, &bits, 4);
    return t;
  };
  uint32_t cut = 0;
  for (int bit = 30; bit >= 23; --bit) {
    const uint32_t trial = cut | (1u << bit);
    const float t = as_float(trial);
    const float mass = BlockSum(n, [&](int64_t i) {
      const F v = Load(p + i);
      return v >= t ? v : Splat(0.0f);
    });
    if (mass >= topp) cut = trial;
  }
  const float lo = as_float(cut), hi = as_float(cut + (1u << 23));
  const float above = BlockSum(n, [&](int64_t i) {
    const F v = Load(p + i);
    return v >= hi ? v : Splat(0.0f);
  });
  int64_t m = Compact(p, n, lo, hi, c);
  for (; m % kLanes != 0; ++m) c[m] = 0.0f;
  for (int bit = 22; bit >= 0; --bit) {
    const uint32_t trial = cut | (1u << bit);
    const float t = as_float(trial);
    const float mass = above + BlockSum(m, [&](int64_t i) {
      const F v = Load(c + i);
      return v >= t ? v : Splat(0.0f);
    });
    if (mass >= topp) cut = trial;
  }
  return as_float(cut);
}

struct RowResult {
  int32_t token;
  float log_prob;
};

// One row: x holds its `valid` logits as float32, padded with -inf to n (a
// multiple of kLanes); s, p and c are scratch of n floats.
RowResult SampleRow(const float* x, float* s, float* p, float* c, int64_t n,
                    int64_t valid, uint32_t k0, uint32_t k1, int32_t position,
                    float temperature, float topp, int64_t topk,
                    bool rescale) {
  const float any_nan = BlockSum(n, [&](int64_t i) {
    const F v = Load(x + i);
    return v != v ? Splat(1.0f) : Splat(0.0f);
  });
  if (any_nan > 0.0f) {
    const bool scored_zero = rescale && !(temperature > kMinTemperature);
    return {static_cast<int32_t>(
                std::find_if(x, x + valid, [](float v) { return v != v; }) -
                x),
            scored_zero ? 0.0f : std::numeric_limits<float>::quiet_NaN()};
  }
  float top;
  if (!(temperature > kMinTemperature)) {
    const int64_t token = ArgMax(x, n, &top);
    return {static_cast<int32_t>(token),
            rescale ? 0.0f : LogSoftmaxAt(x, n, token, top)};
  }
  for (int64_t i = 0; i < n; i += kWidth) {
    Store(s + i, Load(x + i) / temperature);
  }
  if (topk > 0 && topk < valid) {
    std::copy(s, s + valid, p);
    std::nth_element(p, p + (topk - 1), p + valid, std::greater<float>());
    const float kth = p[topk - 1];
    for (int64_t i = 0; i < n; i += kWidth) {
      const F v = Load(s + i);
      Store(s + i, v >= kth ? v : Splat(-kInf));
    }
  }
  // The kept ids' log_softmax at `token` is s[token] - top - log_kept.
  ArgMax(s, n, &top);
  for (int64_t i = 0; i < n; i += kWidth) Store(p + i, Exp(Load(s + i) - top));
  const float sum = BlockSum(n, [&](int64_t i) { return Load(p + i); });
  float log_kept = std::log(sum);
  if (topp > 0.0f) {
    for (int64_t i = 0; i < n; i += kWidth) Store(p + i, Load(p + i) / sum);
    const float cut = TopPCut(p, n, topp, c);
    for (int64_t i = 0; i < n; i += kWidth) {
      const F v = Load(s + i);
      Store(s + i, Load(p + i) >= cut ? v : Splat(-kInf));
    }
    log_kept += std::log(BlockSum(n, [&](int64_t i) {
      const F v = Load(p + i);
      return v >= cut ? v : Splat(0.0f);
    }));
  }
  // Counter-based noise: index i's bits are threefry(key, (0, i)).
  uint32_t r0 = 0, r1 = static_cast<uint32_t>(position);
  Threefry(k0, k1, r0, r1);
  U index;
  for (int64_t l = 0; l < kWidth; ++l) index[l] = static_cast<uint32_t>(l);
  for (int64_t i = 0; i < n; i += kWidth, index += kWidth) {
    U b0 = {}, b1 = index;
    Threefry(r0, r1, b0, b1);
    Store(p + i, Load(s + i) + Gumbel(b0 ^ b1));
  }
  float best;
  const int64_t token = ArgMax(p, n, &best);
  float x_top;
  if (!rescale) ArgMax(x, n, &x_top);
  const float log_prob = rescale ? s[token] - top - log_kept
                                 : LogSoftmaxAt(x, n, token, x_top);
  return {static_cast<int32_t>(token), log_prob};
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
void SampleRows(ffi::ThreadPool& pool, const T* logits, const uint32_t* keys,
                const int32_t* positions, const float* temperature,
                const float* topp, int32_t* tokens, float* log_probs,
                int64_t rows, int64_t n, int64_t topk, bool rescale,
                int max_threads) {
  // A row is read in about this many passes over its floats.
  constexpr int64_t kPasses = 8;
  const int64_t bytes = rows * n * static_cast<int64_t>(sizeof(float));
  const int threads = ThreadsFor(pool, bytes * kPasses, max_threads);
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  ParallelFor(pool, rows, threads, [&](int64_t r) {
    thread_local AlignedVector<float> scratch;
    scratch.resize(static_cast<size_t>(4 * padded));
    float* x = scratch.data();
    for (int64_t i = 0; i < n; ++i) x[i] = ToFloat(logits[r * n + i]);
    std::fill(x + n, x + padded, -kInf);
    const RowResult out = SampleRow(
        x, x + padded, x + 2 * padded, x + 3 * padded, padded, n, keys[2 * r],
        keys[2 * r + 1], positions[r], temperature[r], topp[r], topk, rescale);
    tokens[r] = out.token;
    log_probs[r] = out.log_prob;
  });
}

ffi::Error Sample(ffi::ThreadPool pool, ffi::AnyBuffer logits,
                  ffi::AnyBuffer keys, ffi::AnyBuffer positions,
                  ffi::AnyBuffer temperature, ffi::AnyBuffer topp,
                  ffi::Result<ffi::AnyBuffer> tokens,
                  ffi::Result<ffi::AnyBuffer> log_probs, int64_t topk,
                  int64_t rescale, int64_t threads) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || !IsFloat(logits.element_type())) {
    return ffi::Error::InvalidArgument(
        "t5x_speed_sample: logits must be [rows, vocab] float32 or bfloat16");
  }
  const int64_t rows = dims[0], n = dims[1];
  if (keys.element_type() != ffi::DataType::U32 ||
      keys.element_count() != 2 * rows ||
      positions.element_type() != ffi::DataType::S32 ||
      positions.element_count() != rows ||
      temperature.element_type() != ffi::DataType::F32 ||
      temperature.element_count() != rows ||
      topp.element_type() != ffi::DataType::F32 ||
      topp.element_count() != rows || n < 1 || topk < 0) {
    return ffi::Error::InvalidArgument(
        "t5x_speed_sample: keys [rows, 2] uint32, positions [rows] int32, "
        "temperature and topp [rows] float32, vocab >= 1, topk >= 0");
  }
  const auto* k = static_cast<const uint32_t*>(keys.untyped_data());
  const auto* pos = static_cast<const int32_t*>(positions.untyped_data());
  const auto* t = static_cast<const float*>(temperature.untyped_data());
  const auto* tp = static_cast<const float*>(topp.untyped_data());
  auto* tok = static_cast<int32_t*>(tokens->untyped_data());
  auto* lp = static_cast<float*>(log_probs->untyped_data());
  const int max_threads = NumThreads(threads);
  if (logits.element_type() == ffi::DataType::F32) {
    SampleRows(pool, static_cast<const float*>(logits.untyped_data()), k, pos,
               t, tp, tok, lp, rows, n, topk, rescale != 0, max_threads);
  } else {
    SampleRows(pool, static_cast<const uint16_t*>(logits.untyped_data()), k,
               pos, t, tp, tok, lp, rows, n, topk, rescale != 0, max_threads);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedSample, Sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("topk")
                                  .Attr<int64_t>("rescale")
                                  .Attr<int64_t>("threads"));
