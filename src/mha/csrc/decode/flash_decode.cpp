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
// NaN and Inf (the rule of flash_attn.cpp): a row's output depends only on q and the keys it
// may attend, as IEEE arithmetic of softmax(q k^T scale) v makes it: a NaN score (NaN in q, or
// NaN / Inf in a visible K row) makes the row's max, every weight and the whole output row NaN
// (softmax_*, merge_group keep a NaN max instead of dropping it as max() would); a NaN in a
// visible V row makes that column NaN. Keys a row may not attend never reach it: their weight
// is 0, and where 0 * (a non-finite V) made a row's partial output non-finite, that row is
// computed again from its visible keys only (pv_exact; finite inputs never pay for it).
//
// Two ops: mha::flash_decode (vectorized under __AVX512F__ / __AVX512BF16__, portable C++
// otherwise) and mha::flash_decode_portable (always the portable loops; for tests).

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
#include "amx/decode_amx.h"  // MHA_DECODE_AMX and the AMX q.k, when the target has AMX
#ifdef _OPENMP
#include <omp.h>
#endif

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

// ------------------------------------------------------------------ portable building blocks

// scores[r * kChunk + t] = (q_r . k_t) * scale for r < G, t < n.
template <typename T>
void qk_portable(const T* q, int64_t G, int64_t dk, const T* k, int64_t kst, int64_t n,
                 float scale, float* scores) {
  for (int64_t r = 0; r < G; ++r)
    for (int64_t t = 0; t < n; ++t) {
      float s = 0.f;
      for (int64_t c = 0; c < dk; ++c) s += widen(q[r * dk + c]) * widen(k[t * kst + c]);
      scores[r * kChunk + t] = s * scale;
    }
}

// O[r] += sum_t p[r * kChunk + t] * v_t for r < G, t < n.
template <typename T>
void pv_portable(const float* p, int64_t G, int64_t n, const T* v, int64_t vst, int64_t dv,
                 float* O) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < G; ++r) {
      const float w = p[r * kChunk + t];
      for (int64_t c = 0; c < dv; ++c) O[r * dv + c] += w * widen(v[t * vst + c]);
    }
}

// Row max, then s <- 2^(s - max) in place; returns (max, sum). Entries at -inf become 0; a
// NaN entry makes the max, every entry and the sum NaN.
std::pair<float, float> softmax_portable(float* s, int64_t n) {
  float m = kNegInf, l = 0.f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  // std::max drops NaN; next to a finite score a NaN one still gives a NaN weight and sum.
  // Only "every score NaN" would look like "no key": checked there.
  if (m == kNegInf)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(s[j])) m = s[j];
  for (int64_t j = 0; j < n; ++j) {
    s[j] = (s[j] == kNegInf) ? 0.f : std::exp2(s[j] - m);
    l += s[j];
  }
  return {m, l};
}

// ------------------------------------------------------------------ AVX-512 building blocks
#ifdef __AVX512F__
#define MHA_INLINE inline __attribute__((always_inline))
// Unroll loops over compile-time register counts early: otherwise GCC keeps arrays of
// accumulators in memory and stores them back every iteration.
#define MHA_UNROLL _Pragma("GCC unroll 16")

MHA_INLINE __mmask16 tail16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 bf16 values -> 16 fp32 (exact: bf16 is the top half of an fp32).
MHA_INLINE __m512 load_f32(const bf16* p, __mmask16 mk) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mk, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
MHA_INLINE __m512 load_f32(const float* p, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, p); }

// One dot product's partial sums (16 lanes): q . k over d elements.
MHA_INLINE __m512 dot_lanes(const float* q, const float* k, int64_t d) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(k + c + 16), a1);
  }
  for (; c < d; c += 16) {
    const __mmask16 mk = tail16(d - c);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + c), _mm512_maskz_loadu_ps(mk, k + c), a0);
  }
  return _mm512_add_ps(a0, a1);
}

MHA_INLINE __m512 dot_lanes(const bf16* q, const bf16* k, int64_t d) {
#ifdef __AVX512BF16__
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(q + c), (__m512bh)_mm512_loadu_si512(k + c));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(q + c + 32),
                          (__m512bh)_mm512_loadu_si512(k + c + 32));
  }
  for (; c < d; c += 32) {
    const int64_t r = std::min<int64_t>(32, d - c);
    const __mmask32 mk = r == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << r) - 1ull);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mk, q + c),
                          (__m512bh)_mm512_maskz_loadu_epi16(mk, k + c));
  }
  return _mm512_add_ps(a0, a1);
#else
  __m512 a = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 mk = tail16(d - c);
    a = _mm512_fmadd_ps(load_f32(q + c, mk), load_f32(k + c, mk), a);
  }
  return a;
#endif
}

// Ask for one row (n elements) to be brought into the cache ahead of its use.
template <typename T>
MHA_INLINE void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(c + off, _MM_HINT_T0);
}

// Sixteen 16-lane partial sums -> one vector of their 16 totals. With the accumulators
// assigned as below (acc[i] holds key 4 * (i % 4) + i / 4), lane t of the result is key t.
MHA_INLINE __m512 reduce16(const __m512* a) {
  __m512 s[8], u[4];
  MHA_UNROLL for (int i = 0; i < 8; ++i)  // halves: [a_2i (8 lanes) | a_2i+1 (8 lanes)]
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  MHA_UNROLL for (int i = 0; i < 4; ++i)  // quarters: four 128-bit blocks, one per accumulator
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  const __m512 xy = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 zw = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512d xyd = _mm512_castps_pd(xy), zwd = _mm512_castps_pd(zw);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xyd, zwd)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(xyd, zwd)));
}

template <typename T>
void qk_vec(const T* q, int64_t G, int64_t dk, const T* k, int64_t kst, int64_t n, float scale,
            float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t nt = std::min<int64_t>(16, n - j);
    const T* kp[16];
    MHA_UNROLL for (int t = 0; t < 16; ++t) kp[t] = k + (j + std::min<int64_t>(t, nt - 1)) * kst;
    if (j + 32 < n)  // the block after next: keeps the memory stream ahead of the loads
      for (int t = 0; t < 16; ++t) prefetch_row(kp[t] + 32 * kst, dk);
    for (int64_t r = 0; r < G; ++r) {  // the 16 K rows stay in L1 across the G query rows
      __m512 acc[16];
      // keys are read in memory order; reduce16 wants accumulator i to hold key
      // 4 * (i % 4) + i / 4, so the (compile-time) index is permuted instead of the loads
      MHA_UNROLL for (int t = 0; t < 16; ++t) acc[4 * (t % 4) + t / 4] = dot_lanes(q + r * dk, kp[t], dk);
      _mm512_mask_storeu_ps(scores + r * kChunk + j, tail16(nt),
                            _mm512_mul_ps(reduce16(acc), vscale));
    }
  }
}

// O[r0:r0+R, col:col+16*NV] += p[r0:r0+R, :n] @ v[:n, col:col+16*NV]; accumulators in
// registers, each V vector loaded once for the R rows.
template <typename T, int R, int NV>
void pv_tile(const float* p, int64_t n, const T* v, int64_t vst, int64_t col, __mmask16 last,
             float* O, int64_t dv) {
  __m512 acc[R][NV];
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 pr[R];
    MHA_UNROLL for (int r = 0; r < R; ++r) pr[r] = _mm512_set1_ps(p[r * kChunk + t]);
    const T* vt = v + t * vst + col;
    if (t + 16 < n) prefetch_row(vt + 16 * vst, 16 * NV);
    MHA_UNROLL for (int c = 0; c < NV; ++c) {
      const __m512 x = load_f32(vt + 16 * c, c == NV - 1 ? last : static_cast<__mmask16>(0xFFFF));
      MHA_UNROLL for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(pr[r], x, acc[r][c]);
    }
  }
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int c = 0; c < NV; ++c) {
      float* o = O + r * dv + col + 16 * c;
      const __mmask16 mk = c == NV - 1 ? last : static_cast<__mmask16>(0xFFFF);
      _mm512_mask_storeu_ps(o, mk, _mm512_add_ps(_mm512_maskz_loadu_ps(mk, o), acc[r][c]));
    }
}

// bf16 V without a per-vector conversion shuffle: 32 bf16 loaded as 16 int32 lanes hold an
// even column in the low half and an odd one in the high half of each lane, so
// `x << 16` is the even columns and `x & 0xFFFF0000` the odd ones, as exact fp32 (two cheap
// ALU ops per 32 values instead of a widening shuffle and a shift per 16). Accumulators are
// kept split (even, odd) and interleaved back once, at the end of the tile.
template <int R, int NB>
void pv_tile_bf16(const float* p, int64_t n, const bf16* v, int64_t vst, int64_t col, int64_t w,
                  float* O, int64_t dv) {
  __m512 ae[R][NB], ao[R][NB];
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int c = 0; c < NB; ++c) ae[r][c] = ao[r][c] = _mm512_setzero_ps();
  const int64_t wl = w - 32 * (NB - 1);  // columns in the last 32-column block (1..32)
  const __mmask32 last = wl >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << wl) - 1ull);
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t = 0; t < n; ++t) {
    __m512 pr[R];
    MHA_UNROLL for (int r = 0; r < R; ++r) pr[r] = _mm512_set1_ps(p[r * kChunk + t]);
    const bf16* vt = v + t * vst + col;
    if (t + 16 < n) prefetch_row(vt + 16 * vst, 32 * NB);
    MHA_UNROLL for (int c = 0; c < NB; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi16(c == NB - 1 ? last : 0xFFFFFFFFu, vt + 32 * c);
      const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
      MHA_UNROLL for (int r = 0; r < R; ++r) {
        ae[r][c] = _mm512_fmadd_ps(pr[r], xe, ae[r][c]);
        ao[r][c] = _mm512_fmadd_ps(pr[r], xo, ao[r][c]);
      }
    }
  }
  const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int c = 0; c < NB; ++c) {
      float* o = O + r * dv + col + 32 * c;
      const int64_t left = w - 32 * c;  // valid columns from o on (>= 1)
      const __mmask16 m0 = tail16(left), m1 = left > 16 ? tail16(left - 16) : 0;
      const __m512 lo = _mm512_permutex2var_ps(ae[r][c], lo_idx, ao[r][c]);  // columns 0..15
      const __m512 up = _mm512_permutex2var_ps(ae[r][c], hi_idx, ao[r][c]);  // columns 16..31
      _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), lo));
      _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), up));
    }
}

// Column tiles: 128 columns for up to 2 query rows, 64 for 3-4 (16 accumulators either way).
template <int R>
void pv_rows(const float* p, int64_t n, const float* v, int64_t vst, int64_t dv, float* O) {
  constexpr int64_t kW = R <= 2 ? 128 : 64;
  for (int64_t col = 0; col < dv; col += kW) {
    const int64_t w = std::min<int64_t>(kW, dv - col);
    const int nv = static_cast<int>((w + 15) / 16);
    const __mmask16 last = tail16(w - 16 * (nv - 1));
    switch (nv) {
      case 1: pv_tile<float, R, 1>(p, n, v, vst, col, last, O, dv); break;
      case 2: pv_tile<float, R, 2>(p, n, v, vst, col, last, O, dv); break;
      case 3: pv_tile<float, R, 3>(p, n, v, vst, col, last, O, dv); break;
      case 4: pv_tile<float, R, 4>(p, n, v, vst, col, last, O, dv); break;
      case 5: pv_tile<float, R, 5>(p, n, v, vst, col, last, O, dv); break;
      case 6: pv_tile<float, R, 6>(p, n, v, vst, col, last, O, dv); break;
      case 7: pv_tile<float, R, 7>(p, n, v, vst, col, last, O, dv); break;
      default: pv_tile<float, R, 8>(p, n, v, vst, col, last, O, dv); break;
    }
  }
}

template <int R>
void pv_rows(const float* p, int64_t n, const bf16* v, int64_t vst, int64_t dv, float* O) {
  constexpr int64_t kW = R <= 2 ? 128 : 64;
  for (int64_t col = 0; col < dv; col += kW) {
    const int64_t w = std::min<int64_t>(kW, dv - col);
    switch ((w + 31) / 32) {
      case 1: pv_tile_bf16<R, 1>(p, n, v, vst, col, w, O, dv); break;
      case 2: pv_tile_bf16<R, 2>(p, n, v, vst, col, w, O, dv); break;
      case 3: pv_tile_bf16<R, 3>(p, n, v, vst, col, w, O, dv); break;
      default: pv_tile_bf16<R, 4>(p, n, v, vst, col, w, O, dv); break;
    }
  }
}

template <typename T>
void pv_vec(const float* p, int64_t G, int64_t n, const T* v, int64_t vst, int64_t dv, float* O) {
  int64_t r = 0;
  for (; r + 4 <= G; r += 4) pv_rows<4>(p + r * kChunk, n, v, vst, dv, O + r * dv);
  if (G - r == 3) pv_rows<3>(p + r * kChunk, n, v, vst, dv, O + r * dv);
  if (G - r == 2) pv_rows<2>(p + r * kChunk, n, v, vst, dv, O + r * dv);
  if (G - r == 1) pv_rows<1>(p + r * kChunk, n, v, vst, dv, O + r * dv);
}

using mha_exp2::exp2_avx512;  // 2^x, shared with the flash kernels

std::pair<float, float> softmax_vec(float* s, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 mx = ninf;
  for (int64_t j = 0; j < n; j += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, tail16(n - j), s + j));
  float m = _mm512_reduce_max_ps(mx);
  // vmaxps drops NaN; next to a finite score a NaN one still gives a NaN weight (exp2_avx512 keeps
  // NaN) and sum. Only "every score NaN" would look like "no key": checked there.
  if (m == kNegInf)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(s[j])) m = s[j];
  if (m == kNegInf) {
    std::fill(s, s + n, 0.f);
    return {m, 0.f};
  }
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = tail16(n - j);
    const __m512 x = _mm512_maskz_loadu_ps(mk, s + j);
    // below 2^-125 (relative to the row max) the weight is flushed to an exact 0: -inf
    // (masked) keys, and no denormal results, which can cost floating-point assists; NaN
    // (a NaN max) stays NaN
    const __m512 dx = _mm512_sub_ps(x, vm);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(mk, dx, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_avx512(dx));
    _mm512_mask_storeu_ps(s + j, mk, e);
    sum = _mm512_add_ps(sum, e);
  }
  return {m, _mm512_reduce_add_ps(sum)};
}
#endif  // __AVX512F__



template <typename T, bool kVec>
inline void qk(const T* q, int64_t G, int64_t dk, const T* k, int64_t kst, int64_t n, float scale,
               float* scores) {
#ifdef __AVX512F__
  if constexpr (kVec) return qk_vec(q, G, dk, k, kst, n, scale, scores);
#endif
  qk_portable(q, G, dk, k, kst, n, scale, scores);
}

template <typename T, bool kVec>
inline void pv(const float* p, int64_t G, int64_t n, const T* v, int64_t vst, int64_t dv, float* O) {
#ifdef __AVX512F__
  if constexpr (kVec) return pv_vec(p, G, n, v, vst, dv, O);
#endif
  pv_portable(p, G, n, v, vst, dv, O);
}

template <bool kVec>
inline std::pair<float, float> softmax2(float* s, int64_t n) {
#ifdef __AVX512F__
  if constexpr (kVec) return softmax_vec(s, n);
#endif
  return softmax_portable(s, n);
}

// ------------------------------------------------------------------ the two passes
// One item: keys [j0, j1) of K/V head kvh in batch row b, for the G query rows of its group.
// Writes O (G, d_v) unnormalized, m (G,) and l (G,) for this split. scores: G * kChunk floats.
// Per-thread scratch: scores (G, kChunk), the merge accumulator (d_v), AMX operands.
struct Scratch {
  std::vector<float> scores, acc, tmp;
  std::vector<uint32_t> qpack;
  explicit Scratch(const Problem& P)
      : scores(P.G * kChunk), acc(P.dv), tmp(16 * P.G), qpack(P.amx ? P.dk / 2 * P.G : 0) {}
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


// Row r of a split's O again, from the keys [j0, j1) it may attend only (causal, mask):
// p (the row's weights, 0 where masked) times V with the masked keys skipped, so that 0 * a
// non-finite V never reaches it. Plain loops (inputs with a NaN or an Inf only).
template <typename T>
void pv_exact(const Problem& P, int64_t b, int64_t kvh, int64_t r, int64_t j0, int64_t j1,
              const float* p, const T* v, float* O) {
  const int64_t head = kvh * P.g + r / P.Tq, i = r % P.Tq;
  const int64_t last = P.causal ? i + P.Tk - P.Tq : j1;  // query i sees keys j <= last
  const bool* mr = P.mask ? P.mask + b * P.msb + head * P.msh + i * P.msq : nullptr;
  std::fill(O, O + P.dv, 0.f);
  for (int64_t j = j0; j < std::min(j1, last + 1); ++j) {
    if (mr && !mr[j * P.msk]) continue;
    const float w = p[j - j0];
    const T* vt = v + (j - j0) * P.vst;
    for (int64_t c = 0; c < P.dv; ++c) O[c] += w * widen(vt[c]);
  }
}

template <typename T, bool kVec>
void split_item(const Problem& P, int64_t b, int64_t kvh, int64_t j0, int64_t j1, Scratch& w,
                float* O, float* m, float* l) {
  float* scores = w.scores.data();
  const int64_t G = P.G, n = j1 - j0;
  std::fill(O, O + G * P.dv, 0.f);
  std::fill(m, m + G, kNegInf);
  std::fill(l, l + G, 0.f);
  if (n <= 0) return;
  const T* q = static_cast<const T*>(P.q) + (b * P.h + kvh * P.g) * P.Tq * P.dk;  // (G, d_k)
  const T* k = static_cast<const T*>(P.k) + b * P.ksb + kvh * P.ksh + j0 * P.kst;
  const T* v = static_cast<const T*>(P.v) + b * P.vsb + kvh * P.vsh + j0 * P.vst;
  // scores (G, n) = q (G, d_k) @ k[j0:j1]^T (d_k, n), in base-2 units
  int64_t done = 0;  // keys scored on AMX tiles (whole steps of 32), the rest below
#ifdef MHA_DECODE_AMX
  if constexpr (kVec && std::is_same_v<T, bf16>)
    if (P.amx)
      done = mha_decode_amx::qk_amx(q, G, P.dk, k, P.kst, n, P.scale_log2, scores, kChunk,
                                    w.qpack.data(), w.tmp.data());
#endif
  if (done < n)
    qk<T, kVec>(q, G, P.dk, k + done * P.kst, P.kst, n - done, P.scale_log2, scores + done);
  bool any = false;
  for (int64_t r = 0; r < G; ++r) {  // masks -> -inf; then max, 2^(s - max), sum per row
    float* s = scores + r * kChunk;
    const int64_t head = kvh * P.g + r / P.Tq, i = r % P.Tq;
    if (P.causal) {
      const int64_t last = i + P.Tk - P.Tq;  // query i sees keys j <= last
      for (int64_t j = std::max(j0, last + 1); j < j1; ++j) s[j - j0] = kNegInf;
    }
    if (P.mask) {
      const bool* mr = P.mask + b * P.msb + head * P.msh + i * P.msq;
      for (int64_t j = j0; j < j1; ++j)
        if (!mr[j * P.msk]) s[j - j0] = kNegInf;
    }
    std::tie(m[r], l[r]) = softmax2<kVec>(s, n);
    any = any || l[r] != 0.f;  // NaN too
  }
  // O (G, d_v) = p (G, n) @ v[j0:j1] (n, d_v)
  if (!any) return;
  pv<T, kVec>(scores, G, n, v, P.vst, P.dv, O);
  for (int64_t r = 0; r < G; ++r)  // a NaN l: the whole row is NaN anyway
    if (!std::isnan(l[r]) && !mha_finite::all_finite(O + r * P.dv, P.dv))
      pv_exact(P, b, kvh, r, j0, j1, scores + r * kChunk, v, O + r * P.dv);
}

struct Partials {
  float* O;  // (B, h_kv, S, G, d_v) unnormalized outputs
  float* M;  // (B, h_kv, S, G) maxima, base 2
  float* L;  // (B, h_kv, S, G) sums of 2^(s - M)
};

// Merge the S partials of group bh (in split order) into out rows (head = kvh * g + r / Tq,
// i = r % Tq), which are contiguous: out + (bh * G + r) * d_v.
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
    for (int64_t s = 0; Mx != kNegInf && s < P.S; ++s) {
      const int64_t at = (bh * P.S + s) * P.G + r;
      if (part.L[at] == 0.f) continue;
      const float w = std::exp2(part.M[at] - Mx);
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

template <typename T, bool kVec>
at::Tensor run(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
               const c10::optional<at::Tensor>& key_lengths, const c10::optional<at::Tensor>& mask,
               double scale, bool causal) {
  const at::Tensor q = q_in.contiguous();  // (B, h, Tq, d_k): small
  Problem P{};
  P.B = q.size(0), P.h = q.size(1), P.Tq = q.size(2), P.dk = q.size(3);
  P.h_kv = k.size(1), P.Tk = k.size(2), P.dv = v.size(3);
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
  P.amx = kVec && std::is_same_v<T, bf16> && mha_decode_amx::amx_fits(P.G, P.dk) &&
          mha_decode_amx::amx_permitted();
#endif
  P.scale_log2 = static_cast<float>(scale) * kLog2e;

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
  const int64_t bytes = P.B * P.h_kv * P.Tk * (P.dk + P.dv) * static_cast<int64_t>(sizeof(T));
  const int threads = bytes < (int64_t{1} << 18) ? 1
                      : static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
  auto work = [&](Scratch& w, int64_t it) {
    const int64_t s = it % P.S, bh = it / P.S, b = bh / P.h_kv, kvh = bh % P.h_kv;
    const int64_t len = P.klen ? std::min(P.klen[b], P.Tk) : P.Tk;
    const int64_t j0 = s * P.C, j1 = std::min(j0 + P.C, len);
    split_item<T, kVec>(P, b, kvh, j0, j1, w, part.O + it * P.G * P.dv,
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
                  const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "flash_decode: q, k, v must be CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash_decode: q (B, h, Tq, d_k), k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v) must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flash_decode: q, k, v must share one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                  v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "flash_decode: shapes disagree: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
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
    const int64_t want[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(mask->size(d) == 1 || mask->size(d) == want[d],
                  "flash_decode: mask ", mask->sizes(), " is not broadcastable to (B, h, Tq, Tk)");
  }
}

template <bool kVec>
at::Tensor flash_decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& key_lengths,
                             const c10::optional<at::Tensor>& mask, double scale, bool causal) {
  check_inputs(q, k, v, key_lengths, mask);
  switch (q.scalar_type()) {
    case at::kFloat:
      return run<float, kVec>(q, k, v, key_lengths, mask, scale, causal);
    case at::kBFloat16:
      return run<bf16, kVec>(q, k, v, key_lengths, mask, scale, causal);
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
                                 bool causal) {
  TORCH_CHECK(!at::GradMode::is_enabled() ||
                  !(q.requires_grad() || k.requires_grad() || v.requires_grad()),
              "mha::flash_decode has no backward pass (an inference kernel for decoding): call "
              "it under torch.no_grad(), or use mha.attention, which picks a backend with one");
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kVec ? "mha::flash_decode" : "mha::flash_decode_portable", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&, double, bool)>();
  return op.call(q, k, v, key_lengths, mask, scale, causal);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("flash_decode(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? mask, "
        "float scale, bool causal) -> Tensor");
  m.def("flash_decode_portable(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? mask, "
        "float scale, bool causal) -> Tensor");
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("flash_decode", &flash_decode_impl<true>);
  m.impl("flash_decode_portable", &flash_decode_impl<false>);
}

TORCH_LIBRARY_IMPL(mha, Autograd, m) {
  m.impl("flash_decode", &flash_decode_autograd<true>);
  m.impl("flash_decode_portable", &flash_decode_autograd<false>);
}
