// Register tiles shared by the AVX-512 kernels (flash forward, small path, fused backward):
// an accumulator acc[R][NV] of R rows by NV 16-lane fp32 columns, and what every tile kernel
// does to it — zero it, load it (alpha-scaled), add one rank-1 update, store it — plus the
// fp32 -> bf16 rounding of outputs. Header-only, always inlined; include after <immintrin.h>.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

#include "common/constants.h"

namespace mha_tiles {

using mha_common::kLanes;

#define MHA_TILE_INLINE __attribute__((always_inline)) inline

// In place: rows r[0..15] of a 16 x 16 block of 32-bit words become its columns (64 shuffles;
// fp32 here, bf16 pairs or any words in linear/panels.h).
MHA_TILE_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // interleave row pairs: 2 x 2 blocks
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 4 x 4 blocks within each 128-bit lane
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // u[4 i + k], lane L (128-bit): column 4 L + k of rows 4 i .. 4 i + 3.
  for (int k = 0; k < 4; ++k) {  // gather the 128-bit lanes: first rows 0-7, then 8-15
    const __m512 a0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);       // lanes 0, 2 | 0, 2
    const __m512 a1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);       // lanes 1, 3 | 1, 3
    const __m512 b0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 b1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(a0, b0, 0x88);       // lane 0: column k
    r[8 + k] = _mm512_shuffle_f32x4(a0, b0, 0xDD);   // lane 2: column 8 + k
    r[4 + k] = _mm512_shuffle_f32x4(a1, b1, 0x88);   // lane 1: column 4 + k
    r[12 + k] = _mm512_shuffle_f32x4(a1, b1, 0xDD);  // lane 3: column 12 + k
  }
}

template <int R, int NV>
MHA_TILE_INLINE void acc_zero(__m512 (&acc)[R][NV]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
}

template <int R, int NV>
MHA_TILE_INLINE void acc_load(__m512 (&acc)[R][NV], const float* o, int64_t ld) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(o + r * ld + v * kLanes);
}

// acc[r] = alpha[r] * o[r * ld + ...] (the running output, rescaled by the online softmax).
template <int R, int NV>
MHA_TILE_INLINE void acc_load_scaled(__m512 (&acc)[R][NV], const float* o, int64_t ld,
                                     const float* alpha) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ld + v * kLanes), a);
  }
}

template <int R, int NV>
MHA_TILE_INLINE void acc_store(const __m512 (&acc)[R][NV], float* o, int64_t ld) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + r * ld + v * kLanes, acc[r][v]);
}

// acc[r][v] += o[r * ld + 16 v ...]: partial sums held in memory added to the tile's.
template <int R, int NV>
MHA_TILE_INLINE void acc_add_stored(__m512 (&acc)[R][NV], const float* o, int64_t ld) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm512_add_ps(_mm512_loadu_ps(o + r * ld + v * kLanes), acc[r][v]);
}

// acc = the sum over k in [0, K) of the updates step(acc, k), in blocks of kDotBlock k's: the
// first block sums into the zeroed tile (with K <= kDotBlock: the whole sum, a plain loop);
// each later one parks the tile's sums in spill (R rows of ld floats, the tile's own output),
// sums into the zeroed tile and adds the parked sums back.
template <int R, int NV, class Step>
MHA_TILE_INLINE void acc_dot_blocks(__m512 (&acc)[R][NV], int64_t K, float* spill, int64_t ld,
                                    const Step& step) {
  constexpr int64_t kB = mha_common::kDotBlock;
  acc_zero(acc);
  const int64_t first = K < kB ? K : kB;
  for (int64_t k = 0; k < first; ++k) step(acc, k);
  for (int64_t k0 = kB; k0 < K; k0 += kB) {
    const int64_t k1 = K - k0 < kB ? K : k0 + kB;
    acc_store(acc, spill, ld);
    acc_zero(acc);
    for (int64_t k = k0; k < k1; ++k) step(acc, k);
    acc_add_stored(acc, spill, ld);
  }
}

// One rank-1 update: acc[r][v] += a[r * stride] * b[v] (a column of scalars times a row).
template <int R, int NV>
MHA_TILE_INLINE void acc_rank1(__m512 (&acc)[R][NV], const __m512 (&b)[NV], const float* a,
                               int64_t stride) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(a[r * stride]);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(s, b[v], acc[r][v]);
  }
}

#if defined(__AVX512BF16__)
// One rank-2 update on bf16 pairs (vdpbf16ps): acc[r][v] += a_r . b[v], where a_r is the pair of
// adjacent bf16 at a + r * stride, broadcast to every lane, and b[v] holds 16 pairs.
template <int R, int NV>
MHA_TILE_INLINE void acc_rank2_bf16(__m512 (&acc)[R][NV], const __m512bh (&b)[NV],
                                    const uint16_t* a, int64_t stride) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    __builtin_memcpy(&pair, a + r * stride, sizeof(pair));
    const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, b[v]);
  }
}
#endif

// 16 fp32 -> 16 bf16 bits, rounded to nearest even as at::BFloat16 does (NaN stays NaN).
MHA_TILE_INLINE __m256i to_bf16(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

}  // namespace mha_tiles

#endif  // __AVX512F__
