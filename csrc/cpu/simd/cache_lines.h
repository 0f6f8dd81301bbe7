// Tables the kernels read one row per element from start on a cache line, so that a row never straddles two: a
// per-token patch (128 bytes) then takes two lines, not three, and a 32-byte cell row one. std::vector's own storage
// is only 16-byte aligned (a large block from malloc begins 16 bytes into its page).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace bandpo {

constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine})); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{kCacheLine}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

// A float table whose first element starts a cache line.
using LineAlignedFloats = std::vector<float, CacheLineAllocator<float>>;

}  // namespace bandpo
