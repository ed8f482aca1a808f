// The flash forward's per-thread worker: one work item (a K/V head, a range of query rows) at
// a time. The members are defined by purpose: packing K and V (flash/pack_kv.h), the key loop
// of the register-tile kernels (flash/key_loop.h) and the AMX key loops (amx/flash_amx_loop.h).
#pragma once

#include "amx/flash_amx_kernel.h"  // AmxBf16, MHA_FLASH_AMX where the target has AMX
#include "flash/problem.h"

namespace mha_flash {
namespace {

template <class K, typename T, class Parts>
struct Worker {
  using packed_t = typename K::packed_t;
  using p_t = typename K::p_t;
  const Problem<T>& P;
  int64_t Nb, dkp, dvp, g;
  // V read where it lies (fp32 rows of one head packed one after another, d_v a multiple of
  // 16, not paged): the tiles read its rows at stride ldv = d_v and nothing packs V. Else ldv
  // is dvp, the packed buffer's row.
  bool v_in_place = false;
  int64_t ldv;
  Scratch<K>& sc;
  int64_t hq_ = 0;  // the query head of the block in flight (the score variants read it)
  // With a block plan: the query block's entries (one per plan key block), and the bits of the
  // key block in flight when it is partial (row r of the query block at r * kPlanKeys), else null.
  const int32_t* prow_ = nullptr;
  const bool* pbits_ = nullptr;
  // The wide softmax (softmax_wide), while a query block runs it: each row's running max
  // (natural log units) and sum in double, row r at wide_m_[r], wide_l_[r], where r = (its m pointer) - m_base_.
  double* wide_m_ = nullptr;
  double* wide_l_ = nullptr;
  const float* m_base_ = nullptr;

  Worker(const Problem<T>& p, Scratch<K>& scratch) : P(p), sc(scratch) {
    Nb = std::min<int64_t>(kMaxKeysPerBlock, round_up(std::max<int64_t>(P.Tk, 1), K::kKeyAlign));
    dkp = round_up(P.dk, K::kDkAlign);
    dvp = round_up(P.dv, kLanes);
    g = P.h / P.hkv;
    if constexpr (std::is_same_v<T, float> && std::is_same_v<packed_t, float> && !K::kAmx)
      v_in_place = P.block_table == nullptr && P.vs[3] == 1 && P.vs[2] == P.dv && P.dv == dvp;
    ldv = v_in_place ? P.vs[2] : dvp;
  }

  // K transposed per key block: [dkp][Nb] (fp32) or [dkp/2][Nb][2] (bf16 pairs of d_k).
  // V: [keys][dvp] (fp32) or [keys/2][dvp][2] (bf16 pairs of keys). Zeros past kend / d.
  // Keys [kbeg, kend) are packed (kbeg a multiple of Nb; key kbeg at offset 0), up to kend
  // rounded to 16 (32 for AMX; the tiles never read further); zeros past kend.
  void pack_kv(int64_t b, int64_t kh, int64_t kbeg, int64_t kend, packed_t* kt,
               packed_t* vp) const;

#if defined(__AVX512BW__) && defined(__AVX512VL__)
  // V rows j, j + 1 (j even) of (b, K/V head kh) into [(j - kbeg)/2][dvp][2]; rows at or past
  // kend are zeros.
  void pack_v_pair_bf16(int64_t b, int64_t kh, int64_t j, int64_t kbeg, int64_t kend,
                        packed_t* vp) const;
#endif

  // V row into packed row j (relative to the first packed key); nothing when V is read in place.
  void pack_v_row(const T* vrow, int64_t j, bool real, packed_t* vp) const;

  void zero_rows(int64_t b, int64_t hq, int64_t i0, int64_t i1) const;

  void run_item(const Item& it);

  // kt, vp: keys packed from kbeg (pack_kv); vp: V's row kbeg where V is read in place.
  void query_block(int64_t b, int64_t hq, int64_t i0, int64_t i1, int64_t kbeg,
                   const packed_t* kt, const packed_t* vp);

  // The key loop of one query block (rows from i0) over keys [jlo, kend): m, lsum, o start from
  // an empty row. exact: products of P with V rows a row may not attend are skipped (pv_exact)
  // in every block some row does not see whole; the AMX kernel runs it on its vector tiles.
  void key_loop(int64_t b, int64_t i0, int rows, int rp, int64_t jlo, int64_t kend,
                const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* vp,
                float* s, p_t* p, float* o, float* m, float* alpha, float* lsum, uint16_t* bits,
                bool exact);

  // O = alpha O + P V for the rows [i0, i0 + rows) of one key block (keys j0 + n, n < jn),
  // adding only the keys each row may attend (key_start, key_limit, the bool mask): the exact
  // pass for blocks where a row would otherwise add 0 * (a non-finite V). Plain loops (hostile
  // inputs only). p rows of Nb (fp32, or bf16 bits), v from key j0 (fp32 [n][ldv], or bf16
  // pairs [n/2][dvp][2]).
  void pv_exact(int64_t b, int64_t i0, int rows, int64_t j0, int jn, const bool* mrow0,
                const p_t* p, const packed_t* v, float* o, const float* alpha) const;

  // out row = o * inv, in T (the output's last dim is contiguous: it is allocated so)
  void store_row(const float* o, float inv, T* __restrict orow) const;

  // The online-softmax update of RS rows of one key block (rows of s and p are Nb long; bit
  // masks kMaxVecsPerBlock words per row). bf16 kernels: the one-pass softmax with lazy
  // rescaling (for scale > 0; the masked variant only where some lane may be masked).
  // The online-softmax update of one row (row r of the query block) in double, for rows the
  // float arithmetic cannot hold (needs_wide): the logits x = s * score_scale are exact
  // products of two floats in double (natural log units, no log2 e), the max m is exactly the
  // largest of them, and P = e^(x - m), so a finite logit of any magnitude gives the math's
  // weights; lse = m + log l. Plain loops (hostile inputs only).
  template <int NV>
  void softmax_wide(const float* s, int nvalid, const uint16_t* bits, int64_t r,
                    float& alpha, p_t* p) const;

  // O / l and lse of the rows of a query block that ran the wide softmax (rows from i0).
  void finish_wide(int64_t b, int64_t hq, int64_t i0, int rows, const float* o) const;

  template <int NV, int RS>
  void softmax(bool unmasked, const float* s, const int* nvalid, const uint16_t* bits, float c,
               float* m, float* lsum, float* alpha, p_t* p) const;

#if defined(MHA_FLASH_AMX)
  // AMX, d_v <= 64 (NC = dvp / 16 tiles): each 16-row group walks its key blocks with O kept
  // in tiles 4.. across them (a tile store costs about a tile product here): S = Q K^T (tiles)
  // into s, the softmax into P, O rescaled only where a row's (lazy) max moved, O += P V.
  // With d_k <= 64 too (KC = dkp / 32 tiles), Q stays in tiles 2.. across the key blocks.
  // Wider d_v (NC = 0): O lives in o, and the steps (key block, 16-row group) run key block by
  // key block, so the groups of a query block reuse the block's K / V from L1. The tile unit and
  // the vector units do not overlap on this CPU (measured), so nothing is software-pipelined.
  // s: [16][Nb] floats, p: [16][Nb] bf16, o: [rp][dvp], per-row m / alpha / lsum. Keys
  // [jlo, kend); kt, vp start at key jlo. A group starts at the 32 keys holding its first
  // row's window start (P V reads whole 32-key chunks of V) and ends at its last row's limit.
  void key_loop_amx(int64_t b, int64_t i0, int rows, int64_t jlo, int64_t kend,
                    const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* vp,
                    float* s, p_t* p, float* o, float* m, float* alpha, float* lsum,
                    uint16_t* bits);

  // Keys [ja, jz) for the rg rows of one group starting at row ia (q, o, m, alpha, lsum
  // already offset to the group's first row); NC > 0: O in tiles from zero, stored to o at the
  // end; NC = 0: O in o.
  template <int NC, int KC>
  void group_loop_amx(int64_t b, int64_t ia, int rg, int64_t ja, int64_t jz, int64_t jlo,
                      int64_t kend, const bool* mrow0, const packed_t* q, const packed_t* kt,
                      const packed_t* vp, float* s, p_t* p, float* o, float* m, float* alpha,
                      float* lsum, uint16_t* bits);

  static constexpr int kRunBlocks = 4;  // key blocks per run (group_pair_runs)

  // Two groups, A (16 rows from ia) and B (rgb rows from ia + 16), over keys [ja, jz) (the
  // union of theirs; the softmax masks what a row does not see) in runs of kRunBlocks: phase
  // A computes both groups' S with each K tile loaded once (qk_pair) and their softmax into
  // P; phase B walks the run once per 32 columns of O, both groups' O in tiles 4-7 and each
  // V tile used by both (pv_pair). K and V stream from L2 once per two groups; O passes through
  // memory once per run and 32 columns. q, o, m, alpha, lsum: from A's first row; s: 32 rows.
  void group_pair_runs(int64_t b, int64_t ia, int rgb, int64_t ja, int64_t jz, int64_t jlo,
                       int64_t kend, const bool* mrow0, const packed_t* q, const packed_t* kt,
                       const packed_t* vp, float* s, float* o, float* m, float* alpha,
                       float* lsum, uint16_t* bits);
  // Phase B of group_pair_runs for NC2 tiles of O per group (o, v offset to their first column).
  template <int NC2>
  void pv_pair_run(int nb, const p_t* pr, const float* ar, const int64_t* jrun,
                   const int* jnrun, int rgb, int64_t jlo, const packed_t* vp, float* o,
                   bool o_zero);

  // The softmax of one group's key block (nv 16-key vectors) into p, P's odd 16-key tail zeroed
  // (P V takes 32-key chunks).
  void softmax_step(int64_t b, int64_t ia, int rg, int64_t j0, int nv, const bool* mrow0,
                    const float* s, p_t* p, float* m, float* alpha, float* lsum,
                    uint16_t* bits) const;

  static bool moved(const float* alpha, int rg);
  // Rows r < rg of o (row stride dvp, the first cols columns) times alpha[r], where != 1.
  void scale_o_rows(float* o, int rg, const float* alpha, int64_t cols) const;
#endif

  // The softmax of rows [ia, ia + rg) (a query block, or one AMX group) for the key block at
  // j0 (NV vectors): scores st (rows of Nb), P into p (rows of Nb); m, alpha, lsum of the rows.
  template <int NV>
  void softmax_group(int64_t b, int64_t ia, int rg, int64_t j0, const bool* mrow0,
                     const float* st, p_t* p, float* m, float* alpha, float* lsum,
                     uint16_t* bits) const;

  // O = alpha O + P V over the jn keys of one key block (register tiles), rows [0, rows).
  void pv_block(const p_t* p, const packed_t* v, int jn, int rows, float* o,
                const float* alpha) const;

  template <int NV>
  void key_block(int64_t b, int64_t i0, int rows, int64_t j0, int jn,
                 const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* v,
                 float* s, p_t* p, float* o, float* m, float* alpha, float* lsum,
                 uint16_t* bits, bool exact);
};

}  // namespace
}  // namespace mha_flash
