// Transparent huge pages for a large output that is about to be written for the first time.
// A fresh 32 MB at::empty (above glibc's largest mmap threshold, so every call maps new pages)
// takes 8192 page faults of 4 KB when the kernel first writes it: allocating and filling
// (4, 2048, 16, 64) fp32 took ~12 ms against ~2.4 ms with MADV_HUGEPAGE (one thread,
// epyc-zen5-avx512, THP in "madvise" mode), ~6 % of a 4x16x2048x64 causal forward. Header-only.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mha_common {

constexpr size_t kHugePage = size_t(1) << 21;  // 2 MiB, x86-64's transparent huge page

// glibc serves smaller blocks from its heap once its mmap threshold has grown past them (up to
// 32 MiB on 64-bit): those pages are already faulted in, and advising them would only invite
// khugepaged to collapse them.
constexpr size_t kFreshMapBytes = size_t(32) << 20;

// Asks for huge pages on the whole 2 MiB pages inside [p, p + bytes) when the block is large
// enough to be a fresh mapping (a hint: where THP is off, nothing changes).
inline void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kFreshMapBytes) return;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace mha_common
