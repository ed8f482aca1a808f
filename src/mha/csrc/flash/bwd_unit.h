// One unit of the flash backward: (b, K/V head kvh) and its key blocks jb = s, s + S, ...,
// for all g query heads of the group, in named stages:
//   prepare_unit      size the scratch, pack the group's rows (Q, dO, lse, delta)
//   block_span        the keys of block jb in use and the query rows that can see them
//   pack_key_block    K^T, V^T and K of the block (and their bf16 forms)
//   block_products_*  S, dP, P, dS and the three gradient products of one row block
//   store_key_block   dK_j, dV_j of the block (scaled dK), zeros for keys no row sees
//   store_dq          dQ of the group's rows (final, or this split's partial sum)
#pragma once

#include <algorithm>
#include <cstdint>

#include "amx/flash_amx_bwd.h"
#include "flash/bwd_bf16_pack.h"
#include "flash/bwd_problem.h"
#include "flash/bwd_rows.h"

namespace mha_flash_bwd {
namespace {

// Padded widths of one unit: d_k, d_v rounded up to 16 lanes (fp32 rows) and to 2 (bf16
// pairs), Tq rounded up to 2 (pairs of rows).
struct Widths {
  int64_t dkp, dvp, dk2, dv2, tq2;
  template <typename T>
  explicit Widths(const Problem<T>& P)
      : dkp(round_up(P.dk, kLanes)), dvp(round_up(P.dv, kLanes)), dk2(round_up(P.dk, 2)),
        dv2(round_up(P.dv, 2)), tq2(round_up(P.Tq, 2)) {}
};

// Keys [j0, j0 + kn) of block jb are in use (not padding); query rows [i_lo, i_hi) can see
// one of them (kn = 0: nothing to do but zero the block's dK, dV).
struct BlockSpan {
  int64_t j0, j1, kn, i_lo, i_hi;
};

// tiles: the products on AMX tiles; cleared when the unit's dO is not finite (then the
// vdpbf16ps products run it, see amx/flash_amx_bwd.h).
template <typename T>
void prepare_unit(const Problem<T>& P, int64_t b, int64_t kvh, Scratch& w, const Widths& W,
                  bool pairs, bool& tiles) {
  const int64_t g = P.h / P.hkv;
  w.q.resize(g * P.Tq * W.dkp);
  w.dout.resize(g * P.Tq * W.dvp);
  w.lse2.resize(g * P.Tq);
  w.lse2lo.resize(g * P.Tq);
  w.delta.resize(g * P.Tq);
  w.dq.assign(g * P.Tq * W.dkp, 0.f);
  w.kt.resize(P.dk * kBc);
  w.vt.resize(P.dv * kBc);
  w.kr.resize(kBc * W.dkp);
  w.dk.resize(kBc * W.dkp);
  w.dv.resize(kBc * W.dvp);
  w.s.resize(kBr * kBc);
  w.dp.resize(kBr * kBc);
  pack_rows(P, b, kvh, w, W.dkp, W.dvp);
  tiles = tiles && pairs;
#if defined(MHA_BWD_AMX)
  if (tiles) tiles = prepare_unit_amx(w, g, P.Tq, P.dk, P.dv, W.dkp, W.dvp, AmxWidths(P));
#else
  tiles = false;
#endif
#if defined(MHA_BWD_BF16)
  if (pairs && !tiles) pack_rows_bf16(w, g, P.Tq, P.dk, P.dv, W.dkp, W.dvp);
#else
  (void)pairs;
#endif
}

template <typename T>
BlockSpan block_span(const Problem<T>& P, int64_t jb, int64_t klen, bool pairs) {
  BlockSpan k;
  k.j0 = jb * kBc, k.j1 = std::min(P.Tk, k.j0 + kBc);
  k.kn = std::max<int64_t>(0, std::min(k.j1, klen) - k.j0);  // keys in use (not padding)
  // query rows [i_lo, i_hi) can see a key of the block: causal, from the row whose diagonal
  // reaches key j0; window, up to the last row whose window still holds key j0 + kn - 1
  k.i_lo = P.causal ? std::max<int64_t>(0, k.j0 - (P.Tk - P.Tq)) : 0;
  k.i_hi = P.Tq;
  if (P.window > 0)
    k.i_hi = std::clamp<int64_t>(k.j0 + k.kn - 1 - (P.Tk - P.Tq) + P.window, 0, P.Tq);
  if (k.i_lo >= k.i_hi) k.kn = 0;  // no query row sees this block
  // pairs: blocks start on an even row (the row above sees no key here: P = 0) and end on an
  // even row or at Tq (the row below sees no key here either), so a block with an odd row
  // count is the last one of an odd Tq, whose pair partner in qt / ot is the zero padding at
  // row Tq
  if (pairs) k.i_lo &= ~int64_t(1), k.i_hi = std::min(P.Tq, round_up(k.i_hi, 2));
  return k;
}

// Pack K^T (d_k, Bc), V^T (d_v, Bc) zero-padded from kn to a 16-multiple, K (kn, d_kp); zero
// the dK, dV rows in use.
template <typename T>
void pack_key_block(const Problem<T>& P, int64_t b, int64_t kvh, const BlockSpan& k, Scratch& w,
                    const Widths& W, bool pairs, bool tiles) {
  const int64_t kn = k.kn, dkp = W.dkp, ncols = round_up(kn, kLanes);
  const T* kb = P.k + b * P.ks[0] + kvh * P.ks[1] + k.j0 * P.ks[2];  // key j0, dim 0
  const T* vb = P.v + b * P.vs[0] + kvh * P.vs[1] + k.j0 * P.vs[2];
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
  std::fill_n(w.dv.data(), kn * W.dvp, 0.f);
#if defined(MHA_BWD_BF16)
  if (pairs) pack_block_bf16(w, P.dk, P.dv, kn, ncols, dkp);
#else
  (void)pairs;
#endif
#if defined(MHA_BWD_AMX)
  if (tiles) pack_block_amx(w, P.dk, P.dv, ncols, dkp, AmxWidths(P));
#else
  (void)tiles;
#endif
}

// Rows [i0, i0 + rows) of query head hh (of the group) against the block, fp32 products.
template <typename T>
void block_products_f32(const Problem<T>& P, int64_t b, int64_t kvh, int64_t hh,
                        const BlockSpan& k, int64_t i0, int64_t rows, Scratch& w,
                        const Widths& W, const bool* pbits) {
  const int64_t dkp = W.dkp, dvp = W.dvp, kn = k.kn, ncols = round_up(kn, kLanes);
  const int64_t hi = kvh * (P.h / P.hkv) + hh;
  const bool has_go = P.go != nullptr;
  const float* qi = w.q.data() + (hh * P.Tq + i0) * dkp;     // (rows, d_kp)
  const float* oi = w.dout.data() + (hh * P.Tq + i0) * dvp;  // (rows, d_vp)
  float* dqi = w.dq.data() + (hh * P.Tq + i0) * dkp;         // (rows, d_kp)
  gemm_scores(rows, ncols, P.dk, qi, dkp, 1, w.kt.data(), kBc, w.s.data(), kBc);  // S
  if (has_go)  // dP = dO_i V_j^T: (rows, d_v) x (d_v, Bc)
    gemm(rows, ncols, P.dv, oi, dvp, 1, w.vt.data(), kBc, w.dp.data(), kBc, false);
  softmax_grad(P, b, hi, i0, rows, k.j0, kn, w.lse2.data() + hh * P.Tq,
               w.lse2lo.data() + hh * P.Tq, w.delta.data() + hh * P.Tq, has_go, w.s.data(),
               w.dp.data(), pbits);
  if (has_go)  // dV_j += P^T dO_i: (kn, rows) x (rows, d_vp)
    gemm(kn, dvp, rows, w.s.data(), 1, kBc, oi, dvp, w.dv.data(), dvp, true);
  // dK_j += dS^T Q_i: (kn, rows) x (rows, d_kp)
  gemm(kn, dkp, rows, w.dp.data(), 1, kBc, qi, dkp, w.dk.data(), dkp, true);
  // dQ_i += dS K_j: (rows, kn) x (kn, d_kp)
  gemm(rows, dkp, kn, w.dp.data(), kBc, 1, w.kr.data(), dkp, dqi, dkp, true);
}

#if defined(MHA_BWD_BF16)
// The same on bf16 operands (vdpbf16ps; P and dS rounded to bf16, as the forward's P V does);
// dK^T, dV^T accumulate transposed (store_key_block turns them back).
template <typename T>
void block_products_bf16(const Problem<T>& P, int64_t b, int64_t kvh, int64_t hh,
                         const BlockSpan& k, int64_t i0, int64_t rows, Scratch& w,
                         const Widths& W, const bool* pbits) {
  const int64_t dkp = W.dkp, dk2 = W.dk2, dv2 = W.dv2, tq2 = W.tq2;
  const int64_t kn = k.kn, ncols = round_up(kn, kLanes);
  const int64_t hi = kvh * (P.h / P.hkv) + hh;
  const bool has_go = P.go != nullptr;
  float* dqi = w.dq.data() + (hh * P.Tq + i0) * dkp;             // (rows, d_kp)
  const uint16_t* qbi = w.qb.data() + (hh * P.Tq + i0) * dk2;  // (rows, d_k2)
  const uint16_t* obi = w.ob.data() + (hh * P.Tq + i0) * dv2;  // (rows, d_v2)
  // S = Q_i K_j^T: (rows, d_k) x (d_k, Bc); dP = dO_i V_j^T: (rows, d_v) x (d_v, Bc)
  gemm(rows, ncols, dk2 / 2, qbi, dk2, 0, w.ktp.data(), kBc, w.s.data(), kBc, false);
  if (has_go)
    gemm(rows, ncols, dv2 / 2, obi, dv2, 0, w.vtp.data(), kBc, w.dp.data(), kBc, false);
  softmax_grad(P, b, hi, i0, rows, k.j0, kn, w.lse2.data() + hh * P.Tq,
               w.lse2lo.data() + hh * P.Tq, w.delta.data() + hh * P.Tq, has_go, w.s.data(),
               w.dp.data(), pbits);
  const int64_t rp = round_up(rows, 2);
  for (int64_t r = 0; r < rp; r += 2) {  // P, dS as pairs of rows; dS as bf16 rows
    const bool two = r + 1 < rows;
    pack_pairs(w.s.data() + r * kBc, two ? w.s.data() + (r + 1) * kBc : nullptr, ncols,
               w.p2.data() + r * kBc);
    pack_pairs(w.dp.data() + r * kBc, two ? w.dp.data() + (r + 1) * kBc : nullptr, ncols,
               w.ds2.data() + r * kBc);
  }
  for (int64_t r = 0; r < rows; ++r)
    to_bf16_row(w.dp.data() + r * kBc, ncols, w.dsb.data() + r * kBc);
  // dV_j^T += dO_i^T P: (d_v, rows) x (rows, Bc); dK_j^T += Q_i^T dS: (d_k, rows) x
  // (rows, Bc); rows i0.. of the transposed group rows (i0 even: whole pairs)
  if (has_go)
    gemm(P.dv, ncols, rp / 2, w.ot.data() + hh * P.dv * tq2 + i0, tq2, 0, w.p2.data(), kBc,
         w.dvt.data(), kBc, true);
  gemm(P.dk, ncols, rp / 2, w.qt.data() + hh * P.dk * tq2 + i0, tq2, 0, w.ds2.data(), kBc,
       w.dkt.data(), kBc, true);
  // dQ_i += dS K_j: (rows, Bc) x (Bc, d_kp)
  gemm(rows, dkp, ncols / 2, w.dsb.data(), kBc, 0, w.kp.data(), dkp, dqi, dkp, true);
}
#endif

// dK_j (scaled), dV_j of the block's keys in use; zeros for the block's other keys (past
// key_lengths, or seen by no row).
template <typename T>
void store_key_block(const Problem<T>& P, int64_t b, int64_t kvh, const BlockSpan& k,
                     Scratch& w, const Widths& W, bool pairs) {
  const int64_t kv0 = (b * P.hkv + kvh) * P.Tk, kn = k.kn;
  if (pairs)  // dK, dV rows from the transposed accumulators
    for (int64_t jj = 0; jj < kn; ++jj) {
      for (int64_t c = 0; c < P.dk; ++c) w.dk[jj * W.dkp + c] = w.dkt[c * kBc + jj];
      for (int64_t c = 0; c < P.dv; ++c) w.dv[jj * W.dvp + c] = w.dvt[c * kBc + jj];
    }
  for (int64_t jj = 0; jj < kn; ++jj) {
    T* dkr = P.dkey + (kv0 + k.j0 + jj) * P.dk;
    T* dvr = P.dval + (kv0 + k.j0 + jj) * P.dv;
    for (int64_t c = 0; c < P.dk; ++c) dkr[c] = T(w.dk[jj * W.dkp + c] * P.scale);
    for (int64_t c = 0; c < P.dv; ++c) dvr[c] = T(w.dv[jj * W.dvp + c]);
  }
}

// dQ of the group's rows: final (scaled) when unsplit, else split s's partial sum.
template <typename T>
void store_dq(const Problem<T>& P, int64_t b, int64_t kvh, int64_t s, const Scratch& w,
              const Widths& W) {
  const int64_t g = P.h / P.hkv;
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t t = 0; t < P.Tq; ++t) {
      const int64_t row = (b * P.h + kvh * g + hh) * P.Tq + t;
      const float* src = w.dq.data() + (hh * P.Tq + t) * W.dkp;
      if (P.splits == 1) {
        T* dst = P.dq + row * P.dk;
        for (int64_t c = 0; c < P.dk; ++c) dst[c] = T(src[c] * P.scale);
      } else {
        float* dst = P.dq_part + (s * P.B * P.h * P.Tq + row) * P.dk;
        std::copy(src, src + P.dk, dst);
      }
    }
}

// pairs: the five products on bf16 operands (tiles: on AMX tiles, else vdpbf16ps), else in
// fp32. Only for bf16 inputs (their Q, K, V, dO are exact in bf16).
template <typename T>
void run_unit(const Problem<T>& P, int64_t b, int64_t kvh, int64_t s, Scratch& w, bool pairs,
              bool tiles) {
  const Widths W(P);
  const int64_t g = P.h / P.hkv;
  prepare_unit(P, b, kvh, w, W, pairs, tiles);
  const int64_t klen = P.key_lengths ? P.key_lengths[b] : P.Tk;
  const int64_t nblocks = (P.Tk + kBc - 1) / kBc;
  for (int64_t jb = s; jb < nblocks; jb += P.splits) {
    const BlockSpan k = block_span(P, jb, klen, pairs);
    // dK = dV = 0 for keys past key_lengths and keys no row sees
    const int64_t kv0 = (b * P.hkv + kvh) * P.Tk;
    std::fill(P.dkey + (kv0 + k.j0 + k.kn) * P.dk, P.dkey + (kv0 + k.j1) * P.dk, T(0.f));
    std::fill(P.dval + (kv0 + k.j0 + k.kn) * P.dv, P.dval + (kv0 + k.j1) * P.dv, T(0.f));
    if (k.kn == 0) continue;
    pack_key_block(P, b, kvh, k, w, W, pairs, tiles);
    // Without a plan, row blocks of kBr; with one, the plan's query blocks (kPlanRows <= kBr
    // rows, even: bf16 pairs stay whole), EMPTY ones skipped, partial ones with their bits.
    const int64_t step = P.plan.on() ? mha_common::kPlanRows : kBr;
    const int64_t kb = k.j0 / mha_common::kPlanKeys, kc = k.j0 % mha_common::kPlanKeys;
    for (int64_t hh = 0; hh < g; ++hh)
      for (int64_t i0 = P.plan.on() ? k.i_lo / step * step : k.i_lo; i0 < k.i_hi;) {
        const int64_t ia = std::max(i0, k.i_lo), iz = std::min(i0 + step, k.i_hi);
        i0 += step;
        const bool* pbits = nullptr;
        if (P.plan.on()) {
          const int32_t e = P.plan.row(b, kvh * g + hh, ia / step)[kb];
          if (e == mha_common::kPlanEmpty) continue;
          if (e >= 0) pbits = P.plan.block_bits(e) + (ia % step) * mha_common::kPlanKeys + kc;
        }
#if defined(MHA_BWD_AMX)
        if (tiles) {
          block_products_amx(P, b, kvh, hh, k.j0, k.kn, ia, iz - ia, w, W.dkp, AmxWidths(P),
                             pbits);
          continue;
        }
#endif
#if defined(MHA_BWD_BF16)
        if (pairs) {
          block_products_bf16(P, b, kvh, hh, k, ia, iz - ia, w, W, pbits);
          continue;
        }
#endif
        block_products_f32(P, b, kvh, hh, k, ia, iz - ia, w, W, pbits);
      }
#if defined(MHA_BWD_AMX)
    if (tiles) flush_run_amx(P, k.kn, w, AmxWidths(P));
#endif
    store_key_block(P, b, kvh, k, w, W, pairs);
  }
  store_dq(P, b, kvh, s, w, W);
}

}  // namespace
}  // namespace mha_flash_bwd
