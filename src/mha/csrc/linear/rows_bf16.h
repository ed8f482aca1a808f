// A block of rows through a packed weight on the bf16 tiles: out (R, N) = bf16(A W^T + bias),
// W packed by panels.h. Used by the fused self-attention forward (self_attention.cpp) and timed
// alone by benchmarks/probes/bf16_gemm_micro.cpp.
//
// Shape legend: R rows of A (bf16, pairs along K: A(r, pair k) at a[r lda + 2 k]), K2 = K / 2,
// N output columns, P = ceil(N / 64) panels of W^T, each (K2, 64, 2).
//
// Each 6-row x 64-column tile sums its whole K in registers (24 zmm accumulators started from
// the bias) and rounds once into the output: no fp32 block is stored and reloaded between K
// chunks. Measured against the chunked form (an fp32 (R, 64) block, K in chunks of 128 pairs,
// as mha::linear_bf16): 508 vs 498 GFLOP/s at R = 80, N = 1536, K = 512, 1 thread
// (bf16_gemm_micro.cpp). The panel (64 KB at K = 512) then streams from L2 for each tile.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common/constants.h"
#include "common/register_tiles.h"
#include "linear/panels.h"

namespace mha_rows_bf16 {
namespace {

using mha_common::kLanes;
using mha_panels::kPanel;

constexpr int kTileRows = 6;

// out[r][0, cols) for R rows = bf16(bias + sum_k A(r, k) panel[k]); bias (64,) fp32 or null.
template <int R>
void tile(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t K2, const float* bias,
          uint16_t* out, int64_t ldo, int64_t cols) {
  __m512 x[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      x[r][v] = bias ? _mm512_loadu_ps(bias + v * kLanes) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(panel + (k * kPanel + v * kLanes) * 2);
    mha_tiles::acc_rank2_bf16(x, bv, a + 2 * k, lda);
  }
  for (int r = 0; r < R; ++r)  // one rounding per output
    for (int v = 0; v < 4 && v * kLanes < cols; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + v * kLanes),
                          mha_tiles::to_bf16(x[r][v]));
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                        uint16_t*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr,  &tile<1>, &tile<2>, &tile<3>,
                                          &tile<4>, &tile<5>, &tile<6>};

// out (R, N, bf16, row stride ldo) = bf16(A (R, 2 K2) W^T + bias) from W's packed panels
// wp (P, K2, 64, 2); bias fp32 (P 64,) zero-padded, or null. N % 16 == 0.
inline void project(int64_t R, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                    const uint16_t* wp, const float* bias, uint16_t* out, int64_t ldo) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    const uint16_t* panel = wp + p * K2 * kPanel * 2;
    for (int64_t m0 = 0; m0 < R; m0 += kTileRows)
      kTiles[std::min<int64_t>(kTileRows, R - m0)](a + m0 * lda, lda, panel, K2,
                                                   bias ? bias + n0 : nullptr,
                                                   out + m0 * ldo + n0, ldo, cols);
  }
}

}  // namespace
}  // namespace mha_rows_bf16

#endif  // __AVX512F__ && __AVX512BF16__
