// Intel AMX q.k for the decode kernel (flash_decode.cpp), bf16 only.
//
// Shape legend: G query rows of one K/V group (<= 16), d_k head dim (% 32 == 0, <= 128),
// n keys of one split, ld the stride of the caller's score rows.
//
// Defines MHA_DECODE_AMX when the tile kernels are compiled (amx/amx_tiles.h: a target with
// AMX, or software tiles under MHA_AMX_EMULATE); otherwise empty, and the kernel uses its
// AVX512_BF16 path.

#pragma once

#include "amx/amx_tiles.h"  // MHA_AMX_TILES

#if defined(__AVX512F__) && defined(MHA_AMX_TILES)
#define MHA_DECODE_AMX 1

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>

#include "common/kernel_choice.h"

namespace mha_decode_amx {

// Intel AMX computes q.k for 16 keys and all G <= 16 query rows of a group per tile product,
// reading K straight from the cache: K rows are the A operand (16 keys x 32 d, row stride
// kst), the query rows the B operand (16 d pairs x G, packed once per item), and C is
// (16 keys, G) fp32. Products of bf16 are exact in fp32 and accumulate in fp32, as with
// vdpbf16ps; NaN and Inf pass through the tile products into the scores like any other value
// (flash_decode.cpp's softmax and merge handle them, one rule for every q.k path). Tiles: 0-1 = C, 2-3 = A, 4..4+dk/32 = B (d_k % 32 == 0, d_k <= 128).
using mha_amx::TileConfig;

// Whether bf16 q.k runs on AMX: the OS grants the tile state and MHA_DECODE_BF16 is unset or
// `amx`; `avx512bf16` keeps q.k on vdpbf16ps (to test and measure that path on an AMX CPU).
// Read once per process; flash_decode.cpp's check_decode_bf16 refuses the values that cannot
// run here before any call gets this far.
inline bool amx_permitted() {
  static const bool ok = [] {
    const auto& env = mha_common::decode_bf16_override();
    return (!env || *env == "amx") && mha_amx::amx_permitted();
  }();
  return ok;
}

inline bool amx_fits(int64_t G, int64_t dk) { return G <= 16 && dk % 32 == 0 && dk <= 128; }

// Per thread, before its first item (the shapes depend on G only).
inline void amx_configure(int64_t G) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(4 * G);  // C
  for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;                            // A
  for (int t = 4; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(4 * G);  // B
  mha_amx::load_tile_config(c);
}

// qpack [dk/32][16][G] pairs: qpack[kc][i][r] = (q_r[32 kc + 2 i], q_r[32 kc + 2 i + 1]).
inline void amx_pack_q(const c10::BFloat16* q, int64_t G, int64_t dk, uint32_t* qpack) {
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);  // (G, dk / 2) pairs
  for (int64_t kc = 0; kc < dk / 32; ++kc)
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t r = 0; r < G; ++r) qpack[(kc * 16 + i) * G + r] = q32[r * (dk / 2) + kc * 16 + i];
}

// C tile 0 or 1 (16 keys, G) -> scores[r * ld + j + t] for r < G, t < 16.
inline void amx_store_scores(int tile, int64_t G, float* scores, int64_t ld, int64_t j,
                             float* tmp) {
  if (G == 1) {  // C is 16 contiguous scores
    if (tile == 0) _tile_stored(0, scores + j, 4); else _tile_stored(1, scores + j, 4);
    return;
  }
  if (tile == 0) _tile_stored(0, tmp, 4 * G); else _tile_stored(1, tmp, 4 * G);
  // (16 keys, G) -> the (G, ld) score rows: one 16-lane gather (stride G) per row
  const __m512i at = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int>(G)));
  for (int64_t r = 0; r < G; ++r)
    _mm512_storeu_ps(scores + r * ld + j, _mm512_i32gather_ps(at, tmp + r, 4));
}

// scores[r * ld + t] = (q_r . k_t) * scale for the first 32 * floor(n / 32) keys; returns
// how many keys it did (the rest go to qk_vec). Two 16-key blocks per step, in tiles 0 and 1,
// so that two chains of tile products overlap. tmp: 16 * G floats.
inline int64_t qk_amx(const c10::BFloat16* q, int64_t G, int64_t dk, const c10::BFloat16* k,
                      int64_t kst, int64_t n, float scale, float* scores, int64_t ld,
                      uint32_t* qpack, float* tmp) {
  const int64_t nkc = dk / 32, full = n / 32 * 32;
  if (full == 0) return 0;
  amx_pack_q(q, G, dk, qpack);
  _tile_loadd(4, qpack, 4 * G);  // B tiles stay loaded for the whole item
  if (nkc > 1) _tile_loadd(5, qpack + 16 * G, 4 * G);
  if (nkc > 2) _tile_loadd(6, qpack + 32 * G, 4 * G);
  if (nkc > 3) _tile_loadd(7, qpack + 48 * G, 4 * G);
  const int64_t stride = kst * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t j = 0; j < full; j += 32) {
    const c10::BFloat16* k0 = k + j * kst;
    const c10::BFloat16* k1 = k0 + 16 * kst;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, k0, stride);
    _tile_loadd(3, k1, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
    if (nkc > 1) {
      _tile_loadd(2, k0 + 32, stride);
      _tile_loadd(3, k1 + 32, stride);
      _tile_dpbf16ps(0, 2, 5);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (nkc > 2) {
      _tile_loadd(2, k0 + 64, stride);
      _tile_loadd(3, k1 + 64, stride);
      _tile_dpbf16ps(0, 2, 6);
      _tile_dpbf16ps(1, 3, 6);
    }
    if (nkc > 3) {
      _tile_loadd(2, k0 + 96, stride);
      _tile_loadd(3, k1 + 96, stride);
      _tile_dpbf16ps(0, 2, 7);
      _tile_dpbf16ps(1, 3, 7);
    }
    amx_store_scores(0, G, scores, ld, j, tmp);
    amx_store_scores(1, G, scores, ld, j + 16, tmp);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < G; ++r)
    for (int64_t j = 0; j < full; j += 16) {
      float* s = scores + r * ld + j;
      _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_loadu_ps(s), vscale));
    }
  return full;
}

}  // namespace mha_decode_amx

#endif  // AMX
