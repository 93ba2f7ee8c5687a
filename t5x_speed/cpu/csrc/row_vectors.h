// Vector types and element conversions for the few-row kernels, one set per
// instruction set chosen at compile time (the library is built with
// -march=native on the machine that runs it): f32 vectors, bf16 loads in
// pairs, AVX512_BF16's pair products where the CPU has them, and what the
// attention takes across keys (horizontal sums of many vectors, max, exp).

#ifndef T5X_SPEED_CSRC_ROW_VECTORS_H_
#define T5X_SPEED_CSRC_ROW_VECTORS_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

// AVX512_BF16's bf16 pair products (Dot below), used where x and w are both
// bf16.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define T5X_SPEED_BF16_DOT 1
#else
#define T5X_SPEED_BF16_DOT 0
#endif

namespace t5x_speed_kernels {

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
inline float ToF32(int8_t v) { return static_cast<float>(v); }
inline void FromF32(float v, float* out) { *out = v; }
inline void FromF32(float v, uint16_t* out) { *out = F32ToBf16(v); }

// Software prefetch of weights one block ahead of the loads (the next KC
// rows of w over the same columns; the next group of w.T's rows). Each
// stream the kernels read is short (a few KiB), and the hardware prefetchers
// start over on every new one. Locality 1 (prefetcht2 on x86) brings the
// lines toward the core without evicting the accumulators' lines from L1.
// A prefetch never faults, so addresses past the end of w are harmless.
template <typename T>
inline void Prefetch(const T* p) {
  __builtin_prefetch(p, /*rw=*/0, /*locality=*/1);
}

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
// int8 weights widen exactly to f32 (a sign extension and a conversion).
inline Vec Load(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
inline void LoadPairs(const uint16_t* p, Vec* even, Vec* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(
      _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
// Writes kPair floats: even[0], odd[0], even[1], odd[1], ...
inline void StorePairs(float* p, Vec even, Vec odd) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                       21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, lo, odd));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(even, hi, odd));
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
// Lane i = ReduceAdd(v[i]) for kLanes vectors: the same additions, in the
// same tree, done for all of them at once.
inline Vec ReduceAddLanes(const Vec (&v)[kLanes]) {
  Vec u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i) {  // 16 -> 8: lane i + lane i + 8
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  }
  for (int i = 0; i < 4; ++i) {  // 8 -> 4: i + (i + 4)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
  }
  for (int i = 0; i < 2; ++i) {  // 4 -> 2: i + (i + 2)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xee));
  }
  // 2 -> 1; element 4m + p then holds vector m + 4p's sum.
  const Vec f = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                              _mm512_shuffle_ps(z[0], z[1], 0xdd));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
      f);
}
inline float ReduceMax(Vec v) { return _mm512_reduce_max_ps(v); }
// Lanes of t where b <= limit set to -inf.
inline Vec MaskedWhere(Vec t, Vec b, float limit) {
  return _mm512_mask_mov_ps(
      t, _mm512_cmp_ps_mask(b, _mm512_set1_ps(limit), _CMP_LE_OQ),
      _mm512_set1_ps(-INFINITY));
}
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// b where either is NaN, as x86's maxps (also in the other builds).
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec RoundNearest(Vec v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT |
                                     _MM_FROUND_NO_EXC);
}
// 2^n for whole n in [-126, 127].
inline Vec Pow2(Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// Lanes of v below `limit` set to 0 (a NaN lane is kept).
inline Vec ZeroBelow(Vec v, Vec x, float limit) {
  return _mm512_maskz_mov_ps(
      _mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_NLT_UQ), v);
}
constexpr const char* kIsa = T5X_SPEED_BF16_DOT ? "avx512_bf16" : "avx512";
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
inline Vec Load(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline void LoadPairs(const uint16_t* p, Vec* even, Vec* odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *odd = _mm256_castsi256_ps(
      _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void StorePairs(float* p, Vec even, Vec odd) {
  const __m256 lo = _mm256_unpacklo_ps(even, odd);  // pairs 0, 1, 4, 5
  const __m256 hi = _mm256_unpackhi_ps(even, odd);  // pairs 2, 3, 6, 7
  _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
  _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float ReduceAdd(Vec v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v),
                               _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
// Lane i = ReduceAdd(v[i]) for kLanes vectors: the same additions, in the
// same tree, done for all of them at once.
inline Vec ReduceAddLanes(const Vec (&v)[kLanes]) {
  Vec u[4], w[2];
  for (int i = 0; i < 4; ++i) {  // 8 -> 4: lane i + lane i + 4
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  }
  for (int i = 0; i < 2; ++i) {  // 4 -> 2: i + (i + 2)
    w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xee));
  }
  // 2 -> 1; element 4m + p then holds vector m + 2p's sum.
  const Vec f = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88),
                              _mm256_shuffle_ps(w[0], w[1], 0xdd));
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline float ReduceMax(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline Vec MaskedWhere(Vec t, Vec b, float limit) {
  return _mm256_blendv_ps(
      t, _mm256_set1_ps(-INFINITY),
      _mm256_cmp_ps(b, _mm256_set1_ps(limit), _CMP_LE_OQ));
}
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec RoundNearest(Vec v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec Pow2(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec ZeroBelow(Vec v, Vec x, float limit) {
  return _mm256_and_ps(v, _mm256_cmp_ps(x, _mm256_set1_ps(limit),
                                        _CMP_NLT_UQ));
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
inline Vec Load(const int8_t* p) { return static_cast<float>(*p); }
inline void LoadPairs(const uint16_t* p, Vec* even, Vec* odd) {
  *even = Bf16ToF32(p[0]);
  *odd = Bf16ToF32(p[1]);
}
inline void StorePairs(float* p, Vec even, Vec odd) {
  p[0] = even;
  p[1] = odd;
}
inline void Store(float* p, Vec v) { *p = v; }
inline float ReduceAdd(Vec v) { return v; }
inline Vec ReduceAddLanes(const Vec (&v)[kLanes]) { return v[0]; }
inline float ReduceMax(Vec v) { return v; }
inline Vec MaskedWhere(Vec t, Vec b, float limit) {
  return b <= limit ? -INFINITY : t;
}
inline Vec Max(Vec a, Vec b) { return a > b ? a : b; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline Vec Sub(Vec a, Vec b) { return a - b; }
constexpr const char* kIsa = "portable";
#endif

// exp(x) lane by lane: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a
// degree-6 polynomial in r, times 2^n), within 2 ulp of the exact value;
// 0 below ln(FLT_MIN), so no denormal results; x above 88 is taken as 88;
// a NaN lane stays NaN. The portable build takes std::exp.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline Vec Exp(Vec x) {
  constexpr float kMin = -87.33654f;  // ln(FLT_MIN)
  const Vec xc = Min(Set1(88.0f), Max(Set1(kMin), x));
  const Vec n = RoundNearest(Mul(xc, Set1(1.44269504088896341f)));
  Vec r = Fma(n, Set1(-0.693359375f), xc);
  r = Fma(n, Set1(2.12194440e-4f), r);
  Vec p = Set1(1.9875691500e-4f);
  p = Fma(p, r, Set1(1.3981999507e-3f));
  p = Fma(p, r, Set1(8.3334519073e-3f));
  p = Fma(p, r, Set1(4.1665795894e-2f));
  p = Fma(p, r, Set1(1.6666665459e-1f));
  p = Fma(p, r, Set1(5.0000001201e-1f));
  p = Fma(p, Mul(r, r), Add(r, Set1(1.0f)));
  return ZeroBelow(Mul(p, Pow2(n)), x, kMin);
}
#else
inline Vec Exp(Vec x) { return std::exp(x); }
#endif

// bf16 in pairs: LoadPairs reads kPair bf16 and returns the even-indexed
// and the odd-indexed ones as f32, one shift / one mask per vector (`Load`
// widens kLanes bf16 with a shuffle and a shift). The kernels below use it
// for whole blocks of kPair bf16 weights.
constexpr int kPair = 2 * kLanes;

// Where element i of a paired block layout lies: each block of kPair
// elements even-indexed first (kLanes of them), then odd-indexed.
inline int64_t PairedSlot(int64_t i) {
  const int64_t b = i % kPair;
  return i - b + (b % 2) * kLanes + b / 2;
}

// bf16 pairs in hardware: with AVX512_BF16, Dot(acc, a, b) adds
// a[2l + 1] * b[2l + 1], then a[2l] * b[2l], to lane l of acc (vdpbf16ps),
// with no conversion of either operand: where x is bf16 too, the kernels
// below take w's pairs as they lie in memory (x @ w.T) or interleave two
// rows of w (x @ w) instead of widening every weight to f32.
constexpr bool kBf16Dot = T5X_SPEED_BF16_DOT;
#if T5X_SPEED_BF16_DOT
using Pairs = __m512i;  // kLanes pairs of bf16
inline Pairs LoadPairsBf16(const uint16_t* p) { return _mm512_loadu_si512(p); }
// One pair (p[0], p[1]) in every lane.
inline Pairs BroadcastPair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}
inline Vec Dot(Vec acc, Pairs a, Pairs b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
// Rows a and b of w over kPair columns as pairs (a[n], b[n]): `lo` holds
// columns 0-3, 8-11, 16-19, 24-27 of the block, `hi` the others (the
// unpacks work within 128-bit lanes); StoreInterleaved undoes the order.
inline void Interleave(Pairs a, Pairs b, Pairs* lo, Pairs* hi) {
  *lo = _mm512_unpacklo_epi16(a, b);
  *hi = _mm512_unpackhi_epi16(a, b);
}
inline void StoreInterleaved(float* p, Vec lo, Vec hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5,
                                          6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(lo, second, hi));
}
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

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ROW_VECTORS_H_
