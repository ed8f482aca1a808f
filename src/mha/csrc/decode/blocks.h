// The decode kernel's building blocks: q.k scores, softmax in base 2 and p.v products, as
// portable C++ loops and on AVX-512 (fp32 FMAs; bf16 dot products with AVX512_BF16), and the
// qk / pv / softmax2 switches that pick one at compile time (kVec).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "common/exp2.h"
#include "common/finite.h"
#include "decode/problem.h"

namespace {

// ------------------------------------------------------------------ portable building blocks

// scores[r * kChunk + t] = (q_r . k_t) * scale for r < G, t < n (K in q's dtype, or int8).
template <typename T, typename KV>
void qk_portable(const T* q, int64_t G, int64_t dk, const KV* k, int64_t kst, int64_t n,
                 float scale, float* scores) {
  for (int64_t r = 0; r < G; ++r)
    for (int64_t t = 0; t < n; ++t) {
      float s = 0.f;
      // simd reduction: lane-wise partial sums in a fixed order (GCC does not vectorize a
      // float sum otherwise); the same order on every run and thread count
#pragma omp simd reduction(+ : s)
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

// Row max, then s <- 2^((s - max) unit) in place (unit: Problem::unit); returns (max, sum).
// Entries at -inf become 0; a NaN entry makes the max, every entry and the sum NaN.
std::pair<float, float> softmax_portable(float* s, int64_t n, float unit) {
  float m = kNegInf, l = 0.f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  // std::max drops NaN; next to a finite score a NaN one still gives a NaN weight and sum.
  // Only "every score NaN" would look like "no key": checked there.
  if (m == kNegInf)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(s[j])) m = s[j];
  for (int64_t j = 0; j < n; ++j) {
    s[j] = (s[j] == kNegInf) ? 0.f : std::exp2((s[j] - m) * unit);
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
MHA_INLINE __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }
// 16 int8 values -> 16 fp32 (exact): sign-extended to int32, then converted.
MHA_INLINE __m512 load_f32(const int8_t* p, __mmask16 mk) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, p)));
}
MHA_INLINE __m512 load_f32(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One dot product's partial sums (16 lanes): q . k over d elements (bf16; qk_vec).
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

// One step of a q.k dot product, W elements: fp32 q against fp32 or int8 K (widened; FMAs),
// or bf16 q against bf16 K (vdpbf16ps, pairs of products, exact in fp32).
template <typename QT, typename KT>
struct QkStep {
  static constexpr int64_t W = 16;
  using M = __mmask16;
  static M mask(int64_t left) { return tail16(left); }
  static __m512 q(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 q(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static __m512 k(const KT* p) { return load_f32(p); }
  static __m512 k(const KT* p, M m) { return load_f32(p, m); }
  static __m512 madd(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
  static __m512 fin(__m512 acc) { return acc; }
};
// int16 q (a bf16 q row quantized, see split_item) against int8 K widened to int16:
// vpdpwssd, pairs of exact integer products into int32 lanes; `fin` converts them to fp32.
template <>
struct QkStep<int16_t, int8_t> {
  static constexpr int64_t W = 32;
  using M = __mmask32;
  static M mask(int64_t left) {
    return left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1ull);
  }
  static __m512i q(const int16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i q(const int16_t* p, M m) { return _mm512_maskz_loadu_epi16(m, p); }
  static __m512i k(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512i k(const int8_t* p, M m) { return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, p)); }
  static __m512 madd(__m512 acc, __m512i a, __m512i b) {
    return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), a, b));
  }
  static __m512 fin(__m512 acc) { return _mm512_cvtepi32_ps(_mm512_castps_si512(acc)); }
};

#ifdef __AVX512BF16__
template <>
struct QkStep<bf16, bf16> {
  static constexpr int64_t W = 32;
  using M = __mmask32;
  static M mask(int64_t left) {
    return left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1ull);
  }
  static __m512bh q(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh q(const bf16* p, M m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
  static __m512bh k(const bf16* p) { return q(p); }
  static __m512bh k(const bf16* p, M m) { return q(p, m); }
  static __m512 madd(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }
  static __m512 fin(__m512 acc) { return acc; }
};
#endif

// scores for R query rows against blocks of KB = 16 / R keys (fp32 q with fp32 or int8 K; bf16
// q and K): the R * KB dot products of a block accumulate side by side in 16-lane registers, so
// each K vector is loaded (int8: widened) once for the R rows, and each q vector once for the KB
// keys; one reduce16 then gives the block's R * KB totals in one vector (lane r * KB + t: row r,
// key t). q: (R, dk) rows; scores: row r at scores + r * kChunk; row r's sums are multiplied
// by scale * rs[r] (rs: the int16 q rows' scales) or by scale (rs == nullptr).
template <int R, typename QT, typename KT>
void qk_rows(const QT* q, int64_t dk, const KT* k, int64_t kst, int64_t n, float scale,
             float* scores, const float* rs = nullptr) {
  using S = QkStep<QT, KT>;
  constexpr int KB = 16 / R;  // keys per block (R * KB <= 16 dot products)
  alignas(64) float sl_scale[16];  // lane r * KB + t: row r's
  for (int i = 0; i < 16; ++i) sl_scale[i] = rs && i < R * KB ? scale * rs[i / KB] : scale;
  const __m512 vscale = _mm512_load_ps(sl_scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t j = 0; j < n; j += KB) {
    const int64_t nt = std::min<int64_t>(KB, n - j);
    __m512 acc[16];
    MHA_UNROLL for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    if (R == 1 && nt == KB && dk % S::W == 0) {
      // one query row, a whole block: each K row read whole, in memory order, so that K is
      // one sequential stream which the hardware prefetchers follow by themselves (no
      // software prefetch: it only competed with them). Each accumulator takes its products
      // in the same order as below, so the sums are the same bits.
      const KT* kt = k + j * kst;
      MHA_UNROLL for (int t = 0; t < KB; ++t, kt += kst)
        for (int64_t c = 0; c < dk; c += S::W)
          acc[4 * (t % 4) + t / 4] = S::madd(acc[4 * (t % 4) + t / 4], S::q(q + c), S::k(kt + c));
    } else if (nt == KB && dk % S::W == 0) {
      // a whole block, whole vectors: one pointer walks the KB rows (no per-row pointers to
      // keep in registers), unmasked loads (int8: the widening load takes its memory operand)
      const KT* kb = k + j * kst;
      if (j + 3 * KB < n)
        MHA_UNROLL for (int t = 0; t < KB; ++t) prefetch_row(kb + (3 * KB + t) * kst, dk);
      for (int64_t c = 0; c < dk; c += S::W) {
        decltype(S::q(q)) qv[R];
        MHA_UNROLL for (int r = 0; r < R; ++r) qv[r] = S::q(q + r * dk + c);
        const KT* kt = kb + c;
        MHA_UNROLL for (int t = 0; t < KB; ++t, kt += kst) {
          const auto x = S::k(kt);
          // dot product s = r * KB + t sits where reduce16 puts its total in lane s
          MHA_UNROLL for (int r = 0; r < R; ++r) {
            const int sl = r * KB + t;
            acc[4 * (sl % 4) + sl / 4] = S::madd(acc[4 * (sl % 4) + sl / 4], qv[r], x);
          }
        }
      }
    } else {  // the last keys, or a d_k with a partial vector: clamped row pointers, masks
      const KT* kp[KB];
      MHA_UNROLL for (int t = 0; t < KB; ++t) kp[t] = k + (j + std::min<int64_t>(t, nt - 1)) * kst;
      for (int64_t c = 0; c < dk; c += S::W) {
        const auto mk = S::mask(dk - c);
        decltype(S::q(q)) qv[R];
        MHA_UNROLL for (int r = 0; r < R; ++r) qv[r] = S::q(q + r * dk + c, mk);
        MHA_UNROLL for (int t = 0; t < KB; ++t) {
          const auto x = S::k(kp[t] + c, mk);
          MHA_UNROLL for (int r = 0; r < R; ++r) {
            const int sl = r * KB + t;
            acc[4 * (sl % 4) + sl / 4] = S::madd(acc[4 * (sl % 4) + sl / 4], qv[r], x);
          }
        }
      }
    }
    MHA_UNROLL for (int i = 0; i < 16; ++i) acc[i] = S::fin(acc[i]);
    const __m512 tot = _mm512_mul_ps(reduce16(acc), vscale);
    MHA_UNROLL for (int r = 0; r < R; ++r) {  // row r's keys: lanes r * KB + t, moved to t
      const __m512 row = r == 0 ? tot
                                : _mm512_permutexvar_ps(
                                      _mm512_add_epi32(_mm512_set1_epi32(r * KB), lane), tot);
      _mm512_mask_storeu_ps(scores + r * kChunk + j, tail16(nt), row);
    }
  }
}

// G query rows in groups of up to 4 (qk_rows): fp32 q against int8 or fp32 K, bf16 against bf16.
// int16 q against int8 K: rs (G,) the q rows' scales.
template <typename QT, typename KT>
void qk_vec_rows(const QT* q, int64_t G, int64_t dk, const KT* k, int64_t kst, int64_t n,
                 float scale, float* scores, const float* rs = nullptr) {
  int64_t r = 0;
  auto at = [&](int64_t r0) { return rs ? rs + r0 : nullptr; };
  for (; r + 4 <= G; r += 4)
    qk_rows<4>(q + r * dk, dk, k, kst, n, scale, scores + r * kChunk, at(r));
  if (G - r == 3) qk_rows<3>(q + r * dk, dk, k, kst, n, scale, scores + r * kChunk, at(r));
  if (G - r == 2) qk_rows<2>(q + r * dk, dk, k, kst, n, scale, scores + r * kChunk, at(r));
  if (G - r == 1) qk_rows<1>(q + r * dk, dk, k, kst, n, scale, scores + r * kChunk, at(r));
}

// O[r0:r0+R, col:col+16*NV] += p[r0:r0+R, :n] @ v[:n, col:col+16*NV]; accumulators in
// registers, each V vector loaded once for the R rows. They start from O and add the keys in
// order, so O's sums do not depend on how the keys were cut into runs (paged K/V: the same
// bits as contiguous).
template <typename T, int R, int NV, bool kFull = false>
void pv_tile(const float* p, int64_t n, const T* v, int64_t vst, int64_t col, __mmask16 last,
             float* O, int64_t dv) {
  __m512 acc[R][NV];
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_maskz_loadu_ps(c == NV - 1 ? last : static_cast<__mmask16>(0xFFFF),
                                        O + r * dv + col + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m512 pr[R];
    MHA_UNROLL for (int r = 0; r < R; ++r) pr[r] = _mm512_set1_ps(p[r * kChunk + t]);
    const T* vt = v + t * vst + col;
    if (t + 16 < n) prefetch_row(vt + 16 * vst, 16 * NV);
    MHA_UNROLL for (int c = 0; c < NV; ++c) {
      const __m512 x = kFull || c < NV - 1 ? load_f32(vt + 16 * c) : load_f32(vt + 16 * c, last);
      MHA_UNROLL for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(pr[r], x, acc[r][c]);
    }
  }
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int c = 0; c < NV; ++c) {
      float* o = O + r * dv + col + 16 * c;
      _mm512_mask_storeu_ps(o, c == NV - 1 ? last : static_cast<__mmask16>(0xFFFF), acc[r][c]);
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
// T: fp32, or int8 (widened per vector; its per-key scale is already in p).
template <int R, typename T>
void pv_rows(const float* p, int64_t n, const T* v, int64_t vst, int64_t dv, float* O) {
  constexpr int64_t kW = R <= 2 ? 128 : 64;
  for (int64_t col = 0; col < dv; col += kW) {
    const int64_t w = std::min<int64_t>(kW, dv - col);
    const int nv = static_cast<int>((w + 15) / 16);
    const __mmask16 last = tail16(w - 16 * (nv - 1));
    // int8: whole vectors take the widening load with its memory operand (no mask)
    const bool full = std::is_same_v<T, int8_t> && last == 0xFFFF;
    auto tile = [&](auto nvc) {
      constexpr int NVC = decltype(nvc)::value;
      if (full) pv_tile<T, R, NVC, true>(p, n, v, vst, col, last, O, dv);
      else pv_tile<T, R, NVC>(p, n, v, vst, col, last, O, dv);
    };
    switch (nv) {
      case 1: tile(std::integral_constant<int, 1>{}); break;
      case 2: tile(std::integral_constant<int, 2>{}); break;
      case 3: tile(std::integral_constant<int, 3>{}); break;
      case 4: tile(std::integral_constant<int, 4>{}); break;
      case 5: tile(std::integral_constant<int, 5>{}); break;
      case 6: tile(std::integral_constant<int, 6>{}); break;
      case 7: tile(std::integral_constant<int, 7>{}); break;
      default: tile(std::integral_constant<int, 8>{}); break;
    }
  }
}

template <int R>
void pv_rows_bf16(const float* p, int64_t n, const bf16* v, int64_t vst, int64_t dv, float* O) {
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

template <int R, typename T>
void pv_rows_any(const float* p, int64_t n, const T* v, int64_t vst, int64_t dv, float* O) {
  if constexpr (std::is_same_v<T, bf16>) pv_rows_bf16<R>(p, n, v, vst, dv, O);
  else pv_rows<R, T>(p, n, v, vst, dv, O);
}

// T: fp32, bf16 or int8 V.
template <typename T>
void pv_vec(const float* p, int64_t G, int64_t n, const T* v, int64_t vst, int64_t dv, float* O) {
  int64_t r = 0;
  for (; r + 4 <= G; r += 4) pv_rows_any<4>(p + r * kChunk, n, v, vst, dv, O + r * dv);
  if (G - r == 3) pv_rows_any<3>(p + r * kChunk, n, v, vst, dv, O + r * dv);
  if (G - r == 2) pv_rows_any<2>(p + r * kChunk, n, v, vst, dv, O + r * dv);
  if (G - r == 1) pv_rows_any<1>(p + r * kChunk, n, v, vst, dv, O + r * dv);
}

using mha_exp2::exp2_avx512;  // 2^x, shared with the flash kernels

std::pair<float, float> softmax_vec(float* s, int64_t n, float unit) {
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
    const __m512 dx = _mm512_mul_ps(_mm512_sub_ps(x, vm), _mm512_set1_ps(unit));
    const __mmask16 live = _mm512_mask_cmp_ps_mask(mk, dx, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_avx512(dx));
    _mm512_mask_storeu_ps(s + j, mk, e);
    sum = _mm512_add_ps(sum, e);
  }
  return {m, _mm512_reduce_add_ps(sum)};
}
#endif  // __AVX512F__

// q.k on AVX-512: qk_rows for fp32 q against fp32 or int8 K (a bf16 q with int8 K is widened
// once per split by the caller, split_item) and, with AVX512_BF16, bf16 against bf16; p.v:
// pv_vec (int8 V widened in registers, its v_scale already in p). Portable loops otherwise.
template <typename T, bool kVec, typename KV>
inline void qk(const T* q, int64_t G, int64_t dk, const KV* k, int64_t kst, int64_t n,
               float scale, float* scores) {
#ifdef __AVX512F__
  if constexpr (kVec && std::is_same_v<T, float>)  // fp32 or int8 K
    return qk_vec_rows(q, G, dk, k, kst, n, scale, scores);
  else if constexpr (kVec && std::is_same_v<T, KV>) {  // bf16
#ifdef __AVX512BF16__
    return qk_vec_rows(q, G, dk, k, kst, n, scale, scores);
#else
    return qk_vec(q, G, dk, k, kst, n, scale, scores);  // widened to fp32
#endif
  }
#endif
  qk_portable(q, G, dk, k, kst, n, scale, scores);
}

template <typename KV, bool kVec>
inline void pv(const float* p, int64_t G, int64_t n, const KV* v, int64_t vst, int64_t dv,
               float* O) {
#ifdef __AVX512F__
  if constexpr (kVec) return pv_vec(p, G, n, v, vst, dv, O);
#endif
  pv_portable(p, G, n, v, vst, dv, O);
}

template <bool kVec>
inline std::pair<float, float> softmax2(float* s, int64_t n, float unit) {
#ifdef __AVX512F__
  if constexpr (kVec) return softmax_vec(s, n, unit);
#endif
  return softmax_portable(s, n, unit);
}

}  // namespace
