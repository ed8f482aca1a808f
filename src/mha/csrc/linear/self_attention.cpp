// The seeds' module's self-attention forward in one call on the bf16 tiles (vdpbf16ps), for
// short sequences: the packed QKV projection, attention over every head and W_O, with the
// Q/K/V of a group of batch rows never leaving the thread's L2.
//
// Shape legend: B batch, T sequence length (<= kMaxT), D model width (the input's), h heads,
// d head dim (d % 16 == 0), hd = h d; N_out the output width. x (B, T, D) contiguous,
// W_qkv (3 hd, D) = [W^Q; W^K; W^V] and W_O (N_out, hd) in nn.Linear layout, biases (3 hd,),
// (N_out,) or none. Inference only (no autograd formula): mha.MultiHeadAttention calls it
// when nothing needs a gradient.
//
// Why one call: at B = 32, T = 20, D = 512, h = 8 the module is four GEMMs around 256 heads of
// 20 x 20. Run step by step, the QKV output (B T x 3 D bf16, 2 MB) is written past L2 by its
// GEMM and read back by attention, and every step is an operator call of its own. Here:
//   1. both weights are packed into 64-column panels of bf16 pairs (panels.h); nothing outlives
//      the call (a weight changed by any means is read as it is), unless the caller passes the
//      panels made once by pack_panels_bf16 (mha.MultiHeadAttention.freeze());
//   2. work items are groups of whole batch rows (<= kGroupRows rows, at::parallel_for); each
//      item projects its rows to Q, K, V (R x 3 hd, in a buffer of the thread), runs attention
//      for each (batch row, head) from that buffer and writes the merged heads (R x hd, the
//      layout W_O reads), then applies W_O to them.
// One parallel region per call: each thread of the groups' region first packs the panels it
// claims (an atomic counter) and waits for the others' (measured against a packing region of
// its own: one fork / join less, which a busy neighbour makes cost a scheduler slice). The
// buffers are not zero-filled (2 MB per call): what is read before it is written (Q^T's
// columns past T) feeds only score lanes of queries never output, each lane one query.
// Attention per head, all on vdpbf16ps with fp32 sums, the scores transposed so the softmax
// runs down the keys with 16 queries per vector (no horizontal reductions): S^T = K Q^T (K's
// rows read in place, Q^T packed as pairs along d by 8 x 8 register transposes), P = 2^(t - max)
// / sum in fp32 (2^x of common/exp2.h) rounded to bf16 (as torch's bf16 bmm after its softmax;
// vcvtneps2bf16) and paired along the keys, O = P V (V interleaved into pairs of rows, by
// 64-column panels) rounded to bf16 once. The projections sum in fp32 and round each output
// once, as mha::linear_bf16 (csrc/linear/rows_bf16.h). Every output is computed by one thread in
// a fixed order: deterministic whatever the thread count. NaN / Inf: every key is visible to
// every query (no mask here), so a NaN anywhere in a head's scores or values makes that head's
// rows NaN, as SDPA's softmax.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "common/gemm_tiles.h"
#include "linear/panels.h"
#include "linear/rows_bf16.h"

#if defined(MHA_GEMM_BF16)
#include "common/exp2.h"

namespace mha_self_attention {
namespace {

using mha_common::kLanes;
using mha_panels::kPanel;

constexpr int64_t kMaxT = 64;        // longest sequence served (the scores of a head: T x 64)
constexpr int64_t kGroupRows = 96;   // rows of x per work item (whole batch rows)
constexpr int64_t kSlackRows = 8;    // rows past a group's Q/K/V that Q^T's 8 x 8 blocks may read
constexpr float kLog2e = 1.4426950408889634f;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The first n of 16 lanes (1 <= n <= 16).
__mmask16 lanes_below(int64_t n) { return __mmask16((1u << n) - 1u); }

// n elements, not initialised.
template <typename E>
std::unique_ptr<E[]> uninit(int64_t n) { return std::unique_ptr<E[]>(new E[n]); }

// The per-thread buffers of one work item (sized for the largest group), not initialised.
struct Scratch {
  std::unique_ptr<uint16_t[]> qkv, heads;  // (R + kSlackRows, 3 hd), (R, hd) bf16
  std::unique_ptr<uint32_t[]> qt;          // (d / 2, Tp) pairs: Q^T of one head
  std::unique_ptr<float[]> st;             // (T, Tp) scores, keys by queries, then 2^(t - max)
  std::unique_ptr<uint32_t[]> ppt;         // (T2, Tp) probabilities: pairs of keys per query
  std::unique_ptr<uint32_t[]> vp;          // (ceil(d / 64), T2, 64) pairs of V rows, by panels
};
// O (R rows, 64 columns of one panel) = P V for the query rows q0 .. q0 + R: P^T pairs
// ppt[k][q] (pairs of keys 2k, 2k + 1 for query q, Tp per k), V panel vp[k][64] pairs.
template <int R>
void pv_tile(const uint32_t* ppt, int64_t Tp, const uint32_t* vpanel, int64_t K2, uint16_t* out,
             int64_t ldo, int64_t cols) {
  __m512 x[R][4];
  mha_tiles::acc_zero(x);
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(vpanel + k * kPanel + v * kLanes);
    mha_tiles::acc_rank2_bf16(x, bv, reinterpret_cast<const uint16_t*>(ppt + k * Tp), 2);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4 && v * kLanes < cols; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + v * kLanes),
                          mha_tiles::to_bf16(x[r][v]));
}
using PvFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, uint16_t*, int64_t,
                      int64_t);
constexpr PvFn kPv[7] = {nullptr, &pv_tile<1>, &pv_tile<2>, &pv_tile<3>, &pv_tile<4>,
                         &pv_tile<5>, &pv_tile<6>};

// One head of one batch row: q, k, v its (T, d) rows ld elements apart; out (T, d) rows ldo
// apart, bf16(softmax(scale q k^T) v).
void head(int64_t T, int64_t d, const uint16_t* q, const uint16_t* k, const uint16_t* v,
          int64_t ld, float scale, Scratch& sc, uint16_t* out, int64_t ldo) {
  const int64_t Tp = round_up(T, kLanes), d2 = d / 2, T2 = (T + 1) / 2;
  uint32_t* qt = sc.qt.get();  // qt[k2][i] = pair k2 of query i (columns i >= T: rows past the
                               // head or never written, scores of queries never output: each
                               // lane is one query down to P, which reads queries < T only)
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
  for (int64_t j = 0; j < T; j += 8)
    for (int64_t c = 0; c < d2; c += 8)
      mha_panels::transpose8(reinterpret_cast<const float*>(q32 + j * (ld / 2) + c), ld / 2,
                             reinterpret_cast<float*>(qt + c * Tp + j), Tp);
  float* st = sc.st.get();  // S^T (T keys, Tp queries)
  mha_gemm::gemm<uint16_t>(T, Tp, d2, k, ld, 0, reinterpret_cast<const uint16_t*>(qt), Tp, st,
                           Tp, false);
  const __m512 neg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 cv = _mm512_set1_ps(scale * kLog2e);
  uint32_t* ppt = sc.ppt.get();  // (T2, Tp) pairs of P^T rows
  for (int64_t c = 0; c < Tp; c += kLanes) {  // 16 queries at a time, down the keys
    __m512 m = neg;
    for (int64_t j = 0; j < T; ++j) {
      const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(st + j * Tp + c), cv);
      _mm512_storeu_ps(st + j * Tp + c, t);
      m = _mm512_max_ps(m, t);
    }
    __m512 l = _mm512_setzero_ps();
    for (int64_t j = 0; j < T; ++j) {
      const __m512 e = mha_exp2::exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(st + j * Tp + c), m));
      _mm512_storeu_ps(st + j * Tp + c, e);
      l = _mm512_add_ps(l, e);
    }
    const __m512 iv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    for (int64_t j2 = 0; j2 < T2; ++j2) {  // P rounded to bf16, keys 2 j2 and 2 j2 + 1 paired
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
    for (int64_t q0 = 0; q0 < T; q0 += 6)
      kPv[std::min<int64_t>(6, T - q0)](ppt + q0, Tp, vp + c0 / kPanel * T2 * kPanel, T2,
                                        out + q0 * ldo + c0, ldo, std::min(kPanel, d - c0));
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16,
              "mha self_attention_bf16: ", name, " must be a bfloat16 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
}

const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// bias (n,) bf16 -> fp32 (round_up(n, 64),) zero-padded; empty when absent.
std::vector<float> padded_bias(const std::optional<at::Tensor>& b, int64_t n, const char* name) {
  if (!b.has_value()) return {};
  check_bf16(*b, name);
  TORCH_CHECK(b->dim() == 1 && b->size(0) == n, "mha self_attention_bf16: ", name,
              " must have shape (", n, ",), got ", b->sizes());
  const at::Tensor c = b->contiguous();
  const uint16_t* s = bits(c);
  std::vector<float> out(round_up(n, kPanel), 0.f);
  for (int64_t i = 0; i < n; ++i) {  // exact: a bf16 is the high half of an fp32
    const uint32_t u = uint32_t(s[i]) << 16;
    std::memcpy(&out[i], &u, sizeof u);
  }
  return out;
}

// The panels of pack_panels_bf16 for W (N, K): (ceil(N / 64), K / 2, 64, 2).
std::vector<int64_t> panel_shape(int64_t N, int64_t K) {
  return {(N + kPanel - 1) / kPanel, K / 2, kPanel, 2};
}

// W (N, K) bf16, K even -> its panels (ceil(N / 64), K / 2, 64, 2) bf16 (panels.h's layout,
// zero past N): what self_attention_bf16 packs per call, made once for a frozen module.
at::Tensor pack_panels_bf16(const at::Tensor& w) {
  check_bf16(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 2 == 0,
              "mha pack_panels_bf16: w must be (N, K) with K even, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty(panel_shape(N, K), w.options());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t per = K * kPanel;  // bf16 per panel
  at::parallel_for(0, out.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      mha_panels::pack_panel_bf16(bits(wc), N, K / 2, K, p, dst + p * per);
  });
  return out;
}

// Panels given for a weight (N, K): they must have pack_panels_bf16's shape.
void check_panels(const std::optional<at::Tensor>& panels, int64_t N, int64_t K,
                  const char* name) {
  if (!panels.has_value()) return;
  check_bf16(*panels, name);
  TORCH_CHECK(panels->sizes() == at::IntArrayRef(panel_shape(N, K)) && panels->is_contiguous(),
              "mha self_attention_bf16: ", name, " must be contiguous with shape ",
              at::IntArrayRef(panel_shape(N, K)), " (pack_panels_bf16 of the weight), got ",
              panels->sizes());
}

// y (B, T, N_out) = W_O(attention(split(x W_qkv^T + b_qkv))) + b_O: the module's self-attention
// forward without masks or score variants (see the file comment). w_qkv_panels / w_o_panels:
// the weights already packed (pack_panels_bf16; a frozen module's), read instead of packing
// w_qkv / w_o, whose shapes still define the call.
at::Tensor self_attention_bf16(const at::Tensor& x, const at::Tensor& w_qkv,
                               const std::optional<at::Tensor>& b_qkv, const at::Tensor& w_o,
                               const std::optional<at::Tensor>& b_o, int64_t heads, double scale,
                               const std::optional<at::Tensor>& w_qkv_panels,
                               const std::optional<at::Tensor>& w_o_panels) {
  check_bf16(x, "x");
  check_bf16(w_qkv, "w_qkv");
  check_bf16(w_o, "w_o");
  TORCH_CHECK(x.dim() == 3, "mha self_attention_bf16: x must be (B, T, D), got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(heads >= 1 && w_o.dim() == 2 && w_o.size(1) % heads == 0,
              "mha self_attention_bf16: w_o must be (N_out, heads * d), got ", w_o.sizes(),
              " with heads=", heads);
  const int64_t hd = w_o.size(1), d = hd / heads, N = w_o.size(0);
  TORCH_CHECK(d % 16 == 0 && D % 16 == 0 && N % 16 == 0 && T >= 1 && T <= kMaxT,
              "mha self_attention_bf16: needs d % 16 == 0, D % 16 == 0, N_out % 16 == 0 and "
              "1 <= T <= ", kMaxT, ", got d=", d, ", D=", D, ", N_out=", N, ", T=", T);
  TORCH_CHECK(w_qkv.dim() == 2 && w_qkv.size(0) == 3 * hd && w_qkv.size(1) == D,
              "mha self_attention_bf16: w_qkv must be (3 * heads * d, D) = (", 3 * hd, ", ", D,
              "), got ", w_qkv.sizes());
  check_panels(w_qkv_panels, 3 * hd, D, "w_qkv_panels");
  check_panels(w_o_panels, N, hd, "w_o_panels");
  const std::vector<float> bq = padded_bias(b_qkv, 3 * hd, "b_qkv");
  const std::vector<float> bo = padded_bias(b_o, N, "b_o");
  at::Tensor out = at::empty({B, T, N}, x.options());
  if (B == 0) return out;
  const at::Tensor xc = x.contiguous(), wq = w_qkv.contiguous(), wo = w_o.contiguous();
  const int64_t K2q = D / 2, K2o = hd / 2;
  const int64_t Pq = (3 * hd + kPanel - 1) / kPanel, Po = (N + kPanel - 1) / kPanel;
  const int64_t wq_n = K2q * kPanel * 2, wo_n = K2o * kPanel * 2;  // bf16 per panel
  // the panels: given (nothing to pack) or packed here into buffers of the call
  std::unique_ptr<uint16_t[]> wq_own, wo_own;
  if (!w_qkv_panels.has_value()) wq_own = uninit<uint16_t>(Pq * wq_n);
  if (!w_o_panels.has_value()) wo_own = uninit<uint16_t>(Po * wo_n);
  const uint16_t* wq_p = wq_own ? wq_own.get() : bits(*w_qkv_panels);
  const uint16_t* wo_p = wo_own ? wo_own.get() : bits(*w_o_panels);
  const int64_t to_pack_q = wq_own ? Pq : 0, to_pack = to_pack_q + (wo_own ? Po : 0);
  std::atomic<int64_t> claimed{0}, packed{0};  // panels claimed / packed, W_qkv's first
  auto pack = [&](int64_t p) {
    if (p < to_pack_q)
      mha_panels::pack_panel_bf16(bits(wq), 3 * hd, K2q, D, p, wq_own.get() + p * wq_n);
    else
      mha_panels::pack_panel_bf16(bits(wo), N, K2o, hd, p - to_pack_q,
                                  wo_own.get() + (p - to_pack_q) * wo_n);
  };
  // groups of whole batch rows; as many groups as fit kGroupRows, evened out
  const int64_t per = std::max<int64_t>(1, kGroupRows / T);
  const int64_t groups = (B + per - 1) / per, G = (B + groups - 1) / groups;
  const uint16_t* xb = bits(xc);
  uint16_t* yb = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bqp = bq.empty() ? nullptr : bq.data();
  const float* bop = bo.empty() ? nullptr : bo.data();
  at::parallel_for(0, (B + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    // 1. the panels this thread claims, then the others' (each claimed one is being packed by
    // a thread already running, so the wait ends)
    for (int64_t p; (p = claimed.fetch_add(1, std::memory_order_relaxed)) < to_pack;) {
      pack(p);
      packed.fetch_add(1, std::memory_order_acq_rel);
    }
    while (packed.load(std::memory_order_acquire) < to_pack) _mm_pause();
    // 2. the groups
    Scratch sc;
    const int64_t Tp = round_up(T, kLanes), R = G * T;
    sc.qkv = uninit<uint16_t>((R + kSlackRows) * 3 * hd), sc.heads = uninit<uint16_t>(R * hd);
    sc.qt = uninit<uint32_t>(d / 2 * Tp), sc.st = uninit<float>(T * Tp);
    sc.ppt = uninit<uint32_t>((T + 1) / 2 * Tp);
    sc.vp = uninit<uint32_t>((T + 1) / 2 * round_up(d, kPanel));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * G, nb = std::min(G, B - b0), rows = nb * T;
      mha_rows_bf16::project(rows, 3 * hd, K2q, xb + b0 * T * D, D, wq_p, bqp,
                             sc.qkv.get(), 3 * hd);  // (rows, D) -> (rows, 3 hd) = [Q | K | V]
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t hh = 0; hh < heads; ++hh) {
          const uint16_t* q = sc.qkv.get() + b * T * 3 * hd + hh * d;  // (T, d), rows 3 hd apart
          head(T, d, q, q + hd, q + 2 * hd, 3 * hd, float(scale), sc,
               sc.heads.get() + b * T * hd + hh * d, hd);  // (T, d) of (rows, h d)
        }
      mha_rows_bf16::project(rows, N, K2o, sc.heads.get(), hd, wo_p, bop,
                             yb + b0 * T * N, N);  // (rows, h d) -> (rows, N_out)
    }
  });
  return out;
}

}  // namespace
}  // namespace mha_self_attention
#endif  // MHA_GEMM_BF16

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("self_attention_bf16(Tensor x, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, Tensor? b_o, "
        "int heads, float scale, Tensor? w_qkv_panels=None, Tensor? w_o_panels=None) -> Tensor");
  m.def("pack_panels_bf16(Tensor w) -> Tensor");
}

#if defined(MHA_GEMM_BF16)
TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("self_attention_bf16", &mha_self_attention::self_attention_bf16);
  m.impl("pack_panels_bf16", &mha_self_attention::pack_panels_bf16);
}
#endif
