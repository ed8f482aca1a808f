// Microkernels of the CPU flash-attention forward (flash_attn.cpp drives them; AmxBf16 is in amx/flash_amx_kernel.h).
//
// Shape legend: R query rows of one register tile, NV/CV 16-lane fp32 vectors of one tile's
// columns, Nb keys per key block (multiple of 16, <= 128), dkp/dvp packed head dims.
//
// The kernels share one interface, so the driver is written once:
//   PortableF32  — plain loops (any compiler / ISA); bf16 inputs are widened when packed.
//   Avx512F32    — fp32 FMA tiles: S = Q K^T with K packed transposed [dkp][Nb], O += P V;
//                  the one-pass softmax (softmax_lazy, degree-7 exp2) for scale > 0.
//   Avx512Bf16   — vdpbf16ps tiles: K packed as key-column pairs [dkp/2][Nb][2], V as key
//                  pairs [Tk/2][dvp][2], P rounded to bf16; fp32 accumulation and softmax,
//                  one pass with a lazy running max (softmax_lazy) and a degree-3 exp2.
//   AmxBf16      — Avx512Bf16's layouts and softmax, with whole-block Q K^T and P V on Intel
//                  AMX tiles (qk_group / pv_group ...; the driver calls those when kAmx).
//
// Interface of a kernel K:
//   packed_t        element of the packed Q/K/V buffers;  p_t  element of the P buffer
//   kPairs          bf16 pair layouts (see above)
//   qk<R, NV>(q, ldq, kt, ldk, dkp, s, lds)         S[R][16 NV] = Q[R][dkp] . KT[dkp][16 NV]
//   softmax_rows<NV, RS>(s, lds, nvalid, bits, bstride, c, m, lsum, alpha, p, ldp)
//                   the online-softmax update of RS rows (two passes: max, then exp2)
//   kLazySoftmax    softmax_lazy<NV, RS, Masked>(same arguments) exists and serves scale > 0
//   pv<R, CV>(p, ldp, v, dvp, n, o, ldo, alpha)     O[R][16 CV] = alpha O + P[R][n] . V[n][16 CV]
//   kFusedExp       qk_exp<R, NV> and lazy_finish<NV> exist (Avx512F32): the lazy softmax's
//                   fast path in the Q K^T tile, for unmasked key blocks
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/constants.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "common/exp2.h"
#include "common/lanes16.h"
#include "common/register_tiles.h"
#endif
#include <algorithm>

namespace mha_flash {

using mha_common::kLanes;  // key blocks are multiples of it
using mha_common::kNegInf;

// Rows per register tile for a tile NV vectors wide: at most 24 accumulators (of 32 zmm).
constexpr int rows_for(int nv) { return nv >= 4 ? 6 : (nv == 3 ? 8 : 12); }

// ---------------------------------------------------------------- portable (reference) kernel
struct PortableF32 {
  using packed_t = float;
  using p_t = float;
  static constexpr bool kPairs = false;
  static constexpr const char* kName = "portable";
  static constexpr bool kAmx = false, kLazySoftmax = false, kFusedExp = false;
  static constexpr int kDkAlign = 1, kKeyAlign = kLanes;

  // The d_k products of a score in blocks of kDotBlock (see Avx512F32::qk_acc).
  template <int R, int NV>
  static void qk(const float* q, int64_t ldq, const float* kt, int64_t ldk, int dkp, float* s,
                 int64_t lds) {
    for (int r = 0; r < R; ++r) {
      float acc[NV * kLanes] = {};
      for (int k0 = 0; k0 < dkp; k0 += mha_common::kDotBlock) {
        float part[NV * kLanes] = {};  // this block's sums (the first block's: acc itself)
        float* sum = k0 == 0 ? acc : part;
        for (int kk = k0; kk < std::min(dkp, k0 + mha_common::kDotBlock); ++kk) {
          const float a = q[r * ldq + kk];
          for (int n = 0; n < NV * kLanes; ++n) sum[n] += a * kt[kk * ldk + n];
        }
        if (k0 > 0)
          for (int n = 0; n < NV * kLanes; ++n) acc[n] += part[n];
      }
      for (int n = 0; n < NV * kLanes; ++n) s[r * lds + n] = acc[n];
    }
  }

  template <int NV>
  static void softmax_row(const float* s, int nvalid, const uint16_t* bits, float c, float& m,
                          float* lsum, float& alpha, float* p) {
    float x[NV * kLanes];
    float bm = kNegInf;
    for (int n = 0; n < NV * kLanes; ++n) {
      const bool ok = n < nvalid && (!bits || ((bits[n / kLanes] >> (n % kLanes)) & 1));
      x[n] = ok ? s[n] * c : kNegInf;
      bm = std::max(bm, x[n]);
    }
    // std::max drops NaN. A NaN score next to a finite one still gives a NaN P, so a NaN l and
    // a NaN row; a NaN max (m) stays (m < x is false). Only "every visible score NaN" would
    // look like "nothing visible": checked there.
    float mnew = std::isnan(m) ? m : std::max(m, bm);
    if (mnew == kNegInf)
      for (int n = 0; n < NV * kLanes; ++n)
        if (std::isnan(x[n])) mnew = x[n];
    if (mnew == kNegInf) {  // nothing visible yet in this row
      alpha = 1.f;
      for (int n = 0; n < NV * kLanes; ++n) p[n] = 0.f;
      return;
    }
    alpha = std::exp2(m - mnew);
    m = mnew;
    float sum = lsum[0] * alpha;
    for (int n = 0; n < NV * kLanes; ++n) {
      // s c - m with the product unrounded (one FMA), as the backward recomputes P: the max
      // is only a reference point, so P stays consistent where s c is in the hundreds
      p[n] = x[n] == kNegInf ? 0.f : std::exp2(std::fma(s[n], c, -mnew));
      sum += p[n];
    }
    lsum[0] = sum;
  }

  template <int NV, int RS>
  static void softmax_rows(const float* s, int64_t lds, const int* nvalid, const uint16_t* bits,
                           int bstride, float c, float* m, float* lsum, float* alpha, float* p,
                           int64_t ldp) {
    for (int r = 0; r < RS; ++r)
      softmax_row<NV>(s + r * lds, nvalid[r], bits ? bits + r * bstride : nullptr, c, m[r],
                      lsum + r * kLanes, alpha[r], p + r * ldp);
  }

  template <int R, int CV>
  static void pv(const float* p, int64_t ldp, const float* v, int64_t dvp, int n, float* o,
                 int64_t ldo, const float* alpha) {
    for (int r = 0; r < R; ++r) {
      float acc[CV * kLanes];
      for (int c = 0; c < CV * kLanes; ++c) acc[c] = o[r * ldo + c] * alpha[r];
      for (int j = 0; j < n; ++j) {
        const float a = p[r * ldp + j];
        for (int c = 0; c < CV * kLanes; ++c) acc[c] += a * v[j * dvp + c];
      }
      for (int c = 0; c < CV * kLanes; ++c) o[r * ldo + c] = acc[c];
    }
  }

  static float row_sum(const float* lsum) { return lsum[0]; }
};

#if defined(__AVX512F__)
using mha_exp2::exp2_avx512;

using mha_lanes::lanes_below;
using mha_lanes::load_row16;

// Register-tile accumulators: zero, alpha-scaled load, rank-1 update, store (register_tiles.h).
using mha_tiles::acc_dot_blocks;
using mha_tiles::transpose16;
using mha_tiles::acc_load_scaled;
using mha_tiles::acc_rank1;
using mha_tiles::acc_store;
using mha_tiles::acc_zero;

// The online-softmax update of RS rows (interleaved, so their reduction and exp latency
// chains overlap), shared by both AVX-512 kernels. Scores become base-2 logits t = s * c
// (c = scale * log2 e); masked lanes are -inf. P is written as fp32 or rounded to bf16.
// Row r: scores s + r lds, nvalid[r] leading keys visible, bits + r * bstride (or no bits).
template <int NV, int RS, bool Bf16Out, typename P>
inline void softmax_rows_avx512(const float* s, int64_t lds, const int* nvalid,
                                const uint16_t* bits, int bstride, float c, float* m,
                                float* lsum, float* alpha, P* p, int64_t ldp) {
  const __m512 neg = _mm512_set1_ps(kNegInf), cv = _mm512_set1_ps(c);
  __m512 x[RS][NV], mx[RS];
  float mnew[RS];
  __mmask16 keep[RS][NV];
#pragma GCC unroll 4
  for (int r = 0; r < RS; ++r) {
    mx[r] = neg;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      __mmask16 k = lanes_below(nvalid[r] - v * kLanes);
      if (bits) k &= bits[r * bstride + v];
      keep[r][v] = k;
      x[r][v] = _mm512_mask_mul_ps(neg, k, _mm512_loadu_ps(s + r * lds + v * kLanes), cv);
      mx[r] = _mm512_max_ps(mx[r], x[r][v]);
    }
  }
  // vmaxps may drop a NaN score: next to a finite one it still gives a NaN P (exp2 keeps NaN),
  // so a NaN l and a NaN row; a NaN running max stays. Only "every visible score NaN" would
  // look like "nothing visible": checked there (masked lanes hold -inf, never NaN).
#pragma GCC unroll 4
  for (int r = 0; r < RS; ++r) {
    mnew[r] = std::isnan(m[r]) ? m[r] : std::max(m[r], _mm512_reduce_max_ps(mx[r]));
    if (mnew[r] == kNegInf) {
      __mmask16 nan = 0;
      for (int v = 0; v < NV; ++v) nan |= _mm512_cmp_ps_mask(x[r][v], x[r][v], _CMP_UNORD_Q);
      if (nan) mnew[r] = std::numeric_limits<float>::quiet_NaN();
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RS; ++r) {
    P* pr = p + r * ldp;
    if (mnew[r] == kNegInf) {  // nothing visible yet in this row
      alpha[r] = 1.f;
      for (int n = 0; n < NV * kLanes; ++n) pr[n] = P(0);
      continue;
    }
    alpha[r] = _mm512_cvtss_f32(exp2_avx512(_mm512_set1_ps(m[r] - mnew[r])));  // m = -inf: 0; NaN
    m[r] = mnew[r];
    const __m512 mv = _mm512_set1_ps(mnew[r]);
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(lsum + r * kLanes), _mm512_set1_ps(alpha[r]));
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      // s c - m with the product unrounded (one FMA), as the backward recomputes P
      const __m512 e = exp2_avx512(_mm512_mask_blend_ps(
          keep[r][v], neg, _mm512_fmsub_ps(_mm512_loadu_ps(s + r * lds + v * kLanes), cv, mv)));
      sum = _mm512_add_ps(sum, e);
      if constexpr (Bf16Out) {
#if defined(__AVX512BF16__)
        __m256bh h = _mm512_cvtneps_pbh(e);
        std::memcpy(pr + v * kLanes, &h, sizeof(h));
#endif
      } else {
        _mm512_storeu_ps(reinterpret_cast<float*>(pr) + v * kLanes, e);
      }
    }
    _mm512_storeu_ps(lsum + r * kLanes, sum);
  }
}

#if defined(__AVX512DQ__)
#define MHA_FLASH_LAZY_SOFTMAX 1  // softmax_lazy_avx512 (vreduceps is AVX512DQ)
using mha_exp2::exp2_ftz_avx512;
using mha_exp2::exp2_ftz_unclamped_avx512;

// 2^x for a P that is rounded to bf16 (8-bit mantissa, relative rounding error up to 2^-9)
// before P V, x <= 16 (see kLazyRescaleLimit; or masked): a degree-3 polynomial suffices.
// 2^x = 2^floor(x) * p(f), f = x - floor(x) in [0, 1) (one vreduceps), p fitted
// (relative-error minimax) for this file, max relative error 7.5e-5; 2^floor(x) by the
// vscalefps that also zeroes the lanes outside `keep`. Like exp2_ftz_avx512 (the fp32 P's),
// it runs with flush-to-zero set (mha_exp2::FlushToZero): no clamp of x, and no microcode assist
// for results below the smallest normal float on Intel cores (AMD Zen 5 takes none either way:
// measured).
constexpr float kExp2F0 = 9.999249578e-01f, kExp2F1 = 6.958347559e-01f,
                kExp2F2 = 2.260666192e-01f, kExp2F3 = 7.802354544e-02f;
inline __m512 exp2_bf16_avx512(__m512 x, __mmask16 keep) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(kExp2F3), f, _mm512_set1_ps(kExp2F2));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2F1));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2F0));
  return _mm512_maskz_scalef_ps(keep, y, x);
}

// The running max m of a row is a lazy one: P = 2^(t - m) with the m of an earlier block for as
// long as no lane's sum of this block's P exceeds 2^kLazyRescaleLimit (so every P <= 2^16 and
// O, l stay far from overflow); only then is the block's max taken, m moved to it, and O, l
// rescaled. Exact: the final O / l and lse = m + log2 l use the same (stale) m. The first
// visible block of a row sets m to its max. Saves the per-block max and most O rescales.
constexpr float kLazyRescaleLimit = 65536.f;  // 2^16

// The fast path's test on a row's block sums (16 lanes): every lane in [0, limit]. A lane
// outside (above the limit, or -inf / NaN from the unclamped exp2: a score of +-inf, NaN, or
// far above the stale max) sends the row to the slow path, lazy_move_max, which clamps.
__attribute__((always_inline)) inline bool lazy_sums_ok(__m512 sum, __m512 limit) {
  return (_mm512_cmp_ps_mask(sum, limit, _CMP_LE_OQ) &
          _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GE_OQ)) == __mmask16(0xFFFF);
}

// P of one row and this block's sum of it per lane: P = 2^(s c - m) (one FMA and one exp2 per
// 16 lanes). P as fp32 (degree-7 exp2, fp32 accuracy) or as bf16 pairs (degree-3 exp2; keys
// 2i, 2i + 1 in one 32-bit word: the layout vdpbf16ps broadcasts and the AMX A tile reads).
// Clamp: fp32 P by exp2_ftz_avx512 (the slow path), else by exp2_ftz_unclamped_avx512 (the
// fast path, whose sums lazy_sums_ok judges).
template <int NV, bool Clamp, typename P>
__attribute__((always_inline)) inline __m512 row_exp(const float* s, const __mmask16* keep,
                                                     __m512 cv, float m, P* pr) {
  const __m512 mneg = _mm512_set1_ps(-m);
  __m512 sum = _mm512_setzero_ps();
  if constexpr (std::is_same_v<P, float>) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(s + v * kLanes), cv, mneg);
      const __m512 e =
          Clamp ? exp2_ftz_avx512(x, keep[v]) : exp2_ftz_unclamped_avx512(x, keep[v]);
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(pr + v * kLanes, e);
    }
  } else {
#if defined(__AVX512BF16__)
#pragma GCC unroll 8
    for (int v = 0; v + 1 < NV; v += 2) {
      const __m512 e0 =
          exp2_bf16_avx512(_mm512_fmadd_ps(_mm512_loadu_ps(s + v * kLanes), cv, mneg), keep[v]);
      const __m512 e1 = exp2_bf16_avx512(
          _mm512_fmadd_ps(_mm512_loadu_ps(s + (v + 1) * kLanes), cv, mneg), keep[v + 1]);
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(pr + v * kLanes, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    if constexpr (NV % 2 == 1) {
      const __m512 e = exp2_bf16_avx512(
          _mm512_fmadd_ps(_mm512_loadu_ps(s + (NV - 1) * kLanes), cv, mneg), keep[NV - 1]);
      sum = _mm512_add_ps(sum, e);
      const __m256bh h = _mm512_cvtneps_pbh(e);
      std::memcpy(pr + (NV - 1) * kLanes, &h, sizeof(h));
    }
#endif
  }
  return sum;
}

// The lazy softmax of one row past its fast path (none, or a block sum above the limit): this
// block's max logit moves m where it is above it (m, l rescaled by alpha), then P and l with
// the new m. sr: the row's scores, lr: its l (16 lanes), alpha preset to 1.
template <int NV, typename P>
inline void lazy_move_max(const float* sr, const __mmask16* keep, __m512 cv, float c, float& m,
                          float* lr, float& alpha, P* pr) {
  __m512 mx = _mm512_set1_ps(kNegInf);  // this block's max logit moves m (rare after the first)
  __mmask16 nan = 0;  // visible NaN scores: vmaxps drops them, the max must not
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const __m512 sv = _mm512_loadu_ps(sr + v * kLanes);
    mx = _mm512_mask_max_ps(mx, keep[v], mx, sv);
    nan |= _mm512_mask_cmp_ps_mask(keep[v], sv, sv, _CMP_UNORD_Q);
  }
  const float mb = nan ? std::numeric_limits<float>::quiet_NaN()
                       : _mm512_reduce_max_ps(mx) * c;  // -inf when nothing is visible
  if (mb > m || std::isnan(mb)) {  // NaN: m, alpha, l and P of the row all become NaN
    alpha = _mm512_cvtss_f32(exp2_avx512(_mm512_set1_ps(m - mb)));  // m = -inf: 0
    m = mb;
    _mm512_storeu_ps(lr, _mm512_mul_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(alpha)));
  }
  if (m == kNegInf) {  // nothing visible yet in this row
    std::memset(pr, 0, NV * kLanes * sizeof(P));
    return;
  }
  const __m512 sum = row_exp<NV, true>(sr, keep, cv, m, pr);
  _mm512_storeu_ps(lr, _mm512_add_ps(_mm512_loadu_ps(lr), sum));
}

// The online-softmax update of RS rows in one pass, for scale c > 0 (max(s c) = c max(s)):
// P = 2^(s c - m) with the row's lazy max m (see kLazyRescaleLimit); alpha = 1 unless m moved.
// Masked: lanes past nvalid[r] or with a 0 bit are excluded (P = 0); otherwise every lane is
// visible. P: fp32 (Avx512F32) or bf16 pairs (Avx512Bf16, AmxBf16), see row_exp.
template <int NV, int RS, bool Masked, typename P>
inline void softmax_lazy_avx512(const float* s, int64_t lds, const int* nvalid,
                                const uint16_t* bits, int bstride, float c, float* m,
                                float* lsum, float* alpha, P* p, int64_t ldp) {
  const __m512 cv = _mm512_set1_ps(c);
  const __m512 limit = _mm512_set1_ps(kLazyRescaleLimit);
#pragma GCC unroll 4
  for (int r = 0; r < RS; ++r) {
    const float* sr = s + r * lds;
    P* pr = p + r * ldp;
    float* lr = lsum + r * kLanes;
    __mmask16 keep[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      keep[v] = __mmask16(0xFFFF);
      if constexpr (Masked) {
        keep[v] = lanes_below(nvalid[r] - v * kLanes);
        if (bits) keep[v] &= bits[r * bstride + v];
      }
    }
    alpha[r] = 1.f;
    if (m[r] != kNegInf) {  // the fast path: P with the stale max, kept where its sums pass
                            // lazy_sums_ok (a NaN, +-inf or far too large score does not)
      const __m512 sum = row_exp<NV, false>(sr, keep, cv, m[r], pr);
      if (lazy_sums_ok(sum, limit)) {
        _mm512_storeu_ps(lr, _mm512_add_ps(_mm512_loadu_ps(lr), sum));
        continue;
      }
    }
    lazy_move_max<NV>(sr, keep, cv, c, m[r], lr, alpha[r], pr);
  }
}
#endif  // __AVX512DQ__

struct Avx512F32 {
  using packed_t = float;
  using p_t = float;
  static constexpr bool kPairs = false;
  static constexpr const char* kName = "avx512f";
  static constexpr bool kAmx = false;
#if defined(MHA_FLASH_LAZY_SOFTMAX)
  static constexpr bool kLazySoftmax = true;  // softmax_lazy when scale > 0 (else softmax_rows)
  template <int NV, int RS, bool Masked>
  static inline void softmax_lazy(const float* s, int64_t lds, const int* nvalid,
                                  const uint16_t* bits, int bstride, float c, float* m,
                                  float* lsum, float* alpha, float* p, int64_t ldp) {
    softmax_lazy_avx512<NV, RS, Masked>(s, lds, nvalid, bits, bstride, c, m, lsum, alpha, p, ldp);
  }
#else
  static constexpr bool kLazySoftmax = false;
#endif
  static constexpr int kDkAlign = 1, kKeyAlign = kLanes;

  // acc = Q K^T for R rows and NV vectors of keys: q rows of ldq, kt [dkp][ldk] packed keys.
  // A score's dkp products are summed in blocks of kDotBlock (acc_dot_blocks; s: the S tile,
  // where an earlier block's sums wait), as torch's matmul sums in blocks: one in-order sum of
  // 256 products can cost an fp32 output twice the error of the matmul's (docs/kernel.md).
  template <int R, int NV>
  MHA_TILE_INLINE static void qk_acc(const float* q, int64_t ldq, const float* kt, int64_t ldk,
                                     int dkp, __m512 (&acc)[R][NV], float* s, int64_t lds) {
    acc_dot_blocks(acc, dkp, s, lds,
                   [&](__m512 (&x)[R][NV], int64_t kk) __attribute__((always_inline)) {
                     __m512 kv[NV];
#pragma GCC unroll 4
                     for (int v = 0; v < NV; ++v) kv[v] = _mm512_loadu_ps(kt + kk * ldk + v * kLanes);
                     acc_rank1(x, kv, q + kk, ldq);
                   });
  }

  template <int R, int NV>
  static inline void qk(const float* q, int64_t ldq, const float* kt, int64_t ldk, int dkp,
                        float* s, int64_t lds) {
    __m512 acc[R][NV];
    qk_acc(q, ldq, kt, ldk, dkp, acc, s, lds);
    acc_store(acc, s, lds);
  }

#if defined(MHA_FLASH_LAZY_SOFTMAX)
  // The lazy softmax's fast path fused into Q K^T, for key blocks every row sees whole (no mask)
  // and rows whose m is set: qk, and from the tile's registers P = 2^(s c - m) (the fast
  // path's row_exp arithmetic: the same P and sums) with this chunk's per-lane sums added to
  // psum (zeroed first when `first`), in column order; S is stored too, for lazy_finish's rare
  // slow rows.
  static constexpr bool kFusedExp = true;
  template <int R, int NV>
  static inline void qk_exp(const float* q, int64_t ldq, const float* kt, int64_t ldk, int dkp,
                            float* s, int64_t lds, float c, const float* m, float* p,
                            int64_t ldp, float* psum, bool first) {
    __m512 acc[R][NV];
    qk_acc(q, ldq, kt, ldk, dkp, acc, s, lds);
    acc_store(acc, s, lds);
    const __m512 cv = _mm512_set1_ps(c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 mneg = _mm512_set1_ps(-m[r]);
      __m512 sum = first ? _mm512_setzero_ps() : _mm512_loadu_ps(psum + r * kLanes);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m512 e =
            exp2_ftz_unclamped_avx512(_mm512_fmadd_ps(acc[r][v], cv, mneg), __mmask16(0xFFFF));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(p + r * ldp + v * kLanes, e);
      }
      _mm512_storeu_ps(psum + r * kLanes, sum);
    }
  }

  // After qk_exp over a whole block (NV vectors): each row's fast path done where its block
  // sums pass lazy_sums_ok (l += sum, alpha 1), else lazy_move_max from the stored S.
  template <int NV>
  static inline void lazy_finish(const float* s, int64_t lds, int rows, float c, float* m,
                                 float* lsum, float* alpha, float* p, int64_t ldp,
                                 const float* psum) {
    const __m512 limit = _mm512_set1_ps(kLazyRescaleLimit);
    __mmask16 keep[NV];
    for (int v = 0; v < NV; ++v) keep[v] = __mmask16(0xFFFF);
    for (int r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_loadu_ps(psum + r * kLanes);
      float* lr = lsum + r * kLanes;
      alpha[r] = 1.f;
      if (lazy_sums_ok(sum, limit))
        _mm512_storeu_ps(lr, _mm512_add_ps(_mm512_loadu_ps(lr), sum));
      else
        lazy_move_max<NV>(s + r * lds, keep, _mm512_set1_ps(c), c, m[r], lr, alpha[r],
                          p + r * ldp);
    }
  }
#else
  static constexpr bool kFusedExp = false;
#endif

  template <int NV, int RS>
  static inline void softmax_rows(const float* s, int64_t lds, const int* nvalid,
                                  const uint16_t* bits, int bstride, float c, float* m,
                                  float* lsum, float* alpha, float* p, int64_t ldp) {
    softmax_rows_avx512<NV, RS, false>(s, lds, nvalid, bits, bstride, c, m, lsum, alpha, p, ldp);
  }

  template <int R, int CV>
  static inline void pv(const float* p, int64_t ldp, const float* v, int64_t dvp, int n,
                        float* o, int64_t ldo, const float* alpha) {
    __m512 acc[R][CV];
    acc_load_scaled(acc, o, ldo, alpha);
    for (int j = 0; j < n; ++j) {
      __m512 vv[CV];
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) vv[c] = _mm512_loadu_ps(v + j * dvp + c * kLanes);
      acc_rank1(acc, vv, p + j, ldp);
    }
    acc_store(acc, o, ldo);
  }

  static float row_sum(const float* lsum) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lsum)); }
};
#endif  // __AVX512F__

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define MHA_FLASH_BF16_TILES 1  // Avx512Bf16 is compiled in

struct Avx512Bf16 {
  using packed_t = uint16_t;  // raw bf16 bits
  using p_t = uint16_t;
  static constexpr bool kPairs = true;
  static constexpr const char* kName = "avx512bf16";
  static constexpr bool kAmx = false;
  static constexpr bool kLazySoftmax = true;  // softmax_lazy when scale > 0 (else softmax_rows)
  static constexpr bool kFusedExp = false;
  static constexpr int kDkAlign = 2, kKeyAlign = kLanes;

  // kt: [dkp/2][ldk][2]; q rows: dkp bf16 (dkp even).
  template <int R, int NV>
  static inline void qk(const uint16_t* q, int64_t ldq, const uint16_t* kt, int64_t ldk, int dkp,
                        float* s, int64_t lds) {
    __m512 acc[R][NV];
    acc_zero(acc);
    for (int k2 = 0; k2 < dkp / 2; ++k2) {
      __m512bh kv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        kv[v] = (__m512bh)_mm512_loadu_si512(kt + (k2 * ldk + v * kLanes) * 2);
      mha_tiles::acc_rank2_bf16(acc, kv, q + 2 * k2, ldq);
    }
    acc_store(acc, s, lds);
  }

  template <int NV, int RS>
  static inline void softmax_rows(const float* s, int64_t lds, const int* nvalid,
                                  const uint16_t* bits, int bstride, float c, float* m,
                                  float* lsum, float* alpha, uint16_t* p, int64_t ldp) {
    softmax_rows_avx512<NV, RS, true>(s, lds, nvalid, bits, bstride, c, m, lsum, alpha, p, ldp);
  }

  template <int NV, int RS, bool Masked>
  static inline void softmax_lazy(const float* s, int64_t lds, const int* nvalid,
                                  const uint16_t* bits, int bstride, float c, float* m,
                                  float* lsum, float* alpha, uint16_t* p, int64_t ldp) {
    softmax_lazy_avx512<NV, RS, Masked>(s, lds, nvalid, bits, bstride, c, m, lsum, alpha, p, ldp);
  }

  // p rows: bf16, pairs of keys read as one 32-bit word; v: [n/2][dvp][2].
  template <int R, int CV>
  static inline void pv(const uint16_t* p, int64_t ldp, const uint16_t* v, int64_t dvp, int n,
                        float* o, int64_t ldo, const float* alpha) {
    __m512 acc[R][CV];
    acc_load_scaled(acc, o, ldo, alpha);
    for (int j2 = 0; j2 < (n + 1) / 2; ++j2) {
      __m512bh vv[CV];
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c)
        vv[c] = (__m512bh)_mm512_loadu_si512(v + (j2 * dvp + c * kLanes) * 2);
      mha_tiles::acc_rank2_bf16(acc, vv, p + 2 * j2, ldp);
    }
    acc_store(acc, o, ldo);
  }

  static float row_sum(const float* lsum) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lsum)); }
};
#endif  // __AVX512BF16__ && __AVX512DQ__

}  // namespace mha_flash
