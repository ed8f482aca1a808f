// The decode kernel's problem as it reads it (sizes, pointers, strides, masks) and its
// split size; the algorithm is described in decode/flash_decode.cpp.
#pragma once

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

struct Problem {
  int64_t B, h, h_kv, g, Tq, Tk, dk, dv, G, C, S;
  const void* q;  // contiguous (B, h, Tq, d_k)
  const void* k;  // (B, h_kv, Tk, d_k), last dim contiguous
  const void* v;  // (B, h_kv, Tk, d_v), last dim contiguous
  int64_t ksb, ksh, kst, vsb, vsh, vst;
  const int64_t* klen;  // (B,) or nullptr
  const bool* mask;     // broadcast strides below, or nullptr
  int64_t msb, msh, msq, msk;
  bool causal;
  bool amx;  // bf16 q.k on AMX tiles (see qk_amx)
  float scale_log2;  // scale * log2(e): scores are kept in base 2
};

}  // namespace
