// The seeds' module's self-attention forward in one call, for short sequences: the packed QKV
// projection, attention over every head and W_O, with the Q/K/V of a group of batch rows never
// leaving the thread's L2. One design in two element types (template parameter E): bf16 on the
// vdpbf16ps tiles (self_attention_bf16, E = uint16_t) and fp32 on the FMA tiles
// (self_attention_f32, E = float).
//
// Shape legend: B batch, T sequence length (<= kMaxT), D model width (the input's), h heads,
// d head dim (d % 16 == 0), hd = h d; N_out the output width. x (B, T, D) contiguous,
// W_qkv (3 hd, D) = [W^Q; W^K; W^V] and W_O (N_out, hd) in nn.Linear layout, biases (3 hd,),
// (N_out,) or none. Inference only (no autograd formula): mha.MultiHeadAttention calls it
// when nothing needs a gradient.
//
// Why one call: at B = 32, T = 20, D = 512, h = 8 the module is four GEMMs around 256 heads of
// 20 x 20. Run step by step, the QKV output (B T x 3 D: 2 MB bf16, 4 MB fp32) is written past L2
// by its GEMM and read back by attention, and every step is an operator call of its own. Here:
//   1. both weights are packed into 64-column panels (panels.h: bf16 pairs (K / 2, 64, 2), fp32
//      (K, 64)); nothing outlives the call (a weight changed by any means is read as it is),
//      unless the caller passes the panels made once by pack_panels_bf16 / pack_panels_f32
//      (mha.MultiHeadAttention.freeze());
//   2. work items are groups of whole batch rows (<= kGroupRows rows, at::parallel_for); each
//      item projects its rows to Q, K, V (R x 3 hd, in a buffer of the thread), runs attention
//      for each (batch row, head) from that buffer and writes the merged heads (R x hd, the
//      layout W_O reads), then applies W_O to them.
// One parallel region per call: each thread of the groups' region first packs the panels it
// claims (an atomic counter) and waits for the others' (measured against a packing region of
// its own: one fork / join less, which a busy neighbour makes cost a scheduler slice). The
// buffers are not zero-filled (2 MB per call in bf16): what is read before it is written (Q^T's
// columns past T) feeds only score lanes of queries never output, each lane one query.
// Attention per head, fp32 sums, the scores transposed so the softmax runs down the keys with
// 16 queries per vector (no horizontal reductions): S^T = K Q^T (K's rows read in place, Q^T
// packed by 8 x 8 register transposes: of fp32, or of bf16 pairs along d), P = 2^(t - max) / sum
// in fp32 (2^x of common/exp2.h). bf16: P rounded to bf16 (as torch's bf16 bmm after its
// softmax; vcvtneps2bf16) and paired along the keys, O = P V (V interleaved into pairs of rows,
// by 64-column panels) rounded to bf16 once; the projections sum in fp32 and round each output
// once, as mha::linear_bf16. fp32: P stays fp32 and O = P V reads V's rows in place; nothing is
// rounded but fp32's own sums. The projections are whole-K 6 x 64 tiles (csrc/linear/rows.h).
// RoPE (optional): right after a group's projection, the first r dims of every head's Q and K
// are turned in place by the caller's (B | 1, T, r) cos / signed-sin tables (mha.rope's
// Rotary.angles), in fp32 and rounded once to E, while they are in the thread's cache.
// Causal (query i sees keys j <= i; Tq = Tk, so top-left and bottom-right alignment agree):
// the softmax of 16 queries runs down the keys up to the last one's, a key past a query's own
// is -inf in its lane and exactly 0 after 2^x, the score tiles skip query vectors that see none
// of their keys, and O = P V sums each query over its keys only (the last keys of a 6-query
// block for the rows that see them: fp32 one FMA each, bf16 one word holding V's row in its
// half of a pair), so half the P V products are skipped and no product with an unseen V row
// is formed. Every output is computed by one thread in a fixed order: deterministic whatever
// the thread count. NaN / Inf: without causal every key is visible to every query, so a NaN
// anywhere in a head's scores or values makes that head's rows NaN, as SDPA's softmax; with
// causal a NaN in key or value j reaches the rows i >= j only (as SDPA with is_causal), and a
// NaN in query i row i only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/gemm_tiles.h"
#include "linear/panels.h"
#include "linear/rows.h"

#if defined(__AVX512F__)
#include "common/exp2.h"

namespace mha_self_attention {
namespace {

using mha_common::kLanes;
using mha_panels::kPanel;
using mha_rows::kStep;  // elements of E per word

constexpr int64_t kMaxT = 64;        // longest sequence served (the scores of a head: T x 64)
constexpr int64_t kGroupRows = 96;   // rows of x per work item (whole batch rows)
constexpr int64_t kSlackRows = 8;    // rows past a group's Q/K/V that Q^T's 8 x 8 blocks may read
constexpr float kLog2e = 1.4426950408889634f;

// The element types: E = float (fp32) or uint16_t (bf16 bits). A "word" is what Q^T and the
// panels hold per step of a reduction: an fp32, or a pair of bf16 as 32 bits.
template <typename E>
constexpr bool kBf16 = std::is_same_v<E, uint16_t>;
template <typename E>
using Word = std::conditional_t<kBf16<E>, uint32_t, float>;
template <typename E>
constexpr const char* kOp = kBf16<E> ? "mha self_attention_bf16" : "mha self_attention_f32";

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// n elements, not initialised.
template <typename T>
std::unique_ptr<T[]> uninit(int64_t n) { return std::unique_ptr<T[]>(new T[n]); }

// The per-thread buffers of one work item (sized for the largest group), not initialised.
template <typename E>
struct Scratch {
  std::unique_ptr<E[]> qkv, heads;       // (R + kSlackRows, 3 hd), (R, hd)
  std::unique_ptr<Word<E>[]> qt;         // (d / step, Tp) Q^T of one head (bf16: pairs along d)
  std::unique_ptr<float[]> st;           // (T, Tp) scores, keys by queries, then 2^(t - max)
                                         // (fp32: then P^T)
  std::unique_ptr<uint32_t[]> ppt;       // bf16: (T2, Tp) probabilities, pairs of keys per query
  std::unique_ptr<uint32_t[]> vp;        // bf16: (ceil(d / 64), T2, 64) pairs of V rows, by panels

  Scratch(int64_t R, int64_t T, int64_t d, int64_t hd) {
    const int64_t Tp = round_up(T, kLanes), T2 = (T + 1) / 2;
    qkv = uninit<E>((R + kSlackRows) * 3 * hd), heads = uninit<E>(R * hd);
    qt = uninit<Word<E>>(d / kStep<E> * Tp), st = uninit<float>(T * Tp);
    if constexpr (kBf16<E>) {
      ppt = uninit<uint32_t>(T2 * Tp);
      vp = uninit<uint32_t>(T2 * round_up(d, kPanel));
    }
  }
};

#if defined(MHA_GEMM_BF16)
// O (R rows, 64 columns of one panel) = P V for the query rows q0 .. q0 + R: P^T pairs
// ppt[k][q] (pairs of keys 2k, 2k + 1 for query q, Tp per k), V panel vp[k][64] pairs.
// x (R rows x 64 columns) += P V over K2 pairs of keys: ppt the pairs of P (rows Tp apart),
// vpanel V's pair-packed panel.
template <int R>
MHA_TILE_INLINE void pv_pairs(__m512 (&x)[R][4], const uint32_t* ppt, int64_t Tp,
                              const uint32_t* vpanel, int64_t K2) {
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(vpanel + k * kPanel + v * kLanes);
    mha_tiles::acc_rank2_bf16(x, bv, reinterpret_cast<const uint16_t*>(ppt + k * Tp), 2);
  }
}

template <int R>
void pv_tile(const uint32_t* ppt, int64_t Tp, const uint32_t* vpanel, int64_t K2, uint16_t* out,
             int64_t ldo, int64_t cols) {
  __m512 x[R][4];
  mha_tiles::acc_zero(x);
  pv_pairs(x, ppt, Tp, vpanel, K2);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)  // unrolled: from registers, not a stack array (rows.h)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      if (v * kLanes < cols)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + v * kLanes),
                            mha_tiles::to_bf16(x[r][v]));
}
using PvFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, uint16_t*, int64_t,
                      int64_t);
constexpr PvFn kPv[7] = {nullptr, &pv_tile<1>, &pv_tile<2>, &pv_tile<3>, &pv_tile<4>,
                         &pv_tile<5>, &pv_tile<6>};

// Causal: O (R rows from query q0, 64 columns of one panel) = P V over the keys j <= q, query
// q = q0 + r. The pairs of keys <= q0 (every row sees both) as pv_tile; then each key j of the
// triangle past them (q0 < j < q0 + R, and q0 itself when it opens a pair) for the rows that
// see it, as one word (V's row j in its half of the pair, 0 in the other) against the pair of
// P holding P(q, j): its partner key multiplies 0 (P is finite or the row is NaN anyway), so a
// key a row does not see never enters its sum, whatever its value. ppt and out start at q0; v
// is V's row 0 at the panel's first column, rows ld elements apart.
template <int R>
void pv_tile_causal(const uint32_t* ppt, int64_t Tp, const uint32_t* vpanel, int64_t q0,
                    const uint16_t* v, int64_t ld, uint16_t* out, int64_t ldo, int64_t cols) {
  __m512 x[R][4];
  mha_tiles::acc_zero(x);
  const int64_t K2 = (q0 + 1) / 2;  // pairs of keys <= q0
  pv_pairs(x, ppt, Tp, vpanel, K2);
#pragma GCC unroll 6
  for (int kk = 0; kk < R; ++kk) {  // key j = q0 + kk, seen by rows r >= kk
    const int64_t j = q0 + kk;
    if (j < 2 * K2) continue;  // (q0 odd: key q0 closed the last pair)
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int w = 0; w < 4; ++w) {
      const __m512i u = w * kLanes < cols ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(v + j * ld + w * kLanes))) : _mm512_setzero_si512();
      bv[w] = (__m512bh)(j % 2 ? _mm512_slli_epi32(u, 16) : u);  // V's row j in its half
    }
    const uint32_t* pj = ppt + j / 2 * Tp;  // pairs of P holding key j, by query
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      if (r < kk) continue;
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(pj[r]));
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) x[r][w] = _mm512_dpbf16_ps(x[r][w], a, bv[w]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int w = 0; w < 4; ++w)
      if (w * kLanes < cols)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + w * kLanes),
                            mha_tiles::to_bf16(x[r][w]));
}
using PvCausalFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const uint16_t*,
                            int64_t, uint16_t*, int64_t, int64_t);
constexpr PvCausalFn kPvCausal[7] = {nullptr, &pv_tile_causal<1>, &pv_tile_causal<2>,
                                     &pv_tile_causal<3>, &pv_tile_causal<4>,
                                     &pv_tile_causal<5>, &pv_tile_causal<6>};

// bf16: P (the normalised 2^(t - max) in st) rounded to bf16 and paired along the keys into
// ppt, V interleaved into pairs of rows by 64-column panels, then O = P V rounded once.
// Causal: the 16 queries from c pair only the keys < c + 16 (the rows of st the softmax
// wrote: 0 where a query does not see the key), and each query sums the keys it sees.
void pv_bf16(int64_t T, int64_t d, const uint16_t* v, int64_t ld, const float* iv_of,
             bool causal, Scratch<uint16_t>& sc, uint16_t* out, int64_t ldo) {
  const int64_t Tp = round_up(T, kLanes), T2 = (T + 1) / 2;
  const float* st = sc.st.get();
  uint32_t* ppt = sc.ppt.get();  // (T2, Tp) pairs of P^T rows
  for (int64_t c = 0; c < Tp; c += kLanes) {
    const __m512 iv = _mm512_loadu_ps(iv_of + c);
    const int64_t pairs = causal ? (std::min(T, c + kLanes) + 1) / 2 : T2;
    for (int64_t j2 = 0; j2 < pairs; ++j2) {  // keys 2 j2 and 2 j2 + 1 paired
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
          _mm512_mul_ps(_mm512_loadu_ps(st + 2 * j2 * Tp + c), iv)));
      const __m512i hi = 2 * j2 + 1 < T ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
          _mm512_mul_ps(_mm512_loadu_ps(st + (2 * j2 + 1) * Tp + c), iv))) : _mm512_setzero_si512();
      _mm512_storeu_si512(ppt + j2 * Tp + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  uint32_t* vp = sc.vp.get();  // V in panels of 64 columns of row pairs, zero past T and d
  const int64_t dp = round_up(d, kPanel);
  for (int64_t j2 = 0; j2 < T2; ++j2) {
    const uint16_t* a = v + 2 * j2 * ld;
    const bool odd = 2 * j2 + 1 >= T;
    for (int64_t c = 0; c < dp; c += kLanes) {
      uint32_t* dst = vp + (c / kPanel * T2 + j2) * kPanel + c % kPanel;
      if (c >= d) { _mm512_storeu_si512(dst, _mm512_setzero_si512()); continue; }
      const __m512i lo = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
      const __m512i hi = odd ? _mm512_setzero_si512() : _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + ld + c)));
      _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  for (int64_t c0 = 0; c0 < d; c0 += kPanel)  // O = P V, rounded once
    for (int64_t q0 = 0; q0 < T; q0 += 6) {
      const int64_t R = std::min<int64_t>(6, T - q0), cols = std::min(kPanel, d - c0);
      const uint32_t* vpanel = vp + c0 / kPanel * T2 * kPanel;
      if (causal)
        kPvCausal[R](ppt + q0, Tp, vpanel, q0, v + c0, ld, out + q0 * ldo + c0, ldo, cols);
      else
        kPv[R](ppt + q0, Tp, vpanel, T2, out + q0 * ldo + c0, ldo, cols);
    }
}
#endif  // MHA_GEMM_BF16

// S^T (T keys, Tp = 16 NV queries, row stride Tp) = K Q^T: K's rows ld elements apart, Q^T
// (dw, Tp) words (qt); dw reduction steps (bf16: pairs). The T rows are split evenly over the
// fewest register tiles of at most 24 / NV rows (24 accumulators; at most 12 rows): T = 20,
// Tp = 32 makes two tiles of 10 x 2 vectors, where gemm's 6-row tiles made 6 + 6 + 6 + 2 and
// the 2-row tile's 4 accumulator chains waited on vdpbf16ps's latency. The same sums: fp32 in
// blocks of kDotBlock products (gemm_scores' rule, the flash kernels' S), bf16 pairs in order.
template <int NV, typename E, std::size_t... R>
constexpr std::array<mha_gemm::TileFn<E>, sizeof...(R) + 1> score_tiles(
    std::index_sequence<R...>) {
  return {nullptr, &mha_gemm::tile<int(R) + 1, NV, E, std::is_same_v<E, float>>...};
}
template <int NV, typename E>
constexpr int kScoreRows = std::min(12, 24 / NV);
template <int NV, typename E>
constexpr auto kScoreTiles = score_tiles<NV, E>(std::make_index_sequence<kScoreRows<NV, E>>());

// The score tile of `rows` keys by nv vectors of queries (rows <= kScoreRows of any NV >= nv).
template <typename E>
mha_gemm::TileFn<E> score_tile(int64_t nv, int64_t rows) {
  switch (nv) {
    case 1: return kScoreTiles<1, E>[rows];
    case 2: return kScoreTiles<2, E>[rows];
    case 3: return kScoreTiles<3, E>[rows];
    default: return kScoreTiles<4, E>[rows];
  }
}

// Causal: a tile of keys from m0 skips the query vectors whose 16 queries all come before m0
// (none of them sees any of its keys): those rows of S^T are left unwritten there.
template <int NV, typename E, bool Causal>
void scores_nv(int64_t T, int64_t dw, const E* k, int64_t ld, const E* qt, float* st) {
  constexpr int64_t Tp = NV * kLanes;
  const int64_t tiles = (T + kScoreRows<NV, E> - 1) / kScoreRows<NV, E>;
  const int64_t base = T / tiles, extra = T % tiles;  // the first `extra` tiles: base + 1 rows
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < extra ? 1 : 0);
    const int64_t skip = Causal ? m0 / kLanes : 0;  // query vectors past (< NV: m0 < T <= Tp)
    if (skip == 0)
      kScoreTiles<NV, E>[rows](k + m0 * ld, ld, 1, qt, Tp, dw, st + m0 * Tp, Tp, false);
    else  // Q^T's columns from query 16 skip (bf16: pairs of E)
      score_tile<E>(NV - skip, rows)(k + m0 * ld, ld, 1, qt + skip * kLanes * kStep<E>, Tp, dw,
                                     st + m0 * Tp + skip * kLanes, Tp, false);
    m0 += rows;
  }
}

template <typename E, bool Causal>
void scores(int64_t T, int64_t Tp, int64_t dw, const E* k, int64_t ld, const E* qt, float* st) {
  switch (Tp / kLanes) {
    case 1: return scores_nv<1, E, Causal>(T, dw, k, ld, qt, st);
    case 2: return scores_nv<2, E, Causal>(T, dw, k, ld, qt, st);
    case 3: return scores_nv<3, E, Causal>(T, dw, k, ld, qt, st);
    default: return scores_nv<4, E, Causal>(T, dw, k, ld, qt, st);  // Tp <= kMaxT = 64
  }
}

// fp32, causal: O (R rows from query q0, 16 NV columns) = P V over the keys j <= q, query
// q = q0 + r, P(q, j) = pt[j Tp + r] (pt, out start at q0; v at the block's first column, rows
// ld apart). Keys <= q0 (every row sees them) as gemm's tile, in order; then each key of the
// triangle q0 < j < q0 + R for the rows r >= j - q0 only: a key a row does not see is never
// read for it, whatever its value.
template <int R, int NV>
void pv_tile_causal_f32(const float* pt, int64_t Tp, const float* v, int64_t ld, int64_t q0,
                        float* out, int64_t ldo) {
  __m512 x[R][NV];
  mha_tiles::acc_zero(x);
  for (int64_t k = 0; k <= q0; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) bv[n] = _mm512_loadu_ps(v + k * ld + n * kLanes);
    mha_tiles::acc_rank1(x, bv, pt + k * Tp, 1);
  }
#pragma GCC unroll 6
  for (int kk = 1; kk < R; ++kk) {  // key j = q0 + kk, seen by rows r >= kk
    const int64_t j = q0 + kk;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) bv[n] = _mm512_loadu_ps(v + j * ld + n * kLanes);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      if (r < kk) continue;
      const __m512 s = _mm512_set1_ps(pt[j * Tp + r]);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) x[r][n] = _mm512_fmadd_ps(s, bv[n], x[r][n]);
    }
  }
  mha_tiles::acc_store(x, out, ldo);
}
using PvF32Fn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
template <int R>
constexpr std::array<PvF32Fn, 5> kPvF32Row = {nullptr, &pv_tile_causal_f32<R, 1>,
                                              &pv_tile_causal_f32<R, 2>,
                                              &pv_tile_causal_f32<R, 3>,
                                              &pv_tile_causal_f32<R, 4>};
constexpr std::array<std::array<PvF32Fn, 5>, 7> kPvF32 = {
    std::array<PvF32Fn, 5>{}, kPvF32Row<1>, kPvF32Row<2>, kPvF32Row<3>, kPvF32Row<4>,
    kPvF32Row<5>, kPvF32Row<6>};

// fp32, causal: O (T, d) = P V, each query over the keys it sees; blocks of 6 queries by 64
// columns (the last: 16-column vectors), as gemm's tiles.
void pv_causal_f32(int64_t T, int64_t d, const float* st, int64_t Tp, const float* v, int64_t ld,
                   float* out, int64_t ldo) {
  for (int64_t n0 = 0; n0 < d; n0 += 4 * kLanes) {
    const int64_t nv = std::min<int64_t>(4, (d - n0) / kLanes);
    for (int64_t q0 = 0; q0 < T; q0 += 6)
      kPvF32[std::min<int64_t>(6, T - q0)][nv](st + q0, Tp, v + n0, ld, q0, out + q0 * ldo + n0,
                                               ldo);
  }
}

// One head of one batch row: q, k, v its (T, d) rows ld elements apart; out (T, d) rows ldo
// apart, softmax(scale q k^T) v (bf16: P and O rounded as above; fp32: no rounding but fp32's).
// Causal: query i sees keys j <= i. The softmax of the 16 queries from c runs down the keys
// j < c + 16 only (the others it sees none of), a key j > c for the lanes i >= j - c: a score
// a query does not see is -inf before the max and its 2^(t - max) exactly 0 (stored: bf16 pairs
// a seen key with an unseen one), so neither its value nor a NaN in it reaches the row.
template <typename E, bool Causal>
void head(int64_t T, int64_t d, const E* q, const E* k, const E* v, int64_t ld, float scale,
          Scratch<E>& sc, E* out, int64_t ldo) {
  constexpr int64_t step = kStep<E>;
  const int64_t Tp = round_up(T, kLanes), dw = d / step, ldw = ld / step;
  Word<E>* qt = sc.qt.get();  // qt[c][i] = word c of query i (columns i >= T: rows past the
                              // head or never written, scores of queries never output: each
                              // lane is one query down to P, which reads queries < T only)
  const float* qw = reinterpret_cast<const float*>(q);  // words (bf16 pairs moved as bits)
  for (int64_t j = 0; j < T; j += 8)
    for (int64_t c = 0; c < dw; c += 8)
      mha_panels::transpose8(qw + j * ldw + c, ldw, reinterpret_cast<float*>(qt + c * Tp + j), Tp);
  float* st = sc.st.get();  // S^T (T keys, Tp queries)
  scores<E, Causal>(T, Tp, dw, k, ld, reinterpret_cast<const E*>(qt), st);
  const __m512 neg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 cv = _mm512_set1_ps(scale * kLog2e);
  alignas(64) float iv_of[kMaxT];  // 1 / sum per query
  for (int64_t c = 0; c < Tp; c += kLanes) {  // 16 queries at a time, down the keys
    const int64_t keys = Causal ? std::min(T, c + kLanes) : T;  // keys any of them sees
    // causal: the lanes (queries c + i) that see key j > c, i >= j - c
    auto seen = [c](int64_t j) { return __mmask16(0xFFFFu << (j - c)); };
    __m512 m = neg;
    for (int64_t j = 0; j < keys; ++j) {
      __m512 t = _mm512_mul_ps(_mm512_loadu_ps(st + j * Tp + c), cv);
      if (Causal && j > c) t = _mm512_mask_blend_ps(seen(j), neg, t);
      _mm512_storeu_ps(st + j * Tp + c, t);
      m = _mm512_max_ps(m, t);
    }
    __m512 l = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
      __m512 e = mha_exp2::exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(st + j * Tp + c), m));
      if (Causal && j > c) e = _mm512_maskz_mov_ps(seen(j), e);
      _mm512_storeu_ps(st + j * Tp + c, e);
      l = _mm512_add_ps(l, e);
    }
    const __m512 iv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    if constexpr (kBf16<E>) {
      _mm512_store_ps(iv_of + c, iv);
    } else {
      for (int64_t j = 0; j < keys; ++j)  // P^T = e / sum, in place
        _mm512_storeu_ps(st + j * Tp + c, _mm512_mul_ps(_mm512_loadu_ps(st + j * Tp + c), iv));
    }
  }
  if constexpr (kBf16<E>) {
#if defined(MHA_GEMM_BF16)
    pv_bf16(T, d, v, ld, iv_of, Causal, sc, out, ldo);
#endif
  } else if constexpr (Causal) {
    pv_causal_f32(T, d, st, Tp, v, ld, out, ldo);
  } else {  // O (T, d) = P V: P(q, key) = st[key Tp + q], V's rows read in place
    mha_gemm::gemm<float>(T, d, T, st, 1, Tp, v, ld, out, ldo, false);
  }
}

// 16 elements of E at p as fp32 (m: the lanes read, the others 0).
template <typename E>
__m512 load16(const E* p, __mmask16 m) {
  if constexpr (kBf16<E>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  else
    return _mm512_maskz_loadu_ps(m, p);
}

// The lanes m of x into p as E (bf16: rounded to nearest even once).
template <typename E>
void store16(E* p, __m512 x, __mmask16 m) {
  if constexpr (kBf16<E>)
    _mm256_mask_storeu_epi16(p, m, mha_tiles::to_bf16(x));
  else
    _mm512_mask_storeu_ps(p, m, x);
}

// RoPE on the first r dims of one head's row x (in place): y = x C + partner(x) S in fp32,
// rounded once to E, as mha.rope's rotation (C, S: the row's (r,) cos and signed sin,
// Rotary.angles). Pairs (i, i + r/2), or (2i, 2i + 1) when interleaved.
template <typename E>
void rotate(E* x, int64_t r, const float* C, const float* S, bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < r; i += kLanes) {
      const __mmask16 m = __mmask16((1u << std::min<int64_t>(kLanes, r - i)) - 1);
      const __m512 v = load16<E>(x + i, m);
      const __m512 swapped = _mm512_permute_ps(v, 0xB1);  // (2i, 2i + 1) -> (2i + 1, 2i)
      store16<E>(x + i, _mm512_fmadd_ps(swapped, _mm512_maskz_loadu_ps(m, S + i),
                                        _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, C + i))), m);
    }
    return;
  }
  const int64_t h = r / 2;
  for (int64_t i = 0; i < h; i += kLanes) {
    const __mmask16 m = __mmask16((1u << std::min<int64_t>(kLanes, h - i)) - 1);
    const __m512 a = load16<E>(x + i, m), b = load16<E>(x + h + i, m);
    const __m512 ya = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(m, S + i),
                                      _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, C + i)));
    const __m512 yb = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, S + h + i),
                                      _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, C + h + i)));
    store16<E>(x + i, ya, m);
    store16<E>(x + h + i, yb, m);
  }
}

// The rotation of a call: the (B | 1, T, r) cos / signed-sin tables, or none.
struct Rope {
  const float* C = nullptr;
  const float* S = nullptr;
  int64_t r = 0, row_stride = 0;  // row_stride: T r, or 0 for one table shared by every row
  bool interleaved = false;
};

template <typename E>
void check_dtype(const at::Tensor& t, const char* name) {
  const at::ScalarType want = kBf16<E> ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == want, kOp<E>, ": ", name, " must be a ",
              kBf16<E> ? "bfloat16" : "float32", " CPU tensor, got ", t.scalar_type(), " on ",
              t.device());
}

template <typename E>
const E* data(const at::Tensor& t) {
  return reinterpret_cast<const E*>(t.data_ptr());
}

template <typename E>
E* data_mut(at::Tensor& t) {
  return reinterpret_cast<E*>(t.data_ptr());
}

// bias (n,) -> fp32 (round_up(n, 64),) zero-padded; empty when absent.
template <typename E>
std::vector<float> padded_bias(const std::optional<at::Tensor>& b, int64_t n, const char* name) {
  if (!b.has_value()) return {};
  check_dtype<E>(*b, name);
  TORCH_CHECK(b->dim() == 1 && b->size(0) == n, kOp<E>, ": ", name, " must have shape (", n,
              ",), got ", b->sizes());
  const at::Tensor c = b->contiguous();
  const E* s = data<E>(c);
  std::vector<float> out(round_up(n, kPanel), 0.f);
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (kBf16<E>) {  // exact: a bf16 is the high half of an fp32
      const uint32_t u = uint32_t(s[i]) << 16;
      std::memcpy(&out[i], &u, sizeof u);
    } else {
      out[i] = s[i];
    }
  }
  return out;
}

// The panels of pack_panels_bf16 / pack_panels_f32 for W (N, K): (ceil(N / 64), K / 2, 64, 2)
// bf16 pairs, (ceil(N / 64), K, 64) fp32.
template <typename E>
std::vector<int64_t> panel_shape(int64_t N, int64_t K) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  if constexpr (kBf16<E>) return {P, K / 2, kPanel, 2};
  return {P, K, kPanel};
}

// Panel p of W (N, K), rows K elements apart, into dst (panels.h's layout, zero past N).
template <typename E>
void pack_panel(const E* w, int64_t N, int64_t K, int64_t p, E* dst) {
  if constexpr (kBf16<E>)
    mha_panels::pack_panel_bf16(w, N, K / 2, K, p, dst);
  else
    mha_panels::pack_panel_f32(w, N, K, K, 1, p, dst);
}

// W (N, K) -> its panels (panel_shape, zero past N): what the fused call packs per call, made
// once for a frozen module. bf16: K even.
template <typename E>
at::Tensor pack_panels(const at::Tensor& w) {
  check_dtype<E>(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.size(1) % kStep<E> == 0,
              kBf16<E> ? "mha pack_panels_bf16: w must be (N, K) with K even, got "
                       : "mha pack_panels_f32: w must be (N, K), got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty(panel_shape<E>(N, K), w.options());
  E* dst = data_mut<E>(out);
  const int64_t per = K * kPanel;  // elements per panel
  at::parallel_for(0, out.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pack_panel<E>(data<E>(wc), N, K, p, dst + p * per);
  });
  return out;
}

// Panels given for a weight (N, K): they must have pack_panels's shape.
template <typename E>
void check_panels(const std::optional<at::Tensor>& panels, int64_t N, int64_t K,
                  const char* name) {
  if (!panels.has_value()) return;
  check_dtype<E>(*panels, name);
  const std::vector<int64_t> shape = panel_shape<E>(N, K);
  TORCH_CHECK(panels->sizes() == at::IntArrayRef(shape) && panels->is_contiguous(), kOp<E>, ": ",
              name, " must be contiguous with shape ", at::IntArrayRef(shape),
              " (pack_panels of the weight), got ", panels->sizes());
}

// y (B, T, N_out) = W_O(attention(split(x W_qkv^T + b_qkv))) + b_O: the module's self-attention
// forward without masks or score variants but causal (see the file comment). w_qkv_panels /
// w_o_panels: the weights already packed (pack_panels_*; a frozen module's), read instead of
// packing w_qkv / w_o, whose shapes still define the call. causal: query i sees keys j <= i.
template <typename E>
at::Tensor self_attention(const at::Tensor& x, const at::Tensor& w_qkv,
                          const std::optional<at::Tensor>& b_qkv, const at::Tensor& w_o,
                          const std::optional<at::Tensor>& b_o, int64_t heads, double scale,
                          const std::optional<at::Tensor>& w_qkv_panels,
                          const std::optional<at::Tensor>& w_o_panels, bool causal,
                          const std::optional<at::Tensor>& rope_cos,
                          const std::optional<at::Tensor>& rope_sin, bool rope_interleaved) {
  check_dtype<E>(x, "x");
  check_dtype<E>(w_qkv, "w_qkv");
  check_dtype<E>(w_o, "w_o");
  TORCH_CHECK(x.dim() == 3, kOp<E>, ": x must be (B, T, D), got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(heads >= 1 && w_o.dim() == 2 && w_o.size(1) % heads == 0,
              kOp<E>, ": w_o must be (N_out, heads * d), got ", w_o.sizes(), " with heads=", heads);
  const int64_t hd = w_o.size(1), d = hd / heads, N = w_o.size(0);
  TORCH_CHECK(d % 16 == 0 && D % 16 == 0 && N % 16 == 0 && T >= 1 && T <= kMaxT,
              kOp<E>, ": needs d % 16 == 0, D % 16 == 0, N_out % 16 == 0 and 1 <= T <= ", kMaxT,
              ", got d=", d, ", D=", D, ", N_out=", N, ", T=", T);
  TORCH_CHECK(w_qkv.dim() == 2 && w_qkv.size(0) == 3 * hd && w_qkv.size(1) == D,
              kOp<E>, ": w_qkv must be (3 * heads * d, D) = (", 3 * hd, ", ", D, "), got ",
              w_qkv.sizes());
  check_panels<E>(w_qkv_panels, 3 * hd, D, "w_qkv_panels");
  check_panels<E>(w_o_panels, N, hd, "w_o_panels");
  const std::vector<float> bq = padded_bias<E>(b_qkv, 3 * hd, "b_qkv");
  const std::vector<float> bo = padded_bias<E>(b_o, N, "b_o");
  TORCH_CHECK(rope_cos.has_value() == rope_sin.has_value(), kOp<E>,
              ": rope_cos and rope_sin are given together or not at all");
  Rope rope;
  if (rope_cos.has_value()) {
    for (const auto* t : {&*rope_cos, &*rope_sin})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                  t->dim() == 3 && (t->size(0) == 1 || t->size(0) == B) && t->size(1) == T &&
                  t->size(2) % 2 == 0 && t->size(2) >= 2 && t->size(2) <= d &&
                  t->sizes() == rope_cos->sizes(),
                  kOp<E>, ": rope_cos and rope_sin must be contiguous float32 CPU tensors of "
                  "one shape (B or 1, T, r) with r even and 2 <= r <= d = ", d, ", got ",
                  rope_cos->sizes(), " and ", rope_sin->sizes());
    rope.C = rope_cos->data_ptr<float>();
    rope.S = rope_sin->data_ptr<float>();
    rope.r = rope_cos->size(2);
    rope.row_stride = rope_cos->size(0) == 1 ? 0 : T * rope.r;
    rope.interleaved = rope_interleaved;
  }
  at::Tensor out = at::empty({B, T, N}, x.options());
  if (B == 0) return out;
  const at::Tensor xc = x.contiguous(), wq = w_qkv.contiguous(), wo = w_o.contiguous();
  const int64_t Pq = (3 * hd + kPanel - 1) / kPanel, Po = (N + kPanel - 1) / kPanel;
  const int64_t wq_n = D * kPanel, wo_n = hd * kPanel;  // elements per panel
  // the panels: given (nothing to pack) or packed here into buffers of the call
  std::unique_ptr<E[]> wq_own, wo_own;
  if (!w_qkv_panels.has_value()) wq_own = uninit<E>(Pq * wq_n);
  if (!w_o_panels.has_value()) wo_own = uninit<E>(Po * wo_n);
  const E* wq_p = wq_own ? wq_own.get() : data<E>(*w_qkv_panels);
  const E* wo_p = wo_own ? wo_own.get() : data<E>(*w_o_panels);
  const int64_t to_pack_q = wq_own ? Pq : 0, to_pack = to_pack_q + (wo_own ? Po : 0);
  std::atomic<int64_t> claimed{0}, packed{0};  // panels claimed / packed, W_qkv's first
  auto pack = [&](int64_t p) {
    if (p < to_pack_q)
      pack_panel<E>(data<E>(wq), 3 * hd, D, p, wq_own.get() + p * wq_n);
    else
      pack_panel<E>(data<E>(wo), N, hd, p - to_pack_q, wo_own.get() + (p - to_pack_q) * wo_n);
  };
  // groups of whole batch rows; as many groups as fit kGroupRows, evened out
  const int64_t per = std::max<int64_t>(1, kGroupRows / T);
  const int64_t groups = (B + per - 1) / per, G = (B + groups - 1) / groups;
  const E* xb = data<E>(xc);
  E* yb = data_mut<E>(out);
  const float* bqp = bq.empty() ? nullptr : bq.data();
  const float* bop = bo.empty() ? nullptr : bo.data();
  const int64_t Kq = D / kStep<E>, Ko = hd / kStep<E>;  // the projections' reduction steps
  at::parallel_for(0, (B + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    // 1. the panels this thread claims, then the others' (each claimed one is being packed by
    // a thread already running, so the wait ends)
    for (int64_t p; (p = claimed.fetch_add(1, std::memory_order_relaxed)) < to_pack;) {
      pack(p);
      packed.fetch_add(1, std::memory_order_acq_rel);
    }
    while (packed.load(std::memory_order_acquire) < to_pack) _mm_pause();
    // 2. the groups
    Scratch<E> sc(G * T, T, d, hd);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * G, nb = std::min(G, B - b0), rows = nb * T;
      mha_rows::project<E>(rows, 3 * hd, Kq, xb + b0 * T * D, D, wq_p, bqp, sc.qkv.get(),
                           3 * hd);  // (rows, D) -> (rows, 3 hd) = [Q | K | V]
      if (rope.r > 0)  // Q and K of every head turned, token t of batch row b0 + b at row b T + t
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t b = row / T, t = row % T, at = (b0 + b) * rope.row_stride + t * rope.r;
          E* qk = sc.qkv.get() + row * 3 * hd;
          for (int64_t c = 0; c < 2 * hd; c += d)  // Q's heads, then K's
            rotate<E>(qk + c, rope.r, rope.C + at, rope.S + at, rope.interleaved);
        }
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t hh = 0; hh < heads; ++hh) {
          const E* q = sc.qkv.get() + b * T * 3 * hd + hh * d;  // (T, d), rows 3 hd apart
          E* o = sc.heads.get() + b * T * hd + hh * d;  // (T, d) of (rows, h d)
          (causal ? head<E, true> : head<E, false>)(T, d, q, q + hd, q + 2 * hd, 3 * hd,
                                                   float(scale), sc, o, hd);
        }
      mha_rows::project<E>(rows, N, Ko, sc.heads.get(), hd, wo_p, bop, yb + b0 * T * N,
                           N);  // (rows, h d) -> (rows, N_out)
    }
  });
  return out;
}

}  // namespace
}  // namespace mha_self_attention
#endif  // __AVX512F__

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("self_attention_bf16(Tensor x, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, Tensor? b_o, "
        "int heads, float scale, Tensor? w_qkv_panels=None, Tensor? w_o_panels=None, "
        "bool causal=False, Tensor? rope_cos=None, Tensor? rope_sin=None, "
        "bool rope_interleaved=False) -> Tensor");
  m.def("pack_panels_bf16(Tensor w) -> Tensor");
  m.def("self_attention_f32(Tensor x, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, Tensor? b_o, "
        "int heads, float scale, Tensor? w_qkv_panels=None, Tensor? w_o_panels=None, "
        "bool causal=False, Tensor? rope_cos=None, Tensor? rope_sin=None, "
        "bool rope_interleaved=False) -> Tensor");
  m.def("pack_panels_f32(Tensor w) -> Tensor");
}

#if defined(__AVX512F__)
TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("self_attention_f32", &mha_self_attention::self_attention<float>);
  m.impl("pack_panels_f32", &mha_self_attention::pack_panels<float>);
#if defined(MHA_GEMM_BF16)
  m.impl("self_attention_bf16", &mha_self_attention::self_attention<uint16_t>);
  m.impl("pack_panels_bf16", &mha_self_attention::pack_panels<uint16_t>);
#endif
}
#endif
