// Packing a weight into the column panels the register tiles read (csrc/linear): shared by the
// projections (linear.cpp) and the fused self-attention forward (self_attention.cpp).
//
// Shape legend: W (N, K) in nn.Linear layout, rows sn elements apart; K2 = K / 2 bf16 pairs;
// a panel is 64 output columns of W^T: fp32 (K, 64), element k of column j at [k][j]; bf16
// (K2, 64, 2), pair k2 of column j at [k2][j].
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mha_panels {
namespace {

constexpr int64_t kPanel = 64;  // output columns per packed panel

#if defined(__AVX2__)
// dst[i * ldd + j] = src[j * lds + i] for an 8 x 8 block: rows of src become columns of dst.
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {  // interleave row pairs: 2 x 2 blocks
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // 4 x 4 blocks within each 128-bit lane
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // the 128-bit halves: columns i (low) and 4 + i (high)
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
    _mm256_storeu_ps(dst + (4 + i) * ldd, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
  }
}
#endif

// dst (K, 64) = panel p of W^T in fp32, zero past N: dst[k][j] = W(64 p + j, k) with W(n, k) =
// w[n sn + k sk]. In 64-wide K blocks; a contiguous last dim (sk == 1) moves 8 x 8 blocks
// through registers, anything else goes element by element.
inline void pack_panel_f32(const float* w, int64_t N, int64_t K, int64_t sn, int64_t sk,
                           int64_t p, float* dst) {
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
  for (int64_t k0 = 0; k0 < K; k0 += kPanel) {
    const int64_t k1 = std::min(K, k0 + kPanel);
    int64_t kv = k0;  // k below kv: done by 8 x 8 blocks
#if defined(__AVX2__)
    if (sk == 1 && cols % 8 == 0) {
      for (; kv + 8 <= k1; kv += 8)
        for (int64_t j = 0; j < cols; j += 8)
          transpose8(w + (n0 + j) * sn + kv, sn, dst + kv * kPanel + j, kPanel);
    }
#endif
    for (int64_t k = kv; k < k1; ++k)
      for (int64_t j = 0; j < cols; ++j) dst[k * kPanel + j] = w[(n0 + j) * sn + k * sk];
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t j = cols; j < kPanel; ++j) dst[k * kPanel + j] = 0.f;
  }
}

// dst (K2, 64, 2) = panel p of W^T as bf16 pairs, zero past N: dst[k2][j][e] = W(64 p + j,
// 2 k2 + e) with W(n, k) = w[n sn + k]. A pair is 32 bits, so this is the fp32 packing of
// the (N, K2) matrix of pairs (8 x 8 register transposes of bits, never computed on).
inline void pack_panel_bf16(const uint16_t* w, int64_t N, int64_t K2, int64_t sn, int64_t p,
                            uint16_t* dst) {
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w + n0 * sn);  // pairs, row sn / 2
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  int64_t k = 0;
#if defined(__AVX2__)
  if (cols % 8 == 0)
    for (; k + 8 <= K2; k += 8)
      for (int64_t j = 0; j < cols; j += 8)
        transpose8(reinterpret_cast<const float*>(src + j * (sn / 2) + k), sn / 2,
                   reinterpret_cast<float*>(out + k * kPanel + j), kPanel);
#endif
  for (; k < K2; ++k)
    for (int64_t j = 0; j < cols; ++j) out[k * kPanel + j] = src[j * (sn / 2) + k];
  for (k = 0; k < K2; ++k)
    for (int64_t j = cols; j < kPanel; ++j) out[k * kPanel + j] = 0;
}

}  // namespace
}  // namespace mha_panels
