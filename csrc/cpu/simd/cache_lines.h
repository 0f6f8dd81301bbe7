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
#include <cstdint>
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
    const std::size_t bytes = huge_bytes(n);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Fresh pages of a mapping of its own, advised before their first touch: the allocator's aligned blocks may be
    // heap memory already faulted in on 4 KB pages, which the advice does not convert (half the processes got no
    // 2 MB page for the t-cubic table that way, on an AMD Zen 4 with the "madvise" mode).
    void* const m = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    // the mapping trimmed to [aligned, aligned + bytes): head bytes before it, kHugePage - head after it
    const auto start = reinterpret_cast<std::uintptr_t>(m);
    const std::uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    const std::size_t head = aligned - start;
    if (head > 0) munmap(m, head);
    munmap(reinterpret_cast<void*>(aligned + bytes), kHugePage - head);
    madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // advice only: refused, the pages stay small
    return reinterpret_cast<T*>(aligned);
#else
    return static_cast<T*>(::operator new(bytes, std::align_val_t{kHugePage}));
#endif
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (!huge(n)) return ::operator delete(p, std::align_val_t{kCacheLine});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    munmap(p, huge_bytes(n));
#else
    ::operator delete(p, std::align_val_t{kHugePage});
#endif
  }
  // whole 2 MB pages
  static std::size_t huge_bytes(std::size_t n) { return (n * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage; }
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
