// T5's RMSNorm of a decode step's rows for XLA:CPU behind jax.ffi
// (t5x_speed_rms_norm), one fixed sequence of operations per row.
//
// XLA:CPU vectorises the norm's mean of squares according to the shape it
// reduces: at some widths (192, 768) a row of a 1-row step and the same row
// of an R-row step are summed in different orders, so greedy's and SPEED's
// hidden states differ in the last bits. Here each row is summed alone:
// lane l of a vector accumulator takes x[k]^2 for k = l (mod lanes) in order
// (an FMA chain from 0), the lanes then add in one fixed tree, and
//   y = x * (1 / sqrt(sum / E + eps)),   rounded to the output type,
//   out = y * scale,                     scale rounded to the output type
// first, the product rounded to it (the module's two roundings in bf16).
//
// x [..., E] float32 or bfloat16; scale float32, x's shape (the model's [E]
// broadcast, so that jax.vmap batches it with x); out [..., E] float32 or
// bfloat16; attribute `epsilon` (float32).

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi_threads.h"
#include "row_vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace t5x_speed_kernels;  // NOLINT(build/namespaces)

inline float RoundTo(float v, bool bf16) {
  return bf16 ? Bf16ToF32(F32ToBf16(v)) : v;
}

template <typename X>
float SumOfSquares(const X* x, int64_t E) {
  Vec acc = Zero();
  int64_t k = 0;
  for (; k + kLanes <= E; k += kLanes) {
    const Vec v = Load(x + k);
    acc = Fma(v, v, acc);
  }
  if (k < E) {
    const Vec v = LoadPartial(x + k, static_cast<int>(E - k));
    acc = Fma(v, v, acc);
  }
  return ReduceAdd(acc);
}

template <typename X, typename O>
void Norm(const X* x, const float* scale, O* out, int64_t rows, int64_t E,
          float epsilon) {
  constexpr bool kBf16Out = std::is_same_v<O, uint16_t>;
  for (int64_t r = 0; r < rows; ++r, x += E, out += E, scale += E) {
    const float mean = SumOfSquares(x, E) / static_cast<float>(E);
    const float inv = 1.0f / std::sqrt(mean + epsilon);
    for (int64_t e = 0; e < E; ++e) {
      const float y = RoundTo(ToF32(x[e]) * inv, kBf16Out);
      FromF32(y * RoundTo(scale[e], kBf16Out), out + e);
    }
  }
}

ffi::Error RmsNorm(ffi::AnyBuffer x, ffi::AnyBuffer scale,
                   ffi::Result<ffi::AnyBuffer> out, float epsilon) {
  const auto xd = x.dimensions(), od = out->dimensions(),
             sd = scale.dimensions();
  const int64_t rank = static_cast<int64_t>(xd.size());
  if (rank < 1 || static_cast<int64_t>(od.size()) != rank ||
      static_cast<int64_t>(sd.size()) != rank ||
      !IsFloat(x.element_type()) || !IsFloat(out->element_type()) ||
      scale.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        "rms_norm: x [..., E] and out float32 or bfloat16, scale float32");
  }
  int64_t rows = 1;
  for (int64_t i = 0; i < rank; ++i) {
    if (od[i] != xd[i] || sd[i] != xd[i]) {
      return ffi::Error::InvalidArgument(
          "rms_norm: out and scale must be x's shape");
    }
    if (i < rank - 1) rows *= xd[i];
  }
  const int64_t E = xd[rank - 1];
  if (rows * E == 0) return ffi::Error::Success();
  const float* s = static_cast<const float*>(scale.untyped_data());
  const bool x32 = x.element_type() == ffi::DataType::F32;
  const bool o32 = out->element_type() == ffi::DataType::F32;
  const void* xp = x.untyped_data();
  void* op = out->untyped_data();
  if (x32 && o32) {
    Norm(static_cast<const float*>(xp), s, static_cast<float*>(op), rows, E,
         epsilon);
  } else if (x32) {
    Norm(static_cast<const float*>(xp), s, static_cast<uint16_t*>(op), rows,
         E, epsilon);
  } else if (o32) {
    Norm(static_cast<const uint16_t*>(xp), s, static_cast<float*>(op), rows,
         E, epsilon);
  } else {
    Norm(static_cast<const uint16_t*>(xp), s, static_cast<uint16_t*>(op),
         rows, E, epsilon);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("epsilon"));
