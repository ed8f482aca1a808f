// 2^x in fp32 for every AVX-512 softmax: the flash forward (fp32 softmax, small path, alpha),
// the fused backward, which recomputes P with it (one polynomial, so the backward's P is the
// forward's P; the forward's one-pass softmax evaluates it through exp2_ftz_avx512, without the
// clamp), and the decode kernel; and the same polynomial in plain float arithmetic
// (exp2_scalar) for the score variants' tanh on any target. Header-only.
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
// 2^x for threads running with flush-to-zero (FlushToZero below): the same polynomial on
// f = x - round(x) (one vreduceps), 2^round(x) by a vscalefps that also zeroes the lanes outside
// `keep`. No clamp: results below the smallest normal float flush to 0 (they take no
// microcode assist with FTZ set). Same accuracy as exp2_avx512 down to x = -126; 0 below.
// NaN in a kept lane gives NaN (vreduceps and vscalefps pass it through).
__attribute__((always_inline)) inline __m512 exp2_ftz_avx512(__m512 x, __mmask16 keep) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_scalef_ps(keep, exp2_poly(f), _mm512_sub_ps(x, f));
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
