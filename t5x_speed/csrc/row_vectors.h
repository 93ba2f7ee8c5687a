// Vector types and element conversions for the few-row kernels, one set per
// instruction set chosen at compile time (the library is built with
// -march=native on the machine that runs it): f32 vectors, bf16 loads in
// pairs, and AVX512_BF16's pair products where the CPU has them.

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
constexpr const char* kIsa = "portable";
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
