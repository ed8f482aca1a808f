// Small GEMMs on register tiles, for the kernels that multiply blocks already in cache (the
// fused backward's five products, the projections of mha.linear): C = (acc ? C : 0) + A B with
// A read through two strides (so a transposed operand is never copied) and B row-major, in
// fp32 (FMA) or on bf16 pairs (vdpbf16ps). Header-only; one copy per extension.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/constants.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "common/register_tiles.h"
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MHA_GEMM_BF16 1  // tile<R, NV, uint16_t>: bf16 operands
#endif

namespace mha_gemm {
namespace {

using mha_common::kLanes;
constexpr int kTileRows = 6;  // register tile: 6 rows x 64 columns = 24 zmm accumulators

// C[R][16 NV] = (acc ? C : 0) + sum_k A(r, k) B[k][16 NV], with A(r, k) = a[r sam + k sak]
// (broadcast one A element, load NV vectors of B per k), B row-major with row stride ldb.
// E = uint16_t (bf16 bits, vdpbf16ps): k runs over pairs, A(r, pair k) = a[r sam + 2 k] and
// a[r sam + 2 k + 1] (adjacent; sak unused), B pair-packed [K][ldb][2]: K counts pairs.
// Blocks (fp32, acc false): the K products of each C element summed in blocks of kDotBlock, as
// the flash forward's score tiles (register_tiles.h acc_dot_blocks); else one in-order sum.
template <int R, int NV, typename E, bool Blocks = false>
void tile(const E* a, int64_t sam, int64_t sak, const E* b, int64_t ldb, int64_t K, float* c,
          int64_t ldc, bool acc) {
#if defined(__AVX512F__)
  __m512 x[R][NV];
  if constexpr (std::is_same_v<E, float> && Blocks) {
    mha_tiles::acc_dot_blocks(x, K, c, ldc,
                              [&](__m512 (&y)[R][NV], int64_t k) __attribute__((always_inline)) {
                                __m512 bv[NV];
#pragma GCC unroll 4
                                for (int n = 0; n < NV; ++n)
                                  bv[n] = _mm512_loadu_ps(b + k * ldb + n * kLanes);
                                mha_tiles::acc_rank1(y, bv, a + k * sak, sam);
                              });
    mha_tiles::acc_store(x, c, ldc);
    return;
  }
  if (acc) {
    mha_tiles::acc_load(x, c, ldc);
  } else {
    mha_tiles::acc_zero(x);
  }
  if constexpr (std::is_same_v<E, float>) {
    for (int64_t k = 0; k < K; ++k) {
      __m512 bv[NV];
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) bv[n] = _mm512_loadu_ps(b + k * ldb + n * kLanes);
      mha_tiles::acc_rank1(x, bv, a + k * sak, sam);
    }
  } else {
#if defined(MHA_GEMM_BF16)
    for (int64_t k = 0; k < K; ++k) {
      __m512bh bv[NV];
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n)
        bv[n] = (__m512bh)_mm512_loadu_si512(b + (k * ldb + n * kLanes) * 2);
      mha_tiles::acc_rank2_bf16(x, bv, a + 2 * k, sam);
    }
#endif
  }
  mha_tiles::acc_store(x, c, ldc);
#else
  static_assert(std::is_same_v<E, float>, "bf16 tiles need AVX512_BF16");
  const int64_t block = Blocks ? mha_common::kDotBlock : std::max<int64_t>(K, 1);
  for (int r = 0; r < R; ++r) {
    float x[NV * kLanes];
    for (int n = 0; n < NV * kLanes; ++n) x[n] = acc ? c[r * ldc + n] : 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      float part[NV * kLanes] = {};  // this block's sums (the first block's: x itself)
      float* sum = k0 == 0 ? x : part;
      for (int64_t k = k0; k < std::min(K, k0 + block); ++k) {
        const float av = a[r * sam + k * sak];
        for (int n = 0; n < NV * kLanes; ++n) sum[n] += av * b[k * ldb + n];
      }
      if (k0 > 0)
        for (int n = 0; n < NV * kLanes; ++n) x[n] += part[n];
    }
    for (int n = 0; n < NV * kLanes; ++n) c[r * ldc + n] = x[n];
  }
#endif
}

template <typename E>
using TileFn = void (*)(const E*, int64_t, int64_t, const E*, int64_t, int64_t, float*, int64_t,
                        bool);

template <int R, typename E, bool Blocks>
constexpr TileFn<E> tile_for(int nv) {
  return nv == 4   ? &tile<R, 4, E, Blocks>
         : nv == 3 ? &tile<R, 3, E, Blocks>
         : nv == 2 ? &tile<R, 2, E, Blocks>
                   : &tile<R, 1, E, Blocks>;
}

template <typename E, bool Blocks>
TileFn<E> pick(int r, int nv) {
  switch (r) {
    case 6: return tile_for<6, E, Blocks>(nv);
    case 5: return tile_for<5, E, Blocks>(nv);
    case 4: return tile_for<4, E, Blocks>(nv);
    case 3: return tile_for<3, E, Blocks>(nv);
    case 2: return tile_for<2, E, Blocks>(nv);
    default: return tile_for<1, E, Blocks>(nv);
  }
}

template <typename E, bool Blocks>
void gemm_tiles(int64_t M, int64_t N, int64_t K, const E* a, int64_t sam, int64_t sak,
                const E* b, int64_t ldb, float* c, int64_t ldc, bool acc) {
  const int64_t bstep = std::is_same_v<E, float> ? 1 : 2;  // elements per B column
  for (int64_t n0 = 0; n0 < N; n0 += 4 * kLanes) {
    const int nv = int(std::min<int64_t>(4, (N - n0) / kLanes));
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int r = int(std::min<int64_t>(kTileRows, M - m0));
      pick<E, Blocks>(r, nv)(a + m0 * sam, sam, sak, b + n0 * bstep, ldb, K, c + m0 * ldc + n0,
                             ldc, acc);
    }
  }
}

// C[M][N] = (acc ? C : 0) + A(M x K) B[K][N]; N a multiple of 16 (buffers are padded). For bf16
// operands (E = uint16_t) K counts pairs and B is pair-packed (see tile).
template <typename E>
void gemm(int64_t M, int64_t N, int64_t K, const E* a, int64_t sam, int64_t sak, const E* b,
          int64_t ldb, float* c, int64_t ldc, bool acc) {
  gemm_tiles<E, false>(M, N, K, a, sam, sak, b, ldb, c, ldc, acc);
}

// Scores C[M][N] = A(M x K) B[K][N], K = d_k: fp32 products summed in blocks of kDotBlock, as
// the forward kernels sum them (so a recomputed S has the forward's bits); bf16 pairs (E =
// uint16_t) as gemm.
template <typename E>
void gemm_scores(int64_t M, int64_t N, int64_t K, const E* a, int64_t sam, int64_t sak,
                 const E* b, int64_t ldb, float* c, int64_t ldc) {
  gemm_tiles<E, std::is_same_v<E, float>>(M, N, K, a, sam, sak, b, ldb, c, ldc, false);
}

}  // namespace
}  // namespace mha_gemm
