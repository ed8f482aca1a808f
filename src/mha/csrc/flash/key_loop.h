// The register-tile key loop of one query block (Worker::run_item down to key_block): S = Q K^T,
// the online softmax, O = alpha O + P V, the exact pass for hostile inputs, and the output rows.
#pragma once

#include "flash/trace.h"
#include "flash/worker.h"

namespace mha_flash {
namespace {

// Logits (base 2) from which a row's float softmax may go wrong: P = 2^(fma(s, c, -m)) with
// m = fl(max s c) leaves every P of the row scaled by 2^(the max's rounding error), up to
// half an ulp of m: harmless below 2^24 (at most 2^0.5, and common to the row, so O / l and
// lse are unchanged), an overflow to inf (NaN rows) or to 0 (zero rows) beyond ~2^31; and s c
// itself overflows to -inf (taken for "masked") for |s c| > FLT_MAX. Only a huge bias or
// ALiBi slope, or huge q and k, bring a row there.
constexpr float kWideLogit = 16777216.f;  // 2^24

// Whether a row that the float softmax left with max m and sum l is run again by the wide
// softmax (softmax_wide): a max at or beyond kWideLogit, or +-inf (the row's answer is NaN
// then either way), a non-finite sum with a finite max, or no visible logit where a finite
// score may have overflowed s c (can_overflow: a score variant on, or c > 1, and the row has
// keys before its bool mask). A NaN max: the row is NaN whichever way it is computed.
inline bool needs_wide(float m, float l, bool can_overflow) {
  if (std::isnan(m)) return false;
  if (m == kNegInf) return can_overflow;
  return !(std::fabs(m) < kWideLogit) || !std::isfinite(l);
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::zero_rows(int64_t b, int64_t hq, int64_t i0, int64_t i1) const {
  // no key: zeros; the log-sum-exp is the sink's logit (the only term left), else -inf
  const double lse = P.mods.sinks ? P.mods.sinks[hq] : kNegInf;
  for (int64_t i = i0; i < i1; ++i) {
    T* orow = P.out_row(b, hq, i);
    for (int64_t c = 0; c < P.dv; ++c) orow[c * P.os[3]] = T(0);
    P.lse_at(b, hq, i) = lse;
  }
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::run_item(const Item& it) {
  const int64_t kend = P.key_limit(it.b, it.i1 - 1);
  const int64_t kbeg = P.key_start(it.i0) / Nb * Nb;  // first key block any row sees
  const int64_t h0 = it.kh * g;
  if (kend <= kbeg) {
    for (int64_t hq = h0; hq < h0 + g; ++hq) zero_rows(it.b, hq, it.i0, it.i1);
    return;
  }
  const int64_t nkeys = round_up(kend, Nb) - kbeg;
  packed_t* kt = sc.kt.get(nkeys * dkp);
  packed_t* vp = nullptr;
  if constexpr (std::is_same_v<T, packed_t>)  // the tiles only read V (packed_t* for pack_kv)
    if (v_in_place) vp = const_cast<packed_t*>(P.v_row(it.b, it.kh, kbeg));
  if (!vp) vp = sc.v.get(nkeys * dvp);
  if (!P.plan.on()) {
    const TraceSpan span(it.b * P.hkv + it.kh, -1);  // benchmark builds only (flash/trace.h)
    pack_kv(it.b, it.kh, kbeg, kend, kt, vp);
  } else {  // only the key blocks some query block of the item visits (EMPTY ones: never read)
    for (int64_t jb = kbeg; jb < kend; jb += Nb) {
      bool used = false;
      for (int64_t hq = h0; hq < h0 + g && !used; ++hq)
        for (int64_t i0 = it.i0; i0 < it.i1 && !used; i0 += kRowsPerBlock)
          used = P.plan.row(it.b, hq, i0 / kRowsPerBlock)[jb / mha_common::kPlanKeys] !=
                 mha_common::kPlanEmpty;
      if (used)  // key block jb alone, at its place in the packed buffers
        pack_kv(it.b, it.kh, jb, std::min(jb + Nb, kend), kt + (jb - kbeg) / Nb * dkp * Nb,
                vp + (jb - kbeg) * ldv);
    }
  }
  for (int64_t hq = h0; hq < h0 + g; ++hq)
    for (int64_t i0 = it.i0; i0 < it.i1; i0 += kRowsPerBlock) {
      const TraceSpan span(it.b * P.h + hq, i0);
      query_block(it.b, hq, i0, std::min(it.i1, i0 + kRowsPerBlock), kbeg, kt, vp);
    }
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::query_block(int64_t b, int64_t hq, int64_t i0, int64_t i1, int64_t kbeg,
                 const packed_t* kt, const packed_t* vp) {
  const int rows = int(i1 - i0);
  hq_ = hq;
  prow_ = P.plan.on() ? P.plan.row(b, hq, i0 / kRowsPerBlock) : nullptr;  // i0: a block's start
  const int64_t kend = P.key_limit(b, i1 - 1);
  const int64_t jlo = P.key_start(i0) / Nb * Nb;  // the block's first key block (>= kbeg)
  if (kend <= jlo) return zero_rows(b, hq, i0, i1);
  kt += (jlo - kbeg) / Nb * dkp * Nb;  // key block jlo
  vp += (jlo - kbeg) * ldv;            // same offset for both V layouts (jlo - kbeg is even)
  const int rp = K::kAmx ? int(round_up(rows, 16)) : rows;  // AMX tiles take 16 rows
  packed_t* q = sc.q.get(rp * dkp);
  // AMX: one 16-row S and P (a group at a time), two groups' S (group_pair_runs); the exact
  // pass (key_loop) takes rows of each, as the other kernels do
  float* s = sc.s.get(std::max(K::kAmx ? 32 : 0, rp) * Nb);
  p_t* p = sc.p.get(std::max(K::kAmx ? 16 : 0, rp) * Nb);
  float* o = sc.o.get(rp * dvp);
  float* m = sc.m.get(rows);
  float* alpha = sc.alpha.get(rows);
  float* lsum = sc.lsum.get(rows * kLanes);
  uint16_t* bits = sc.bits.get(rows * kMaxVecsPerBlock);
  for (int r = 0; r < rows; ++r) {
    const T* qrow = P.q_row(b, hq, i0 + r);
    constexpr bool same_bits =  // packing copies the bits (fp32, or bf16 kept as bf16)
        std::is_same_v<T, packed_t> ||
        (std::is_same_v<T, at::BFloat16> && std::is_same_v<packed_t, uint16_t>);
    if (same_bits && P.qs[3] == 1 && dkp == P.dk) {
      std::memcpy(q + r * dkp, qrow, dkp * sizeof(packed_t));
    } else {
      for (int64_t kk = 0; kk < dkp; ++kk)
        q[r * dkp + kk] = kk < P.dk ? pack_elem<packed_t>(qrow[kk * P.qs[3]]) : packed_t(0);
    }
  }
  std::fill(q + rows * dkp, q + rp * dkp, packed_t(0));  // AMX padding rows
  const bool* mrow0 = P.mask ? P.mask + b * P.ms[0] + hq * P.ms[1] : nullptr;
  key_loop(b, i0, rows, rp, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum, bits, false);
  // The tiles multiply every key of a block by its P, P = 0 at keys a row may not attend, and
  // 0 * NaN (or Inf) in V is NaN: a non-finite O in a row whose l is finite (not NaN: then
  // every output of the row is NaN anyway) may come from such a key. Only then is the block
  // run again with those products skipped (key_loop's exact pass): finite inputs never pay.
  bool redo = false;
  for (int r = 0; r < rows && !redo; ++r) {
    const float l = K::row_sum(lsum + r * kLanes);
    redo = !std::isnan(l) && !mha_finite::all_finite(o + r * dvp, P.dv);
  }
  // A row of huge logits (needs_wide): the block runs again with the wide softmax, its
  // products as the exact pass takes them. Finite logits of ordinary size never get here.
  const float c = P.mods.score_scale(P.scale) * kLog2e;
  const bool can_overflow = P.mods.on_scores() || std::fabs(c) > 1.f;
  bool wide = false;
  for (int r = 0; r < rows && !wide; ++r)
    wide = needs_wide(m[r], K::row_sum(lsum + r * kLanes),
                      can_overflow && P.key_limit(b, i0 + r) > P.key_start(i0 + r));
  if (wide) {
    wide_m_ = sc.wm.get(rows);
    wide_l_ = sc.wl.get(rows);
    m_base_ = m;
    key_loop(b, i0, rows, rp, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum, bits, true);
    finish_wide(b, hq, i0, rows, o);
    wide_m_ = wide_l_ = nullptr;
    return;
  }
  if (redo)
    key_loop(b, i0, rows, rp, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum, bits, true);
  for (int r = 0; r < rows; ++r) {  // O / l and the log-sum-exp
    // l == 0: the row saw no key (zeros, lse -inf). l NaN (a NaN or +inf score reached the
    // row): inv and lse are NaN, so is the whole row. Never both: a row that saw a key has
    // a P of 1 at its max.
    float l = K::row_sum(lsum + r * kLanes), mr = m[r], inv = l != 0.f ? 1.f / l : 0.f;
    if (P.mods.sinks && l != 0.f) {  // the sink joins the denominator: l 2^m + 2^sink
      const float sk = P.mods.sink_log2(hq), mn = std::max(mr, sk);  // NaN m: stays NaN
      const float shrink = std::exp2(mr - mn);
      l = l * shrink + std::exp2(sk - mn);
      inv = shrink / l;
      mr = mn;
    }
    store_row(o + r * dvp, inv, P.out_row(b, hq, i0 + r));
    const double none = P.mods.sinks ? P.mods.sinks[hq] : kNegInf;  // no key: the sink alone
    P.lse_at(b, hq, i0 + r) =
        l != 0.f ? (double(mr) + std::log2(double(l))) * kLn2d : none;
  }
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::key_loop(int64_t b, int64_t i0, int rows, int rp, int64_t jlo, int64_t kend,
              const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* vp,
              float* s, p_t* p, float* o, float* m, float* alpha, float* lsum, uint16_t* bits,
              bool exact) {
  std::fill(m, m + rows, kNegInf);
  std::fill(lsum, lsum + rows * kLanes, 0.f);
  std::fill(o, o + rp * dvp, 0.f);
  if (wide_m_) {
    std::fill(wide_m_, wide_m_ + rows, double(kNegInf));
    std::fill(wide_l_, wide_l_ + rows, 0.0);
  }
#if defined(MHA_FLASH_AMX)
  if constexpr (K::kAmx) {
    if (!exact) {
      std::fill(p, p + 16 * Nb, p_t(0));  // rows of a partial last group stay finite
      return key_loop_amx(b, i0, rows, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum,
                          bits);
    }
  }
#endif
  // From the 16 keys holding the first row's window start (0 without a window) to the
  // end of its packed block, then whole blocks: the tiles read packed K^T at a column offset.
  for (int64_t jb = P.key_start(i0) / kLanes * kLanes; jb < kend; jb = (jb / Nb + 1) * Nb) {
    int64_t j0 = jb, jz = std::min((jb / Nb + 1) * Nb, kend);  // this block's keys [j0, jz)
    pbits_ = nullptr;
    if (prow_) {  // the plan's block (Nb is kPlanKeys, or Tk fits in one block)
      const int32_t e = prow_[jb / mha_common::kPlanKeys];
      if (e == mha_common::kPlanEmpty) continue;  // never read
      if (e >= 0) {  // partial: its bits, and only the 16-key vectors some row may attend
        pbits_ = P.plan.block_bits(e);
        int vlo, vhi;
        plan_vectors(pbits_, vlo, vhi);
        const int64_t c0 = jb / mha_common::kPlanKeys * mha_common::kPlanKeys;
        j0 = std::max(j0, c0 + vlo * kLanes);
        jz = std::min(jz, c0 + vhi * kLanes);
        if (jz <= j0) continue;
      }
    }
    const int jn = int(jz - j0);
    const int nv = (jn + kLanes - 1) / kLanes;
    const packed_t* ktb = kt + ((j0 - jlo) / Nb) * dkp * Nb + (j0 % Nb) * (K::kPairs ? 2 : 1);
    const packed_t* vb = vp + (j0 - jlo) * ldv;  // same offset for both V layouts (even)
    switch (nv) {
#define MHA_KEY_BLOCK(NV) \
case NV: key_block<NV>(b, i0, rows, j0, jn, mrow0, q, ktb, vb, s, p, o, m, alpha, lsum, bits, exact); break;
      MHA_KEY_BLOCK(1) MHA_KEY_BLOCK(2) MHA_KEY_BLOCK(3) MHA_KEY_BLOCK(4)
      MHA_KEY_BLOCK(5) MHA_KEY_BLOCK(6) MHA_KEY_BLOCK(7) MHA_KEY_BLOCK(8)
#undef MHA_KEY_BLOCK
      default: TORCH_CHECK(false, "flash_attention: bad key block width");
    }
  }
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::pv_exact(int64_t b, int64_t i0, int rows, int64_t j0, int jn, const bool* mrow0,
              const p_t* p, const packed_t* v, float* o, const float* alpha) const {
  auto to_float = [](auto x) {
    if constexpr (std::is_same_v<decltype(x), uint16_t>) {
      const uint32_t u = uint32_t(x) << 16;  // bf16 bits: the top half of an fp32
      float f;
      std::memcpy(&f, &u, sizeof(f));
      return f;
    } else {
      return float(x);
    }
  };
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r, lo = P.key_start(i), hi = P.key_limit(b, i);
    const bool* mrow = mrow0 ? mrow0 + i * P.ms[2] : nullptr;
    float* orow = o + r * dvp;
    for (int64_t c = 0; c < dvp; ++c) orow[c] *= alpha[r];
    for (int n = 0; n < jn; ++n) {
      const int64_t j = j0 + n;
      if (j < lo || j >= hi || (mrow && !mrow[j * P.ms[3]])) continue;
      if (pbits_ && !pbits_[(i % kRowsPerBlock) * mha_common::kPlanKeys + j % mha_common::kPlanKeys])
        continue;
      const float pj = to_float(p[r * Nb + n]);
      for (int64_t c = 0; c < P.dv; ++c) {
        const packed_t x = K::kPairs ? v[(n / 2) * dvp * 2 + c * 2 + (n & 1)] : v[n * ldv + c];
        orow[c] += pj * to_float(x);
      }
    }
  }
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::store_row(const float* o, float inv, T* __restrict orow) const {
  int64_t c = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; c + kLanes <= P.dv; c += kLanes) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + c), iv);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(orow + c, x);
    } else {  // round to nearest even, as at::BFloat16 does
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c), mha_tiles::to_bf16(x));
    }
  }
#endif
  for (; c < P.dv; ++c) orow[c] = T(o[c] * inv);
}

template <class K, typename T, class Parts>
template <int NV, int RS>
void Worker<K, T, Parts>::softmax(bool unmasked, const float* s, const int* nvalid, const uint16_t* bits, float c,
             float* m, float* lsum, float* alpha, p_t* p) const {
  if (wide_m_) {
    for (int r = 0; r < RS; ++r)
      softmax_wide<NV>(s + r * Nb, nvalid[r], bits ? bits + r * kMaxVecsPerBlock : nullptr,
                       m + r - m_base_, alpha[r], p + r * Nb);
    return;
  }
#if defined(__AVX512F__)
  if constexpr (K::kLazySoftmax) {
    if (c > 0.f) {
      if (unmasked)
        K::template softmax_lazy<NV, RS, false>(s, Nb, nvalid, bits, kMaxVecsPerBlock, c, m,
                                                lsum, alpha, p, Nb);
      else
        K::template softmax_lazy<NV, RS, true>(s, Nb, nvalid, bits, kMaxVecsPerBlock, c, m,
                                               lsum, alpha, p, Nb);
      return;
    }
  }
#endif
  K::template softmax_rows<NV, RS>(s, Nb, nvalid, bits, kMaxVecsPerBlock, c, m, lsum, alpha,
                                   p, Nb);
}

template <class K, typename T, class Parts>
template <int NV>
void Worker<K, T, Parts>::softmax_wide(const float* s, int nvalid, const uint16_t* bits,
                                       int64_t r, float& alpha, p_t* p) const {
  constexpr int W = NV * kLanes;
  const double u = P.mods.score_scale(P.scale);  // natural-log logits x = s u
  double x[W];
  double mb = kNegInf;
  bool nan = false;
  for (int n = 0; n < W; ++n) {
    const bool ok = n < nvalid && (!bits || ((bits[n / kLanes] >> (n % kLanes)) & 1));
    x[n] = ok ? double(s[n]) * u : double(kNegInf);  // exact: 24 x 24 bits
    if (std::isnan(x[n])) nan = true;
    else mb = std::max(mb, x[n]);
  }
  double& m = wide_m_[r];
  double& l = wide_l_[r];
  const double mnew = nan || std::isnan(m) ? std::numeric_limits<double>::quiet_NaN()
                                           : std::max(m, mb);
  if (mnew == double(kNegInf)) {  // nothing visible yet in this row
    alpha = 1.f;
    for (int n = 0; n < W; ++n) p[n] = p_t(0);
    return;
  }
  const double a = std::exp(m - mnew);  // m = -inf: 0; a +inf logit: NaN (so is the row)
  alpha = float(a);
  m = mnew;
  double sum = l * a;
  for (int n = 0; n < W; ++n) {
    const double e = x[n] == double(kNegInf) ? 0.0 : std::exp(x[n] - mnew);
    sum += e;
    if constexpr (std::is_same_v<p_t, float>) {
      p[n] = float(e);
    } else {  // bf16 bits, rounded to nearest even (NaN kept NaN)
      const float f = float(e);
      uint32_t u;
      std::memcpy(&u, &f, sizeof(u));
      p[n] = std::isnan(f) ? p_t(0x7FC0) : p_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
  }
  l = sum;
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::finish_wide(int64_t b, int64_t hq, int64_t i0, int rows,
                                      const float* o) const {
  for (int r = 0; r < rows; ++r) {  // as the float rows' O / l and lse, in double
    double l = wide_l_[r], mr = wide_m_[r], inv = l != 0.0 ? 1.0 / l : 0.0;
    if (P.mods.sinks && l != 0.0) {  // the sink joins the denominator: l e^m + e^sink
      const double sk = P.mods.sinks[hq], mn = std::max(mr, sk);
      const double shrink = std::exp(mr - mn);  // NaN m: stays NaN
      l = l * shrink + std::exp(sk - mn);
      inv = shrink / l;
      mr = mn;
    }
    store_row(o + r * dvp, float(inv), P.out_row(b, hq, i0 + r));
    const double none = P.mods.sinks ? P.mods.sinks[hq] : kNegInf;  // no key: the sink alone
    P.lse_at(b, hq, i0 + r) = l != 0.0 ? mr + std::log(l) : none;
  }
}

template <class K, typename T, class Parts>
template <int NV>
void Worker<K, T, Parts>::softmax_group(int64_t b, int64_t ia, int rg, int64_t j0, const bool* mrow0,
                   const float* st, p_t* p, float* m, float* alpha, float* lsum,
                   uint16_t* bits) const {
  constexpr int W = NV * kLanes;
  // some row's window starts inside this block (rows further down start further right)
  const bool left = j0 < P.key_start(ia + rg - 1);
  const bool unmasked =
      mrow0 == nullptr && pbits_ == nullptr && !left && j0 + W <= P.key_limit(b, ia);
  const float c = P.mods.score_scale(P.scale) * kLog2e;
  constexpr int RS = NV <= 4 ? 4 : 2;  // rows per softmax call (x[RS][NV] in registers)
  for (int r0 = 0; r0 < rg; r0 += RS) {
    const int rs = std::min(RS, rg - r0);
    int nvalid[RS];
    for (int r = r0; r < r0 + rs; ++r) {
      nvalid[r - r0] = unmasked ? W : int(std::clamp<int64_t>(P.key_limit(b, ia + r) - j0, 0, W));
      uint16_t* br = bits + r * kMaxVecsPerBlock;
      if (mrow0) mask_bits(mrow0 + (ia + r) * P.ms[2], P.ms[3], j0, P.Tk, NV, br);
      else if (left || pbits_) std::fill(br, br + NV, uint16_t(0xFFFF));
      if (left) clear_left_of(P.key_start(ia + r) - j0, NV, br);
      if (pbits_)  // a partial plan block: the mask_mod's bits of the row
        and_plan_bits(pbits_ + ((ia + r) % kRowsPerBlock) * mha_common::kPlanKeys,
                      j0 % mha_common::kPlanKeys, NV, br);
    }
    const uint16_t* rb = (mrow0 || left || pbits_) ? bits + r0 * kMaxVecsPerBlock : nullptr;
    if (rs == RS)
      softmax<NV, RS>(unmasked, st + r0 * Nb, nvalid, rb, c, m + r0, lsum + r0 * kLanes,
                      alpha + r0, p + r0 * Nb);
    else
      for (int r = 0; r < rs; ++r)
        softmax<NV, 1>(unmasked, st + (r0 + r) * Nb, nvalid + r,
                       rb ? rb + r * kMaxVecsPerBlock : nullptr, c, m + r0 + r,
                       lsum + (r0 + r) * kLanes, alpha + r0 + r, p + (r0 + r) * Nb);
  }
}

template <class K, typename T, class Parts>
template <int NV>
void Worker<K, T, Parts>::key_block(int64_t b, int64_t i0, int rows, int64_t j0, int jn,
               const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* v,
               float* s, p_t* p, float* o, float* m, float* alpha, float* lsum,
               uint16_t* bits, bool exact) {
  if constexpr (K::kFusedExp) {
    // every row sees the whole block (no mask, no score variant) and has a max: S = Q K^T and
    // P with the stale max from the tiles' registers (the lazy softmax's fast path), then the
    // rows whose block sum passes the limit take the slow path from S (lazy_finish)
    const float c = P.mods.score_scale(P.scale) * kLog2e;
    bool fused = c > 0.f && !wide_m_ && !P.mods.on_scores() && mrow0 == nullptr && pbits_ == nullptr &&
                 jn == NV * kLanes && j0 >= P.key_start(i0 + rows - 1) &&
                 j0 + jn <= P.key_limit(b, i0);
    for (int r = 0; r < rows && fused; ++r) fused = m[r] != kNegInf;
    if (fused) {
      float* psum = sc.psum.get(rows * kLanes);
      for (int c0 = 0; c0 < NV; c0 += 4) {  // column chunks of <= 64 keys
        const float* kc = kt + c0 * kLanes;
        const bool first = c0 == 0;
        float *sc0 = s + c0 * kLanes, *pc0 = p + c0 * kLanes;
        switch (std::min(4, NV - c0)) {
#define MHA_QK_EXP(NVC, RMAX)                                                                     \
  for_row_tiles<RMAX>(rows, QkExpTile<K, NVC>{q, kc, dkp, Nb, int(dkp), sc0, Nb, c, m, pc0, Nb, \
                                              psum, first});                                      \
  break;
          case 1: MHA_QK_EXP(1, rows_for(1))
          case 2: MHA_QK_EXP(2, rows_for(2))
          case 3: MHA_QK_EXP(3, rows_for(3))
          default: MHA_QK_EXP(4, rows_for(4))
#undef MHA_QK_EXP
        }
      }
      K::template lazy_finish<NV>(s, Nb, rows, c, m, lsum, alpha, p, Nb, psum);
      return pv_block(p, v, jn, rows, o, alpha);
    }
  }
  for (int c0 = 0; c0 < NV; c0 += 4) {  // S = Q K^T in column chunks of <= 64 keys
    const packed_t* kc = kt + c0 * kLanes * (K::kPairs ? 2 : 1);
    float* sc = s + c0 * kLanes;
    switch (std::min(4, NV - c0)) {
      case 1: for_row_tiles<rows_for(1)>(rows, QkTile<K, 1>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
      case 2: for_row_tiles<rows_for(2)>(rows, QkTile<K, 2>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
      case 3: for_row_tiles<rows_for(3)>(rows, QkTile<K, 3>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
      default: for_row_tiles<rows_for(4)>(rows, QkTile<K, 4>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
    }
  }
  if (P.mods.on_scores())  // softcap, bias, ALiBi on the block's scores (common/score_mods.h)
    for (int r = 0; r < rows; ++r)
      P.mods.apply_row(s + r * Nb, jn, b, hq_, i0 + r, j0, P.Tq, P.Tk, P.scale);
  softmax_group<NV>(b, i0, rows, j0, mrow0, s, p, m, alpha, lsum, bits);
  // exact pass: the tiles where every row sees every key of the block, else pv_exact
  if (exact && !(mrow0 == nullptr && pbits_ == nullptr && j0 >= P.key_start(i0 + rows - 1) &&
                 j0 + jn <= P.key_limit(b, i0)))
    return pv_exact(b, i0, rows, j0, jn, mrow0, p, v, o, alpha);
  pv_block(p, v, jn, rows, o, alpha);
}

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::pv_block(const p_t* p, const packed_t* v, int jn, int rows, float* o,
                                   const float* alpha) const {
  const int nvt = int(dvp / kLanes);
  for (int c0 = 0; c0 < nvt; c0 += 4) {
    const packed_t* vc = v + c0 * kLanes * (K::kPairs ? 2 : 1);
    float* oc = o + c0 * kLanes;
    switch (std::min(4, nvt - c0)) {
      case 1: for_row_tiles<rows_for(1)>(rows, PvTile<K, 1>{p, Nb, vc, ldv, jn, oc, dvp, alpha}); break;
      case 2: for_row_tiles<rows_for(2)>(rows, PvTile<K, 2>{p, Nb, vc, ldv, jn, oc, dvp, alpha}); break;
      case 3: for_row_tiles<rows_for(3)>(rows, PvTile<K, 3>{p, Nb, vc, ldv, jn, oc, dvp, alpha}); break;
      default: for_row_tiles<rows_for(4)>(rows, PvTile<K, 4>{p, Nb, vc, ldv, jn, oc, dvp, alpha}); break;
    }
  }
}

}  // namespace
}  // namespace mha_flash
