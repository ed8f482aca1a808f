// Packing a weight into the column panels the register tiles read (csrc/linear): shared by the
// projections (linear.cpp) and the fused self-attention forward (self_attention.cpp).
//
// Shape legend: W (N, K) in nn.Linear layout, rows sn elements apart; K2 = K / 2 bf16 pairs;
// a panel is 64 output columns of W^T: fp32 (K, 64), element k of column j at [k][j]; bf16
// (K2, 64, 2), pair k2 of column j at [k2][j].
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "common/register_tiles.h"

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

#if defined(__AVX512F__)
// The same for a 16 x 16 block of 32-bit words: 16 rows of 64 bytes (whole cache lines) in,
// 16 out, through mha_tiles::transpose16 (64 shuffles; transpose8: 96 per 1 KB, half lines).
// Measured by benchmarks/probes/pack_micro.cpp (docs/module.md, "Where the fused call's time
// goes").
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  mha_tiles::transpose16(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_ps(dst + c * ldd, r[c]);
}
#endif

#if defined(__AVX512F__)
// out[k][j] = src[j lds + k] for j < cols (cols % 16 == 0) and k < K16 = K rounded down to 16,
// 32-bit words, out's rows 64 words apart; returns K16. By 16 x 16 blocks, 16 rows of src at a
// time, each read along K with the line 4 ahead prefetched (rows 1 KB apart: 16 streams).
inline int64_t pack_words16(const float* src, int64_t lds, int64_t cols, int64_t K, float* out) {
  const int64_t k16 = K / 16 * 16;
  for (int64_t j = 0; j < cols; j += 16)
    for (int64_t k = 0; k < k16; k += 16) {
      if (k + 64 < k16)
        for (int i = 0; i < 16; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(src + (j + i) * lds + k + 64), _MM_HINT_T0);
      transpose16(src + j * lds + k, lds, out + k * kPanel + j, kPanel);
    }
  return k16;
}
#endif

// dst (K, 64) = panel p of W^T in fp32, zero past N: dst[k][j] = W(64 p + j, k) with W(n, k) =
// w[n sn + k sk]. A contiguous last dim (sk == 1) moves 16 x 16 (pack_words16) or 8 x 8 blocks
// through registers, anything else goes element by element.
inline void pack_panel_f32(const float* w, int64_t N, int64_t K, int64_t sn, int64_t sk,
                           int64_t p, float* dst) {
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
  int64_t kd = 0;  // k below kd: done by pack_words16
#if defined(__AVX512F__)
  if (sk == 1 && cols % 16 == 0) kd = pack_words16(w + n0 * sn, sn, cols, K, dst);
#endif
  for (int64_t k0 = kd; k0 < K; k0 += kPanel) {  // in 64-wide K blocks
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
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = cols; j < kPanel; ++j) dst[k * kPanel + j] = 0.f;
}

// dst (K2, 64, 2) = panel p of W^T as bf16 pairs, zero past N: dst[k2][j][e] = W(64 p + j,
// 2 k2 + e) with W(n, k) = w[n sn + k]. A pair is 32 bits, so this is the fp32 packing of
// the (N, K2) matrix of pairs (register transposes of bits, never computed on).
inline void pack_panel_bf16(const uint16_t* w, int64_t N, int64_t K2, int64_t sn, int64_t p,
                            uint16_t* dst) {
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w + n0 * sn);  // pairs, row sn / 2
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  int64_t k = 0;
#if defined(__AVX512F__)
  if (cols % 16 == 0)
    k = pack_words16(reinterpret_cast<const float*>(src), sn / 2, cols, K2,
                     reinterpret_cast<float*>(out));
#endif
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
