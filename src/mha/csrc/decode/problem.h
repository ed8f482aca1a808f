// The decode kernel's problem as it reads it (sizes, pointers, strides, masks) and its
// split size; the algorithm is described in decode/flash_decode.cpp.
#pragma once

#include "common/score_mods.h"
#include <c10/util/BFloat16.h>

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
  // softmax's units) without variants; scale with them (decode/variants.h goes to base 2).
  float qk_scale;
  // Score variants (decode/variants.h), each optional.
  bool variants;                // softcap, bias or alibi present: apply_variants runs on every row
  mha_common::ScoreMods mods;   // the flash kernel's (common/score_mods.h)
  // int8 K/V (symmetric, one fp32 scale per token and K/V head): k = k_scale * k_int8
  const float* ksc;     // (B, h_kv, Tk) fp32 strided, or nullptr (K/V in q's dtype)
  const float* vsc;
  int64_t kscb, ksch, kscs, vscb, vsch, vscs;
};

}  // namespace
