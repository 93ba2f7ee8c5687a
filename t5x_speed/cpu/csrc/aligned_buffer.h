// Scratch buffers aligned to a cache line.
//
// The kernels load whole vectors from their own buffers (the rows of x, the
// running sums, a row of logits). XLA's buffers start on a cache line; a
// std::vector's storage need not, and then most 64-byte vector loads and
// stores straddle two lines and cost two accesses each.

#ifndef T5X_SPEED_CSRC_ALIGNED_BUFFER_H_
#define T5X_SPEED_CSRC_ALIGNED_BUFFER_H_

#include <cstddef>
#include <new>
#include <vector>

namespace t5x_speed_kernels {

constexpr std::size_t kCacheLine = 64;

template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT
  T* allocate(std::size_t n) {
    return static_cast<T*>(
        ::operator new(n * sizeof(T), std::align_val_t(kCacheLine)));
  }
  void deallocate(T* p, std::size_t) {
    ::operator delete(p, std::align_val_t(kCacheLine));
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_ALIGNED_BUFFER_H_
