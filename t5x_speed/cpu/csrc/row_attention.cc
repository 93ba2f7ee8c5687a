// A decode step's cache writes and attention for XLA:CPU, behind jax.ffi
// (t5x_speed/cpu/attention.py): the handlers t5x_speed_cached_attention
// (writes the step's rows, then attends) and t5x_speed_attention (attends
// over caches it does not write), with the attributes `threads` (int64, 0:
// one per hardware thread) and `stages` (int64 array: each slot's stage).
// The arithmetic: row_attention.h.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ffi_threads.h"
#include "row_attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace t5x_speed_kernels;  // NOLINT(build/namespaces)

// ---------------------------------------------------------------------------
// Cached attention with the step's cache writes: query [..., B, S, H, D];
// keys and values [..., R, B, H, L, D], one cache per stage; bias [..., B,
// S, H, L]; the step's new keys and values [..., B, S, H, D] (the caches'
// dtype) at positions [..., B, S] (int32). Slot s writes its new key and
// value at its position of stage stages[s] (a position outside [0, L)
// writes nothing), then every slot attends over its stage: out [..., B, S,
// H, D], and the updated caches, which XLA aliases to the caches passed in
// (written in place). Leading axes are equal in every operand (jax.vmap's
// broadcast_all). The arithmetic: row_attention.h.

// Copies the slots' new rows into the caches (bytes: one cache element).
void WriteRows(const ffi::AnyBuffer& new_rows, const int32_t* positions,
               const int64_t* stages, ffi::AnyBuffer& cache, int64_t V,
               int64_t R, int64_t Bn, int64_t S, int64_t H, int64_t L,
               int64_t D, int64_t bytes) {
  const char* src = static_cast<const char*>(new_rows.untyped_data());
  char* dst = static_cast<char*>(cache.untyped_data());
  for (int64_t vi = 0; vi < V; ++vi) {
    for (int64_t bi = 0; bi < Bn; ++bi) {
      for (int64_t si = 0; si < S; ++si) {
        const int64_t pos = positions[(vi * Bn + bi) * S + si];
        if (pos < 0 || pos >= L) continue;
        for (int64_t hi = 0; hi < H; ++hi) {
          const int64_t from = (((vi * Bn + bi) * S + si) * H + hi) * D;
          const int64_t to =
              ((((vi * R + stages[si]) * Bn + bi) * H + hi) * L + pos) * D;
          std::memcpy(dst + to * bytes, src + from * bytes, D * bytes);
        }
      }
    }
  }
}

template <typename Q, typename C, typename B>
ffi::Error Attend(ffi::ThreadPool& pool, const ffi::AnyBuffer& query,
                  const ffi::AnyBuffer& keys, const ffi::AnyBuffer& values,
                  const ffi::AnyBuffer& bias, ffi::AnyBuffer& out,
                  const int64_t* stages, int64_t V, int64_t R, int64_t Bn,
                  int64_t S, int64_t H, int64_t L, int64_t D,
                  int max_threads) {
  const Q* q = static_cast<const Q*>(query.untyped_data());
  const C* k = static_cast<const C*>(keys.untyped_data());
  const C* v = static_cast<const C*>(values.untyped_data());
  const B* b = static_cast<const B*>(bias.untyped_data());
  Q* o = static_cast<Q*>(out.untyped_data());
  const int64_t rows = V * Bn * S * H;
  const int64_t bytes = rows * L * D * 2 * static_cast<int64_t>(sizeof(C));
  const int threads = ThreadsFor(pool, bytes, max_threads);
  const int64_t per = std::max<int64_t>(1, rows / (4 * threads));
  const int64_t chunks = (rows + per - 1) / per;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  ParallelFor(pool, chunks, threads, [&](int64_t c) {
    thread_local AlignedVector<float> scratch;
    scratch.resize(static_cast<size_t>(L + kLanes + 2 * Dp));
    for (int64_t row = c * per; row < std::min(rows, (c + 1) * per); ++row) {
      // row = ((vi * Bn + bi) * S + si) * H + hi
      const int64_t hi = row % H, si = row / H % S, bi = row / (H * S) % Bn,
                    vi = row / (H * S * Bn);
      const int64_t cache = (((vi * R + stages[si]) * Bn + bi) * H + hi) * L * D;
      AttendRow(q + row * D, k + cache, v + cache, b + row * L, L, D,
                o + row * D, scratch.data());
    }
  });
  return ffi::Error::Success();
}

bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Sizes of an attention call, from its query [..., B, S, H, D], caches
// [..., R, B, H, L, D] and bias [..., B, S, H, L].
struct Dims {
  int64_t V = 1, R = 0, Bn = 0, S = 0, H = 0, L = 0, D = 0;
};

// Checks the operands both handlers share and fills `dims`.
ffi::Error CheckAttention(const char* name, const ffi::AnyBuffer& query,
                          const ffi::AnyBuffer& keys,
                          const ffi::AnyBuffer& values,
                          const ffi::AnyBuffer& bias,
                          const ffi::AnyBuffer& out,
                          ffi::Span<const int64_t> stages, int64_t threads,
                          Dims& dims) {
  const std::string prefix = std::string(name) + ": ";
  const auto qd = query.dimensions(), kd = keys.dimensions(),
             bd = bias.dimensions();
  const int64_t rank = static_cast<int64_t>(qd.size());
  if (rank < 4 || static_cast<int64_t>(kd.size()) != rank + 1 ||
      static_cast<int64_t>(bd.size()) != rank) {
    return ffi::Error::InvalidArgument(prefix + "operand ranks");
  }
  const int64_t lead = rank - 4;
  for (int64_t i = 0; i < lead; ++i) {
    if (kd[i] != qd[i] || bd[i] != qd[i]) {
      return ffi::Error::InvalidArgument(prefix +
                                         "leading axes must be equal");
    }
    dims.V *= qd[i];
  }
  dims.Bn = qd[lead], dims.S = qd[lead + 1], dims.H = qd[lead + 2],
  dims.D = qd[lead + 3], dims.R = kd[lead], dims.L = kd[lead + 3];
  if (!SameDims(values.dimensions(), kd) || !SameDims(out.dimensions(), qd) ||
      kd[lead + 1] != dims.Bn || kd[lead + 2] != dims.H ||
      kd[lead + 4] != dims.D || bd[lead] != dims.Bn ||
      bd[lead + 1] != dims.S || bd[lead + 2] != dims.H ||
      bd[lead + 3] != dims.L ||
      static_cast<int64_t>(stages.size()) != dims.S) {
    return ffi::Error::InvalidArgument(prefix + "shape mismatch");
  }
  for (int64_t s = 0; s < dims.S; ++s) {
    if (stages[s] < 0 || stages[s] >= dims.R) {
      return ffi::Error::InvalidArgument(prefix + "bad stage");
    }
  }
  if (threads < 0) return ffi::Error::InvalidArgument(prefix + "threads >= 0");
  const ffi::DataType cache_type = keys.element_type();
  if (!IsFloat(query.element_type()) || !IsFloat(cache_type) ||
      !IsFloat(bias.element_type()) || values.element_type() != cache_type ||
      out.element_type() != query.element_type()) {
    return ffi::Error::InvalidArgument(
        prefix + "float32 or bfloat16 operands, the caches of one dtype, out "
                 "of the query's");
  }
  return ffi::Error::Success();
}

// Every row's attention over its stage's cache, for the operands' dtypes.
ffi::Error AttendAll(ffi::ThreadPool& pool, const ffi::AnyBuffer& query,
                     const ffi::AnyBuffer& keys, const ffi::AnyBuffer& values,
                     const ffi::AnyBuffer& bias, ffi::AnyBuffer& out,
                     const int64_t* st, const Dims& d, int64_t threads) {
  if (d.V * d.Bn * d.S * d.H == 0 || d.D == 0) return ffi::Error::Success();
  if (d.L == 0) return ffi::Error::InvalidArgument("attention: empty cache");
  const int n = NumThreads(threads);
  const bool q32 = query.element_type() == ffi::DataType::F32;
  const bool c32 = keys.element_type() == ffi::DataType::F32;
  const bool b32 = bias.element_type() == ffi::DataType::F32;
#define T5X_SPEED_ATTEND(Q, C, B)                                          \
  return Attend<Q, C, B>(pool, query, keys, values, bias, out, st, d.V, d.R, \
                         d.Bn, d.S, d.H, d.L, d.D, n)
  if (q32 && c32 && b32) T5X_SPEED_ATTEND(float, float, float);
  if (q32 && c32) T5X_SPEED_ATTEND(float, float, uint16_t);
  if (q32 && b32) T5X_SPEED_ATTEND(float, uint16_t, float);
  if (q32) T5X_SPEED_ATTEND(float, uint16_t, uint16_t);
  if (c32 && b32) T5X_SPEED_ATTEND(uint16_t, float, float);
  if (c32) T5X_SPEED_ATTEND(uint16_t, float, uint16_t);
  if (b32) T5X_SPEED_ATTEND(uint16_t, uint16_t, float);
  T5X_SPEED_ATTEND(uint16_t, uint16_t, uint16_t);
#undef T5X_SPEED_ATTEND
}

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::AnyBuffer query,
                           ffi::AnyBuffer keys, ffi::AnyBuffer values,
                           ffi::AnyBuffer bias, ffi::AnyBuffer new_keys,
                           ffi::AnyBuffer new_values, ffi::AnyBuffer positions,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> keys_out,
                           ffi::Result<ffi::AnyBuffer> values_out,
                           ffi::Span<const int64_t> stages, int64_t threads) {
  Dims d;
  ffi::Error error = CheckAttention("cached_attention", query, keys, values,
                                    bias, *out, stages, threads, d);
  if (error.failure()) return error;
  const auto qd = query.dimensions(), kd = keys.dimensions(),
             pd = positions.dimensions();
  bool positions_ok = pd.size() + 2 == qd.size();
  for (size_t i = 0; positions_ok && i < pd.size(); ++i) {
    positions_ok = pd[i] == qd[i];
  }
  const ffi::DataType cache_type = keys.element_type();
  if (!positions_ok || !SameDims(keys_out->dimensions(), kd) ||
      !SameDims(values_out->dimensions(), kd) ||
      !SameDims(new_keys.dimensions(), qd) ||
      !SameDims(new_values.dimensions(), qd) ||
      new_keys.element_type() != cache_type ||
      new_values.element_type() != cache_type ||
      keys_out->element_type() != cache_type ||
      values_out->element_type() != cache_type ||
      positions.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument(
        "cached_attention: new rows [..., B, S, H, D] of the caches' dtype, "
        "int32 positions [..., B, S]");
  }
  // Not aliased (XLA could not reuse the input buffers): start from a copy.
  const int64_t bytes = cache_type == ffi::DataType::F32 ? 4 : 2;
  const size_t cache_bytes = static_cast<size_t>(keys.element_count() * bytes);
  if (keys_out->untyped_data() != keys.untyped_data()) {
    std::memcpy(keys_out->untyped_data(), keys.untyped_data(), cache_bytes);
  }
  if (values_out->untyped_data() != values.untyped_data()) {
    std::memcpy(values_out->untyped_data(), values.untyped_data(),
                cache_bytes);
  }
  if (d.V * d.Bn * d.S * d.H == 0 || d.D == 0) return ffi::Error::Success();
  if (d.L == 0) {
    return ffi::Error::InvalidArgument("cached_attention: empty cache");
  }
  const int32_t* pos = static_cast<const int32_t*>(positions.untyped_data());
  WriteRows(new_keys, pos, stages.begin(), *keys_out, d.V, d.R, d.Bn, d.S,
            d.H, d.L, d.D, bytes);
  WriteRows(new_values, pos, stages.begin(), *values_out, d.V, d.R, d.Bn, d.S,
            d.H, d.L, d.D, bytes);
  return AttendAll(pool, query, *keys_out, *values_out, bias, *out,
                   stages.begin(), d, threads);
}

// Attention alone over caches that the step does not write (an
// encoder-decoder's cross-attention keys and values): the same operands
// without the new rows, positions and cache results.
ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer query,
                     ffi::AnyBuffer keys, ffi::AnyBuffer values,
                     ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Span<const int64_t> stages, int64_t threads) {
  Dims d;
  ffi::Error error = CheckAttention("attention", query, keys, values, bias,
                                    *out, stages, threads, d);
  if (error.failure()) return error;
  return AttendAll(pool, query, keys, values, bias, *out, stages.begin(), d,
                   threads);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("stages")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("stages")
                                  .Attr<int64_t>("threads"));
