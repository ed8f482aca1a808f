// The flash backward's shared pieces: block sizes, the problem as the kernel reads it
// (pointers, strides, masks) and one unit's scratch. The algorithm is described in
// flash/flash_attn_bwd.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/block_plan.h"
#include "common/constants.h"
#include "common/score_mods.h"
#include "common/tensor_access.h"
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
using mha_common::prefetch_row;
using mha_common::widen;
// Block sizes: 32/96/128 rows and 128 keys measured within noise of 64 x 64.
constexpr int64_t kBr = 64;       // query rows per block
constexpr int64_t kBc = 64;       // keys per block (a multiple of kLanes)
static_assert(mha_common::kPlanKeys % kBc == 0);  // a key block lies in one plan block
constexpr int64_t kMinUnits = 8;  // split key blocks until there are this many units (shape only)

// ------------------------------------------------------------------------------ GEMM tiles
using mha_gemm::gemm;
using mha_gemm::gemm_scores;

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
  const double* lse;              // float64 (the forward's)
  const float* glse;              // may be null (no gradient of lse)
  int64_t qs[4], ks[4], vs[4], os[4], gos[4], ls[3], gls[3], ms[4];
  const bool* mask = nullptr;           // ms is 0 on broadcast dims
  const int64_t* key_lengths = nullptr;
  int64_t B, h, hkv, Tq, Tk, dk, dv, splits;
  float scale;
  bool causal;
  int64_t window;           // > 0: sliding window (the left edge); 0: none
  T *dq, *dkey, *dval;      // contiguous outputs (B, h, Tq, d_k), (B, h_kv, Tk, d_k|d_v)
  float* dq_part;           // (S, B, h, Tq, d_k) partial dQ when splits > 1, else null
  mha_common::ScoreMods mods;  // softcap, sinks, bias, ALiBi (common/score_mods.h)
  mha_common::PlanView plan;   // a mask_mod's block plan (common/block_plan.h), or off
  float* dbias = nullptr;   // (B, h, Tq|1, Tk|1) fp32 bias gradient, or null; dbs: its strides,
  int64_t dbs[4] = {0, 0, 0, 0};  // 0 on the bias's broadcast query / key dims

  // Keys j < start are left of query row i's window (0 without a window), as in the forward.
  int64_t key_start(int64_t i) const {
    return window > 0 ? std::max<int64_t>(0, i + Tk - Tq - window + 1) : 0;
  }
};

// Scratch of one unit, sized once per unit.
struct Scratch {
  std::vector<float> q, dout, lse2, lse2lo, delta, dq;  // the group's rows: (g, Tq, d_kp|d_vp|1);
                                                        // lse2 + lse2lo: lse log2 e, hi + lo
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
  // AMX tiles (amx/flash_amx_bwd.h): the group's rows as tile operands qa, oa (rows) and qta,
  // ota (transposed); P and dS of a run of row blocks as pairs of rows p2run, ds2run, the run
  // being rows [run_a, run_a + run_rows) of query head run_hh.
  std::vector<uint16_t> qa, oa, qta, ota, p2run, ds2run;
  int64_t run_hh = 0, run_a = 0, run_rows = 0;
};

}  // namespace
}  // namespace mha_flash_bwd
