// The small-problem path of the flash backward: every key of a head in one block, scores
// transposed (the backward's counterpart of flash/flash_small.h).
//
// Shape legend: B batch, h query heads, h_kv K/V heads (g = h / h_kv), Tq/Tk query/key
// lengths, d_k/d_v head dims (d_kp, d_vp: rounded up to 16); a chunk is <= kSmallBwdCols query
// rows, held transposed as 16-lane vectors (NV = ceil(rows / 16) of them).
//
// With few keys the block driver (flash/bwd_unit.h) pads rows and keys to its blocks and packs
// per block; here one item is (b, K/V head) with all g query heads, and per chunk of rows:
//   S^T  = K Q^T      (Tk, rows)    K broadcast from its rows, Q^T packed once per chunk
//   dP^T = V dO^T     (Tk, rows)
//   P^T  = 2^(S^T scale log2 e - lse log2 e),  dS^T = P^T (dP^T - delta)   down the key axis,
//          16 query rows per vector: masks are per-lane key limits (causal, key_lengths) and
//          lane bits (bool mask); masked lanes are selected to 0
//   dV  += P^T dO,  dK += dS^T Q      (Tk, d): rank-1 updates over the chunk's rows, summed
//          in fp32 over the g heads and the chunks, stored once per item (dK scaled)
//   dQ   = dS K scale                  (rows, d_k): rank-1 updates over the keys
// bf16 inputs are widened to fp32 (fp32 products, as the block driver runs them below one
// whole block); gradients are rounded once. NaN / Inf follow flash_attn_bwd.cpp's rule with
// the same operands: Q with non-finite elements as 0 (S, dK += dS^T Q), K as 0 (dQ += dS K), P
// and dS selected to 0 on masked lanes, lse NaN for rows whose q is not finite.
// Every item is computed by one thread in a fixed order: bitwise deterministic.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/lanes16.h"
#include "flash/bwd_problem.h"
#include "flash/bwd_rows.h"

#if defined(__AVX512F__)
#define MHA_BWD_SMALL 1

namespace mha_flash_bwd {
namespace {

constexpr int64_t kSmallBwdMaxKeys = 64;  // largest Tk the path serves
constexpr int64_t kSmallBwdMaxRows = 64;  // largest Tq the auto choice gives it
constexpr int kSmallBwdCols = 64;         // query rows per chunk: 4 vectors of 16
constexpr int64_t kSmallBwdMaxDim = 256;

// Whether the path can serve P (any Tq: rows run in chunks) and whether the auto choice takes
// it (docs/kernel.md "The backward", "Small problems": the measured crossover).
template <typename T>
bool small_bwd_serves(const Problem<T>& P) {
  return P.Tk <= kSmallBwdMaxKeys && P.dk <= kSmallBwdMaxDim && P.dv <= kSmallBwdMaxDim &&
         P.window == 0 && !P.mods.any() && !P.plan.on() && P.dbias == nullptr;
}
template <typename T>
bool small_bwd_chosen(const Problem<T>& P) {
  return small_bwd_serves(P) && P.Tq <= kSmallBwdMaxRows;
}

using mha_lanes::lanes_below;
using mha_lanes::load_row16;

// The first n lanes of x stored to dst as T (bf16 rounded to nearest even).
template <typename T>
inline void small_store16(T* dst, __m512 x, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(dst, m, x);
  } else {
    const __m256i h = mha_tiles::to_bf16(x);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    _mm256_mask_storeu_epi16(dst, m, h);
#else
    alignas(32) uint16_t tmp[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
    for (int l = 0; l < kLanes; ++l)
      if ((m >> l) & 1) std::memcpy(dst + l, tmp + l, sizeof(T));
#endif
  }
}

// Calls f.template run<R>(r0) over n rows in tiles of RMAX rows, then one tile of the rest.
template <int R, class F>
inline void small_rest(int rest, int r0, const F& f) {
  if constexpr (R > 0) {
    if (rest == R) f.template run<R>(r0);
    else small_rest<R - 1>(rest, r0, f);
  }
}
template <int RMAX, class F>
inline void small_row_tiles(int n, const F& f) {
  int r0 = 0;
  for (; r0 + RMAX <= n; r0 += RMAX) f.template run<RMAX>(r0);
  if (r0 < n) small_rest<RMAX - 1>(n - r0, r0, f);
}

// Rows per tile NV vectors wide: at most 24 accumulators.
constexpr int small_rows_for(int nv) { return nv >= 4 ? 6 : (nv == 3 ? 8 : 12); }

// out^T[j][16 v + l] = sum_c A[j][c] BT[c][16 v + l] for R rows j of A (lda apart), the c
// products in blocks of kDotBlock (the tile kernels' sums): S^T = K Q^T and dP^T = V dO^T.
template <int NV>
struct TransposedProduct {
  const float *a, *bt;
  int64_t lda, depth;
  float* out;  // (rows, kSmallBwdCols)
  template <int R>
  void run(int j0) const {
    __m512 acc[R][NV];
    const float* aj = a + j0 * lda;
    mha_tiles::acc_dot_blocks(
        acc, depth, out + j0 * kSmallBwdCols, kSmallBwdCols,
        [&](__m512 (&x)[R][NV], int64_t c) __attribute__((always_inline)) {
          __m512 bv[NV];
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(bt + c * kSmallBwdCols + v * kLanes);
          mha_tiles::acc_rank1(x, bv, aj + c, lda);
        });
    mha_tiles::acc_store(acc, out + j0 * kSmallBwdCols, kSmallBwdCols);
  }
};

// acc[r][16 v + l] (+)= sum_{x < n} A[r][x] Brow[x][c0 + 16 v + l], A[r][x] at a + r ra + x xa:
// dV += P^T dO, dK += dS^T Q (r a key, x a row), dQ = dS K (r a row, x a key). Accumulates
// into out (ldo apart) when load, else overwrites it.
template <int CV>
struct RankOneProduct {
  const float* a;
  int64_t ra, xa;
  const float* b;
  int64_t ldb, n, c0;
  float* out;
  int64_t ldo;
  bool load;
  template <int R>
  void run(int r0) const {
    __m512 acc[R][CV];
    float* o = out + r0 * ldo + c0;
    if (load) mha_tiles::acc_load(acc, o, ldo);
    else mha_tiles::acc_zero(acc);
    const float* ar = a + r0 * ra;
    for (int64_t x = 0; x < n; ++x) {
      __m512 bv[CV];
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) bv[c] = _mm512_loadu_ps(b + x * ldb + c0 + c * kLanes);
      mha_tiles::acc_rank1(acc, bv, ar + x * xa, ra);
    }
    mha_tiles::acc_store(acc, o, ldo);
  }
};

// rows x width (a multiple of 16) of out = sum over n terms, in column panels of <= 4 vectors.
inline void rank_one_rows(int rows, int64_t width, const float* a, int64_t ra, int64_t xa,
                          const float* b, int64_t ldb, int64_t n, float* out, int64_t ldo,
                          bool load) {
  for (int64_t c0 = 0; c0 < width; c0 += 4 * kLanes) {
    const int64_t cv = std::min<int64_t>(4, (width - c0) / kLanes);
    switch (cv) {
      case 1: small_row_tiles<12>(rows, RankOneProduct<1>{a, ra, xa, b, ldb, n, c0, out, ldo, load}); break;
      case 2: small_row_tiles<12>(rows, RankOneProduct<2>{a, ra, xa, b, ldb, n, c0, out, ldo, load}); break;
      case 3: small_row_tiles<8>(rows, RankOneProduct<3>{a, ra, xa, b, ldb, n, c0, out, ldo, load}); break;
      default: small_row_tiles<6>(rows, RankOneProduct<4>{a, ra, xa, b, ldb, n, c0, out, ldo, load}); break;
    }
  }
}

// out^T (rows, kSmallBwdCols) = A (rows, depth) BT (depth, 16 nv).
inline void transposed_rows(int rows, int nv, const float* a, int64_t lda, const float* bt,
                            int64_t depth, float* out) {
  switch (nv) {
    case 1: small_row_tiles<small_rows_for(1)>(rows, TransposedProduct<1>{a, bt, lda, depth, out}); break;
    case 2: small_row_tiles<small_rows_for(2)>(rows, TransposedProduct<2>{a, bt, lda, depth, out}); break;
    case 3: small_row_tiles<small_rows_for(3)>(rows, TransposedProduct<3>{a, bt, lda, depth, out}); break;
    default: small_row_tiles<small_rows_for(4)>(rows, TransposedProduct<4>{a, bt, lda, depth, out}); break;
  }
}

// One thread's scratch, kept between calls.
struct SmallBwdScratch {
  std::vector<float> kr, k0, vr;   // the item's K (Tk, d_kp), K with non-finite as 0, V (Tk, d_vp)
  std::vector<float> dk, dv;       // dK, dV sums of the item (Tk, d_kp|d_vp)
  std::vector<float> qr, dor;      // the chunk's Q (non-finite as 0) and dO rows (64, d_kp|d_vp)
  std::vector<float> qt, dot;      // the same transposed (d_kp|d_vp, 64)
  std::vector<float> st, dpt;      // S^T then P^T, dP^T then dS^T (Tk, 64)
  std::vector<float> dq;           // the chunk's dQ (64, d_kp)
  std::vector<uint16_t> bits;      // the bool mask as lane bits (Tk, 4)
  alignas(64) float lse2[kSmallBwdCols], lse2lo[kSmallBwdCols], delta[kSmallBwdCols];
};

template <typename T>
struct SmallBwdWorker {
  const Problem<T>& P;
  SmallBwdScratch& w;
  int64_t g, dkp, dvp;

  SmallBwdWorker(const Problem<T>& p, SmallBwdScratch& s) : P(p), w(s) {
    g = P.h / P.hkv, dkp = round_up(P.dk, kLanes), dvp = round_up(P.dv, kLanes);
    w.kr.resize(P.Tk * dkp), w.k0.resize(P.Tk * dkp), w.vr.resize(P.Tk * dvp);
    w.dk.resize(P.Tk * dkp), w.dv.resize(P.Tk * dvp);
    w.qr.resize(kSmallBwdCols * dkp), w.dor.resize(kSmallBwdCols * dvp);
    w.qt.resize(dkp * kSmallBwdCols), w.dot.resize(dvp * kSmallBwdCols);
    w.st.resize(P.Tk * kSmallBwdCols), w.dpt.resize(P.Tk * kSmallBwdCols);
    w.dq.resize(kSmallBwdCols * dkp), w.bits.resize(P.Tk * 4);
  }

  // Keys j < key_limit(b, i) are visible to row i before the bool mask.
  int64_t key_limit(int64_t b, int64_t i) const {
    const int64_t kl = P.key_lengths ? P.key_lengths[b] : P.Tk;
    return P.causal ? std::clamp<int64_t>(i + P.Tk - P.Tq + 1, 0, kl) : kl;
  }

  // Row r of a (.., d) tensor at base (rows rs apart, elements cs) as fp32 at dst, zeros
  // from d to ld; the row kRowsAhead below it is asked for (the hardware prefetchers do not
  // keep up with several tensors' rows of a few hundred bytes: see pack_rows).
  void widen_row(const T* base, int64_t rs, int64_t cs, int64_t r, int64_t n, int64_t d,
                 float* dst, int64_t ld) const {
    if (r + kRowsAhead < n) prefetch_row(base + (r + kRowsAhead) * rs, d, cs);
    for (int64_t c = 0; c < ld; c += kLanes)
      _mm512_storeu_ps(dst + r * ld + c,
                       load_row16(base + r * rs, cs, c, std::clamp<int64_t>(d - c, 0, kLanes)));
  }

  // 64 rows of src (ld apart; rows >= n read as 0) transposed into dst (ld, 64).
  static void transpose_rows(const float* src, int64_t ld, int n, float* dst) {
    for (int rv = 0; rv * kLanes < n; ++rv)
      for (int64_t c = 0; c < ld; c += kLanes) {
        __m512 blk[16];
#pragma GCC unroll 16
        for (int r = 0; r < kLanes; ++r) {
          const int row = rv * kLanes + r;
          blk[r] = row < n ? _mm512_loadu_ps(src + row * ld + c) : _mm512_setzero_ps();
        }
        mha_tiles::transpose16(blk);
#pragma GCC unroll 16
        for (int cc = 0; cc < kLanes; ++cc)
          _mm512_storeu_ps(dst + (c + cc) * kSmallBwdCols + rv * kLanes, blk[cc]);
      }
  }

  // All g query heads of K/V head kvh in batch b.
  void run_item(int64_t b, int64_t kvh) {
    const int64_t kend = key_limit(b, P.Tq - 1);  // keys any row sees
    const T* kb = P.k + b * P.ks[0] + kvh * P.ks[1];
    const T* vb = P.v + b * P.vs[0] + kvh * P.vs[1];
    for (int64_t j = 0; j < kend; ++j) {
      widen_row(kb, P.ks[2], P.ks[3], j, kend, P.dk, w.kr.data(), dkp);
      widen_row(vb, P.vs[2], P.vs[3], j, kend, P.dv, w.vr.data(), dvp);
    }
    std::copy_n(w.kr.data(), kend * dkp, w.k0.data());
    zero_non_finite(w.k0.data(), kend * dkp);
    std::fill_n(w.dk.data(), kend * dkp, 0.f);
    std::fill_n(w.dv.data(), kend * dvp, 0.f);
    for (int64_t hq = kvh * g; hq < (kvh + 1) * g; ++hq)
      for (int64_t i0 = 0; i0 < P.Tq; i0 += kSmallBwdCols)
        chunk(b, hq, i0, int(std::min<int64_t>(kSmallBwdCols, P.Tq - i0)));
    // dK (scaled), dV of the item's keys; zeros for keys no row sees
    const int64_t kv0 = (b * P.hkv + kvh) * P.Tk;
    const __m512 sc = _mm512_set1_ps(P.scale);
    for (int64_t j = 0; j < P.Tk; ++j) {
      T* dkr = P.dkey + (kv0 + j) * P.dk;
      T* dvr = P.dval + (kv0 + j) * P.dv;
      if (j >= kend) {
        std::fill_n(dkr, P.dk, T(0.f));
        std::fill_n(dvr, P.dv, T(0.f));
        continue;
      }
      for (int64_t c = 0; c < P.dk; c += kLanes)
        small_store16(dkr + c, _mm512_mul_ps(_mm512_loadu_ps(w.dk.data() + j * dkp + c), sc),
                      lanes_below(P.dk - c));
      for (int64_t c = 0; c < P.dv; c += kLanes)
        small_store16(dvr + c, _mm512_loadu_ps(w.dv.data() + j * dvp + c), lanes_below(P.dv - c));
    }
  }

  // Rows [i0, i0 + nq) of head hq: Q (non-finite as 0), dO, lse in base 2 (hi + lo; +inf for
  // rows that see nothing, NaN for rows whose q is not finite or whose lse is +inf) and delta =
  // rowsum(dO O) - dlse, as the block driver's pack_rows.
  void pack_chunk(int64_t b, int64_t hq, int64_t i0, int nq) {
    const T* qb = P.q + b * P.qs[0] + hq * P.qs[1] + i0 * P.qs[2];
    const T* gb = P.go ? P.go + b * P.gos[0] + hq * P.gos[1] + i0 * P.gos[2] : nullptr;
    const T* ob = P.out + b * P.os[0] + hq * P.os[1] + i0 * P.os[2];
    for (int r = 0; r < nq; ++r) {
      const int64_t t = i0 + r;
      widen_row(qb, P.qs[2], P.qs[3], r, nq, P.dk, w.qr.data(), dkp);
      if (P.go) {
        widen_row(gb, P.gos[2], P.gos[3], r, nq, P.dv, w.dor.data(), dvp);
        if (r + kRowsAhead < nq) prefetch_row(ob + (r + kRowsAhead) * P.os[2], P.dv, P.os[3]);
      }
      const bool finite = zero_non_finite(w.qr.data() + r * dkp, P.dk);
      float dsum = 0.f;
      if (P.go) {
        const T* orow = ob + r * P.os[2];
        __m512 part = _mm512_setzero_ps();  // lane l sums c = l mod 16 (the block driver's order)
        for (int64_t c = 0; c < P.dv; c += kLanes)
          part = _mm512_add_ps(part, _mm512_mul_ps(_mm512_loadu_ps(w.dor.data() + r * dvp + c),
                                                   load_row16(orow, P.os[3], c,
                                                                std::min<int64_t>(kLanes, P.dv - c))));
        alignas(64) float lanes[kLanes];
        _mm512_store_ps(lanes, part);
        for (int l = 0; l < kLanes; ++l) dsum += lanes[l];
      }
      if (P.glse) dsum -= P.glse[b * P.gls[0] + hq * P.gls[1] + t * P.gls[2]];
      w.delta[r] = dsum;
      const double l = P.lse[b * P.ls[0] + hq * P.ls[1] + t * P.ls[2]];
      const double l2 = l * mha_common::kLog2eD;
      w.lse2[r] = l == -kInf ? kInf : finite && l != kInf ? float(l2) : std::nanf("");
      w.lse2lo[r] = std::isfinite(l2) ? float(l2 - double(float(l2))) : 0.f;
    }
    for (int r = nq; r < round_up(nq, kLanes); ++r)
      w.lse2[r] = kInf, w.lse2lo[r] = 0.f, w.delta[r] = 0.f;  // padding lanes: P = 0
    transpose_rows(w.qr.data(), dkp, nq, w.qt.data());
    if (P.go) transpose_rows(w.dor.data(), dvp, nq, w.dot.data());
  }

  // The bool mask as lane bits: bits[4 j + v] lane l = mask[b, hq, i0 + 16 v + l, j].
  const uint16_t* mask_bits(int64_t b, int64_t hq, int64_t i0, int nq, int nkeys) {
    uint16_t* bits = w.bits.data();
    std::fill_n(bits, size_t(nkeys) * 4, uint16_t(0));
    const bool* base = P.mask + b * P.ms[0] + hq * P.ms[1] + i0 * P.ms[2];
    const int nrows = P.ms[2] == 0 ? 1 : nq;  // a mask broadcast over queries: one row
    for (int r = 0; r < nrows; ++r) {
      const bool* mrow = base + r * P.ms[2];
      for (int j = 0; j < nkeys; ++j) {
        if (!mrow[j * P.ms[3]]) continue;
        if (nrows == 1) {
          for (int v = 0; v < 4; ++v) bits[j * 4 + v] = 0xFFFF;
        } else {
          bits[j * 4 + r / kLanes] |= uint16_t(1u << (r % kLanes));
        }
      }
    }
    return bits;
  }

  // In place over st, dpt (nkeys rows): S^T -> P^T, dP^T -> dS^T; masked lanes exactly 0.
  void softmax_grad_t(int64_t b, int64_t hq, int64_t i0, int nq, int nkeys) {
    const __m512 c = _mm512_set1_ps(P.scale * kLog2e);
    const uint16_t* bits = P.mask ? mask_bits(b, hq, i0, nq, nkeys) : nullptr;
    const int64_t kl = P.key_lengths ? P.key_lengths[b] : P.Tk;
    const bool has_go = P.go != nullptr;
    for (int v = 0; v * kLanes < nq; ++v) {
      // per-lane key limit: keys j < lim are visible (before the bool mask); padding sees none
      const __m512i row = _mm512_add_epi32(
          _mm512_set1_epi32(int32_t(i0 + v * kLanes)),
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
      __m512i lim = _mm512_set1_epi32(int32_t(kl));
      if (P.causal)  // query i sees keys j <= i + Tk - Tq
        lim = _mm512_min_epi32(lim, _mm512_add_epi32(row, _mm512_set1_epi32(int32_t(P.Tk - P.Tq + 1))));
      lim = _mm512_maskz_mov_epi32(lanes_below(nq - v * kLanes), lim);
      const __m512 l2 = _mm512_load_ps(w.lse2 + v * kLanes);
      const __m512 l2lo = _mm512_load_ps(w.lse2lo + v * kLanes);
      const __m512 dl = _mm512_load_ps(w.delta + v * kLanes);
      float* sc = w.st.data() + v * kLanes;
      float* dc = w.dpt.data() + v * kLanes;
      for (int j = 0; j < nkeys; ++j) {
        __mmask16 ok = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(j));
        if (bits) ok &= bits[j * 4 + v];
        float* s = sc + j * kSmallBwdCols;
        float* d = dc + j * kSmallBwdCols;
        const __m512 x = _mm512_sub_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s), c, l2), l2lo);
        const __m512 p = _mm512_maskz_mov_ps(ok, exp2_avx512(x));
        const __m512 dp = has_go ? _mm512_loadu_ps(d) : _mm512_setzero_ps();
        _mm512_storeu_ps(s, p);
        _mm512_storeu_ps(d, _mm512_maskz_mul_ps(ok, p, _mm512_sub_ps(dp, dl)));
      }
    }
  }

  void chunk(int64_t b, int64_t hq, int64_t i0, int nq) {
    const int nkeys = int(key_limit(b, i0 + nq - 1));  // the chunk's last row sees the most
    T* dq0 = P.dq + ((b * P.h + hq) * P.Tq + i0) * P.dk;  // contiguous (B, h, Tq, d_k)
    if (nkeys == 0) {
      std::fill_n(dq0, nq * P.dk, T(0.f));
      return;
    }
    const int nv = (nq + kLanes - 1) / kLanes;
    pack_chunk(b, hq, i0, nq);
    transposed_rows(nkeys, nv, w.kr.data(), dkp, w.qt.data(), P.dk, w.st.data());  // S^T
    if (P.go) transposed_rows(nkeys, nv, w.vr.data(), dvp, w.dot.data(), P.dv, w.dpt.data());
    softmax_grad_t(b, hq, i0, nq, nkeys);
    // dV += P^T dO: (nkeys, nq) x (nq, d_vp); dK += dS^T Q: (nkeys, nq) x (nq, d_kp)
    if (P.go)
      rank_one_rows(nkeys, dvp, w.st.data(), kSmallBwdCols, 1, w.dor.data(), dvp, nq,
                    w.dv.data(), dvp, true);
    rank_one_rows(nkeys, dkp, w.dpt.data(), kSmallBwdCols, 1, w.qr.data(), dkp, nq, w.dk.data(),
                  dkp, true);
    // dQ = dS K: (nq, nkeys) x (nkeys, d_kp), dS^T read down its columns
    rank_one_rows(nq, dkp, w.dpt.data(), 1, kSmallBwdCols, w.k0.data(), dkp, nkeys, w.dq.data(),
                  dkp, false);
    const __m512 sc = _mm512_set1_ps(P.scale);
    for (int r = 0; r < nq; ++r)
      for (int64_t c = 0; c < P.dk; c += kLanes)
        small_store16(dq0 + r * P.dk + c, _mm512_mul_ps(_mm512_loadu_ps(w.dq.data() + r * dkp + c), sc),
                      lanes_below(P.dk - c));
  }
};

template <typename T>
void run_small_bwd(const Problem<T>& P) {
  const int64_t items = P.B * P.hkv;  // (b, K/V head), all g query heads each
  const double item_flops = 2.0 * double(P.h / P.hkv) * double(P.Tq) * double(P.Tk) *
                            double(3 * P.dk + 2 * P.dv);
  // at least ~1 MFLOP per thread's range: below that the parallel region costs more than it saves
  const int64_t grain = std::max<int64_t>(1, int64_t(1e6 / std::max(item_flops, 1.0)));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    thread_local SmallBwdScratch scratch;
    SmallBwdWorker<T> worker(P, scratch);
    for (int64_t it = begin; it < end; ++it) worker.run_item(it / P.hkv, it % P.hkv);
  });
}

}  // namespace
}  // namespace mha_flash_bwd

#endif  // __AVX512F__
