// Sixteen fp32 lanes (one 512-bit vector): the mask of the first n, and up to 16 elements of a
// row widened to fp32. Shared by the forward's and the backward's small-problem paths and the
// tile drivers.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "common/constants.h"
#include "common/tensor_access.h"

namespace mha_lanes {

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 lanes_below(int64_t n) {
  return n >= mha_common::kLanes ? __mmask16(0xFFFF)
                                 : (n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1));
}

// Up to 16 elements [c0, c0 + n) of a row as fp32 (zeros past n); stride: the last dim's.
template <typename T>
inline __m512 load_row16(const T* row, int64_t stride, int64_t c0, int64_t n) {
  const __mmask16 m = lanes_below(n);
  if (stride == 1) {
    if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(m, row + c0);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    else {
      const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(row + c0));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#endif
  }
  alignas(64) float tmp[mha_common::kLanes] = {};
  for (int64_t l = 0; l < n; ++l) tmp[l] = mha_common::widen(row[(c0 + l) * stride]);
  return _mm512_load_ps(tmp);
}

}  // namespace mha_lanes
#endif  // __AVX512F__
