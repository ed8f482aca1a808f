// A block of rows through a packed weight on the register tiles: out (R, N) = A W^T + bias, W
// packed by panels.h, in fp32 (E = float: FMA, fp32 panels (P, K, 64)) or bf16 (E = uint16_t:
// vdpbf16ps on pairs, panels (P, K / 2, 64, 2), each output rounded to bf16 once). Used by the
// fused self-attention forward (self_attention.cpp) and timed alone by
// benchmarks/probes/bf16_gemm_micro.cpp (bf16) and f32_rows_micro.cpp (fp32).
//
// Shape legend: R rows of A (row stride lda; bf16: pairs along K, A(r, pair k) at a[r lda + 2 k]),
// K the reduction length (bf16: K2 = K / 2 pairs), N output columns, P = ceil(N / 64) panels.
//
// Each 6-row x 64-column tile sums its whole K in registers (24 zmm accumulators started from
// the bias) and stores (bf16: rounds) once into the output: no fp32 block is stored and
// reloaded between K chunks. Measured in bf16 against the chunked form (an fp32 (R, 64) block,
// K in chunks of 128 pairs, as mha::linear_bf16): 508 vs 498 GFLOP/s at R = 80, N = 1536,
// K = 512, 1 thread (bf16_gemm_micro.cpp); in fp32 241-254 vs 218-232 GFLOP/s on the same
// shape (f32_rows_micro.cpp). The panel (64 KB bf16, 128 KB fp32 at K = 512) then streams from
// L2 for each tile.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/constants.h"
#include "common/register_tiles.h"
#include "linear/panels.h"

namespace mha_rows {
namespace {

using mha_common::kLanes;
using mha_panels::kPanel;

constexpr int kTileRows = 6;

// Elements of E per step of K in a panel row (bf16: one pair per column).
template <typename E>
constexpr int64_t kStep = std::is_same_v<E, float> ? 1 : 2;

// out[r][0, cols) for R rows = bias + sum_k A(r, k) panel[k] (bf16: rounded once); bias (64,)
// fp32 or null. K: steps of the reduction (bf16: pairs). The stores are unrolled (a branch per
// 16 columns): a loop bounded by cols made the compiler keep all 24 accumulators in a stack
// array (stored after the K loop, reloaded to round and store).
template <int R, typename E>
void tile(const E* a, int64_t lda, const E* panel, int64_t K, const float* bias, E* out,
          int64_t ldo, int64_t cols) {
  __m512 x[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      x[r][v] = bias ? _mm512_loadu_ps(bias + v * kLanes) : _mm512_setzero_ps();
  if constexpr (std::is_same_v<E, float>) {
    for (int64_t k = 0; k < K; ++k) {
      __m512 bv[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) bv[v] = _mm512_loadu_ps(panel + k * kPanel + v * kLanes);
      mha_tiles::acc_rank1(x, bv, a + k, lda);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v)
        if (v * kLanes < cols) _mm512_storeu_ps(out + r * ldo + v * kLanes, x[r][v]);
  } else {
#if defined(__AVX512BF16__)
    for (int64_t k = 0; k < K; ++k) {
      __m512bh bv[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v)
        bv[v] = (__m512bh)_mm512_loadu_si512(panel + (k * kPanel + v * kLanes) * 2);
      mha_tiles::acc_rank2_bf16(x, bv, a + 2 * k, lda);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)  // one rounding per output
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v)
        if (v * kLanes < cols)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + v * kLanes),
                              mha_tiles::to_bf16(x[r][v]));
#else
    static_assert(std::is_same_v<E, float>, "bf16 rows need AVX512_BF16");
#endif
  }
}

template <typename E>
using TileFn = void (*)(const E*, int64_t, const E*, int64_t, const float*, E*, int64_t,
                        int64_t);
template <typename E>
constexpr TileFn<E> kTiles[kTileRows + 1] = {nullptr,        &tile<1, E>, &tile<2, E>,
                                             &tile<3, E>,    &tile<4, E>, &tile<5, E>,
                                             &tile<6, E>};

// out (R, N, row stride ldo) = A (R, K) W^T + bias (bf16: rounded once) from W's packed panels
// wp (P, K, 64) fp32 or (P, K2, 64, 2) bf16, K counting steps (bf16: pairs); bias fp32
// (P 64,) zero-padded, or null. N % 16 == 0.
//
// The R rows are split evenly over the fewest tiles of at most 6 rows (80 rows: ten of 6 and
// four of 5, not thirteen of 6 and one of 2): a 2-row tile has 8 accumulator chains, too few
// to cover vdpbf16ps's / FMA's latency, and took as long as half a 6-row tile for a third of its
// work. Each output is the same sum either way (same bias, same K order): the same bits.
template <typename E>
void project(int64_t R, int64_t N, int64_t K, const E* a, int64_t lda, const E* wp,
             const float* bias, E* out, int64_t ldo) {
  if (R <= 0) return;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t tiles = (R + kTileRows - 1) / kTileRows;
  const int64_t base = R / tiles, extra = R % tiles;  // the first `extra` tiles: base + 1 rows
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    const E* panel = wp + p * K * kPanel * kStep<E>;
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      kTiles<E>[rows](a + m0 * lda, lda, panel, K, bias ? bias + n0 : nullptr,
                      out + m0 * ldo + n0, ldo, cols);
      m0 += rows;
    }
  }
}

}  // namespace
}  // namespace mha_rows

#endif  // __AVX512F__
