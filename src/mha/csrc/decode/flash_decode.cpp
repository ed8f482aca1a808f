// Flash-decoding on the CPU: a few queries (Tq <= 16) against a long K/V cache.
//
// Shape legend: B batch, h query heads, h_kv key/value heads, g = h / h_kv (query heads per
// K/V head), Tq query length, Tk key length, d_k / d_v head dims, G = g * Tq (the query rows
// that share one K/V head), C keys per split (split_length), S = ceil(Tk / C) key splits.
//
//   out[b, head, i] = softmax_j(q[b, head, i] . k[b, head / g, j] * scale) v[b, head / g, j]
//
// Work is split into items (b, kv head, split): each item reads its chunk of K and V exactly
// once for all G query rows of the group (GQA without repeating K/V), and leaves an
// unnormalized partial output with its running max m and sum l (base-2 log-sum-exp parts).
// A second pass merges the S partials of every query row in split order:
//   M = max_s m_s,  L = sum_s l_s 2^(m_s - M),  out = sum_s O_s 2^(m_s - M) / L.
// The split size depends on the shape only (split_length), so the result does not depend on
// the number of threads (deterministic, bitwise). All arithmetic accumulates in fp32. bf16 q.k
// runs on AMX tiles where they fit (qk_amx), else as AVX512_BF16 dot products; bf16 p.v uses
// fp32 FMAs on V widened by a shift / mask (pv_tile_bf16). Products of bf16 values are exact
// in fp32 on every path, and p stays fp32.
//
// Masks (True = may attend; all optional, combined with AND):
//   causal       query i sees key j iff j <= i + Tk - Tq (bottom-right aligned)
//   key_lengths  (B,) int64: keys j >= key_lengths[b] are padding and are never read
//   mask         bool, 4-D, broadcastable to (B, h, Tq, Tk) (size-1 dims are broadcast)
// Query rows that may attend no key return zeros.
//
// int8 K/V (optional): k, v int8 with fp32 scales (B, h_kv, Tk), one per token and K/V head
// (k = k_scale * k_int8). Dequantized in the loops, never stored: q . k_int8 is scaled by
// k_scale per key before the variants, and each weight p_j by v_scale_j before p . v. On
// AVX-512 the int8 rows are widened to fp32 in registers (q.k: qk_rows, R query rows of the
// group per block of 16 / R keys, with a bf16 q widened once per split; p.v: pv_tile), fp32 K
// takes the same q.k, bf16 K its vdpbf16ps form; without AVX-512 the portable loops.
//
// Score variants (optional; decode/variants.h, the order of mha/scores.py): softcap, bias
// (fp32, read through its broadcast strides) and ALiBi (-slope * (i + Tk - Tq - j)) change each
// row of a split's score block before the masks; a sink (h,) adds exp(sink) to each row's
// denominator once, in merge_group. A row with no visible key returns zeros, sink or not.
//
// NaN and Inf (the rule of flash_attn.cpp): a row's output depends only on q and the keys it
// may attend, as IEEE arithmetic of softmax(q k^T scale) v makes it: a NaN score (NaN in q, or
// NaN / Inf in a visible K row) makes the row's max, every weight and the whole output row NaN
// (softmax_*, merge_group keep a NaN max instead of dropping it as max() would); a NaN in a
// visible V row makes that column NaN. Keys a row may not attend never reach it: their weight
// is 0, and where 0 * (a non-finite V) made a row's partial output non-finite, that row is
// computed again from its visible keys only (pv_exact; finite inputs never pay for it).
//
// Paged K/V (optional block_table, int32 (B, max_pages)): k, v are page pools (num_pages, h_kv,
// page_size, d) (the page size is k's dim 2; int8 scales (num_pages, h_kv, page_size)), and row
// b's key j is slot j % page_size of page block_table[b, j / page_size]. Tk is then
// max_pages * page_size (what mask and bias broadcast to), key_lengths give each row's length,
// and causal and ALiBi are aligned to that length (query i of row b sees keys
// j <= i + key_lengths[b] - Tq): each row is its own sequence. The pages are gathered inside the
// split loop: a split's keys are cut into runs that are contiguous in memory (at most one page
// each) and every q.k / p.v building block (portable, AVX-512, AMX) runs on one run at a time,
// so every variant, GQA and int8 K/V work unchanged, and nothing is copied.
//
// Two ops: mha::flash_decode (vectorized under __AVX512F__ / __AVX512BF16__, portable C++
// otherwise) and mha::flash_decode_portable (always the portable loops; for tests).
//
// Files: decode/problem.h (Problem), decode/blocks.h (the portable and AVX-512 building
// blocks), amx/decode_amx.h (the AMX q.k); this file: the two passes, the checks and the ops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/constants.h"
#include "common/finite.h"
#include "common/tensor_access.h"
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "common/exp2.h"
#include "common/kernel_choice.h"  // MHA_DECODE_BF16 and the rule for a forced value
#include "amx/decode_amx.h"  // MHA_DECODE_AMX and the AMX q.k, when the target has AMX
#ifdef _OPENMP
#include <omp.h>
#endif
#include "decode/blocks.h"
#include "decode/problem.h"
#include "decode/variants.h"

namespace {

// ------------------------------------------------------------------ the two passes
// One item: keys [j0, j1) of K/V head kvh in batch row b, for the G query rows of its group.
// Writes O (G, d_v) unnormalized, m (G,) and l (G,) for this split. scores: G * kChunk floats.
// Per-thread scratch: scores (G, kChunk), the merge accumulator (d_v), AMX operands.
struct Scratch {
  // int8 K/V: the group's q in fp32 (qf), or in int16 (q16) with one scale per row (qs)
  std::vector<float> scores, acc, tmp, qf, qs;
  std::vector<int16_t> q16;
  std::vector<uint32_t> qpack;
  explicit Scratch(const Problem& P)
      : scores(P.G * kChunk), acc(P.dv), tmp(16 * P.G), qf(P.ksc ? P.G * P.dk : 0),
        qs(P.ksc ? P.G : 0), q16(P.ksc ? P.G * P.dk : 0), qpack(P.amx ? P.dk / 2 * P.G : 0) {}
};

// Turns the AMX tile state on for this thread for as long as it lives (when P.amx).
struct AmxScope {
  bool on;
  explicit AmxScope(const Problem& P) : on(P.amx) {
#ifdef MHA_DECODE_AMX
    if (on) mha_decode_amx::amx_configure(P.G);
#endif
  }
  ~AmxScope() {
#ifdef MHA_DECODE_AMX
    if (on) _tile_release();
#endif
  }
};


// Row r of a split's O again, from the keys [j0, j1) it may attend only (causal, mask; Tk the
// row's causal alignment, as in split_item):
// p (the row's weights, 0 where masked) times V with the masked keys skipped, so that 0 * a
// non-finite V never reaches it. Plain loops (inputs with a NaN or an Inf only).
template <typename T>
void pv_exact(const Problem& P, int64_t b, int64_t kvh, int64_t r, int64_t j0, int64_t j1,
              int64_t Tk, const float* p, const T* v, float* O) {
  const int64_t head = kvh * P.g + r / P.Tq, i = r % P.Tq;
  const int64_t last = P.causal ? i + Tk - P.Tq : j1;  // query i sees keys j <= last
  const bool* mr = P.mask ? P.mask + b * P.msb + head * P.msh + i * P.msq : nullptr;
  std::fill(O, O + P.dv, 0.f);
  for (int64_t j = j0; j < std::min(j1, last + 1); ++j) {
    if (mr && !mr[j * P.msk]) continue;
    const float w = p[j - j0];
    const T* vt = v + kv_at(P, b, kvh, j).v;  // v: the whole V tensor (or pool)
    for (int64_t c = 0; c < P.dv; ++c) O[c] += w * widen(vt[c]);
  }
}

// Row-wise products with a per-key fp32 scale (int8 K/V): s[r * kChunk + t] *= sc[t * stride].
// Contiguous scales (stride 1, the KVCache layout) take the loop the compiler vectorizes.
inline void scale_keys(float* s, int64_t G, int64_t n, const float* sc, int64_t stride) {
  for (int64_t r = 0; r < G; ++r) {
    float* __restrict sr = s + r * kChunk;
    const float* __restrict c = sc;
    if (stride == 1)
      for (int64_t t = 0; t < n; ++t) sr[t] *= c[t];
    else
      for (int64_t t = 0; t < n; ++t) sr[t] *= c[t * stride];
  }
}

// scores[r * kChunk + t] = qk_scale * (q_r . k_t), t < n, for one run of n keys contiguous in
// memory (k: its first row): on AMX tiles where they serve (whole steps of 32), the rest with qk.
template <typename T, bool kVec, typename KV>
inline void qk_run(const Problem& P, const T* q, const KV* k, int64_t n, float* scores,
                   Scratch& w) {
  int64_t done = 0;
#ifdef MHA_DECODE_AMX
  if constexpr (kVec && std::is_same_v<T, bf16> && std::is_same_v<KV, bf16>)
    if (P.amx)
      done = mha_decode_amx::qk_amx(q, P.G, P.dk, k, P.kst, n, P.qk_scale, scores, kChunk,
                                    w.qpack.data(), w.tmp.data());
#endif
  (void)w;
  if (done < n)
    qk<T, kVec, KV>(q, P.G, P.dk, k + done * P.kst, P.kst, n - done, P.qk_scale, scores + done);
}

// Paged K/V: ask for the run after [j, e) (the next page, up to j1) to be brought into the
// cache while this one is computed. Within a run the hardware prefetchers follow the stream;
// at a jump to another page they have to find it again, which costs a run of a few KB most of
// its time in misses (measured, bf16, pages of 16 tokens in a random order, Tk 4096: 2.0x the
// contiguous step's time without this, 1.5x with it). `rows`: elements of `x` per key.
template <typename KV>
inline void prefetch_next_run(const Problem& P, const KV* x, int64_t b, int64_t kvh, int64_t e,
                              int64_t j1, bool is_v, int64_t rows) {
  if (!P.bt || e >= j1) return;
  const KVAt at = kv_at(P, b, kvh, e);
  const char* c = reinterpret_cast<const char*>(x + (is_v ? at.v : at.k));
  const int64_t n = run_end(P, e, j1) - e;
  const int64_t bytes = ((n - 1) * (is_v ? P.vst : P.kst) + rows) * static_cast<int64_t>(sizeof(KV));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// bf16 q against int8 K: each q row as int16 times one fp32 scale (absmax / 32767), so q.k
// runs as exact integer products (vpdpwssd, 32 per instruction, int8 K widened to int16)
// instead of fp32 FMAs on widened K (16 per instruction). The int16 rounding, at most 2^-16 of
// the row's absmax per element, is far below bf16's own (2^-9 of each element). Integer sums
// stay below 2^31 for d_k <= 512. Returns false (the fp32 path then) without AVX-512, for
// larger d_k, or when a row holds a NaN or an Inf (its IEEE result is kept).
template <typename T>
bool quantize_q16(const T* q, int64_t G, int64_t dk, Scratch& w) {
#ifdef __AVX512F__
  if (dk > 512) return false;
  for (int64_t r = 0; r < G; ++r) {
    float amax = 0.f;
    for (int64_t c = 0; c < dk; ++c) {
      const float x = widen(q[r * dk + c]);
      if (!std::isfinite(x)) return false;
      amax = std::max(amax, std::fabs(x));
    }
    const float s = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
    w.qs[r] = s;
    for (int64_t c = 0; c < dk; ++c)
      w.q16[r * dk + c] = static_cast<int16_t>(std::nearbyint(widen(q[r * dk + c]) * inv));
  }
  return true;
#else
  (void)q, (void)G, (void)dk, (void)w;
  return false;
#endif
}

// T: q's (and the output's) dtype; KV: K/V's, T or int8 (dequantized here, never stored).
// Tk: what causal (and ALiBi) align to: P.Tk, or row b's length when K/V are paged.
template <typename T, bool kVec, typename KV>
void split_item(const Problem& P, int64_t b, int64_t kvh, int64_t j0, int64_t j1, int64_t Tk,
                Scratch& w, float* O, float* m, float* l) {
  float* scores = w.scores.data();
  const int64_t G = P.G, n = j1 - j0;
  std::fill(O, O + G * P.dv, 0.f);
  std::fill(m, m + G, kNegInf);
  std::fill(l, l + G, 0.f);
  if (n <= 0) return;
  const T* q = static_cast<const T*>(P.q) + (b * P.h + kvh * P.g) * P.Tq * P.dk;  // (G, d_k)
  // int8 K on AVX-512: q.k takes fp32 q, so a bf16 q is widened here once per split (exact)
  using QT = std::conditional_t<kVec && std::is_same_v<KV, int8_t>, float, T>;
  const QT* qq;
  bool q16 = false;  // bf16 q against int8 K in int16 (vpdpwssd): see quantize_q16
  if constexpr (std::is_same_v<QT, T>) {
    qq = q;
  } else {
    if constexpr (std::is_same_v<T, bf16>) q16 = quantize_q16(q, G, P.dk, w);
    if (!q16) for (int64_t c = 0; c < G * P.dk; ++c) w.qf[c] = widen(q[c]);  // (G, d_k) fp32
    qq = w.qf.data();
  }
  const KV* K = static_cast<const KV*>(P.k);
  const KV* V = static_cast<const KV*>(P.v);
  // scores (G, n) = q (G, d_k) @ k[j0:j1]^T (d_k, n), in P.unit units, one contiguous run of
  // keys at a time (the whole split without pages; a page at most with them)
  for (int64_t j = j0; j < j1;) {
    const int64_t e = run_end(P, j, j1);
    const KVAt at = kv_at(P, b, kvh, j);
    prefetch_next_run(P, K, b, kvh, e, j1, false, P.dk);
#ifdef __AVX512F__
    if constexpr (kVec && std::is_same_v<KV, int8_t>)
      if (q16) {
        qk_vec_rows(w.q16.data(), G, P.dk, K + at.k, P.kst, e - j, P.qk_scale,
                    scores + (j - j0), w.qs.data());
        goto scaled;
      }
#endif
    qk_run<QT, kVec, KV>(P, qq, K + at.k, e - j, scores + (j - j0), w);
  scaled:
    if constexpr (std::is_same_v<KV, int8_t>)  // s = scale * k_scale_j * (q . k_int8_j)
      scale_keys(scores + (j - j0), G, e - j, P.ksc + at.ks, P.kscs);
    j = e;
  }
  bool any = false;
  for (int64_t r = 0; r < G; ++r) {  // variants; masks -> -inf; then max, 2^(s - max), sum
    float* s = scores + r * kChunk;
    const int64_t head = kvh * P.g + r / P.Tq, i = r % P.Tq;
    if (P.variants) apply_variants(P, b, head, i, j0, n, Tk, s);  // natural-log units
    if (P.causal) {
      const int64_t last = i + Tk - P.Tq;  // query i sees keys j <= last
      for (int64_t j = std::max(j0, last + 1); j < j1; ++j) s[j - j0] = kNegInf;
    }
    if (P.mask) {
      const bool* mr = P.mask + b * P.msb + head * P.msh + i * P.msq;
      for (int64_t j = j0; j < j1; ++j)
        if (!mr[j * P.msk]) s[j - j0] = kNegInf;
    }
    std::tie(m[r], l[r]) = softmax2<kVec>(s, n, P.unit);
    any = any || l[r] != 0.f;  // NaN too
  }
  // O (G, d_v) = p (G, n) @ v[j0:j1] (n, d_v), run by run (pv accumulates into O)
  if (!any) return;
  for (int64_t j = j0; j < j1;) {
    const int64_t e = run_end(P, j, j1);
    const KVAt at = kv_at(P, b, kvh, j);
    prefetch_next_run(P, V, b, kvh, e, j1, true, P.dv);
    if constexpr (std::is_same_v<KV, int8_t>)  // p_j v_j = (p_j v_scale_j) v_int8_j
      scale_keys(scores + (j - j0), G, e - j, P.vsc + at.vs, P.vscs);
    pv<KV, kVec>(scores + (j - j0), G, e - j, V + at.v, P.vst, P.dv, O);
    j = e;
  }
  for (int64_t r = 0; r < G; ++r)  // a NaN l: the whole row is NaN anyway
    if (!std::isnan(l[r]) && !mha_finite::all_finite(O + r * P.dv, P.dv))
      pv_exact(P, b, kvh, r, j0, j1, Tk, scores + r * kChunk, V, O + r * P.dv);
}

struct Partials {
  float* O;  // (B, h_kv, S, G, d_v) unnormalized outputs
  float* M;  // (B, h_kv, S, G) maxima, base 2
  float* L;  // (B, h_kv, S, G) sums of 2^(s - M)
};

// Merge the S partials of group bh (in split order) into out rows (head = kvh * g + r / Tq,
// i = r % Tq), which are contiguous: out + (bh * G + r) * d_v. A sink adds 2^(sink - M) to the
// denominator here, once per row (never per split), and only to a row that sees a key.
template <typename T>
void merge_group(const Problem& P, const Partials& part, int64_t bh, float* acc, T* out) {
  for (int64_t r = 0; r < P.G; ++r) {
    float Mx = kNegInf;
    for (int64_t s = 0; s < P.S; ++s) {
      const float ms = part.M[(bh * P.S + s) * P.G + r];
      Mx = std::isnan(ms) || std::isnan(Mx) ? ms + Mx : std::max(Mx, ms);  // NaN stays NaN
    }
    std::fill(acc, acc + P.dv, 0.f);
    float Ls = 0.f;
    if (P.mods.sinks && Mx != kNegInf) {  // the sink's logit in M's units; the max over keys
      const int64_t head = (bh % P.h_kv) * P.g + r / P.Tq;  // and sink
      const float sink = P.unit == 1.f ? P.mods.sink_log2(head) : P.mods.sinks[head];
      if (!std::isnan(Mx)) Mx = std::isnan(sink) ? sink : std::max(Mx, sink);
      Ls = std::exp2((sink - Mx) * P.unit);
    }
    for (int64_t s = 0; Mx != kNegInf && s < P.S; ++s) {  // Mx: -inf only without keys
      const int64_t at = (bh * P.S + s) * P.G + r;
      if (part.L[at] == 0.f) continue;
      const float w = std::exp2((part.M[at] - Mx) * P.unit);
      Ls += part.L[at] * w;
      const float* o = part.O + at * P.dv;
      for (int64_t c = 0; c < P.dv; ++c) acc[c] += w * o[c];
    }
    const float inv = Ls != 0.f ? 1.f / Ls : 0.f;  // no visible key: zeros; NaN: NaN
    T* dst = out + (bh * P.G + r) * P.dv;
    for (int64_t c = 0; c < P.dv; ++c) dst[c] = static_cast<T>(acc[c] * inv);
  }
}

// A range of work items [next, end) shared by its owner (takes from the front) and helpers
// (take from the back); both ends live in one atomic word, so each item is taken exactly once.
struct alignas(64) Range {
  std::atomic<uint64_t> span{0};  // next in the low 32 bits, end in the high 32 bits
  void set(int64_t next, int64_t end) {
    span.store(static_cast<uint64_t>(end) << 32 | static_cast<uint64_t>(next));
  }
  bool take_front(int64_t& it) { return take(it, true); }
  bool take_back(int64_t& it) { return take(it, false); }

 private:
  bool take(int64_t& it, bool front) {
    uint64_t cur = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t next = cur & 0xFFFFFFFFu, end = cur >> 32;
      if (next >= end) return false;
      const uint64_t want = front ? (end << 32 | (next + 1)) : ((end - 1) << 32 | next);
      if (span.compare_exchange_weak(cur, want, std::memory_order_relaxed)) {
        it = static_cast<int64_t>(front ? next : end - 1);
        return true;
      }
    }
  }
};

// Keys per split: long splits mean fewer switches between the K and V streams and fewer
// partials (1024 measured best at B1 h32 Tk4096), but there must be enough items for the
// threads: halve the split until there are >= 16 items (or 64 keys). A function of the shape
// only, never of the thread count, so results stay thread-independent.
int64_t split_length(int64_t groups, int64_t Tk) {
  int64_t c = kChunk;
  while (c > 64 && groups * ((Tk + c - 1) / c) < 16) c /= 2;
  return c;
}

// The op's optional score-variant arguments, as it receives them (checked by check_inputs).
struct VariantArgs {
  c10::optional<double> softcap;
  c10::optional<at::Tensor> sinks, bias, alibi_slopes;  // fp32: (h,), 4-D broadcast, (1|B, h)
  c10::optional<at::Tensor> k_scale, v_scale;  // int8 K/V: fp32 (B, h_kv, Tk) each
  c10::optional<at::Tensor> block_table;        // paged K/V: int32 (B, max_pages)
};

template <typename T, bool kVec, typename KV = T>
at::Tensor run(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
               const c10::optional<at::Tensor>& key_lengths, const c10::optional<at::Tensor>& mask,
               double scale, bool causal, const VariantArgs& va) {
  const at::Tensor q = q_in.contiguous();  // (B, h, Tq, d_k): small
  Problem P{};
  P.B = q.size(0), P.h = q.size(1), P.Tq = q.size(2), P.dk = q.size(3);
  P.h_kv = k.size(1), P.Tk = k.size(2), P.dv = v.size(3);
  at::Tensor bt;
  if (va.block_table.has_value()) {  // paged: the pools' dim 2 is the page size
    bt = va.block_table->contiguous();
    P.bt = bt.data_ptr<int32_t>(), P.bts = bt.size(1), P.page = k.size(2);
    P.Tk = bt.size(1) * P.page;
  }
  P.g = P.h / P.h_kv, P.G = P.g * P.Tq, P.C = split_length(P.B * P.h_kv, P.Tk);
  P.S = (P.Tk + P.C - 1) / P.C;
  P.q = q.data_ptr(), P.k = k.data_ptr(), P.v = v.data_ptr();
  P.ksb = k.stride(0), P.ksh = k.stride(1), P.kst = k.stride(2);
  P.vsb = v.stride(0), P.vsh = v.stride(1), P.vst = v.stride(2);
  at::Tensor klen, m4;
  if (key_lengths.has_value()) {
    klen = key_lengths->to(at::kLong).contiguous();
    P.klen = klen.data_ptr<int64_t>();
  }
  if (mask.has_value()) {
    m4 = *mask;
    P.mask = m4.data_ptr<bool>();
    auto st = [&](int d) { return m4.size(d) == 1 ? int64_t{0} : m4.stride(d); };
    P.msb = st(0), P.msh = st(1), P.msq = st(2), P.msk = st(3);
  }
  P.causal = causal;
#ifdef MHA_DECODE_AMX
  P.amx = kVec && std::is_same_v<T, bf16> && std::is_same_v<KV, bf16> &&
          mha_decode_amx::amx_fits(P.G, P.dk) &&
          mha_decode_amx::amx_permitted();
#endif
  // score variants: the small tensors made contiguous, the bias read in place (strides)
  at::Tensor sinks, alibi;
  if (va.softcap.has_value()) P.mods.softcap = static_cast<float>(*va.softcap);
  if (va.sinks.has_value()) {
    sinks = va.sinks->contiguous();
    P.mods.sinks = sinks.data_ptr<float>();
  }
  if (va.bias.has_value()) {
    P.mods.bias = va.bias->data_ptr<float>();
    mha_common::fill_strides(*va.bias, P.mods.bs, 4, true);
  }
  if (va.alibi_slopes.has_value()) {
    alibi = va.alibi_slopes->contiguous();  // (1|B, h)
    P.mods.alibi = alibi.data_ptr<float>();
    P.mods.as0 = alibi.size(0) == 1 ? 0 : P.h;
  }
  if (va.k_scale.has_value()) {  // int8 K/V: (B, h_kv, Tk) scales, read through their strides
    P.ksc = va.k_scale->data_ptr<float>(), P.vsc = va.v_scale->data_ptr<float>();
    P.kscb = va.k_scale->stride(0), P.ksch = va.k_scale->stride(1), P.kscs = va.k_scale->stride(2);
    P.vscb = va.v_scale->stride(0), P.vsch = va.v_scale->stride(1), P.vscs = va.v_scale->stride(2);
  }
  P.variants = P.mods.on_scores();
  P.qk_scale = static_cast<float>(scale) * (P.variants ? 1.f : kLog2e);
  P.unit = P.variants ? kLog2e : 1.f;

  // partials in one buffer: O (B, h_kv, S, G, d_v), then M and L (B, h_kv, S, G) each
  const int64_t rows = P.B * P.h_kv * P.S * P.G;
  std::unique_ptr<float[]> buf(new float[rows * (P.dv + 2)]);  // every entry is written
  Partials part{buf.get(), buf.get() + rows * P.dv, buf.get() + rows * (P.dv + 1)};
  at::Tensor out = at::empty({P.B, P.h, P.Tq, P.dv}, q.options());  // (B, h, Tq, d_v)
  if (P.S == 0) return out.zero_();  // no keys at all: every row sees nothing
  T* outp = out.data_ptr<T>();

  // Items (b, kv head, split) are in memory order. Each thread owns a contiguous range of them
  // and takes them in order, so it reads K and V as two sequential streams that the hardware
  // prefetchers follow across items; a thread that runs out takes items from the far end of
  // the others' ranges (robust to a busy machine: nobody waits for a descheduled thread).
  // The thread that finishes the last split of a group merges that group. Which thread does
  // what never changes the arithmetic, so results are bitwise reproducible.
  const int64_t groups = P.B * P.h_kv, items = groups * P.S;
  std::vector<std::atomic<int64_t>> remaining(groups);
  for (auto& r : remaining) r.store(P.S, std::memory_order_relaxed);
  const int64_t bytes = P.B * P.h_kv * P.Tk * (P.dk + P.dv) * static_cast<int64_t>(sizeof(KV));
  const int threads = bytes < (int64_t{1} << 18) ? 1
                      : static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
  auto work = [&](Scratch& w, int64_t it) {
    const int64_t s = it % P.S, bh = it / P.S, b = bh / P.h_kv, kvh = bh % P.h_kv;
    const int64_t len = P.klen ? std::min(P.klen[b], P.Tk) : P.Tk;
    const int64_t j0 = s * P.C, j1 = std::min(j0 + P.C, len);
    split_item<T, kVec, KV>(P, b, kvh, j0, j1, P.bt ? len : P.Tk, w, part.O + it * P.G * P.dv,
                        part.M + it * P.G, part.L + it * P.G);
    if (remaining[bh].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge_group(P, part, bh, w.acc.data(), outp);
  };
  TORCH_CHECK(items < (int64_t{1} << 31), "flash_decode: too many work items (", items, ")");
  if (threads <= 1) {  // small problems: no parallel region at all (no thread wake-ups)
    Scratch w(P);
    AmxScope amx(P);
    for (int64_t it = 0; it < items; ++it) work(w, it);
    return out;
  }
  std::vector<Range> ranges(threads);
  for (int t = 0; t < threads; ++t) ranges[t].set(items * t / threads, items * (t + 1) / threads);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
  {
    Scratch w(P);
    AmxScope amx(P);
#ifdef _OPENMP
    const int me = omp_get_thread_num();
#else
    const int me = 0;
#endif
    int64_t it;
    while (ranges[me].take_front(it)) work(w, it);
    for (int o = 1; o < threads; ++o)  // then help the others, from the ends of their ranges
      while (ranges[(me + o) % threads].take_back(it)) work(w, it);
  }
  return out;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& key_lengths,
                  const c10::optional<at::Tensor>& mask, const VariantArgs& va) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "flash_decode: q, k, v must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash_decode: q (B, h, Tq, d_k), k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v) must be 4-D");
  TORCH_CHECK(va.k_scale.has_value() == va.v_scale.has_value(),
              "flash_decode: k_scale and v_scale come together (int8 K/V)");
  if (va.k_scale.has_value()) {
    TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar,
                "flash_decode: with k_scale / v_scale, k and v must be int8");
    for (const at::Tensor* t : {&*va.k_scale, &*va.v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 3 &&
                      t->size(0) == k.size(0) && t->size(1) == k.size(1) && t->size(2) == k.size(2),
                  "flash_decode: k_scale / v_scale must be float32 (B, h_kv, Tk), got ",
                  t->scalar_type(), " ", t->sizes());
  } else {
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                "flash_decode: q, k, v must share one dtype");
  }
  const bool paged = va.block_table.has_value();
  TORCH_CHECK((paged ? v.size(0) == k.size(0) : k.size(0) == q.size(0) && v.size(0) == q.size(0)) &&
                  k.size(3) == q.size(3) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "flash_decode: shapes disagree: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  int64_t Tk = k.size(2);  // the key length masks and biases broadcast to
  if (paged) {
    const at::Tensor& bt = *va.block_table;
    TORCH_CHECK(bt.scalar_type() == at::kInt && bt.device().is_cpu() && bt.dim() == 2 &&
                    bt.size(0) == q.size(0),
                "flash_decode: block_table must be an int32 CPU tensor (B, max_pages) with B = ",
                q.size(0), ", got ", bt.scalar_type(), " ", bt.sizes());
    TORCH_CHECK(k.size(2) > 0, "flash_decode: paged k, v (num_pages, h_kv, page_size, d) need "
                "page_size >= 1, got k ", k.sizes());
    Tk = bt.size(1) * k.size(2);
    // the pages each row will read (guards memory): entries before ceil(len / page_size)
    const at::Tensor btc = bt.contiguous();
    const at::Tensor kl = key_lengths.has_value() ? key_lengths->to(at::kLong).contiguous()
                                                  : at::Tensor();
    TORCH_CHECK(!kl.defined() || (kl.dim() == 1 && kl.size(0) == q.size(0)),
                "flash_decode: key_lengths must be an integer tensor (B,)");
    const int32_t* e = btc.data_ptr<int32_t>();
    for (int64_t b = 0; b < bt.size(0); ++b) {
      const int64_t len = std::max<int64_t>(0, kl.defined() ? std::min(kl.data_ptr<int64_t>()[b], Tk) : Tk);
      for (int64_t i = 0; i < (len + k.size(2) - 1) / k.size(2); ++i)
        TORCH_CHECK(e[b * bt.size(1) + i] >= 0 && e[b * bt.size(1) + i] < k.size(0),
                    "flash_decode: block_table[", b, ", ", i, "] = ", e[b * bt.size(1) + i],
                    " is not a page of the pool [0, ", k.size(0), ") (row ", b, " holds ", len,
                    " keys)");
    }
  }
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "flash_decode: h must be a multiple of h_kv, got q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1,
              "flash_decode: k and v need a contiguous last dim");
  if (key_lengths.has_value())
    TORCH_CHECK(key_lengths->dim() == 1 && key_lengths->size(0) == q.size(0) &&
                    !at::isFloatingType(key_lengths->scalar_type()),
                "flash_decode: key_lengths must be an integer tensor (B,)");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4,
                "flash_decode: mask must be a 4-D bool tensor");
    const int64_t want[4] = {q.size(0), q.size(1), q.size(2), Tk};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(mask->size(d) == 1 || mask->size(d) == want[d],
                  "flash_decode: mask ", mask->sizes(), " is not broadcastable to (B, h, Tq, Tk)");
  }
  // the variants (validated in Python; these guard memory)
  if (va.softcap.has_value())
    TORCH_CHECK(*va.softcap > 0 && std::isfinite(*va.softcap),
                "flash_decode: softcap must be a finite number > 0, got ", *va.softcap);
  auto fp32_cpu = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "flash_decode: ", name,
                " must be a float32 CPU tensor, got ", t.scalar_type());
  };
  if (va.sinks.has_value()) {
    fp32_cpu(*va.sinks, "sinks");
    TORCH_CHECK(va.sinks->dim() == 1 && va.sinks->size(0) == q.size(1),
                "flash_decode: sinks must be (h,) = (", q.size(1), "), got ", va.sinks->sizes());
  }
  if (va.bias.has_value()) {
    fp32_cpu(*va.bias, "bias");
    TORCH_CHECK(va.bias->dim() == 4, "flash_decode: bias must be 4-D, got ", va.bias->sizes());
    const int64_t want[4] = {q.size(0), q.size(1), q.size(2), Tk};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(va.bias->size(d) == 1 || va.bias->size(d) == want[d],
                  "flash_decode: bias ", va.bias->sizes(), " is not broadcastable to (B, h, Tq, Tk)");
  }
  if (va.alibi_slopes.has_value()) {
    const at::Tensor& a = *va.alibi_slopes;
    fp32_cpu(a, "alibi_slopes");
    TORCH_CHECK(a.dim() == 2 && (a.size(0) == 1 || a.size(0) == q.size(0)) &&
                    a.size(1) == q.size(1),
                "flash_decode: alibi_slopes must be (1|B, h), got ", a.sizes());
  }
}

// MHA_DECODE_BF16 against what this build and process can run (common/kernel_choice.h's rule:
// an unknown value or one that cannot run here is refused at every bf16 call). Once per process.
void check_decode_bf16() {
  static const bool checked = [] {
    if (const auto& env = mha_common::decode_bf16_override()) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      const std::string dot = "";
#else
      const std::string dot = mha_common::build_lacks("avx512bf16", "AVX512_BF16",
                                                      mha_common::cpu_has_avx512_bf16());
#endif
#ifdef MHA_DECODE_AMX
      const std::string amx = mha_amx::tiles_unavailable();
#elif defined(MHA_AMX_TILES)
      const std::string amx = "no AMX tiles in the decode kernel of this build (it lacks avx512f)";
#else
      const std::string amx = mha_amx::tiles_unavailable();
#endif
      mha_common::check_forced("MHA_DECODE_BF16", *env, {{"amx", amx}, {"avx512bf16", dot}});
    }
    return true;
  }();
  (void)checked;
}

template <bool kVec>
at::Tensor flash_decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& key_lengths,
                             const c10::optional<at::Tensor>& mask, double scale, bool causal,
                             c10::optional<double> softcap, const c10::optional<at::Tensor>& sinks,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& alibi_slopes,
                             const c10::optional<at::Tensor>& k_scale,
                             const c10::optional<at::Tensor>& v_scale,
                             const c10::optional<at::Tensor>& block_table) {
  const VariantArgs va{softcap, sinks, bias, alibi_slopes, k_scale, v_scale, block_table};
  check_inputs(q, k, v, key_lengths, mask, va);
  const bool int8 = k_scale.has_value();
  switch (q.scalar_type()) {
    case at::kFloat:
      return int8 ? run<float, kVec, int8_t>(q, k, v, key_lengths, mask, scale, causal, va)
                  : run<float, kVec>(q, k, v, key_lengths, mask, scale, causal, va);
    case at::kBFloat16:
      check_decode_bf16();
      return int8 ? run<bf16, kVec, int8_t>(q, k, v, key_lengths, mask, scale, causal, va)
                  : run<bf16, kVec>(q, k, v, key_lengths, mask, scale, causal, va);
    default:
      TORCH_CHECK(false, "flash_decode: dtype ", q.scalar_type(), " not supported (float32, bfloat16)");
  }
}

// Autograd: decoding is inference. Refuse inputs that require grad (in words), instead of
// PyTorch's fallback, which would warn and return no gradient; otherwise run the CPU kernel.
template <bool kVec>
at::Tensor flash_decode_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const c10::optional<at::Tensor>& key_lengths,
                                 const c10::optional<at::Tensor>& mask, double scale,
                                 bool causal, c10::optional<double> softcap,
                                 const c10::optional<at::Tensor>& sinks,
                                 const c10::optional<at::Tensor>& bias,
                                 const c10::optional<at::Tensor>& alibi_slopes,
                                 const c10::optional<at::Tensor>& k_scale,
                                 const c10::optional<at::Tensor>& v_scale,
                                 const c10::optional<at::Tensor>& block_table) {
  auto grad = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); };
  TORCH_CHECK(!at::GradMode::is_enabled() ||
                  !(q.requires_grad() || k.requires_grad() || v.requires_grad() || grad(sinks) ||
                    grad(bias)),
              "mha::flash_decode has no backward pass (an inference kernel for decoding): call "
              "it under torch.no_grad(), or use mha.attention, which picks a backend with one");
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kVec ? "mha::flash_decode" : "mha::flash_decode_portable", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&, double, bool,
                                         c10::optional<double>, const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&)>();
  return op.call(q, k, v, key_lengths, mask, scale, causal, softcap, sinks, bias, alibi_slopes,
                 k_scale, v_scale, block_table);
}

// The bf16 q.k this process runs where the AMX tiles fit (G <= 16, d_k % 32 == 0, d_k <= 128):
// "amx", "amx-emulated" (software tiles: a MHA_AMX_EMULATE build), "avx512bf16" (vdpbf16ps) or
// "fp32" (widened). Read back by tests and `mha build`; MHA_DECODE_BF16 is read (and refused
// when it cannot run here) as in a call.
std::string flash_decode_bf16_qk() {
  check_decode_bf16();
#ifdef MHA_DECODE_AMX
  if (mha_decode_amx::amx_permitted()) {
#if defined(MHA_AMX_EMULATED)
    return "amx-emulated";
#else
    return "amx";
#endif
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512bf16";
#else
  return "fp32";
#endif
}

// Why the AMX q.k compiled into this build does not run in this process (the OS refuses the
// tile state, or MHA_DECODE_BF16=avx512bf16), for mha.explain and `mha build`; "" when it runs
// (where the tiles fit) or is not compiled in.
std::string flash_decode_amx() {
  check_decode_bf16();
#ifdef MHA_DECODE_AMX
  if (mha_decode_amx::amx_permitted()) return "";
  if (!mha_amx::tiles_unavailable().empty()) return mha_amx::tiles_unavailable();
  return "MHA_DECODE_BF16=avx512bf16";
#else
  return "";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mha, m) {
  // the score variants (decode/variants.h) are optional, after the masks; then the scales of
  // int8 K/V (k, v int8 with fp32 (B, h_kv, Tk) scales, dequantized in the loops); then the
  // block table of paged K/V (k, v page pools (num_pages, h_kv, page_size, d))
  m.def("flash_decode(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? mask, "
        "float scale, bool causal, float? softcap=None, Tensor? sinks=None, Tensor? bias=None, "
        "Tensor? alibi_slopes=None, Tensor? k_scale=None, Tensor? v_scale=None, "
        "Tensor? block_table=None) -> Tensor");
  m.def("flash_decode_portable(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? mask, "
        "float scale, bool causal, float? softcap=None, Tensor? sinks=None, Tensor? bias=None, "
        "Tensor? alibi_slopes=None, Tensor? k_scale=None, Tensor? v_scale=None, "
        "Tensor? block_table=None) -> Tensor");
  m.def("flash_decode_bf16_qk() -> str", &flash_decode_bf16_qk);
  m.def("flash_decode_amx() -> str", &flash_decode_amx);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("flash_decode", &flash_decode_impl<true>);
  m.impl("flash_decode_portable", &flash_decode_impl<false>);
}

TORCH_LIBRARY_IMPL(mha, Autograd, m) {
  m.impl("flash_decode", &flash_decode_autograd<true>);
  m.impl("flash_decode_portable", &flash_decode_autograd<false>);
}
