// 2^x in fp32 for every AVX-512 softmax: the flash forward (two-pass softmax, small path,
// alpha), the fused backward, which recomputes P with it, and the decode kernel; the forward's
// one-pass softmax (under flush-to-zero) takes the table form exp2_ftz_avx512, within one ulp
// of it; and the polynomial in plain float arithmetic (exp2_scalar) for the score variants'
// tanh on any target. Header-only.
#pragma once

#include <cstdint>
#include <cstring>

namespace mha_exp2 {

// 2^f on [-1/2, 1/2]: the degree-7 Taylor polynomial of e^(f ln 2), coefficients ln2^k / k!
// (truncation error < 1e-8 relative); c0 = 1 exactly. Evaluated in fp32 with FMA, 2^x over
// [-125, 0] is within 0.83 ulp of the exact value (a degree-6 minimax fit: 0.91 ulp).
constexpr float kExp2C1 = 6.9314718055994531e-01f, kExp2C2 = 2.4022650695910071e-01f,
                kExp2C3 = 5.5504108664821580e-02f, kExp2C4 = 9.6181291076284772e-03f,
                kExp2C5 = 1.3333558146428441e-03f, kExp2C6 = 1.5403530393381606e-04f,
                kExp2C7 = 1.5252733804059841e-05f;

// 2^x for x <= 0 in plain float arithmetic (the same polynomial, selects the vectorizer turns
// into blends, given -fno-trapping-math): x clamped at -126 (2^-126, the smallest normal
// float; -inf gives it too, below fp32's resolution next to any term >= 2^-102), NaN gives
// NaN (it is converted as 0 and added back at the end).
inline float exp2_scalar(float x) {
  float xc = x < -126.f ? -126.f : x;
  xc = xc == xc ? xc : 0.f;                  // NaN: 0 (no float -> int conversion of NaN)
  const int32_t k = int32_t(0.5f - xc);      // round(-xc), xc in [-126, 0]
  const float f = xc + float(k);             // [-1/2, 1/2]
  float y = kExp2C7;
  y = y * f + kExp2C6;
  y = y * f + kExp2C5;
  y = y * f + kExp2C4;
  y = y * f + kExp2C3;
  y = y * f + kExp2C2;
  y = y * f + kExp2C1;
  y = y * f + 1.f;
  const uint32_t bits = (127u - uint32_t(k)) << 23;  // 2^-k by its exponent bits
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n + (x == x ? 0.f : x);
}

}  // namespace mha_exp2

#if defined(__AVX512F__)
#include <immintrin.h>

namespace mha_exp2 {

// 2^f for f in [-1/2, 1/2] (Horner).
__attribute__((always_inline)) inline __m512 exp2_poly(__m512 f) {
  __m512 y = _mm512_set1_ps(kExp2C7);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2C6));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2C5));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2C4));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2C3));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2C2));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2C1));
  return _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
}

// 2^x for x <= 0 (or -inf): round to n, polynomial on f = x - n, scale by 2^n. Inputs below
// -125 give exactly 0 (true value < 3e-38): results stay normal numbers, because an underflowing
// vscalefps takes a slow microcode assist on Intel cores (measured: it dominated the softmax
// whenever masked or far-below-max scores were present). NaN gives NaN: the lanes kept are those
// not below -125 (unordered compare), and vmaxps returns its second operand, x, when x is NaN.
__attribute__((always_inline)) inline __m512 exp2_avx512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-125.f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(exp2_poly(_mm512_sub_ps(x, n)), n));
}

#if defined(__AVX512DQ__)
// 2^x for threads running with flush-to-zero (FlushToZero below), the forward's one-pass
// softmax: x = k/32 + f, with k = round(32 x) from one add of 1.5 * 2^18 (whose ulp is 1/32:
// k lands in the low mantissa bits), 2^((k mod 32)/32) from a 32-entry table (one vpermt2ps),
// 2^f on [-1/64, 1/64] by a degree-3 Taylor polynomial (truncation 6e-10), 2^floor(k/32) by
// a vscalefps that also zeroes the lanes outside `keep`. Four multiply-adds instead of the
// degree-7 polynomial's seven and a vreduceps: ~1 % of the whole fp32 forward on Zen 5
// (benchmarks/probes/flash_ab.py). Max relative error 1.1e-7 over [-126, 16], under one ulp
// (exp2_avx512: 0.83 ulp). No clamp: every finite x below 2^22 gives what the clamped form
// gives (0 below -126, flushed: no microcode assist with FTZ set; +inf above 128; the same
// bits within [-150, 200]), but a finite x from 2^22 on may give -inf (just below a power of
// two, where f is far off), and +-inf or NaN inputs are left to the hardware. The one-pass
// softmax's fast path takes it so (its sums then leave [0, limit] and the row takes the slow
// path, lazy_sums_ok): each clamp instruction cost ~0.5 % of the fp32 forward on Zen 5.
__attribute__((always_inline)) inline __m512 exp2_ftz_unclamped_avx512(__m512 x, __mmask16 keep) {
  const __m512 tlo = _mm512_castsi512_ps(_mm512_setr_epi32(
      0x3f800000, 0x3f82cd87, 0x3f85aac3, 0x3f88980f, 0x3f8b95c2, 0x3f8ea43a, 0x3f91c3d3,
      0x3f94f4f0, 0x3f9837f0, 0x3f9b8d3a, 0x3f9ef532, 0x3fa27043, 0x3fa5fed7, 0x3fa9a15b,
      0x3fad583f, 0x3fb123f6));
  const __m512 thi = _mm512_castsi512_ps(_mm512_setr_epi32(
      0x3fb504f3, 0x3fb8fbaf, 0x3fbd08a4, 0x3fc12c4d, 0x3fc5672a, 0x3fc9b9be, 0x3fce248c,
      0x3fd2a81e, 0x3fd744fd, 0x3fdbfbb8, 0x3fe0ccdf, 0x3fe5b907, 0x3feac0c7, 0x3fefe4ba,
      0x3ff5257d, 0x3ffa83b3));
  const __m512 magic = _mm512_set1_ps(393216.f);  // 1.5 * 2^18: its ulp is 1/32
  const __m512 y = _mm512_add_ps(x, magic);   // x rounded to 1/32, k = 32 x in the low bits
  const __m512 xi = _mm512_sub_ps(y, magic);  // k / 32
  const __m512 f = _mm512_sub_ps(x, xi);      // [-1/64, 1/64]
  const __m512 t = _mm512_permutex2var_ps(tlo, _mm512_castps_si512(y), thi);  // 2^((k mod 32)/32)
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(kExp2C3), f, _mm512_set1_ps(kExp2C2));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(kExp2C1));
  r = _mm512_mul_ps(r, f);  // 2^f - 1
  return _mm512_maskz_scalef_ps(keep, _mm512_fmadd_ps(t, r, t), xi);  // times 2^floor(k/32)
}

// exp2_ftz_unclamped_avx512 of x clamped to [-150, 200] (NaN kept): -inf gives 0, x above 128
// +inf, NaN NaN; within [-150, 200] the same bits.
__attribute__((always_inline)) inline __m512 exp2_ftz_avx512(__m512 x, __mmask16 keep) {
  x = _mm512_max_ps(_mm512_set1_ps(-150.f), _mm512_min_ps(_mm512_set1_ps(200.f), x));
  return exp2_ftz_unclamped_avx512(x, keep);
}
#endif

// Flush-to-zero for this thread while alive (the previous MXCSR restored after, also on an
// exception): the bf16 kernels' one-pass softmax (exp2 without a clamp) then gets 0 for results
// below the smallest normal float instead of a slow microcode assist per underflowing vscalefps
// on Intel cores. The AMX tile products flush denormals anyway (AMX-BF16 treats them as zero).
class FlushToZero {
 public:
  explicit FlushToZero(bool on) : saved_(_mm_getcsr()), on_(on) {
    if (on_) _mm_setcsr(saved_ | kFtz);
  }
  ~FlushToZero() {
    if (on_) _mm_setcsr(saved_);
  }
  FlushToZero(const FlushToZero&) = delete;
  FlushToZero& operator=(const FlushToZero&) = delete;

 private:
  static constexpr unsigned kFtz = 0x8000;
  unsigned saved_;
  bool on_;
};

}  // namespace mha_exp2

#endif  // __AVX512F__
