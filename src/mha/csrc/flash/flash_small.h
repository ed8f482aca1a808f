// The small-problem path of the CPU flash-attention forward: every key of a head in one block.
//
// Shape legend: B batch, h query heads, h_kv K/V heads (g = h / h_kv), Tq/Tk query/key
// lengths, d_k/d_v head dims; Q^T (d_k, 16 NV) a chunk of <= kSmallCols query rows transposed.
//
// When Tk is small (<= 64; bf16 on AMX <= 32) the tile driver's per-block machinery costs more
// than the math
// (measured at B=32, h=8, T=20, d=64: gathers packing K^T, V row copies, buffer fills, the
// online-softmax rescale, an atomic per item). Here the scores are computed transposed,
// S^T (keys, query rows), so:
//   * only Q is packed (transposed in registers, 16 x 16 at a time); K is broadcast from its
//     rows and V is read in place (fp32 with a contiguous last dim; else widened/copied once per
//     (b, K/V head) and shared by its g query heads);
//   * the softmax runs down the key axis with 16 query rows per vector: max and sum are
//     element-wise (no horizontal reductions) and, with one key block, there is no rescaling;
//   * masks become per-key lane masks: causal and key_lengths by comparing the key index with
//     each row's key limit, a window with each row's first key, a bool mask read through its
//     strides (a window's keys are still all scored: Tk is small here);
//   * work items are (b, K/V head) with all g query heads, split into equal contiguous ranges
//     by at::parallel_for (no atomic counter; the parallel region is skipped when tiny).
// bf16 inputs are widened to fp32 (fp32 products, sums and softmax; out rounded once).
// Every item is computed by one thread in a fixed order: bitwise deterministic.
// NaN / Inf follow flash_attn.cpp's rule: a visible NaN score makes its row's max, P, l and
// output NaN; keys a row may not attend never reach it (chunk: the exact pass).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/finite.h"
#include "flash/flash_attn_kernels.h"
#include "flash/problem.h"

#if defined(__AVX512F__)
#define MHA_FLASH_SMALL 1

namespace mha_flash {
namespace {

constexpr int64_t kSmallMaxKeys = 64;  // largest Tk this path can serve
constexpr int kSmallCols = 64;         // query rows per chunk: 4 vectors of 16
constexpr int64_t kSmallMaxDim = 256;

// Whether the path can serve P; with `tiles` (the tile kernel the call would otherwise run)
// whether it should, by the measured crossover (1 thread, d=64, docs/kernel.md "Small
// problems"): faster than the fp32 tiles up to Tk=64 at every Tq measured, faster than the
// bf16 AMX tiles up to Tk=32 (slower from Tk=48).
template <typename T>
bool small_path_applies(const Problem<T>& P, const std::string& tiles = "") {
  if (tiles == "portable") return false;  // asked for the reference loops (MHA_FLASH_BF16)
  const int64_t max_keys = tiles == "amx" ? 32 : kSmallMaxKeys;
  return P.Tk <= max_keys && P.dk <= kSmallMaxDim && P.dv <= kSmallMaxDim;
}

template <typename T>
struct SmallScratch {
  Buffer<float> qt, st, kf, vf;
  Buffer<uint16_t> bits;
};

// S^T[j][16 v + l] = sum_kk K[j][kk] QT[kk][16 v + l] for R keys j (rows of k, ldk apart),
// the dk products in blocks of kDotBlock (the tile kernels' sums: acc_dot_blocks).
template <int R, int NV>
inline void small_qk(const float* k, int64_t ldk, const float* qt, int dk, float* st) {
  __m512 acc[R][NV];
  acc_dot_blocks(acc, dk, st, kSmallCols,
                 [&](__m512 (&x)[R][NV], int64_t kk) __attribute__((always_inline)) {
                   __m512 qv[NV];
#pragma GCC unroll 4
                   for (int v = 0; v < NV; ++v)
                     qv[v] = _mm512_load_ps(qt + kk * kSmallCols + v * kLanes);
                   acc_rank1(x, qv, k + kk, ldk);
                 });
  acc_store(acc, st, kSmallCols);
}

// O[r][16 c + l] = inv[r] sum_j PT[j][r] V[j][16 c + l] for R query rows, then stored in T.
// Returns whether some sum is not finite (see SmallWorker::chunk: 0 * a non-finite V may have
// leaked into it from a key the row may not attend).
template <int R, int CV, typename T>
inline bool small_pv(const float* pt, int nkeys, const float* v, int64_t ldv, const float* inv,
                     int64_t dv, T* const* orows, int64_t c0) {
  __m512 acc[R][CV];
  acc_zero(acc);
  for (int j = 0; j < nkeys; ++j) {
    __m512 vv[CV];
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) vv[c] = _mm512_loadu_ps(v + j * ldv + c0 + c * kLanes);
    acc_rank1(acc, vv, pt + j * kSmallCols, 1);
  }
  __m512 chk[CV];  // column sums of the tile: not finite iff some sum is (or they overflow)
#pragma GCC unroll 4
  for (int c = 0; c < CV; ++c) chk[c] = acc[0][c];
#pragma GCC unroll 16
  for (int r = 1; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) chk[c] = _mm512_add_ps(chk[c], acc[r][c]);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 iv = _mm512_set1_ps(inv[r]);
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) {
      const int64_t col = c0 + c * kLanes;
      const __mmask16 m = lanes_below(int(dv - col));
      const __m512 x = _mm512_mul_ps(acc[r][c], iv);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(orows[r] + col, m, x);
      } else {  // round to nearest even, as at::BFloat16 does
        const __m256i h = mha_tiles::to_bf16(x);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        _mm256_mask_storeu_epi16(orows[r] + col, m, h);
#else
        alignas(32) uint16_t tmp[kLanes];
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
        std::memcpy(orows[r] + col, tmp, std::min<int64_t>(kLanes, dv - col) * sizeof(T));
#endif
      }
    }
  }
  __m512 all = chk[0];
#pragma GCC unroll 4
  for (int c = 1; c < CV; ++c) all = _mm512_add_ps(all, chk[c]);
  const __m512 zero = _mm512_setzero_ps();  // x * 0 is 0 for finite x, NaN for NaN and +-Inf
  return _mm512_cmp_ps_mask(_mm512_mul_ps(all, zero), zero, _CMP_NEQ_UQ) != 0;
}

template <typename T>
struct SmallWorker {
  const Problem<T>& P;
  SmallScratch<T>& sc;
  int64_t g, dvp;

  SmallWorker(const Problem<T>& p, SmallScratch<T>& s) : P(p), sc(s) {
    g = P.h / P.hkv;
    dvp = round_up(P.dv, kLanes);
  }

  // All g query heads of K/V head kh in batch b.
  void run_item(int64_t b, int64_t kh) {
    const int64_t kend = P.key_limit(b, P.Tq - 1);  // keys any row sees (before the bool mask)
    // K rows as fp32 with a contiguous last dim: in place, or widened / copied once here.
    const float* k;
    int64_t ldk;
    const T* kbase = P.k + b * P.ks[0] + kh * P.ks[1];
    if (std::is_same_v<T, float> && P.ks[3] == 1) {
      k = reinterpret_cast<const float*>(kbase), ldk = P.ks[2];
    } else {
      float* kf = sc.kf.get(std::max<int64_t>(kend, 1) * P.dk);
      for (int64_t j = 0; j < kend; ++j)
        for (int64_t c = 0; c < P.dk; c += kLanes)
          _mm512_mask_storeu_ps(kf + j * P.dk + c, lanes_below(int(P.dk - c)),
                                load_row16(kbase + j * P.ks[2], P.ks[3], c,
                                           int(std::min<int64_t>(kLanes, P.dk - c))));
      k = kf, ldk = P.dk;
    }
    // V rows: read past d_v up to dvp by the tiles, so in place only when d_v % 16 == 0.
    const float* v;
    int64_t ldv;
    const T* vbase = P.v + b * P.vs[0] + kh * P.vs[1];
    if (std::is_same_v<T, float> && P.vs[3] == 1 && P.dv == dvp) {
      v = reinterpret_cast<const float*>(vbase), ldv = P.vs[2];
    } else {
      float* vf = sc.vf.get(std::max<int64_t>(kend, 1) * dvp);
      for (int64_t j = 0; j < kend; ++j)
        for (int64_t c = 0; c < dvp; c += kLanes)
          _mm512_storeu_ps(vf + j * dvp + c,
                           load_row16(vbase + j * P.vs[2], P.vs[3], c,
                                      int(std::clamp<int64_t>(P.dv - c, 0, kLanes))));
      v = vf, ldv = dvp;
    }
    for (int64_t hq = kh * g; hq < (kh + 1) * g; ++hq)
      for (int64_t i0 = 0; i0 < P.Tq; i0 += kSmallCols)
        chunk(b, hq, i0, int(std::min<int64_t>(kSmallCols, P.Tq - i0)), k, ldk, v, ldv);
  }

  // Asks for the next item's Q, K and V rows (first kSmallCols query rows) while this one
  // computes: without it, at B=32, h=8, T=20 the first loads of each head waited on memory.
  void prefetch_item(int64_t b, int64_t kh) const {
    auto rows = [](const T* base, int64_t n, int64_t stride, int64_t bytes) {
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < bytes; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(base + r * stride) + c, _MM_HINT_T0);
    };
    if (P.qs[3] != 1 || P.ks[3] != 1 || P.vs[3] != 1) return;  // strided rows: left to the hardware
    const int64_t nk = P.key_limit(b, P.Tq - 1), nq = std::min<int64_t>(P.Tq, kSmallCols);
    for (int64_t hq = kh * g; hq < (kh + 1) * g; ++hq)
      rows(P.q + b * P.qs[0] + hq * P.qs[1], nq, P.qs[2], P.dk * int64_t(sizeof(T)));
    rows(P.k + b * P.ks[0] + kh * P.ks[1], nk, P.ks[2], P.dk * int64_t(sizeof(T)));
    rows(P.v + b * P.vs[0] + kh * P.vs[1], nk, P.vs[2], P.dv * int64_t(sizeof(T)));
  }

  // Q rows [i0, i0 + nq) of head hq, transposed into qt [d_k][kSmallCols], zeros past nq.
  void pack_qt(int64_t b, int64_t hq, int64_t i0, int nq, float* qt) const {
    const T* qbase = P.q + b * P.qs[0] + hq * P.qs[1] + i0 * P.qs[2];
    const int nvq = (nq + kLanes - 1) / kLanes;
    for (int rv = 0; rv < nvq; ++rv)
      for (int64_t c = 0; c < P.dk; c += kLanes) {
        __m512 blk[16];
        const int nc = int(std::min<int64_t>(kLanes, P.dk - c));
#pragma GCC unroll 16
        for (int r = 0; r < kLanes; ++r) {
          const int row = rv * kLanes + r;
          blk[r] = row < nq ? load_row16(qbase + row * P.qs[2], P.qs[3], c, nc)
                            : _mm512_setzero_ps();
        }
        transpose16(blk);
        for (int cc = 0; cc < nc; ++cc)
          _mm512_store_ps(qt + (c + cc) * kSmallCols + rv * kLanes, blk[cc]);
      }
  }

  void chunk(int64_t b, int64_t hq, int64_t i0, int nq, const float* k, int64_t ldk,
             const float* v, int64_t ldv) {
    const int nkeys = int(P.key_limit(b, i0 + nq - 1));  // the chunk's last row sees the most
    T* orows[kSmallCols];
    for (int r = 0; r < nq; ++r) orows[r] = P.out + b * P.os[0] + hq * P.os[1] + (i0 + r) * P.os[2];
    double* lse = P.lse + (b * P.h + hq) * P.Tq + i0;
    if (nkeys == 0) {
      for (int r = 0; r < nq; ++r) {
        std::fill(orows[r], orows[r] + P.dv, T(0));
        lse[r] = kNegInf;
      }
      return;
    }
    float* qt = sc.qt.get(P.dk * kSmallCols);
    float* st = sc.st.get(kSmallMaxKeys * kSmallCols);
    pack_qt(b, hq, i0, nq, qt);
    switch ((nq + kLanes - 1) / kLanes) {
      case 1: scores<1>(k, ldk, qt, nkeys, st); break;
      case 2: scores<2>(k, ldk, qt, nkeys, st); break;
      case 3: scores<3>(k, ldk, qt, nkeys, st); break;
      default: scores<4>(k, ldk, qt, nkeys, st); break;
    }
    alignas(64) float inv[kSmallCols];
    softmax(b, hq, i0, nq, nkeys, st, inv, lse);
    bool nonfinite = false;
    for (int64_t c0 = 0; c0 < P.dv; c0 += 4 * kLanes) {
      switch (std::min<int64_t>(4, (P.dv - c0 + kLanes - 1) / kLanes)) {
        case 1: rows<12, 1>(st, nkeys, v, ldv, inv, nq, orows, c0, nonfinite); break;
        case 2: rows<12, 2>(st, nkeys, v, ldv, inv, nq, orows, c0, nonfinite); break;
        case 3: rows<8, 3>(st, nkeys, v, ldv, inv, nq, orows, c0, nonfinite); break;
        default: rows<6, 4>(st, nkeys, v, ldv, inv, nq, orows, c0, nonfinite); break;
      }
    }
    // Every row multiplies all nkeys keys by its P, P = 0 at keys it may not attend, and 0 *
    // NaN (or Inf) in V is NaN. Only when some sum is not finite are the outputs computed
    // again from the keys each row may attend (finite inputs never pay).
    if (nonfinite) exact_rows(b, hq, i0, nq, nkeys, st, v, ldv, inv, orows);
  }

  // out[r] = inv[r] sum over the keys j < nkeys row i0 + r may attend of PT[j][r] V[j] (plain
  // loops: only for inputs with a NaN or an Inf).
  void exact_rows(int64_t b, int64_t hq, int64_t i0, int nq, int nkeys, const float* pt,
                  const float* v, int64_t ldv, const float* inv, T* const* orows) const {
    std::vector<float> acc(P.dv);
    for (int r = 0; r < nq; ++r) {
      const int64_t i = i0 + r, lo = P.key_start(i), hi = P.key_limit(b, i);
      const bool* mrow = P.mask ? P.mask + b * P.ms[0] + hq * P.ms[1] + i * P.ms[2] : nullptr;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = lo; j < std::min<int64_t>(hi, nkeys); ++j) {
        if (mrow && !mrow[j * P.ms[3]]) continue;
        const float pj = pt[j * kSmallCols + r];
        for (int64_t c = 0; c < P.dv; ++c) acc[c] += pj * v[j * ldv + c];
      }
      for (int64_t c = 0; c < P.dv; ++c) orows[r][c] = T(acc[c] * inv[r]);
    }
  }

  // Tiles of rows_for(NV) keys, then one tile of the remaining keys (for_row_tiles), so every
  // FMA chain has several independent accumulators.
  template <int NV>
  struct QkTiles {
    const float *k, *qt;
    int64_t ldk;
    int dk;
    float* st;
    template <int R>
    void run(int j0) const { small_qk<R, NV>(k + j0 * ldk, ldk, qt, dk, st + j0 * kSmallCols); }
  };
  template <int NV>
  void scores(const float* k, int64_t ldk, const float* qt, int nkeys, float* st) const {
    for_row_tiles<rows_for(NV)>(nkeys, QkTiles<NV>{k, qt, ldk, int(P.dk), st});
  }

  template <int CV>
  struct PvTiles {
    const float *pt, *v, *inv;
    int nkeys;
    int64_t ldv, dv, c0;
    T* const* orows;
    bool* nonfinite;  // set when some tile's sums are not finite
    template <int R>
    void run(int r0) const {
      if (small_pv<R, CV>(pt + r0, nkeys, v, ldv, inv + r0, dv, orows + r0, c0)) *nonfinite = true;
    }
  };
  template <int R, int CV>
  void rows(const float* pt, int nkeys, const float* v, int64_t ldv, const float* inv, int nq,
            T* const* orows, int64_t c0, bool& nonfinite) const {
    for_row_tiles<R>(nq, PvTiles<CV>{pt, v, inv, nkeys, ldv, P.dv, c0, orows, &nonfinite});
  }

  // In place over st: scores -> P^T = 2^(t - m) per query column (t = s * scale * log2 e,
  // -inf where masked); inv = 1 / sum (0 for rows that see no key) and the log-sum-exp.
  void softmax(int64_t b, int64_t hq, int64_t i0, int nq, int nkeys, float* st, float* inv,
               double* lse) {
    const __m512 neg = _mm512_set1_ps(kNegInf), cv = _mm512_set1_ps(P.scale * kLog2e);
    const int nvq = (nq + kLanes - 1) / kLanes;
    const uint16_t* bits = P.mask ? mask_bits_t(b, hq, i0, nq, nkeys, nvq) : nullptr;
    const int64_t kl = P.key_lengths ? P.key_lengths[b] : P.Tk;
    for (int vq = 0; vq < nvq; ++vq) {
      // per-lane key limit: keys j < lim are visible (before the bool mask); rows >= nq see none
      const __m512i row = _mm512_add_epi32(
          _mm512_set1_epi32(int32_t(i0 + vq * kLanes)),
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
      __m512i lim = _mm512_set1_epi32(int32_t(kl));
      if (P.causal) {  // query i sees keys j <= i + Tk - Tq
        const __m512i diag = _mm512_add_epi32(row, _mm512_set1_epi32(int32_t(P.Tk - P.Tq + 1)));
        lim = _mm512_min_epi32(lim, diag);
      }
      lim = _mm512_maskz_mov_epi32(lanes_below(nq - vq * kLanes), lim);
      // per-lane first key: j >= start (the window's left edge; 0 without a window)
      __m512i start = _mm512_setzero_si512();
      if (P.window > 0)
        start = _mm512_max_epi32(start, _mm512_add_epi32(row, _mm512_set1_epi32(int32_t(
                                                                 P.Tk - P.Tq - P.window + 1))));
      __m512 m = neg;
      __mmask16 nan = 0;  // rows whose visible scores are all NaN
      float* col = st + vq * kLanes;
      for (int j = 0; j < nkeys; ++j) {
        __mmask16 ok = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(j)) &
                       _mm512_cmple_epi32_mask(start, _mm512_set1_epi32(j));
        if (bits) ok &= bits[j * 4 + vq];
        const __m512 x = _mm512_mask_mul_ps(neg, ok, _mm512_load_ps(col + j * kSmallCols), cv);
        _mm512_store_ps(col + j * kSmallCols, x);
        m = _mm512_max_ps(m, x);
      }
      // vmaxps drops NaN; next to a finite score a NaN one still gives a NaN P and l. Rows
      // whose max is -inf saw no key, or only NaN scores: told apart here (rare)
      const __mmask16 empty = _mm512_cmp_ps_mask(m, neg, _CMP_EQ_OQ);
      if (empty)
        for (int j = 0; j < nkeys; ++j) {
          const __m512 x = _mm512_load_ps(col + j * kSmallCols);
          nan |= _mm512_mask_cmp_ps_mask(empty, x, x, _CMP_UNORD_Q);
        }
      m = _mm512_mask_mov_ps(m, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
      // rows that see no key: 2^(-inf - 0) = 0; a NaN max gives NaN P, l, inv and lse
      const __mmask16 any = _mm512_cmp_ps_mask(m, neg, _CMP_NEQ_UQ);
      const __m512 ms = _mm512_maskz_mov_ps(any, m);
      __m512 l = _mm512_setzero_ps();
      for (int j = 0; j < nkeys; ++j) {
        const __m512 p = exp2_avx512(_mm512_sub_ps(_mm512_load_ps(col + j * kSmallCols), ms));
        _mm512_store_ps(col + j * kSmallCols, p);
        l = _mm512_add_ps(l, p);
      }
      const __mmask16 seen = _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      _mm512_store_ps(inv + vq * kLanes, _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.f), l));
      alignas(64) float lv[kLanes], mv[kLanes];
      _mm512_store_ps(lv, l);
      _mm512_store_ps(mv, m);
      for (int r = 0; r < kLanes && vq * kLanes + r < nq; ++r)
        lse[vq * kLanes + r] =
            lv[r] != 0.f ? (double(mv[r]) + std::log2(double(lv[r]))) * kLn2d : kNegInf;
    }
  }

  // The bool mask as lane masks: bits[4 j + vq] lane l = mask[b, hq, i0 + 16 vq + l, j].
  const uint16_t* mask_bits_t(int64_t b, int64_t hq, int64_t i0, int nq, int nkeys, int nvq) {
    uint16_t* bits = sc.bits.get(size_t(nkeys) * 4);
    std::fill(bits, bits + size_t(nkeys) * 4, uint16_t(0));
    const bool* base = P.mask + b * P.ms[0] + hq * P.ms[1] + i0 * P.ms[2];
    const int nrows = P.ms[2] == 0 ? 1 : nq;  // a mask broadcast over queries: one row
    for (int r = 0; r < nrows; ++r) {
      const bool* mrow = base + r * P.ms[2];
      for (int j = 0; j < nkeys; ++j) {
        if (!mrow[j * P.ms[3]]) continue;
        if (nrows == 1) {
          for (int vq = 0; vq < nvq; ++vq) bits[j * 4 + vq] = 0xFFFF;
        } else {
          bits[j * 4 + r / kLanes] |= uint16_t(1u << (r % kLanes));
        }
      }
    }
    return bits;
  }
};

template <typename T>
void run_small(const Problem<T>& P) {
  const int64_t items = P.B * P.hkv;  // (b, K/V head), all g query heads each
  const double item_flops =
      2.0 * double(P.h / P.hkv) * double(P.Tq) * double(P.Tk) * double(P.dk + P.dv);
  // at least ~1 MFLOP per thread's range: below that the parallel region costs more than it saves
  const int64_t grain = std::max<int64_t>(1, int64_t(1e6 / std::max(item_flops, 1.0)));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    thread_local SmallScratch<T> scratch;
    SmallWorker<T> w(P, scratch);
    for (int64_t it = begin; it < end; ++it) {
      if (it + 1 < end) w.prefetch_item((it + 1) / P.hkv, (it + 1) % P.hkv);
      w.run_item(it / P.hkv, it % P.hkv);
    }
  });
}

}  // namespace
}  // namespace mha_flash

#endif  // __AVX512F__
