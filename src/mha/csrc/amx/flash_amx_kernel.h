// The flash forward's AMX tile kernel AmxBf16 (the kernel interface of flash_attn_kernels.h),
// compiled where the tile kernels are (amx/amx_tiles.h: a target with AMX-TILE and AMX-BF16, or
// software tiles under MHA_AMX_EMULATE); then MHA_FLASH_AMX is defined.
#pragma once

#include "amx/amx_tiles.h"
#include "flash/flash_attn_kernels.h"

namespace mha_flash {

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__) && \
    defined(MHA_AMX_TILES)
#define MHA_FLASH_AMX 1
// Intel AMX: the tile unit does Q K^T and P V (tdpbf16ps, 16 x 16 fp32 tiles from 16 x 32 bf16
// operands in the same pair layouts as Avx512Bf16); packing is Avx512Bf16's, the softmax its own
// (softmax_lazy). Tiles, d_k and d_v <= 64: 0 (S, then P), 1 (K, then V), 2-3 (Q, resident),
// 4-7 (O, resident); d_v <= 64 < d_k: Q K^T 0-1 (S), 2 (Q), 3 (K), P V 0 (P), 1 (V), 4-7 (O,
// resident); wider d_v, two groups at a time: Q K^T 0-1 (S), 2 (K), 3-4 (Q), then P V 0-1 (P),
// 2-3 (V), 4-7 (32 columns of both groups' O); a group left over: Q K^T 0-1 (S), 2 (Q), 3 (K),
// P V 0-3 (O), 4 (P), 5-6 (V).
using mha_amx::amx_permitted;

// Tile T (a literal: GCC's tile intrinsics paste it into the instruction) to memory (Store) or
// from it, rows of ld floats.
#define MHA_TILE_MOVE(Store, T, p, ld)  \
  do {                                 \
    if constexpr (Store)               \
      _tile_stored(T, p, (ld) * 4);    \
    else                               \
      _tile_loadd(T, p, (ld) * 4);     \
  } while (0)
using mha_amx::TileConfig;

struct AmxBf16 : Avx512Bf16 {
  static constexpr const char* kName = "amx";
  static constexpr bool kAmx = true;
  static constexpr int kDkAlign = 32, kKeyAlign = 32;

  static void configure() {  // per thread, at the start of each parallel region
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    mha_amx::load_tile_config(c);
  }
  static void release() { _tile_release(); }

  // The O-resident layout (d_v <= 64): O of one 16-row group lives in tiles 4..4+NC-1 across
  // all key blocks; Q K^T uses tiles 0-1 (S), 2 (Q) and 3 (K), P V uses 0 (P) and 1 (V), so no
  // O tile is loaded or stored per key block (a tile store costs about a product here).
  // S[i][16 c] for 16-key chunks c < nchunks of one group: q rows of dkp bf16, kt
  // [dkp/2][ldk][2], s rows of lds floats.
  __attribute__((noinline)) static void qk_group(const uint16_t* q, int64_t dkp,
                                                 const uint16_t* kt, int64_t ldk, int nchunks,
                                                 float* s, int64_t lds) {
    int c0 = 0;
    for (; c0 + 2 <= nchunks; c0 += 2) {
      _tile_zero(0); _tile_zero(1);
      for (int64_t kc = 0; kc < dkp / 32; ++kc) {
        _tile_loadd(2, q + kc * 32, dkp * 2);
        const uint16_t* kb = kt + (kc * 16 * ldk + c0 * 16) * 2;
        _tile_loadd(3, kb, ldk * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, kb + 32, ldk * 4);
        _tile_dpbf16ps(1, 2, 3);
      }
      _tile_stored(0, s + c0 * 16, lds * 4);
      _tile_stored(1, s + c0 * 16 + 16, lds * 4);
    }
    if (c0 < nchunks) {
      _tile_zero(0);
      for (int64_t kc = 0; kc < dkp / 32; ++kc) {
        _tile_loadd(2, q + kc * 32, dkp * 2);
        _tile_loadd(3, kt + (kc * 16 * ldk + c0 * 16) * 2, ldk * 4);
        _tile_dpbf16ps(0, 2, 3);
      }
      _tile_stored(0, s + c0 * 16, lds * 4);
    }
  }

  // With d_k <= 64 (KC = dkp / 32 tiles) Q of the group stays in tiles 2.. as well: S is
  // computed 16 keys at a time in tile 0 (K in 1); no Q tile is reloaded per key chunk.
  template <int KC>
  static void q_tiles_load(const uint16_t* q, int64_t dkp) {
    _tile_loadd(2, q, dkp * 2);
    if constexpr (KC > 1) _tile_loadd(3, q + 32, dkp * 2);
  }
  template <int KC>
  __attribute__((noinline)) static void qk_group_qres(const uint16_t* kt, int64_t ldk,
                                                      int nchunks, float* s, int64_t lds) {
    for (int c = 0; c < nchunks; ++c) {
      const uint16_t* kb = kt + c * 32;
      _tile_zero(0);
      _tile_loadd(1, kb, ldk * 4);
      _tile_dpbf16ps(0, 2, 1);
      if constexpr (KC > 1) {
        _tile_loadd(1, kb + 32 * ldk, ldk * 4);
        _tile_dpbf16ps(0, 3, 1);
      }

      _tile_stored(0, s + c * 16, lds * 4);
    }
  }
  // O tiles (4.. 4 + NC - 1) += P[:, 0, 32 kchunks) V, P through tile 0 and V through tile 1:
  // p rows of ldp bf16, v [keys/2][dvp][2].
  template <int NC>
  __attribute__((noinline)) static void pv_group(const uint16_t* p, int64_t ldp,
                                                 const uint16_t* v, int64_t dvp, int kchunks) {
    for (int kc = 0; kc < kchunks; ++kc) {
      _tile_loadd(0, p + kc * 32, ldp * 2);
      const uint16_t* vb = v + int64_t(kc) * 16 * dvp * 2;
      _tile_loadd(1, vb, dvp * 4);
      _tile_dpbf16ps(4, 0, 1);
      if constexpr (NC > 1) { _tile_loadd(1, vb + 32, dvp * 4); _tile_dpbf16ps(5, 0, 1); }
      if constexpr (NC > 2) { _tile_loadd(1, vb + 64, dvp * 4); _tile_dpbf16ps(6, 0, 1); }
      if constexpr (NC > 3) { _tile_loadd(1, vb + 96, dvp * 4); _tile_dpbf16ps(7, 0, 1); }
    }
  }

  // Two 16-row groups at once (Worker::group_pair_runs), so K and V stream from L2 once for
  // both. S of groups A (q) and B (q + 16 dkp) for 16-key chunks c < nchunks: K through tile 2,
  // Q of A through 3 and of B through 4 (from L1), S in 0 (A) and 1 (B).
  __attribute__((noinline)) static void qk_pair(const uint16_t* q, int64_t dkp,
                                                const uint16_t* kt, int64_t ldk, int nchunks,
                                                float* sa, float* sb, int64_t lds) {
    const uint16_t* qb = q + 16 * dkp;
    for (int c = 0; c < nchunks; ++c) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t kc = 0; kc < dkp / 32; ++kc) {
        _tile_loadd(2, kt + (kc * 16 * ldk + c * 16) * 2, ldk * 4);
        _tile_loadd(3, q + kc * 32, dkp * 2);
        _tile_dpbf16ps(0, 3, 2);
        _tile_loadd(4, qb + kc * 32, dkp * 2);
        _tile_dpbf16ps(1, 4, 2);
      }
      _tile_stored(0, sa + c * 16, lds * 4);
      _tile_stored(1, sb + c * 16, lds * 4);
    }
  }
  // O of the two groups, NC2 (1 or 2) 16-column tiles each: A in tiles 4.., B in 6.. (rows of
  // ldo floats); O += P V with P of A through tile 0, of B through 1, V through 2 and 3 (each V
  // tile used by both groups): p rows of ldp bf16, v [keys/2][dvp][2] from the first column.
  template <int NC2, bool Store>
  static void o_pair(float* oa, float* ob, int64_t ldo) {
    MHA_TILE_MOVE(Store, 4, oa, ldo);
    MHA_TILE_MOVE(Store, 6, ob, ldo);
    if constexpr (NC2 > 1) {
      MHA_TILE_MOVE(Store, 5, oa + 16, ldo);
      MHA_TILE_MOVE(Store, 7, ob + 16, ldo);
    }
  }
  template <int NC2>
  __attribute__((noinline)) static void pv_pair(const uint16_t* pa, const uint16_t* pb,
                                                int64_t ldp, const uint16_t* v, int64_t dvp,
                                                int kchunks) {
    for (int kc = 0; kc < kchunks; ++kc) {
      _tile_loadd(0, pa + kc * 32, ldp * 2);
      _tile_loadd(1, pb + kc * 32, ldp * 2);
      const uint16_t* vb = v + int64_t(kc) * 16 * dvp * 2;
      _tile_loadd(2, vb, dvp * 4);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (NC2 > 1) {
        _tile_loadd(3, vb + 32, dvp * 4);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(7, 1, 3);
      }
    }
  }

  // The resident O tiles (4.. 4 + NC - 1): zeroed, or to / from 16 rows of dvp floats.
  template <int NC>
  static void o_tiles_zero() {
    _tile_zero(4);
    if constexpr (NC > 1) _tile_zero(5);
    if constexpr (NC > 2) _tile_zero(6);
    if constexpr (NC > 3) _tile_zero(7);
  }
  template <int NC, bool Store>
  static void o_tiles(float* o, int64_t dvp) {
    MHA_TILE_MOVE(Store, 4, o, dvp);
    if constexpr (NC > 1) MHA_TILE_MOVE(Store, 5, o + 16, dvp);
    if constexpr (NC > 2) MHA_TILE_MOVE(Store, 6, o + 32, dvp);
    if constexpr (NC > 3) MHA_TILE_MOVE(Store, 7, o + 48, dvp);
  }

  // O[i][:] += P[i][0, 32 kchunks) V for one 16-row group with O in memory (d_v > 64): p rows
  // of ldp bf16, v [keys/2][dvp][2], o rows of dvp floats (dvp % 16 == 0); O tiles 4 at a time
  // in tiles 0-3, P in 4, V in 5-6.
  __attribute__((noinline)) static void pv_block(const uint16_t* p, int64_t ldp,
                                                 const uint16_t* v, int64_t dvp, int kchunks,
                                                 float* o) {
    const int nvc = int(dvp / 16);
    for (int c0 = 0; c0 < nvc; c0 += 4) {
      const int nc = std::min(4, nvc - c0);
      float* oc = o + c0 * 16;
      _tile_loadd(0, oc, dvp * 4);
      if (nc > 1) _tile_loadd(1, oc + 16, dvp * 4);
      if (nc > 2) _tile_loadd(2, oc + 32, dvp * 4);
      if (nc > 3) _tile_loadd(3, oc + 48, dvp * 4);
      for (int kc = 0; kc < kchunks; ++kc) {
        _tile_loadd(4, p + kc * 32, ldp * 2);
        const uint16_t* vb = v + (int64_t(kc) * 16 * dvp + c0 * 16) * 2;
        _tile_loadd(5, vb, dvp * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (nc > 1) { _tile_loadd(6, vb + 32, dvp * 4); _tile_dpbf16ps(1, 4, 6); }
        if (nc > 2) { _tile_loadd(5, vb + 64, dvp * 4); _tile_dpbf16ps(2, 4, 5); }
        if (nc > 3) { _tile_loadd(6, vb + 96, dvp * 4); _tile_dpbf16ps(3, 4, 6); }
      }
      _tile_stored(0, oc, dvp * 4);
      if (nc > 1) _tile_stored(1, oc + 16, dvp * 4);
      if (nc > 2) _tile_stored(2, oc + 32, dvp * 4);
      if (nc > 3) _tile_stored(3, oc + 48, dvp * 4);
    }
  }
};
#endif  // AMX

}  // namespace mha_flash
