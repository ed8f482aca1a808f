// The flash backward's row work: recomputing P and dS for a block of rows (softmax_grad),
// and packing the group's query rows with their lse and delta (pack_rows).
#pragma once

#include <cmath>

#include "flash/bwd_problem.h"

namespace mha_flash_bwd {
namespace {

// P and dS of rows [i0, i0 + rows) of head hi against keys [j0, j0 + kn): s holds S on entry
// and P on exit, dp holds dP (or garbage when there is no grad_out) and dS on exit. pbits: a
// partial plan block's bits of row i0 at key j0 (rows kPlanKeys apart), or null.
template <typename T>
void softmax_grad(const Problem<T>& P, int64_t b, int64_t hi, int64_t i0, int64_t rows, int64_t j0,
                  int64_t kn, const float* lse2, const float* lse2lo, const float* delta,
                  bool has_go, float* s, float* dp, const bool* pbits) {
  const float c = P.mods.score_scale(P.scale) * kLog2e;
  const int64_t ncols = round_up(kn, kLanes);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    int64_t lim = kn;  // keys [j0 + first, j0 + lim) are visible before the bool mask
    if (P.causal) lim = std::min(lim, i + P.Tk - P.Tq + 1 - j0);
    const int64_t first = std::max<int64_t>(0, P.key_start(i) - j0);
    float* sr = s + r * kBc;
    float* dr = dp + r * kBc;
    const bool* mrow = P.mask ? P.mask + b * P.ms[0] + hi * P.ms[1] + i * P.ms[2] + j0 * P.ms[3]
                              : nullptr;
    const bool* prow = pbits ? pbits + r * mha_common::kPlanKeys : nullptr;
    const float l2 = lse2[i], l2lo = lse2lo[i], dl = delta[i];
    float dcap[kBc];  // the softcap's derivative per key (score variants)
    const bool capped = P.mods.softcap > 0.f;
    if (P.mods.on_scores())
      P.mods.apply_row(sr, kn, b, hi, i, j0, P.Tq, P.Tk, P.scale, capped ? dcap : nullptr);
    for (int64_t c0 = 0; c0 < ncols; c0 += kLanes) {
      const int64_t nvis = std::clamp<int64_t>(lim - c0, 0, kLanes);
      uint32_t bits = nvis == kLanes ? 0xFFFFu : (1u << nvis) - 1;  // lane l visible
      const int64_t nleft = std::clamp<int64_t>(first - c0, 0, kLanes);  // left of the window
      if (nleft > 0) bits &= nleft == kLanes ? 0u : ~((1u << nleft) - 1);
      if (mrow)
        for (int l = int(nleft); l < nvis; ++l)
          if (!mrow[(c0 + l) * P.ms[3]]) bits &= ~(1u << l);
      if (prow)
        for (int l = int(nleft); l < nvis; ++l)
          if (!prow[c0 + l]) bits &= ~(1u << l);
#if defined(__AVX512F__)
      const __mmask16 m = __mmask16(bits);
      const __m512 x = _mm512_sub_ps(  // s c - (l2 + l2lo): the product unrounded (FMA)
          _mm512_fmsub_ps(_mm512_loadu_ps(sr + c0), _mm512_set1_ps(c), _mm512_set1_ps(l2)),
          _mm512_set1_ps(l2lo));
      const __m512 p = _mm512_maskz_mov_ps(m, exp2_avx512(x));
      const __m512 d = has_go ? _mm512_loadu_ps(dr + c0) : _mm512_setzero_ps();
      _mm512_storeu_ps(sr + c0, p);  // masked lanes: exactly 0, whatever S or dP hold there
      _mm512_storeu_ps(dr + c0, _mm512_maskz_mul_ps(m, p, _mm512_sub_ps(d, _mm512_set1_ps(dl))));
#else
      for (int l = 0; l < kLanes; ++l) {
        const float p = ((bits >> l) & 1) ? std::exp2(std::fma(sr[c0 + l], c, -l2) - l2lo) : 0.f;
        const float d = has_go ? dr[c0 + l] : 0.f;
        sr[c0 + l] = p;
        dr[c0 + l] = ((bits >> l) & 1) ? p * (d - dl) : 0.f;
      }
#endif
    }
    if (P.dbias) {  // d bias = dS per pair (0 at masked pairs), summed where the bias broadcasts
      float* db = P.dbias + b * P.dbs[0] + hi * P.dbs[1] + i * P.dbs[2] + j0 * P.dbs[3];
      if (P.dbs[3] == 1)
        for (int64_t n = 0; n < kn; ++n) db[n] += dr[n];
      else
        for (int64_t n = 0; n < kn; ++n) db[n * P.dbs[3]] += dr[n];
    }
    if (capped)  // dS of the scaled raw scores; 0 stays 0 (a masked pair's derivative may be NaN)
      for (int64_t n = 0; n < kn; ++n) dr[n] = dr[n] != 0.f ? dr[n] * dcap[n] : 0.f;
  }
}

// Sets non-finite elements of x[0, n) to 0; false when there was one. Branch-free (x - x is
// 0 exactly for finite x, NaN for +-Inf and NaN), so the loop vectorizes.
bool zero_non_finite(float* x, int64_t n) {
  int bad = 0;
  for (int64_t c = 0; c < n; ++c) {
    const float v = x[c];
    const bool ok = v - v == 0.f;
    x[c] = ok ? v : 0.f;
    bad |= !ok;
  }
  return bad == 0;
}

// Pack the g query heads of (b, kvh): Q with non-finite elements as 0, dO (zero-padded to
// 16-multiples), lse in base 2 (+inf for rows that see nothing, so P = 0; NaN for rows whose q
// is not finite or whose lse is +inf, so P = NaN on all their visible lanes, as softmax gives
// for a row with a NaN or +inf score), delta = rowsum(dO O) - dlse.
constexpr int64_t kRowsAhead = 8;  // pack_rows asks for the rows this far ahead

template <typename T>
void pack_rows(const Problem<T>& P, int64_t b, int64_t kvh, Scratch& w, int64_t dkp, int64_t dvp) {
  const int64_t g = P.h / P.hkv;
  for (int64_t hh = 0; hh < g; ++hh) {
    const int64_t hi = kvh * g + hh;
    for (int64_t t = 0; t < P.Tq; ++t) {
      const int64_t row = hh * P.Tq + t;
      const T* qr = P.q + b * P.qs[0] + hi * P.qs[1] + t * P.qs[2];
      if (t + kRowsAhead < P.Tq) {  // the rows kRowsAhead below: Q, dO, O
        const int64_t ta = t + kRowsAhead;
        prefetch_row(qr + kRowsAhead * P.qs[2], P.dk, P.qs[3]);
        if (P.go) {
          prefetch_row(P.go + b * P.gos[0] + hi * P.gos[1] + ta * P.gos[2], P.dv, P.gos[3]);
          prefetch_row(P.out + b * P.os[0] + hi * P.os[1] + ta * P.os[2], P.dv, P.os[3]);
        }
      }
      float* dst = w.q.data() + row * dkp;
      if (P.qs[3] == 1)
        for (int64_t c = 0; c < P.dk; ++c) dst[c] = widen(qr[c]);
      else
        for (int64_t c = 0; c < P.dk; ++c) dst[c] = widen(qr[c * P.qs[3]]);
      std::fill(dst + P.dk, dst + dkp, 0.f);
      const bool finite = zero_non_finite(dst, P.dk);
      float* od = w.dout.data() + row * dvp;
      float dsum = 0.f;
      if (P.go) {
        const T* gr = P.go + b * P.gos[0] + hi * P.gos[1] + t * P.gos[2];
        const T* orow = P.out + b * P.os[0] + hi * P.os[1] + t * P.os[2];
        for (int64_t c = 0; c < P.dv; ++c) od[c] = widen(gr[c * P.gos[3]]);
        std::fill(od + P.dv, od + dvp, 0.f);
        float part[kLanes] = {};  // 16 partial sums, lane l over c = l mod 16 (a fixed order)
        for (int64_t c0 = 0; c0 < P.dv; c0 += kLanes) {
          const int n = int(std::min<int64_t>(kLanes, P.dv - c0));
          if (P.os[3] == 1 && n == kLanes) {
#pragma GCC unroll 16
            for (int l = 0; l < kLanes; ++l) part[l] += od[c0 + l] * widen(orow[c0 + l]);
          } else {
            for (int l = 0; l < n; ++l) part[l] += od[c0 + l] * widen(orow[(c0 + l) * P.os[3]]);
          }
        }
        for (int l = 0; l < kLanes; ++l) dsum += part[l];
      } else {
        std::fill(od, od + dvp, 0.f);
      }
      if (P.glse) dsum -= P.glse[b * P.gls[0] + hi * P.gls[1] + t * P.gls[2]];
      w.delta[row] = dsum;
      const double l = P.lse[b * P.ls[0] + hi * P.ls[1] + t * P.ls[2]];
      const double l2 = l * mha_common::kLog2eD;
      w.lse2[row] = l == -kInf ? kInf : finite && l != kInf ? float(l2) : std::nanf("");
      w.lse2lo[row] = std::isfinite(l2) ? float(l2 - double(float(l2))) : 0.f;  // the rest
    }
  }
}

}  // namespace
}  // namespace mha_flash_bwd
