// Reading tensors from the kernels: element strides and widening an element to float.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace mha_common {

// The first n strides of t (in elements) into s; with zero_broadcast, a size-1 dimension gets
// stride 0 (a broadcast mask).
inline void fill_strides(const at::Tensor& t, int64_t* s, int n, bool zero_broadcast) {
  for (int d = 0; d < n; ++d) s[d] = (zero_broadcast && t.size(d) == 1) ? 0 : t.stride(d);
}

// One element as float (bf16 widens exactly).
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// Asks the cache for the n elements of a row, elements `stride` apart (read soon). Where a
// loop reads rows of several tensors a few hundred bytes each, the hardware prefetchers do not
// keep up (the flash backward's row packing: docs/kernel.md, "Where the time goes").
template <typename T>
inline void prefetch_row(const T* row, int64_t n, int64_t stride) {
  const char* c = reinterpret_cast<const char*>(row);
  const int64_t bytes = ((n - 1) * stride + 1) * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

}  // namespace mha_common
