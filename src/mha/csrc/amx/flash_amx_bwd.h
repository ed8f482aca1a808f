// The flash backward's five products on AMX tiles (tdpbf16ps), compiled where the tile kernels
// are (amx/amx_tiles.h: a target with AMX-TILE and AMX-BF16, or software tiles under
// MHA_AMX_EMULATE) and the bf16 products are (MHA_BWD_BF16); then MHA_BWD_AMX is defined.
//
// The stages are those of the vdpbf16ps backward (flash/bwd_unit.h), with the same pair layouts
// padded to whole tiles (16 rows x 32 bf16 operands, 16 x 16 fp32 results):
//   S  = Q_i K_j^T   A: Q rows (d_k padded to 32)       B: K^T pair-packed along d
//   dP = dO_i V_j^T  A: dO rows (d_v padded to 32)      B: V^T pair-packed along d
//   dQ_i += dS K_j   A: dS rows (keys padded to 32)     B: K pair-packed along keys
//   dV_j^T += dO^T P A: dO^T rows (query rows padded)   B: P as row pairs
//   dK_j^T += Q^T dS A: Q^T rows                        B: dS as row pairs
// One routine serves all five (tile_gemm: 2 x 2 result tiles held across the reduction, each
// loaded A / B tile feeding two products). S and dP go to memory for the softmax
// (softmax_grad, on the vector units), dQ is loaded and stored around its 64-key reduction.
// dK^T and dV^T are the accumulators that can stay in tiles long: P and dS of a *run* of
// consecutive row blocks of one head (up to kAmxRunRows rows) are packed side by side, and each
// 16 x 16 tile of dV^T / dK^T is loaded once, accumulates the whole run (8 products per tile at
// 256 rows) and is stored once, instead of once per row block.
//
// Exactness of the padding: a product's reduction padding is zero in both operands (rows past
// the run: P, dS zero, dO^T / Q^T finite; d past d_k: zero in Q and K^T; keys past the block:
// zero in dS and K); result rows and columns past the problem's are never read (S, dP) or add
// exactly zero (dQ rows past the block: dS rows zero). dO^T rows past a run are the next rows'
// dO, finite only if all of the unit's dO is: a unit whose dO holds NaN / Inf runs the vdpbf16ps
// products instead (prepare_unit_amx answers false), so NaN propagates exactly as there.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx/amx_tiles.h"
#include "flash/bwd_bf16_pack.h"
#include "flash/bwd_problem.h"
#include "flash/bwd_rows.h"

#if defined(MHA_AMX_TILES) && defined(MHA_BWD_BF16)
#define MHA_BWD_AMX 1

namespace mha_flash_bwd {
namespace {

constexpr int64_t kAmxRunRows = 256;  // rows of P / dS packed before dK^T, dV^T take them

// Padded widths of the tile operands: d_k, d_v to 32 (a reduction of whole tiles) and 16 (rows
// of dK^T, dV^T tiles); the transposed rows' pitch: Tq rounded up to 2, plus 32 zero query rows,
// so a run's last tile never reads past its head.
struct AmxWidths {
  int64_t dk32, dv32, dk16, dv16, tqp;
  template <typename T>
  explicit AmxWidths(const Problem<T>& P)
      : dk32(round_up(P.dk, 32)), dv32(round_up(P.dv, 32)), dk16(round_up(P.dk, 16)),
        dv16(round_up(P.dv, 16)), tqp(round_up(P.Tq, 2) + 32) {}
};

// Every tile 16 rows x 64 bytes, as the forward's (per thread, around the parallel loop).
inline void amx_configure() {
  mha_amx::TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  mha_amx::load_tile_config(c);
}
inline void amx_release() { _tile_release(); }

// C (16 rows of ldc floats, nt 16-column tiles) = (load ? C : 0) + A B, A 16 rows of 32 kc
// bf16 (rows of lda bf16), B pair-packed [16 kc][ldb][2] from its first column. Four C tiles at
// a time in tiles 0-3, each loaded (or zeroed) once and stored once around the whole reduction;
// A through tile 4, B alternately through 5 and 6 (loads overlap the products, stores do not).
__attribute__((noinline)) void tile_rows(const uint16_t* a, int64_t lda, int kc,
                                         const uint16_t* b, int64_t ldb, int nt, float* c,
                                         int64_t ldc, bool load) {
  for (int t0 = 0; t0 < nt; t0 += 4) {
    const int n = std::min(4, nt - t0);
    float* ct = c + t0 * 16;
    if (load) {
      _tile_loadd(0, ct, ldc * 4);
      if (n > 1) _tile_loadd(1, ct + 16, ldc * 4);
      if (n > 2) _tile_loadd(2, ct + 32, ldc * 4);
      if (n > 3) _tile_loadd(3, ct + 48, ldc * 4);
    } else {
      _tile_zero(0);
      if (n > 1) _tile_zero(1);
      if (n > 2) _tile_zero(2);
      if (n > 3) _tile_zero(3);
    }
    for (int k = 0; k < kc; ++k) {
      _tile_loadd(4, a + k * 32, lda * 2);
      const uint16_t* bk = b + (int64_t(k) * 16 * ldb + t0 * 16) * 2;
      _tile_loadd(5, bk, ldb * 4);
      _tile_dpbf16ps(0, 4, 5);
      if (n > 1) { _tile_loadd(6, bk + 32, ldb * 4); _tile_dpbf16ps(1, 4, 6); }
      if (n > 2) { _tile_loadd(5, bk + 64, ldb * 4); _tile_dpbf16ps(2, 4, 5); }
      if (n > 3) { _tile_loadd(6, bk + 96, ldb * 4); _tile_dpbf16ps(3, 4, 6); }
    }
    _tile_stored(0, ct, ldc * 4);
    if (n > 1) _tile_stored(1, ct + 16, ldc * 4);
    if (n > 2) _tile_stored(2, ct + 32, ldc * 4);
    if (n > 3) _tile_stored(3, ct + 48, ldc * 4);
  }
}

// The same for 32 result rows (A rows 0-15 and 16-31, lda apart) and two 16-column tiles at a
// time (the last one alone when nt is odd): C (rows 0-15) in tiles 0-1, (rows 16-31) in 2-3, A
// through 4 and 5, B through 6 and 7, so each tile loaded per step feeds two products (four
// loads for four products instead of five).
__attribute__((noinline)) void tile_rows2(const uint16_t* a, int64_t lda, int kc,
                                          const uint16_t* b, int64_t ldb, int nt, float* c,
                                          int64_t ldc, bool load) {
  const uint16_t* a1 = a + 16 * lda;
  for (int t0 = 0; t0 < nt; t0 += 2) {
    const bool two = t0 + 1 < nt;
    float* c0 = c + t0 * 16;
    float* c1 = c0 + 16 * ldc;
    if (load) {
      _tile_loadd(0, c0, ldc * 4);
      _tile_loadd(2, c1, ldc * 4);
      if (two) { _tile_loadd(1, c0 + 16, ldc * 4); _tile_loadd(3, c1 + 16, ldc * 4); }
    } else {
      _tile_zero(0);
      _tile_zero(2);
      if (two) { _tile_zero(1); _tile_zero(3); }
    }
    for (int k = 0; k < kc; ++k) {
      const uint16_t* bk = b + (int64_t(k) * 16 * ldb + t0 * 16) * 2;
      _tile_loadd(4, a + k * 32, lda * 2);
      _tile_loadd(6, bk, ldb * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a1 + k * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (two) {
        _tile_loadd(7, bk + 32, ldb * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, ldc * 4);
    _tile_stored(2, c1, ldc * 4);
    if (two) { _tile_stored(1, c0 + 16, ldc * 4); _tile_stored(3, c1 + 16, ldc * 4); }
  }
}

// C (m rows, a multiple of 16) = (load ? C : 0) + A B, 32 rows at a time (tile_rows2), the
// last 16 alone (tile_rows).
void tile_gemm(int64_t m, const uint16_t* a, int64_t lda, int kc, const uint16_t* b,
               int64_t ldb, int nt, float* c, int64_t ldc, bool load) {
  int64_t r = 0;
  for (; r + 32 <= m; r += 32)
    tile_rows2(a + r * lda, lda, kc, b, ldb, nt, c + r * ldc, ldc, load);
  if (r < m) tile_rows(a + r * lda, lda, kc, b, ldb, nt, c + r * ldc, ldc, load);
}

// The group's rows as tile operands, from pack_rows' fp32 copies (exact: the inputs are bf16,
// and Q's non-finite elements are zeros there):
// Q, dO as bf16 rows qa (g Tq + 16, d_k32), oa (g Tq + 16, d_v32) and transposed qta (g, d_k16,
// tqp), ota (g, d_v16, tqp), zero past d, Tq and in the 16 rows of slack. False when dO holds a
// non-finite element (then the unit runs the vdpbf16ps products: see the top of this file).
bool prepare_unit_amx(Scratch& w, int64_t g, int64_t Tq, int64_t dk, int64_t dv, int64_t dkp,
                      int64_t dvp, const AmxWidths& A) {
  int bad = 0;  // branch-free (x - x is 0 exactly for finite x), so the loop vectorizes
  for (int64_t e = 0; e < g * Tq * dvp; ++e) bad |= !(w.dout[e] - w.dout[e] == 0.f);
  if (bad) return false;
  w.qa.assign((g * Tq + 16) * A.dk32, 0);
  w.oa.assign((g * Tq + 16) * A.dv32, 0);
  w.qta.assign(g * A.dk16 * A.tqp, 0);
  w.ota.assign(g * A.dv16 * A.tqp, 0);
  w.p2run.resize((kAmxRunRows + kBr + 32) * kBc);
  w.ds2run.resize((kAmxRunRows + kBr + 32) * kBc);
  w.dsb.resize((kBr + 16) * kBc);
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
      for (int64_t t = t0; t < t1; ++t) {  // zero past d in both (dkp <= d_k32, dvp <= d_v32)
        to_bf16_row(qr + t * dkp, dkp, w.qa.data() + (hh * Tq + t) * A.dk32);
        to_bf16_row(orow + t * dvp, dvp, w.oa.data() + (hh * Tq + t) * A.dv32);
      }
      for (int64_t c = 0; c < dk; ++c)
        for (int64_t t = t0; t < t1; ++t)
          w.qta[(hh * A.dk16 + c) * A.tqp + t] = bits(qr[t * dkp + c]);
      for (int64_t c = 0; c < dv; ++c)
        for (int64_t t = t0; t < t1; ++t)
          w.ota[(hh * A.dv16 + c) * A.tqp + t] = bits(orow[t * dvp + c]);
    }
  w.dq.resize((g * Tq + 16) * dkp, 0.f);  // dQ tiles of a block's last 16 rows: slack
  w.run_rows = 0;
  return true;
}

// One key block's B operands padded to whole tiles, after pack_block_bf16: K^T, V^T with zero
// pairs up to d_k32 / d_v32, K with zero keys up to 32; dK^T, dV^T accumulators of d_k16 / d_v16
// rows at zero.
void pack_block_amx(Scratch& w, int64_t dk, int64_t dv, int64_t ncols, int64_t dkp,
                    const AmxWidths& A) {
  const int64_t kt_used = round_up(dk, 2) / 2 * kBc * 2, vt_used = round_up(dv, 2) / 2 * kBc * 2;
  w.ktp.resize(A.dk32 / 2 * kBc * 2);
  w.vtp.resize(A.dv32 / 2 * kBc * 2);
  std::fill(w.ktp.begin() + kt_used, w.ktp.end(), 0);
  std::fill(w.vtp.begin() + vt_used, w.vtp.end(), 0);
  std::fill(w.kp.begin() + ncols * dkp, w.kp.begin() + round_up(ncols, 32) * dkp, 0);
  w.dkt.assign(A.dk16 * kBc, 0.f);
  w.dvt.assign(A.dv16 * kBc, 0.f);
}

// dV^T += dO^T P and dK^T += Q^T dS over the packed run (rows [run_a, run_a + run_rows) of head
// run_hh), each dK^T / dV^T tile loaded and stored once for the whole run; then the run is empty.
template <typename T>
void flush_run_amx(const Problem<T>& P, int64_t kn, Scratch& w, const AmxWidths& A) {
  const int64_t n = w.run_rows;
  if (n == 0) return;
  w.run_rows = 0;
  const int64_t n32 = round_up(n, 32), nt = round_up(kn, kLanes) / 16;
  const int64_t tail = round_up(n, 2) * kBc;  // pairs past the run: zero (a reduction's padding)
  std::fill(w.p2run.begin() + tail, w.p2run.begin() + n32 * kBc, 0);
  std::fill(w.ds2run.begin() + tail, w.ds2run.begin() + n32 * kBc, 0);
  const int64_t hh = w.run_hh, ra = w.run_a;
  if (P.go)
    tile_gemm(A.dv16, w.ota.data() + hh * A.dv16 * A.tqp + ra, A.tqp, int(n32 / 32),
              w.p2run.data(), kBc, int(nt), w.dvt.data(), kBc, true);
  tile_gemm(A.dk16, w.qta.data() + hh * A.dk16 * A.tqp + ra, A.tqp, int(n32 / 32),
            w.ds2run.data(), kBc, int(nt), w.dkt.data(), kBc, true);
}

// Rows [i0, i0 + rows) of query head hh (of the group) against the key block at j0 (kn keys in
// use) on tiles: S, dP, the softmax gradient, dQ += dS K; P and dS join the run (flushed first
// when the rows do not continue it or it is full). dkp: d_k rounded up to 16 (dQ's row pitch).
template <typename T>
void block_products_amx(const Problem<T>& P, int64_t b, int64_t kvh, int64_t hh, int64_t j0,
                        int64_t kn, int64_t i0, int64_t rows, Scratch& w, int64_t dkp,
                        const AmxWidths& A, const bool* pbits) {
  const int64_t ncols = round_up(kn, kLanes), nt = ncols / 16;
  const int64_t kc32 = round_up(ncols, 32), rg16 = round_up(rows, 16);
  const int64_t hi = kvh * (P.h / P.hkv) + hh;
  const bool has_go = P.go != nullptr;
  if (w.run_rows > 0 && (hh != w.run_hh || i0 != w.run_a + w.run_rows ||
                         w.run_rows + rows > kAmxRunRows))
    flush_run_amx(P, kn, w, A);
  if (w.run_rows == 0) w.run_hh = hh, w.run_a = i0;
  const uint16_t* qa = w.qa.data() + (hh * P.Tq + i0) * A.dk32;  // (rg16, d_k32)
  const uint16_t* oa = w.oa.data() + (hh * P.Tq + i0) * A.dv32;  // (rg16, d_v32)
  // S, dP: (rg16, d) x (d, Bc); rows past `rows` are never read
  tile_gemm(rg16, qa, A.dk32, int(A.dk32 / 32), w.ktp.data(), kBc, int(nt), w.s.data(), kBc,
            false);
  if (has_go)
    tile_gemm(rg16, oa, A.dv32, int(A.dv32 / 32), w.vtp.data(), kBc, int(nt), w.dp.data(),
              kBc, false);
  softmax_grad(P, b, hi, i0, rows, j0, kn, w.lse2.data() + hh * P.Tq,
               w.lse2lo.data() + hh * P.Tq, w.delta.data() + hh * P.Tq, has_go, w.s.data(),
               w.dp.data(), pbits);
  uint16_t* p2 = w.p2run.data() + w.run_rows * kBc;  // this block's rows in the run (i0 even)
  uint16_t* ds2 = w.ds2run.data() + w.run_rows * kBc;
  for (int64_t r = 0; r < rows; r += 2) {  // P, dS as pairs of rows
    const bool two = r + 1 < rows;
    pack_pairs(w.s.data() + r * kBc, two ? w.s.data() + (r + 1) * kBc : nullptr, ncols,
               p2 + r * kBc);
    pack_pairs(w.dp.data() + r * kBc, two ? w.dp.data() + (r + 1) * kBc : nullptr, ncols,
               ds2 + r * kBc);
  }
  w.run_rows += rows;
  // dQ_i += dS K_j: (16, keys) x (keys, d_kp) per 16 rows; dS zero past kn (to 32) and past
  // `rows` (to 16), so those dQ rows take exactly zero
  for (int64_t r = 0; r < rg16; ++r) {
    uint16_t* row = w.dsb.data() + r * kBc;
    if (r < rows) to_bf16_row(w.dp.data() + r * kBc, ncols, row);
    std::fill(row + (r < rows ? ncols : 0), row + kc32, 0);
  }
  float* dqi = w.dq.data() + (hh * P.Tq + i0) * dkp;  // (rg16, d_kp)
  tile_gemm(rg16, w.dsb.data(), kBc, int(kc32 / 32), w.kp.data(), dkp, int(dkp / 16), dqi, dkp,
            true);
}

}  // namespace
}  // namespace mha_flash_bwd

#endif  // MHA_AMX_TILES && MHA_BWD_BF16
