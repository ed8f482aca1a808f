// Finiteness of a row of floats, shared by the forward and decode kernels' NaN rule (an output
// row with a finite softmax denominator but a non-finite value is recomputed exactly, without
// the masked products; see flash_attn.cpp and flash_decode.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace mha_finite {

// Whether x[0, n) holds no NaN and no +-Inf (exponent bits all ones).
inline bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t c = 0; c < n; ++c) {
    uint32_t u;
    std::memcpy(&u, x + c, sizeof(u));
    bad |= uint32_t((u & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

}  // namespace mha_finite
