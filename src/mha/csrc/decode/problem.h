// The decode kernel's problem as it reads it (sizes, pointers, strides, masks) and its
// split size; the algorithm is described in decode/flash_decode.cpp.
#pragma once

#include "common/score_mods.h"
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "common/constants.h"
#include "common/tensor_access.h"

namespace {

constexpr int64_t kChunk = 1024;  // most keys per split (the stride of the score rows)
using mha_common::kLog2e;
using mha_common::kNegInf;
using mha_common::widen;

using bf16 = c10::BFloat16;
inline float widen(int8_t x) { return static_cast<float>(x); }  // int8 K/V (times its scale)

struct Problem {
  int64_t B, h, h_kv, g, Tq, Tk, dk, dv, G, C, S;
  const void* q;  // contiguous (B, h, Tq, d_k)
  const void* k;  // (B, h_kv, Tk, d_k), last dim contiguous; q's dtype, or int8 with k_scale
  const void* v;  // (B, h_kv, Tk, d_v), last dim contiguous; q's dtype, or int8 with v_scale
  int64_t ksb, ksh, kst, vsb, vsh, vst;
  const int64_t* klen;  // (B,) or nullptr
  const bool* mask;     // broadcast strides below, or nullptr
  int64_t msb, msh, msq, msk;
  bool causal;
  bool amx;  // bf16 q.k on AMX tiles (see qk_amx)
  // The q.k paths leave qk_scale * (q . k) in the score block: scale * log2(e) (base 2, the
  // softmax's units) without variants; scale with them (the variants' natural-log units).
  float qk_scale;
  // The softmax's weights are 2^((s - max) unit): 1 for base-2 scores (no variants); log2(e)
  // for the variants' natural-log scores, so that the row's max is subtracted before the
  // product (a bias of -1e6 costs no weight 6% through fl(s log2 e), and one of -3e38 does not
  // overflow it to -inf). The maxima M of the splits are in the same units.
  float unit;
  // Score variants (decode/variants.h), each optional.
  bool variants;                // softcap, bias or alibi present: apply_variants runs on every row
  mha_common::ScoreMods mods;   // the flash kernel's (common/score_mods.h)
  // int8 K/V (symmetric, one fp32 scale per token and K/V head): k = k_scale * k_int8
  const float* ksc;     // (B, h_kv, Tk) fp32 strided, or nullptr (K/V in q's dtype)
  const float* vsc;
  int64_t kscb, ksch, kscs, vscb, vsch, vscs;
  // Paged K/V (optional): k, v (and the int8 scales) are page pools whose first dim counts
  // pages, (num_pages, h_kv, page, d); row b's key j lives in page bt[b * bts + j / page] at
  // slot j % page. Tk is then the block table's reach, max_pages * page. Without pages
  // (bt == nullptr) the first dim is the batch row.
  const int32_t* bt;
  int64_t bts, page;
};

// Where key j of row b, K/V head kvh is stored: element offsets into k, v, k_scale, v_scale.
struct KVAt {
  int64_t k, v, ks, vs;
};
inline KVAt kv_at(const Problem& P, int64_t b, int64_t kvh, int64_t j) {
  int64_t blk = b, t = j;  // contiguous: the batch row and the position
  if (P.bt) blk = P.bt[b * P.bts + j / P.page], t = j % P.page;  // paged: the page and the slot
  return {blk * P.ksb + kvh * P.ksh + t * P.kst, blk * P.vsb + kvh * P.vsh + t * P.vst,
          blk * P.kscb + kvh * P.ksch + t * P.kscs, blk * P.vscb + kvh * P.vsch + t * P.vscs};
}

// The end of the run of keys from j on that is contiguous in memory (at most j1): the end of
// j's page when paged, else j1.
inline int64_t run_end(const Problem& P, int64_t j, int64_t j1) {
  return P.bt ? std::min(j1, (j / P.page + 1) * P.page) : j1;
}

}  // namespace
