// Row gather for XLA:CPU behind jax.ffi: t5x_speed_gather_rows copies
// embedding rows as they are stored; t5x_speed_gather_rows_q8 widens an int8
// table's rows to float32, each times its row's scale. Done here, the scaling
// is one multiply per element in every program: as XLA ops it could be
// fused into a consumer (the residual add) as an FMA in one program and not
// in another.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Row gather: out[..., n, :] = table[..., ids[..., n], :], the bits of any
// element type copied as they are (XLA:CPU gathers bfloat16 through a
// float32 or uint16 copy of the whole table). Ids out of range are clamped
// after negative ones are counted from the end, as jnp indexing does.
// Leading axes are equal in every operand (jax.vmap's broadcast_all).
// With `scales` (float32 [..., V], one per row of an int8 table): out is
// float32, table[..., i, e] * scales[..., i].
ffi::Error Gather(const ffi::AnyBuffer& table, const ffi::AnyBuffer& ids,
                  ffi::AnyBuffer& out, const ffi::AnyBuffer* scales) {
  const auto td = table.dimensions(), id = ids.dimensions(),
             od = out.dimensions();
  const int64_t rank = static_cast<int64_t>(td.size());
  const ffi::DataType want =
      scales == nullptr ? table.element_type() : ffi::DataType::F32;
  if (rank < 2 || static_cast<int64_t>(id.size()) != rank - 1 ||
      static_cast<int64_t>(od.size()) != rank ||
      ids.element_type() != ffi::DataType::S32 ||
      out.element_type() != want) {
    return ffi::Error::InvalidArgument(
        "gather_rows: table [..., V, E], int32 ids [..., N], out [..., N, E]");
  }
  if (scales != nullptr) {
    const auto sd = scales->dimensions();
    bool ok = table.element_type() == ffi::DataType::S8 &&
              scales->element_type() == ffi::DataType::F32 &&
              static_cast<int64_t>(sd.size()) == rank - 1;
    for (int64_t i = 0; ok && i < rank - 1; ++i) ok = sd[i] == td[i];
    if (!ok) {
      return ffi::Error::InvalidArgument(
          "gather_rows_q8: an int8 table [..., V, E], float32 scales [..., V]");
    }
  }
  int64_t lead = 1;
  for (int64_t i = 0; i < rank - 2; ++i) {
    if (id[i] != td[i] || od[i] != td[i]) {
      return ffi::Error::InvalidArgument(
          "gather_rows: leading axes must be equal");
    }
    lead *= td[i];
  }
  const int64_t V = td[rank - 2], E = td[rank - 1], N = id[rank - 2];
  if (od[rank - 2] != N || od[rank - 1] != E) {
    return ffi::Error::InvalidArgument("gather_rows: shape mismatch");
  }
  if (lead * N * E == 0) return ffi::Error::Success();
  if (V == 0) return ffi::Error::InvalidArgument("gather_rows: empty table");
  const int64_t row = E * static_cast<int64_t>(
      ffi::ByteWidth(table.element_type()));
  const char* src = static_cast<const char*>(table.untyped_data());
  const int32_t* idx = static_cast<const int32_t*>(ids.untyped_data());
  char* dst = static_cast<char*>(out.untyped_data());
  for (int64_t t = 0; t < lead; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      int64_t i = idx[t * N + n];
      if (i < 0) i += V;
      i = std::min(std::max<int64_t>(i, 0), V - 1);
      if (scales == nullptr) {
        std::memcpy(dst + (t * N + n) * row, src + (t * V + i) * row, row);
        continue;
      }
      const int8_t* q = reinterpret_cast<const int8_t*>(src) + (t * V + i) * E;
      const float s =
          static_cast<const float*>(scales->untyped_data())[t * V + i];
      float* o = reinterpret_cast<float*>(dst) + (t * N + n) * E;
      for (int64_t e = 0; e < E; ++e) o[e] = static_cast<float>(q[e]) * s;
    }
  }
  return ffi::Error::Success();
}

ffi::Error GatherRows(ffi::AnyBuffer table, ffi::AnyBuffer ids,
                      ffi::Result<ffi::AnyBuffer> out) {
  return Gather(table, ids, *out, nullptr);
}

ffi::Error GatherRowsQ8(ffi::AnyBuffer table, ffi::AnyBuffer scales,
                        ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> out) {
  return Gather(table, ids, *out, &scales);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedGatherRowsQ8, GatherRowsQ8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
