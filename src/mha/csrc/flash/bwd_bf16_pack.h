// The flash backward's bf16 operands (vdpbf16ps products): fp32 rows and key blocks
// repacked as bf16 rows and pair-packed columns. Compiled where MHA_BWD_BF16 is defined.
#pragma once

#include <cstring>

#include "flash/bwd_problem.h"

#if defined(MHA_BWD_BF16)
namespace mha_flash_bwd {
namespace {

// dst[2 j] = bf16(r0[j]), dst[2 j + 1] = bf16(r1[j]) (0 when r1 is null) for j < n (n % 16 == 0):
// two fp32 rows as the bf16 pairs a pair-packed operand (or a row of pairs) holds.
void pack_pairs(const float* r0, const float* r1, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const __m256i a = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + j));
    const __m256i b = r1 ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + j))
                         : _mm256_setzero_si256();
    _mm512_storeu_si512(dst + 2 * j, _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                                     _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
  }
}

// dst[j] = bf16(src[j]) for j < n (n % 16 == 0).
void to_bf16_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; j += kLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
}

// The group's rows for the bf16 products, from pack_rows' fp32 copies (exact: the inputs are
// bf16): Q, dO as bf16 rows, and transposed with pairs of rows adjacent (zero past Tq).
void pack_rows_bf16(Scratch& w, int64_t g, int64_t Tq, int64_t dk, int64_t dv, int64_t dkp,
                    int64_t dvp) {
  const int64_t dk2 = round_up(dk, 2), dv2 = round_up(dv, 2), tq2 = round_up(Tq, 2);
  w.qb.resize(g * Tq * dk2 + kLanes);  // + kLanes: to_bf16_row writes whole vectors
  w.ob.resize(g * Tq * dv2 + kLanes);
  w.qt.assign(g * dk * tq2, 0);
  w.ot.assign(g * dv * tq2, 0);
  auto bits = [](float x) {  // exact for a bf16 value held in an fp32
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    return uint16_t(u >> 16);
  };
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t t0 = 0; t0 < Tq; t0 += 32) {  // 32 rows at a time: the transposes stay in L1
      const int64_t t1 = std::min(Tq, t0 + 32);
      const float* qr = w.q.data() + hh * Tq * dkp;
      const float* orow = w.dout.data() + hh * Tq * dvp;
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t c = 0; c < dk2; ++c) w.qb[(hh * Tq + t) * dk2 + c] = bits(qr[t * dkp + c]);
        for (int64_t c = 0; c < dv2; ++c) w.ob[(hh * Tq + t) * dv2 + c] = bits(orow[t * dvp + c]);
      }
      for (int64_t c = 0; c < dk; ++c)
        for (int64_t t = t0; t < t1; ++t) w.qt[(hh * dk + c) * tq2 + t] = bits(qr[t * dkp + c]);
      for (int64_t c = 0; c < dv; ++c)
        for (int64_t t = t0; t < t1; ++t) w.ot[(hh * dv + c) * tq2 + t] = bits(orow[t * dvp + c]);
    }
}

// One key block for the bf16 products, from the fp32 packs kt (d_k, Bc), vt (d_v, Bc) and
// kr (Bc, d_kp) (zero past kn): K^T and V^T pair-packed along d, K pair-packed along keys.
// The accumulators dK^T, dV^T start at zero.
void pack_block_bf16(Scratch& w, int64_t dk, int64_t dv, int64_t kn, int64_t ncols,
                     int64_t dkp) {
  const int64_t dk2 = round_up(dk, 2), dv2 = round_up(dv, 2);
  w.ktp.resize(dk2 / 2 * kBc * 2);
  w.vtp.resize(dv2 / 2 * kBc * 2);
  w.kp.resize(kBc / 2 * dkp * 2);
  w.p2.resize(kBr / 2 * kBc * 2);
  w.ds2.resize(kBr / 2 * kBc * 2);
  w.dsb.resize(kBr * kBc);
  w.dkt.assign(dk * kBc, 0.f);
  w.dvt.assign(dv * kBc, 0.f);
  for (int64_t c = 0; c < dk2; c += 2)
    pack_pairs(w.kt.data() + c * kBc, c + 1 < dk ? w.kt.data() + (c + 1) * kBc : nullptr, ncols,
               w.ktp.data() + c * kBc);
  for (int64_t c = 0; c < dv2; c += 2)
    pack_pairs(w.vt.data() + c * kBc, c + 1 < dv ? w.vt.data() + (c + 1) * kBc : nullptr, ncols,
               w.vtp.data() + c * kBc);
  std::fill(w.kr.begin() + kn * dkp, w.kr.begin() + ncols * dkp, 0.f);
  for (int64_t j = 0; j < ncols; j += 2)
    pack_pairs(w.kr.data() + j * dkp, w.kr.data() + (j + 1) * dkp, dkp, w.kp.data() + j * dkp);
}

}  // namespace
}  // namespace mha_flash_bwd
#endif  // MHA_BWD_BF16
