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

}  // namespace mha_common
