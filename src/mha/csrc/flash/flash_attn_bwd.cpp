// CPU flash-attention backward (FlashAttention-2's algorithm): O(T d) memory, fp32 math.
//
// Shape legend: B batch, h query heads, h_kv key/value heads (g = h / h_kv query heads share
// one K/V head), Tq/Tk query/key lengths, d_k/d_v head dims, Br/Bc query rows/keys per block.
// Inputs q (B, h, Tq, d_k), k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v), out and grad_out
// (B, h, Tq, d_v), lse and grad_lse (B, h, Tq), any strides. Returns dq, dk, dv (contiguous,
// in q's dtype). Masks as in the forward (True = may attend, combined with AND): causal aligned
// bottom-right (query i sees keys j <= i + Tk - Tq), key_lengths (B,), a bool mask
// broadcastable to (B, h, Tq, Tk) read through its strides (stride 0 on broadcast dims), and
// a sliding window w > 0 exactly as the forward's (the left edge: query i sees keys
// j > i + Tk - Tq - w; with causal, keys i + Tk - Tq - w < j <= i + Tk - Tq).
//
// For each key block j (Bc keys) and each query block i (Br rows) that can see it:
//   S = Q_i K_j^T,  P = exp(S scale - lse_i) (masked -> 0),  dP = dO_i V_j^T,
//   dS = P (dP - delta_i) with delta_i = rowsum(dO_i O_i) - dlse_i,
//   dV_j += P^T dO_i,  dK_j += dS^T Q_i scale,  dQ_i += dS K_j scale.
// Query blocks wholly above the causal diagonal of a key block or wholly right of its window,
// and keys past key_lengths, are never touched (with a window the work is O(Tq w)). No (Tq, Tk)
// matrix exists: S, P, dP, dS live in one Br x Bc scratch per thread.
//
// NaN / Inf (the rule every backend follows, see mha.native): a pair (i, j) row i may not
// attend contributes exactly 0 to every gradient. dP = dO V^T and S can be NaN there (a NaN in
// V_j or K_j), so P and dS are selected to 0 on masked lanes (never 0 * NaN); the operands the
// products multiply by dS (Q in dK += dS^T Q, K in dQ += dS K) are packed with non-finite
// elements as 0, and a row whose q is non-finite (or whose lse is +inf) gets lse = NaN, so its
// visible pairs still give P = dS = NaN. Rows whose output is NaN have delta = rowsum(dO O) =
// NaN, hence NaN gradients from each key they see (as SDPA); rows that see no key get zero
// gradients.
//
// Work: a unit is one (b, K/V head) and one of S interleaved subsets of its key blocks
// (j = s, s + S, ...), for all g query heads of the group. It owns its dK_j, dV_j outright and
// accumulates dQ for the group's rows in its own fp32 buffer; with S > 1 those partial dQ are
// summed in the order s = 0, 1, ... after the parallel loop. S depends only on the shape, and
// every unit is computed by one thread in a fixed order, so the result is bitwise the same for
// any thread count or schedule.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/constants.h"
#include "common/kernel_choice.h"
#include "common/qkv_checks.h"
#include "common/tensor_access.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "common/exp2.h"
#include "common/register_tiles.h"
#endif
#include "common/gemm_tiles.h"
#if defined(MHA_GEMM_BF16) && defined(__AVX512BW__)
#define MHA_BWD_BF16 1  // bf16 inputs can run the five products on vdpbf16ps (see run_unit)
#endif

namespace mha_flash_bwd {
namespace {

using mha_common::kInf;
using mha_common::kLanes;
using mha_common::kLog2e;
using mha_common::round_up;
using mha_common::fill_strides;
using mha_common::widen;
// Block sizes: 32/96/128 rows and 128 keys measured within noise of 64 x 64.
constexpr int64_t kBr = 64;       // query rows per block
constexpr int64_t kBc = 64;       // keys per block (a multiple of kLanes)
constexpr int64_t kMinUnits = 8;  // split key blocks until there are this many units (shape only)

// ------------------------------------------------------------------------------ GEMM tiles
using mha_gemm::gemm;

#if defined(MHA_BWD_BF16)
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
#endif

// ------------------------------------------------------------------------------ exp
// 2^x: the forward's own (common/exp2.h), so the recomputed P is the forward's P.
#if defined(__AVX512F__)
using mha_exp2::exp2_avx512;
#endif

// ------------------------------------------------------------------------------ problem

// T is the element type of q, k, v, out, grad_out and of the gradients (float or BFloat16).
template <typename T>
struct Problem {
  const T *q, *k, *v, *out, *go;  // go may be null (no gradient of out)
  const float *lse, *glse;         // glse may be null (no gradient of lse)
  int64_t qs[4], ks[4], vs[4], os[4], gos[4], ls[3], gls[3], ms[4];
  const bool* mask = nullptr;           // ms is 0 on broadcast dims
  const int64_t* key_lengths = nullptr;
  int64_t B, h, hkv, Tq, Tk, dk, dv, splits;
  float scale;
  bool causal;
  int64_t window;           // > 0: sliding window (the left edge); 0: none
  T *dq, *dkey, *dval;      // contiguous outputs (B, h, Tq, d_k), (B, h_kv, Tk, d_k|d_v)
  float* dq_part;           // (S, B, h, Tq, d_k) partial dQ when splits > 1, else null

  // Keys j < start are left of query row i's window (0 without a window), as in the forward.
  int64_t key_start(int64_t i) const {
    return window > 0 ? std::max<int64_t>(0, i + Tk - Tq - window + 1) : 0;
  }
};

// Scratch of one unit, sized once per unit.
struct Scratch {
  std::vector<float> q, dout, lse2, delta, dq;  // the group's rows: (g, Tq, d_kp | d_vp | 1)
  std::vector<float> kt, vt, kr, dk, dv;        // one key block: K^T (d_k, Bc), V^T (d_v, Bc),
                                                // K (Bc, d_kp), dK (Bc, d_kp), dV (Bc, d_vp)
  std::vector<float> s, dp;                     // (Br, Bc): S then P, dP then dS
  // bf16 products (pairs = true): the group's rows as bf16 rows qb (g Tq, d_k2), ob (g Tq,
  // d_v2) and transposed with pairs of rows adjacent qt (g, d_k, Tq2), ot (g, d_v, Tq2); one key
  // block pair-packed: ktp (d_k2 / 2, Bc, 2), vtp (d_v2 / 2, Bc, 2), kp (Bc / 2, d_kp, 2); P and
  // dS as pairs of rows p2, ds2 (Br / 2, Bc, 2) and dS as bf16 rows dsb (Br, Bc); dK^T, dV^T
  // accumulate in dkt (d_k, Bc), dvt (d_v, Bc). d_k2, d_v2, Tq2: rounded up to even.
  std::vector<uint16_t> qb, ob, qt, ot, ktp, vtp, kp, p2, ds2, dsb;
  std::vector<float> dkt, dvt;
};

// P and dS of rows [i0, i0 + rows) of head hi against keys [j0, j0 + kn): s holds S on entry
// and P on exit, dp holds dP (or garbage when there is no grad_out) and dS on exit.
template <typename T>
void softmax_grad(const Problem<T>& P, int64_t b, int64_t hi, int64_t i0, int64_t rows, int64_t j0,
                  int64_t kn, const float* lse2, const float* delta, bool has_go, float* s,
                  float* dp) {
  const float c = P.scale * kLog2e;
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
    const float l2 = lse2[i], dl = delta[i];
    for (int64_t c0 = 0; c0 < ncols; c0 += kLanes) {
      const int64_t nvis = std::clamp<int64_t>(lim - c0, 0, kLanes);
      uint32_t bits = nvis == kLanes ? 0xFFFFu : (1u << nvis) - 1;  // lane l visible
      const int64_t nleft = std::clamp<int64_t>(first - c0, 0, kLanes);  // left of the window
      if (nleft > 0) bits &= nleft == kLanes ? 0u : ~((1u << nleft) - 1);
      if (mrow)
        for (int l = int(nleft); l < nvis; ++l)
          if (!mrow[(c0 + l) * P.ms[3]]) bits &= ~(1u << l);
#if defined(__AVX512F__)
      const __mmask16 m = __mmask16(bits);
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(sr + c0), _mm512_set1_ps(c),
                                       _mm512_set1_ps(l2));
      const __m512 p = _mm512_maskz_mov_ps(m, exp2_avx512(x));
      const __m512 d = has_go ? _mm512_loadu_ps(dr + c0) : _mm512_setzero_ps();
      _mm512_storeu_ps(sr + c0, p);  // masked lanes: exactly 0, whatever S or dP hold there
      _mm512_storeu_ps(dr + c0, _mm512_maskz_mul_ps(m, p, _mm512_sub_ps(d, _mm512_set1_ps(dl))));
#else
      for (int l = 0; l < kLanes; ++l) {
        const float p = ((bits >> l) & 1) ? std::exp2(sr[c0 + l] * c - l2) : 0.f;
        const float d = has_go ? dr[c0 + l] : 0.f;
        sr[c0 + l] = p;
        dr[c0 + l] = ((bits >> l) & 1) ? p * (d - dl) : 0.f;
      }
#endif
    }
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
template <typename T>
void pack_rows(const Problem<T>& P, int64_t b, int64_t kvh, Scratch& w, int64_t dkp, int64_t dvp) {
  const int64_t g = P.h / P.hkv;
  for (int64_t hh = 0; hh < g; ++hh) {
    const int64_t hi = kvh * g + hh;
    for (int64_t t = 0; t < P.Tq; ++t) {
      const int64_t row = hh * P.Tq + t;
      const T* qr = P.q + b * P.qs[0] + hi * P.qs[1] + t * P.qs[2];
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
      const float l = P.lse[b * P.ls[0] + hi * P.ls[1] + t * P.ls[2]];
      w.lse2[row] = l == -kInf ? kInf : finite && l != kInf ? l * kLog2e : std::nanf("");
    }
  }
}

// One unit: (b, kvh) and key blocks jb = s, s + S, ...
#if defined(MHA_BWD_BF16)
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
#endif

// pairs: the five products on bf16 operands (vdpbf16ps; P and dS rounded to bf16, as the
// forward's P V does), else in fp32. Only for bf16 inputs (their Q, K, V, dO are exact in bf16).
template <typename T>
void run_unit(const Problem<T>& P, int64_t b, int64_t kvh, int64_t s, Scratch& w, bool pairs) {
  const int64_t g = P.h / P.hkv;
  const int64_t dkp = round_up(P.dk, kLanes), dvp = round_up(P.dv, kLanes);
  const int64_t dk2 = round_up(P.dk, 2), dv2 = round_up(P.dv, 2), tq2 = round_up(P.Tq, 2);
  const bool has_go = P.go != nullptr;
  w.q.resize(g * P.Tq * dkp);
  w.dout.resize(g * P.Tq * dvp);
  w.lse2.resize(g * P.Tq);
  w.delta.resize(g * P.Tq);
  w.dq.assign(g * P.Tq * dkp, 0.f);
  w.kt.resize(P.dk * kBc);
  w.vt.resize(P.dv * kBc);
  w.kr.resize(kBc * dkp);
  w.dk.resize(kBc * dkp);
  w.dv.resize(kBc * dvp);
  w.s.resize(kBr * kBc);
  w.dp.resize(kBr * kBc);
  pack_rows(P, b, kvh, w, dkp, dvp);
#if defined(MHA_BWD_BF16)
  if (pairs) pack_rows_bf16(w, g, P.Tq, P.dk, P.dv, dkp, dvp);
#endif

  const int64_t klen = P.key_lengths ? P.key_lengths[b] : P.Tk;
  const int64_t nblocks = (P.Tk + kBc - 1) / kBc;
  for (int64_t jb = s; jb < nblocks; jb += P.splits) {
    const int64_t j0 = jb * kBc, j1 = std::min(P.Tk, j0 + kBc);
    int64_t kn = std::max<int64_t>(0, std::min(j1, klen) - j0);  // keys in use (not padding)
    // query rows [i_lo, i_hi) can see a key of the block: causal, from the row whose diagonal
    // reaches key j0; window, up to the last row whose window still holds key j0 + kn - 1
    int64_t i_lo = P.causal ? std::max<int64_t>(0, j0 - (P.Tk - P.Tq)) : 0;
    int64_t i_hi = P.Tq;
    if (P.window > 0)
      i_hi = std::clamp<int64_t>(j0 + kn - 1 - (P.Tk - P.Tq) + P.window, 0, P.Tq);
    if (i_lo >= i_hi) kn = 0;  // no query row sees this block
    // pairs: blocks start on an even row (the row above sees no key here: P = 0) and end on an
    // even row or at Tq (the row below sees no key here either), so a block with an odd row
    // count is the last one of an odd Tq, whose pair partner in qt / ot is the zero padding at
    // row Tq
    if (pairs) i_lo &= ~int64_t(1), i_hi = std::min(P.Tq, round_up(i_hi, 2));
    // dK = dV = 0 for keys past key_lengths and keys no row sees
    const int64_t kv0 = (b * P.hkv + kvh) * P.Tk;
    std::fill(P.dkey + (kv0 + j0 + kn) * P.dk, P.dkey + (kv0 + j1) * P.dk, T(0.f));
    std::fill(P.dval + (kv0 + j0 + kn) * P.dv, P.dval + (kv0 + j1) * P.dv, T(0.f));
    if (kn == 0) continue;
    // pack K^T (d_k, Bc), V^T (d_v, Bc) zero-padded from kn to a 16-multiple, K (kn, d_kp)
    const int64_t ncols = round_up(kn, kLanes);
    const T* kb = P.k + b * P.ks[0] + kvh * P.ks[1] + j0 * P.ks[2];  // key j0, dim 0
    const T* vb = P.v + b * P.vs[0] + kvh * P.vs[1] + j0 * P.vs[2];
    for (int64_t jj = 0; jj < kn; ++jj) {
      float* krow = w.kr.data() + jj * dkp;
      const T* src = kb + jj * P.ks[2];
      if (P.ks[3] == 1)
        for (int64_t c = 0; c < P.dk; ++c) krow[c] = widen(src[c]);
      else
        for (int64_t c = 0; c < P.dk; ++c) krow[c] = widen(src[c * P.ks[3]]);
      std::fill(krow + P.dk, krow + dkp, 0.f);
    }
    for (int64_t c = 0; c < P.dk; ++c)
      for (int64_t jj = 0; jj < kn; ++jj) w.kt[c * kBc + jj] = w.kr[jj * dkp + c];
    // K^T (for S) as it is; K (for dQ += dS K) with non-finite elements as 0: a row that sees
    // such a key has S = NaN there, so dS = NaN, and a row that does not has dS = 0 exactly
    for (int64_t jj = 0; jj < kn; ++jj) zero_non_finite(w.kr.data() + jj * dkp, P.dk);
    for (int64_t c = 0; c < P.dv; ++c)
      for (int64_t jj = 0; jj < kn; ++jj)
        w.vt[c * kBc + jj] = widen(vb[jj * P.vs[2] + c * P.vs[3]]);
    for (int64_t c = 0; c < P.dk; ++c) std::fill_n(w.kt.data() + c * kBc + kn, ncols - kn, 0.f);
    for (int64_t c = 0; c < P.dv; ++c) std::fill_n(w.vt.data() + c * kBc + kn, ncols - kn, 0.f);
    std::fill_n(w.dk.data(), kn * dkp, 0.f);  // dK, dV rows in use
    std::fill_n(w.dv.data(), kn * dvp, 0.f);
#if defined(MHA_BWD_BF16)
    if (pairs) pack_block_bf16(w, P.dk, P.dv, kn, ncols, dkp);
#endif
    for (int64_t hh = 0; hh < g; ++hh) {
      const int64_t hi = kvh * g + hh;
      const float* qh = w.q.data() + hh * P.Tq * dkp;
      const float* oh = w.dout.data() + hh * P.Tq * dvp;
      for (int64_t i0 = i_lo; i0 < i_hi; i0 += kBr) {
        const int64_t rows = std::min(kBr, i_hi - i0);
        const float* qi = qh + i0 * dkp;   // (rows, d_kp)
        const float* oi = oh + i0 * dvp;   // (rows, d_vp)
        float* dqi = w.dq.data() + (hh * P.Tq + i0) * dkp;  // (rows, d_kp)
#if defined(MHA_BWD_BF16)
        if (pairs) {
          const uint16_t* qbi = w.qb.data() + (hh * P.Tq + i0) * dk2;  // (rows, d_k2)
          const uint16_t* obi = w.ob.data() + (hh * P.Tq + i0) * dv2;  // (rows, d_v2)
          // S = Q_i K_j^T: (rows, d_k) x (d_k, Bc); dP = dO_i V_j^T: (rows, d_v) x (d_v, Bc)
          gemm(rows, ncols, dk2 / 2, qbi, dk2, 0, w.ktp.data(), kBc, w.s.data(), kBc, false);
          if (has_go)
            gemm(rows, ncols, dv2 / 2, obi, dv2, 0, w.vtp.data(), kBc, w.dp.data(), kBc, false);
          softmax_grad(P, b, hi, i0, rows, j0, kn, w.lse2.data() + hh * P.Tq,
                       w.delta.data() + hh * P.Tq, has_go, w.s.data(), w.dp.data());
          const int64_t rp = round_up(rows, 2);
          for (int64_t r = 0; r < rp; r += 2) {  // P, dS as pairs of rows; dS as bf16 rows
            const bool two = r + 1 < rows;
            pack_pairs(w.s.data() + r * kBc, two ? w.s.data() + (r + 1) * kBc : nullptr, ncols,
                       w.p2.data() + r * kBc);
            pack_pairs(w.dp.data() + r * kBc, two ? w.dp.data() + (r + 1) * kBc : nullptr,
                       ncols, w.ds2.data() + r * kBc);
          }
          for (int64_t r = 0; r < rows; ++r)
            to_bf16_row(w.dp.data() + r * kBc, ncols, w.dsb.data() + r * kBc);
          // dV_j^T += dO_i^T P: (d_v, rows) x (rows, Bc); dK_j^T += Q_i^T dS: (d_k, rows) x
          // (rows, Bc); rows i0.. of the transposed group rows (i0 even: whole pairs)
          if (has_go)
            gemm(P.dv, ncols, rp / 2, w.ot.data() + hh * P.dv * tq2 + i0, tq2, 0, w.p2.data(),
                 kBc, w.dvt.data(), kBc, true);
          gemm(P.dk, ncols, rp / 2, w.qt.data() + hh * P.dk * tq2 + i0, tq2, 0, w.ds2.data(),
               kBc, w.dkt.data(), kBc, true);
          // dQ_i += dS K_j: (rows, Bc) x (Bc, d_kp)
          gemm(rows, dkp, ncols / 2, w.dsb.data(), kBc, 0, w.kp.data(), dkp, dqi, dkp, true);
          continue;
        }
#endif
        gemm(rows, ncols, P.dk, qi, dkp, 1, w.kt.data(), kBc, w.s.data(), kBc, false);  // S
        if (has_go)  // dP = dO_i V_j^T: (rows, d_v) x (d_v, Bc)
          gemm(rows, ncols, P.dv, oi, dvp, 1, w.vt.data(), kBc, w.dp.data(), kBc, false);
        softmax_grad(P, b, hi, i0, rows, j0, kn, w.lse2.data() + hh * P.Tq,
                     w.delta.data() + hh * P.Tq, has_go, w.s.data(), w.dp.data());
        if (has_go)  // dV_j += P^T dO_i: (kn, rows) x (rows, d_vp)
          gemm(kn, dvp, rows, w.s.data(), 1, kBc, oi, dvp, w.dv.data(), dvp, true);
        // dK_j += dS^T Q_i: (kn, rows) x (rows, d_kp)
        gemm(kn, dkp, rows, w.dp.data(), 1, kBc, qi, dkp, w.dk.data(), dkp, true);
        // dQ_i += dS K_j: (rows, kn) x (kn, d_kp)
        gemm(rows, dkp, kn, w.dp.data(), kBc, 1, w.kr.data(), dkp, dqi, dkp, true);
      }
    }
    if (pairs)  // dK, dV rows from the transposed accumulators
      for (int64_t jj = 0; jj < kn; ++jj) {
        for (int64_t c = 0; c < P.dk; ++c) w.dk[jj * dkp + c] = w.dkt[c * kBc + jj];
        for (int64_t c = 0; c < P.dv; ++c) w.dv[jj * dvp + c] = w.dvt[c * kBc + jj];
      }
    for (int64_t jj = 0; jj < kn; ++jj) {
      T* dkr = P.dkey + (kv0 + j0 + jj) * P.dk;
      T* dvr = P.dval + (kv0 + j0 + jj) * P.dv;
      for (int64_t c = 0; c < P.dk; ++c) dkr[c] = T(w.dk[jj * dkp + c] * P.scale);
      for (int64_t c = 0; c < P.dv; ++c) dvr[c] = T(w.dv[jj * dvp + c]);
    }
  }
  // dQ of the group's rows: final (scaled) when unsplit, else this split's partial sum
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t t = 0; t < P.Tq; ++t) {
      const int64_t row = (b * P.h + kvh * g + hh) * P.Tq + t;
      const float* src = w.dq.data() + (hh * P.Tq + t) * dkp;
      if (P.splits == 1) {
        T* dst = P.dq + row * P.dk;
        for (int64_t c = 0; c < P.dk; ++c) dst[c] = T(src[c] * P.scale);
      } else {
        float* dst = P.dq_part + (s * P.B * P.h * P.Tq + row) * P.dk;
        std::copy(src, src + P.dk, dst);
      }
    }
}

// bf16 inputs: the products on vdpbf16ps where the dot-product unit is fast (AMD Zen 4/5: twice
// the fp32 FMA rate), as the forward picks its bf16 tiles; elsewhere in fp32 (Intel cores run
// vdpbf16ps at half the fp32 FMA rate). MHA_FLASH_BF16=avx512bf16 forces the bf16 products, any
// other value fp32; math "bf16" / "fp32" (the test op) overrides both. Fixed per process.
bool use_bf16_products(const std::string& math) {
#if defined(MHA_BWD_BF16)
  if (math == "bf16" || math == "fp32") return math == "bf16";
  const auto& env = mha_common::flash_bf16_override();
  return env ? *env == "avx512bf16" : mha_common::bf16_dot_is_fast();
#else
  TORCH_CHECK(math != "bf16", "flash_attention_bwd: bf16 products are not compiled in");
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& mask, bool causal, double scale, const std::string& math,
    int64_t window) {
  TORCH_CHECK(math == "auto" || math == "bf16" || math == "fp32",
              "flash_attention_bwd: math must be 'auto', 'bf16' or 'fp32', got '", math, "'");
  const mha_ops::QkvDims dims = mha_ops::check_qkv(q, k, v, "flash_attention_bwd");
  const int64_t B = dims.B, h = dims.h, Tq = dims.Tq, dk = dims.dk;
  const int64_t hkv = dims.hkv, Tk = dims.Tk, dv = dims.dv;
  const std::vector<int64_t> row_shape{B, h, Tq};
  TORCH_CHECK(out.sizes() == at::IntArrayRef({B, h, Tq, dv}) && lse.sizes() == row_shape,
              "flash_attention_bwd: expected out (B, h, Tq, d_v) and lse (B, h, Tq), got ",
              out.sizes(), " and ", lse.sizes());
  if (grad_out.has_value())
    TORCH_CHECK(grad_out->sizes() == out.sizes(),
                "flash_attention_bwd: grad_out must have out's shape ", out.sizes(), ", got ",
                grad_out->sizes());
  if (grad_lse.has_value())
    TORCH_CHECK(grad_lse->sizes() == lse.sizes(),
                "flash_attention_bwd: grad_lse must have lse's shape ", lse.sizes(), ", got ",
                grad_lse->sizes());
  const auto f32 = at::kFloat, dt = q.scalar_type();
  const bool nothing = (!grad_out.has_value() && !grad_lse.has_value()) || B == 0 || h == 0 ||
                       Tq == 0 || Tk == 0;
  // gradients in q's dtype; the kernel writes every element (zeros where no row sees a key)
  auto make = [&](at::IntArrayRef shape) {
    return nothing ? at::zeros(shape, q.options()) : at::empty(shape, q.options());
  };
  at::Tensor dq = make({B, h, Tq, dk}), dkey = make({B, hkv, Tk, dk}),
             dval = make({B, hkv, Tk, dv});
  if (nothing) return {dq, dkey, dval};
  // out and grad_out in q's dtype (a copy only if they differ), lse and grad_lse in fp32
  const at::Tensor of = out.to(dt), lf = lse.to(f32);
  at::Tensor gof, glf, kl, m;
  if (grad_out.has_value()) gof = grad_out->to(dt);
  if (grad_lse.has_value()) glf = grad_lse->to(f32);
  if (key_lengths.has_value()) {
    TORCH_CHECK(key_lengths->dim() == 1 && key_lengths->size(0) == B,
                "flash_attention_bwd: key_lengths must have shape (B,) = (", B, ",), got ",
                key_lengths->sizes());
    kl = key_lengths->to(at::kLong).contiguous();
    const int64_t* len = kl.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(len[b] >= 0 && len[b] <= Tk,
                  "flash_attention_bwd: key_lengths must lie in [0, Tk=", Tk, "]");
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4,
                "flash_attention_bwd: mask must be a 4-D bool tensor broadcastable to "
                "(B, h, Tq, Tk)");
    const int64_t want[4] = {B, h, Tq, Tk};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(mask->size(d) == 1 || mask->size(d) == want[d], "flash_attention_bwd: mask ",
                  mask->sizes(), " is not broadcastable to (B, h, Tq, Tk) = (", B, ", ", h, ", ",
                  Tq, ", ", Tk, ")");
    m = *mask;
  }
  const int64_t groups = B * hkv, nblocks = (Tk + kBc - 1) / kBc;
  const int64_t splits = std::max<int64_t>(1, std::min(nblocks, (kMinUnits + groups - 1) / groups));
  at::Tensor part;
  if (splits > 1) part = at::empty({splits, B, h, Tq, dk}, q.options().dtype(f32));

  auto run = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> P;
    P.q = q.data_ptr<T>(), P.k = k.data_ptr<T>(), P.v = v.data_ptr<T>();
    P.out = of.data_ptr<T>(), P.lse = lf.data_ptr<float>();
    fill_strides(q, P.qs, 4, false);
    fill_strides(k, P.ks, 4, false);
    fill_strides(v, P.vs, 4, false);
    fill_strides(of, P.os, 4, false);
    fill_strides(lf, P.ls, 3, false);
    P.go = gof.defined() ? gof.data_ptr<T>() : nullptr;
    if (gof.defined()) fill_strides(gof, P.gos, 4, false);
    P.glse = glf.defined() ? glf.data_ptr<float>() : nullptr;
    if (glf.defined()) fill_strides(glf, P.gls, 3, false);
    P.key_lengths = kl.defined() ? kl.data_ptr<int64_t>() : nullptr;
    P.mask = m.defined() ? m.data_ptr<bool>() : nullptr;
    if (m.defined()) fill_strides(m, P.ms, 4, true);
    P.B = B, P.h = h, P.hkv = hkv, P.Tq = Tq, P.Tk = Tk, P.dk = dk, P.dv = dv;
    P.scale = float(scale);
    P.causal = causal;
    P.window = window > 0 && window < Tk ? window : 0;  // w >= Tk hides no key: no window
    P.splits = splits;
    P.dq = dq.data_ptr<T>(), P.dkey = dkey.data_ptr<T>(), P.dval = dval.data_ptr<T>();
    P.dq_part = splits > 1 ? part.data_ptr<float>() : nullptr;
    // bf16 products pay for their packing from one whole block each way on (measured: at
    // 32 x 8 x 20 x 64 they were ~15 % slower than fp32, at 4 x 8 x 512 x 64 ~30 % faster)
    const bool big = Tq >= kBr && Tk >= kBc;
    const bool pairs = std::is_same_v<T, at::BFloat16> &&
                       (math == "auto" ? big && use_bf16_products(math) : use_bf16_products(math));
    at::parallel_for(0, groups * splits, 1, [&](int64_t u0, int64_t u1) {
      Scratch w;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t s = u % splits, grp = u / splits;
        run_unit(P, grp / hkv, grp % hkv, s, w, pairs);
      }
    });
    if (splits > 1) {  // dQ = scale * (part_0 + part_1 + ...), in that order
      const int64_t n = B * h * Tq * dk;
      const float* src = P.dq_part;
      T* dst = P.dq;
      at::parallel_for(0, n, 1 << 14, [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          float acc = src[e];
          for (int64_t s = 1; s < splits; ++s) acc += src[s * n + e];
          dst[e] = T(acc * P.scale);
        }
      });
    }
  };
  if (dt == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return {dq, dkey, dval};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_fused(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& mask, bool causal, double scale, int64_t window) {
  return backward_impl(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, causal, scale,
                       "auto", window);
}

// The backward with the products' arithmetic named ("auto", "bf16", "fp32"), for tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_fused_math(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& mask, bool causal, double scale, std::string math,
    int64_t window) {
  return backward_impl(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, causal, scale,
                       math, window);
}

// Which arithmetic the backward's products use for bf16 inputs of at least one 64-row query
// block and one 64-key block ("bf16" or "fp32"; smaller problems always run fp32).
std::string flash_attention_bwd_bf16_math() { return use_bf16_products("auto") ? "bf16" : "fp32"; }

}  // namespace
}  // namespace mha_flash_bwd

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("flash_attention_bwd_fused(Tensor? grad_out, Tensor? grad_lse, Tensor q, Tensor k, "
        "Tensor v, Tensor out, Tensor lse, Tensor? key_lengths, Tensor? mask, bool causal, "
        "float scale, int window=0) -> (Tensor, Tensor, Tensor)");
  m.def("_flash_attention_bwd_fused_math(Tensor? grad_out, Tensor? grad_lse, Tensor q, "
        "Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_lengths, Tensor? mask, "
        "bool causal, float scale, str math, int window=0) -> (Tensor, Tensor, Tensor)");
  m.def("flash_attention_bwd_bf16_math() -> str", &mha_flash_bwd::flash_attention_bwd_bf16_math);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("flash_attention_bwd_fused", &mha_flash_bwd::flash_attention_bwd_fused);
  m.impl("_flash_attention_bwd_fused_math", &mha_flash_bwd::flash_attention_bwd_fused_math);
}
