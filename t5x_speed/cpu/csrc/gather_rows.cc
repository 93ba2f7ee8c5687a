// Row gather for XLA:CPU behind jax.ffi: t5x_speed_gather_rows copies
// embedding rows as they are stored.

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
ffi::Error GatherRows(ffi::AnyBuffer table, ffi::AnyBuffer ids,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto td = table.dimensions(), id = ids.dimensions(),
             od = out->dimensions();
  const int64_t rank = static_cast<int64_t>(td.size());
  if (rank < 2 || static_cast<int64_t>(id.size()) != rank - 1 ||
      static_cast<int64_t>(od.size()) != rank ||
      ids.element_type() != ffi::DataType::S32 ||
      out->element_type() != table.element_type()) {
    return ffi::Error::InvalidArgument(
        "gather_rows: table [..., V, E], int32 ids [..., N], out [..., N, E]");
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
  char* dst = static_cast<char*>(out->untyped_data());
  for (int64_t t = 0; t < lead; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      int64_t i = idx[t * N + n];
      if (i < 0) i += V;
      i = std::min(std::max<int64_t>(i, 0), V - 1);
      std::memcpy(dst + (t * N + n) * row, src + (t * V + i) * row, row);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(T5xSpeedGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
