// The flash forward's AMX key loops (Worker::key_loop_amx and its parts): bf16 S = Q K^T and
// O += P V on the tile unit, one 16-row group or a pair of groups at a time.
#pragma once

#include "flash/worker.h"

#if defined(MHA_FLASH_AMX)

namespace mha_flash {
namespace {

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::key_loop_amx(int64_t b, int64_t i0, int rows, int64_t jlo, int64_t kend,
                  const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* vp,
                  float* s, p_t* p, float* o, float* m, float* alpha, float* lsum,
                  uint16_t* bits) {
  const int nc = dvp <= 64 ? int(dvp / 16) : 0;
  const int groups = (rows + 15) / 16;
  int g0 = 0;
  if (!nc)  // d_v > 64: groups two at a time (K / V from L2 once for both)
    for (; g0 + 1 < groups; g0 += 2) {
      const int r0 = g0 * 16, rgb = std::min(16, rows - r0 - 16);
      const int64_t ia = i0 + r0;
      const int64_t ja = std::max(jlo, P.key_start(ia) / 32 * 32);
      const int64_t jz = std::min(kend, P.key_limit(b, ia + 16 + rgb - 1));
      group_pair_runs(b, ia, rgb, ja, jz, jlo, kend, mrow0, q + r0 * dkp, kt, vp, s,
                      o + r0 * dvp, m + r0, alpha + r0, lsum + r0 * kLanes, bits);
    }
  const int left = groups - g0;  // NC > 0: every group; else the one left over, if any
  const int64_t blocks = nc ? 1 : (kend - jlo + Nb - 1) / Nb;
  for (int64_t t = 0; t < blocks * left; ++t) {  // NC = 0: (block, group); else (group)
    const int r0 = (g0 + int(t % left)) * 16, rg = std::min(16, rows - r0);
    const int64_t ia = i0 + r0;
    int64_t ja = std::max(jlo, P.key_start(ia) / 32 * 32);
    int64_t jz = std::min(kend, P.key_limit(b, ia + rg - 1));
    if (!nc) {  // the one key block of this step, clipped to what the group sees
      ja = std::max(ja, jlo + t / left * Nb);
      jz = std::min(jz, jlo + (t / left + 1) * Nb);
    }
    const int kc = nc && dkp <= 64 ? int(dkp / 32) : 0;  // Q tiles kept (d_k <= 64)
    switch (nc * 10 + kc) {
#define MHA_GROUP_LOOP(NC, KC) \
case NC * 10 + KC: group_loop_amx<NC, KC>(b, ia, rg, ja, jz, jlo, kend, mrow0, q + r0 * dkp, kt, vp, s, p, o + r0 * dvp, m + r0, alpha + r0, lsum + r0 * kLanes, bits); break;
      MHA_GROUP_LOOP(0, 0) MHA_GROUP_LOOP(1, 0) MHA_GROUP_LOOP(2, 0) MHA_GROUP_LOOP(3, 0)
      MHA_GROUP_LOOP(4, 0) MHA_GROUP_LOOP(1, 1) MHA_GROUP_LOOP(2, 1) MHA_GROUP_LOOP(3, 1)
      MHA_GROUP_LOOP(4, 1) MHA_GROUP_LOOP(1, 2) MHA_GROUP_LOOP(2, 2) MHA_GROUP_LOOP(3, 2)
      MHA_GROUP_LOOP(4, 2)
#undef MHA_GROUP_LOOP
      default: TORCH_CHECK(false, "flash_attention: bad tile count");
    }
  }
}

template <class K, typename T, class Parts>
template <int NC, int KC>
void Worker<K, T, Parts>::group_loop_amx(int64_t b, int64_t ia, int rg, int64_t ja, int64_t jz, int64_t jlo,
                    int64_t kend, const bool* mrow0, const packed_t* q, const packed_t* kt,
                    const packed_t* vp, float* s, p_t* p, float* o, float* m, float* alpha,
                    float* lsum, uint16_t* bits) {
  if constexpr (NC > 0) K::template o_tiles_zero<NC>();
  if constexpr (KC > 0) K::template q_tiles_load<KC>(q, dkp);
  bool o_zero = NC > 0;  // O tiles still zero: nothing to rescale (O in o: scaled anyway)
  if constexpr (!Parts::kTiles) std::fill(s, s + 16 * Nb, 0.f);  // finite scores
  for (int64_t j0 = ja; j0 < jz; j0 = (j0 / Nb + 1) * Nb) {
    const int jn = int(std::min((j0 / Nb + 1) * Nb, kend) - j0);
    const int nv = (jn + kLanes - 1) / kLanes;
    const packed_t* ktb = kt + ((j0 - jlo) / Nb) * dkp * Nb + (j0 % Nb) * 2;
    if constexpr (!Parts::kTiles) {
    } else if constexpr (KC > 0) {
      K::template qk_group_qres<KC>(ktb, Nb, nv, s, Nb);
    } else {
      K::qk_group(q, dkp, ktb, Nb, nv, s, Nb);
    }
    softmax_step(b, ia, rg, j0, nv, mrow0, s, p, m, alpha, lsum, bits);
    if (!o_zero && moved(alpha, rg)) {  // rare with the lazy max: scale the rows whose max moved
      if constexpr (NC > 0) K::template o_tiles<NC, true>(o, dvp);
      scale_o_rows(o, rg, alpha, dvp);
      if constexpr (NC > 0) K::template o_tiles<NC, false>(o, dvp);
    }
    const packed_t* vb = vp + (j0 - jlo) * dvp;
    if constexpr (!Parts::kTiles) {
    } else if constexpr (NC > 0) {
      K::template pv_group<NC>(p, Nb, vb, dvp, (jn + 31) / 32);
    } else {
      K::pv_block(p, Nb, vb, dvp, (jn + 31) / 32, o);
    }
    o_zero = false;
  }
  if constexpr (NC > 0) K::template o_tiles<NC, true>(o, dvp);
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::group_pair_runs(int64_t b, int64_t ia, int rgb, int64_t ja, int64_t jz, int64_t jlo,
                     int64_t kend, const bool* mrow0, const packed_t* q, const packed_t* kt,
                     const packed_t* vp, float* s, float* o, float* m, float* alpha,
                     float* lsum, uint16_t* bits) {
  p_t* pr = sc.prun.get(kRunBlocks * 32 * Nb);  // P: [block][group][16][Nb]
  float* ar = sc.arun.get(kRunBlocks * 32);     // alpha: [block][group][16]
  int64_t jrun[kRunBlocks];
  int jnrun[kRunBlocks];
  if (rgb < 16)  // P rows past group B's last stay zero (finite) in P V
    for (int i = 0; i < kRunBlocks; ++i)
      std::fill(pr + (i * 32 + 16 + rgb) * Nb, pr + (i + 1) * 32 * Nb, p_t(0));
  if constexpr (!Parts::kTiles) std::fill(s, s + 32 * Nb, 0.f);  // finite scores
  bool first = true;  // o is still zero
  for (int64_t j0 = ja; j0 < jz; first = false) {
    int nb = 0;
    for (; nb < kRunBlocks && j0 < jz; ++nb, j0 = (j0 / Nb + 1) * Nb) {
      const int jn = int(std::min((j0 / Nb + 1) * Nb, kend) - j0);
      const int nv = (jn + kLanes - 1) / kLanes;
      const packed_t* ktb = kt + ((j0 - jlo) / Nb) * dkp * Nb + (j0 % Nb) * 2;
      if constexpr (Parts::kTiles) K::qk_pair(q, dkp, ktb, Nb, nv, s, s + 16 * Nb, Nb);
      p_t* pa = pr + nb * 32 * Nb;
      softmax_step(b, ia, 16, j0, nv, mrow0, s, pa, m, alpha, lsum, bits);
      softmax_step(b, ia + 16, rgb, j0, nv, mrow0, s + 16 * Nb, pa + 16 * Nb, m + 16,
                   alpha + 16, lsum + 16 * kLanes, bits);
      std::copy(alpha, alpha + 16 + rgb, ar + nb * 32);
      jrun[nb] = j0;
      jnrun[nb] = jn;
    }
    for (int c0 = 0; c0 < dvp / 16; c0 += 2) {
      if (c0 + 1 < dvp / 16)
        pv_pair_run<2>(nb, pr, ar, jrun, jnrun, rgb, jlo, vp + c0 * 32, o + c0 * 16, first);
      else
        pv_pair_run<1>(nb, pr, ar, jrun, jnrun, rgb, jlo, vp + c0 * 32, o + c0 * 16, first);
    }
  }
}

template <class K, typename T, class Parts>
template <int NC2>
void Worker<K, T, Parts>::pv_pair_run(int nb, const p_t* pr, const float* ar, const int64_t* jrun,
                 const int* jnrun, int rgb, int64_t jlo, const packed_t* vp, float* o,
                 bool o_zero) {
  float* ob = o + 16 * dvp;
  K::template o_pair<NC2, false>(o, ob, dvp);
  for (int i = 0; i < nb; ++i) {
    const float* a = ar + i * 32;
    if (!o_zero && (moved(a, 16) || moved(a + 16, rgb))) {
      K::template o_pair<NC2, true>(o, ob, dvp);
      scale_o_rows(o, 16, a, NC2 * 16);
      scale_o_rows(ob, rgb, a + 16, NC2 * 16);
      K::template o_pair<NC2, false>(o, ob, dvp);
    }
    if constexpr (Parts::kTiles)
      K::template pv_pair<NC2>(pr + i * 32 * Nb, pr + (i * 32 + 16) * Nb, Nb,
                               vp + (jrun[i] - jlo) * dvp, dvp, (jnrun[i] + 31) / 32);
    o_zero = false;
  }
  K::template o_pair<NC2, true>(o, ob, dvp);
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::softmax_step(int64_t b, int64_t ia, int rg, int64_t j0, int nv, const bool* mrow0,
                  const float* s, p_t* p, float* m, float* alpha, float* lsum,
                  uint16_t* bits) const {
  if constexpr (!Parts::kSoftmax) return std::fill(alpha, alpha + rg, 1.f);
  switch (nv) {
#define MHA_KEY_STEP(NV) \
case NV: softmax_group<NV>(b, ia, rg, j0, mrow0, s, p, m, alpha, lsum, bits); break;
    MHA_KEY_STEP(1) MHA_KEY_STEP(2) MHA_KEY_STEP(3) MHA_KEY_STEP(4)
    MHA_KEY_STEP(5) MHA_KEY_STEP(6) MHA_KEY_STEP(7) MHA_KEY_STEP(8)
#undef MHA_KEY_STEP
    default: TORCH_CHECK(false, "flash_attention: bad key block width");
  }
  if (nv % 2)
    for (int r = 0; r < rg; ++r)
      std::fill(p + r * Nb + nv * kLanes, p + r * Nb + (nv + 1) * kLanes, p_t(0));
}

template <class K, typename T, class Parts>
bool Worker<K, T, Parts>::moved(const float* alpha, int rg) {
  bool any = false;
  for (int r = 0; r < rg; ++r) any |= alpha[r] != 1.f;
  return any;
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::scale_o_rows(float* o, int rg, const float* alpha, int64_t cols) const {
  for (int r = 0; r < rg; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < cols; c += kLanes)
      _mm512_storeu_ps(o + r * dvp + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * dvp + c), a));
  }
}

}  // namespace
}  // namespace mha_flash
#endif
