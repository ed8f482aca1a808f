// The score variants inside the kernels (mha/scores.py defines them; this is the same order):
// for query row i of batch b and head hq against key j, from x = scale * (q_i . k_j),
//   x = softcap * tanh(x / softcap)            softcap > 0
//   x = x + bias[b, hq, i, j]                  bias read through its strides (0 on broadcast dims)
//   x = x - slope[b, hq] * (i + Tk - Tq - j)   ALiBi, aligned bottom-right like causal
// and a sink logit per head that joins the softmax denominator with no value (applied where
// each kernel finishes a row). A row's modified scores x replace its raw dot products, and the
// kernel's softmax then multiplies by log2 e instead of scale * log2 e (score_scale below): no
// division and multiplication by scale, whose rounding at scores of ~100 (ALiBi at long
// distances) would be ~1e-5 in each P.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "common/constants.h"
#include "common/exp2.h"
#include "common/tensor_access.h"

namespace mha_common {

// tanh in plain float arithmetic (vectorizes; within ~2 ulp): an odd Taylor polynomial below
// |y| = 1/4, else (1 - e) / (1 + e) with e = exp(-2 |y|) (e <= 0.61 there, so 1 - e loses at
// most a bit to cancellation).
inline float tanh_fast(float y) {
  const float a = std::fabs(y);
  const float e = mha_exp2::exp2_scalar(-2.f * kLog2e * a);
  const float big = std::copysign((1.f - e) / (1.f + e), y);  // NaN for a NaN y
  // ys - ys^3/3 + 2ys^5/15 - 17ys^7/315 + 62ys^9/2835 - 1382ys^11/155925 on ys = y clamped to
  // +-1/4 (finite for any y; the next term is < 1e-10 relative at 1/4)
  const float ys = std::copysign(a < 0.25f ? a : 0.25f, y), y2 = ys * ys;
  const float small =
      ys * (1.f + y2 * (-1.f / 3 + y2 * (2.f / 15 + y2 * (-17.f / 315 +
                                                            y2 * (62.f / 2835 + y2 * (-1382.f / 155925))))));
  const float w = a < 0.25f ? 1.f : 0.f;  // a blend, not a branch: the loop vectorizes
  return w * small + (1.f - w) * big;  // exactly one of the two (both finite, or big NaN)
}

struct ScoreMods {
  float softcap = 0.f;            // > 0: on
  const float* sinks = nullptr;   // (h,) natural-log logits, or null
  const float* bias = nullptr;    // fp32, 4-D broadcastable to (B, h, Tq, Tk), or null
  int64_t bs[4] = {0, 0, 0, 0};   // its strides, 0 on broadcast dims
  const float* alibi = nullptr;   // slopes (B|1, h), or null
  int64_t as0 = 0;                // the slopes' batch stride (0: shared by the batch)

  bool on_scores() const { return softcap > 0.f || bias != nullptr || alibi != nullptr; }
  bool any() const { return on_scores() || sinks != nullptr; }

  // Row i's raw dot products s[0, n) against keys j0 + (0 .. n) become the modified scores x.
  // dcap (when softcap is on and dcap is not null) receives the softcap's derivative
  // 1 - tanh^2 per key, for the backward.
  void apply_row(float* s, int64_t n, int64_t b, int64_t hq, int64_t i, int64_t j0, int64_t Tq,
                 int64_t Tk, float scale, float* dcap = nullptr) const {
    const float cap = softcap, icap = softcap > 0.f ? 1.f / softcap : 0.f;
    if (cap > 0.f && dcap) {  // two loops: a branch inside would stop the vectorizer
      for (int64_t c = 0; c < n; ++c) {
        const float t = tanh_fast(s[c] * scale * icap);
        s[c] = cap * t;
        dcap[c] = 1.f - t * t;
      }
    } else if (cap > 0.f) {
      for (int64_t c = 0; c < n; ++c) s[c] = cap * tanh_fast(s[c] * scale * icap);
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] *= scale;
    }
    if (bias) {
      const float* br = bias + b * bs[0] + hq * bs[1] + i * bs[2] + j0 * bs[3];
      if (bs[3] == 1)
        for (int64_t c = 0; c < n; ++c) s[c] += br[c];
      else
        for (int64_t c = 0; c < n; ++c) s[c] += br[c * bs[3]];
    }
    if (alibi) {
      const float slope = alibi[b * as0 + hq];
      const float d0 = float(i + Tk - Tq - j0);  // the distance of key j0; exact below 2^24
      const int32_t n32 = int32_t(n);  // a block's keys: int32 -> float vectorizes, int64 not
      for (int32_t c = 0; c < n32; ++c) s[c] -= slope * (d0 - float(c));
    }
  }

  // What the softmax multiplies a stored score by (before log2 e): scale for raw dot products,
  // 1 for scores apply_row has modified.
  float score_scale(float scale) const { return on_scores() ? 1.f : scale; }

  // The sink of head hq in the unit of a kernel's running max (log2 of the scaled scores).
  float sink_log2(int64_t hq) const { return sinks[hq] * kLog2e; }
};

// The variants of one call from the op's optional arguments (already validated and converted
// to fp32 by mha.ops): sinks (h,), bias 4-D broadcastable to (B, h, Tq, Tk), slopes (B|1, h).
inline ScoreMods make_score_mods(double softcap, const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& alibi, int64_t B, int64_t h,
                                 int64_t Tq, int64_t Tk, const char* op) {
  ScoreMods m;
  TORCH_CHECK(softcap >= 0.0, op, ": softcap must be > 0 (0: none), got ", softcap);
  m.softcap = float(softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == h &&
                    sinks->is_contiguous(),
                op, ": sinks must be a contiguous float32 (h,) = (", h, ",), got ", sinks->sizes());
    m.sinks = sinks->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4, op,
                ": bias must be a 4-D float32 tensor broadcastable to (B, h, Tq, Tk)");
    const int64_t want[4] = {B, h, Tq, Tk};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(bias->size(d) == 1 || bias->size(d) == want[d], op, ": bias of shape ",
                  bias->sizes(), " is not broadcastable to (B, h, Tq, Tk) = (", B, ", ", h, ", ",
                  Tq, ", ", Tk, ")");
    m.bias = bias->data_ptr<float>();
    fill_strides(*bias, m.bs, 4, true);
  }
  if (alibi.has_value()) {
    TORCH_CHECK(alibi->scalar_type() == at::kFloat && alibi->dim() == 2 &&
                    (alibi->size(0) == 1 || alibi->size(0) == B) && alibi->size(1) == h &&
                    alibi->stride(1) == 1,
                op, ": alibi_slopes must be float32 (1|B, h) with unit stride over h, got ",
                alibi->sizes());
    m.alibi = alibi->data_ptr<float>();
    m.as0 = alibi->size(0) == 1 ? 0 : alibi->stride(0);
  }
  return m;
}

}  // namespace mha_common
