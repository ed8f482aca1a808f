// The score variants of the decode kernel (mha/scores.py's order), applied to one row of a
// split's fp32 score block between q.k and the masks. One helper for every q.k path (portable,
// AVX-512, AMX): they all leave scale * (q . k) in the block. The result stays in natural-log
// units: the softmax multiplies by log2(e) after subtracting the row's max (Problem::unit).
//
//   s  = scale * (q_i . k_j)                      (from qk / qk_amx: P.qk_scale = scale)
//   s  = softcap * tanh(s / softcap)              softcap
//   s  = s + bias[b, head, i, j]                  bias, read through its strides (0: broadcast)
//   s  = s - slope[b, head] * (i + Tk - Tq - j)   ALiBi, the distance computed here (Tk: the
//                                                 row's length when K/V are paged)
//
// The sink is not a score of any key: merge_group adds e^(sink - M) to each row's
// denominator once, after the splits are combined.
#pragma once

#include <cmath>
#include <cstdint>

#include "decode/problem.h"

namespace {

// s[t] for keys j0 + t, t < n, of query row i of head `head` in batch row b; Tk is the row's
// key length that ALiBi's distance is aligned to (P.Tk, or the row's length when paged).
// The arithmetic is the flash kernel's (mha_common::ScoreMods::apply_row, with the scale
// already applied by q.k).
inline void apply_variants(const Problem& P, int64_t b, int64_t head, int64_t i, int64_t j0,
                           int64_t n, int64_t Tk, float* s) {
  P.mods.apply_row(s, n, b, head, i, j0, P.Tq, Tk, 1.f);
}

}  // namespace
