// Tables the kernels read one row per element from start on a cache line, so that a row never straddles two: a
// per-token patch (128 bytes) then takes two lines, not three, and a 32-byte cell row one. std::vector's own storage
// is only 16-byte aligned (a large block from malloc begins 16 bytes into its page).
//
// A table of 1 MB or more (the per-token patches: 12.8 MB; the t-cubic table: 1.6 MB; each read at random, one run per
// element) is also laid on 2 MB pages where the OS gives them on request (Linux transparent huge pages, whose common
// default mode, "madvise", gives them only to memory advised so): on 4 KB pages most such reads also missed the TLB.
// Measured on an AMD Zen 1 with the per-token kernel alone (p log-uniform, N = 2^22, 1 thread): δ log-uniform over the
// table's range 13.3 -> 10.3 ns per element, δ in [0.01, 0.1] 9.0 -> 8.7. A table that nearly fills the L2 cache (the
// t-cubic table in an AMD Zen 4's 2 MB) also needs the physical contiguity: on 4 KB pages where the OS puts each page
// decides which L2 sets its lines share, and the per-token kernel's time varied by 40% between processes (3.8 to 5.3 ns
// per element).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace bandpo {

constexpr std::size_t kCacheLine = 64;
constexpr std::size_t kHugePage = std::size_t{1} << 21;
constexpr std::size_t kHugeFrom = kHugePage / 2;  // at most half a page's worth rounded up

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding
  // A large table takes whole 2 MB pages: its size rounded up, from a 2 MB boundary.
  static bool huge(std::size_t n) { return n * sizeof(T) >= kHugeFrom; }
  T* allocate(std::size_t n) {
    if (!huge(n)) return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine}));
    const std::size_t bytes = (n * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
    void* p = ::operator new(bytes, std::align_val_t{kHugePage});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, bytes, MADV_HUGEPAGE);  // advice only: where it is refused, the table stays on small pages
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    ::operator delete(p, std::align_val_t{huge(n) ? kHugePage : kCacheLine});
  }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

// A float table whose first element starts a cache line (and, from 2 MB, a huge page).
using LineAlignedFloats = std::vector<float, CacheLineAllocator<float>>;

}  // namespace bandpo
