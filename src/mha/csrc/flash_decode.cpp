// Flash-decoding on the CPU: a few queries (Tq <= 16) against a long K/V cache.
//
// Shape legend: B batch, h query heads, h_kv key/value heads, g = h / h_kv (query heads per
// K/V head), Tq query length, Tk key length, d_k / d_v head dims, G = g * Tq (the query rows
// that share one K/V head), S = ceil(Tk / kChunk) key splits.
//
//   out[b, head, i] = softmax_j(q[b, head, i] . k[b, head / g, j] * scale) v[b, head / g, j]
//
// Work is split into items (b, kv head, split): each item reads its chunk of K and V exactly
// once for all G query rows of the group (GQA without repeating K/V), and leaves an
// unnormalized partial output with its running max m and sum l (base-2 log-sum-exp parts).
// A second pass merges the S partials of every query row in split order:
//   M = max_s m_s,  L = sum_s l_s 2^(m_s - M),  out = sum_s O_s 2^(m_s - M) / L.
// The split size is a constant, so the result does not depend on the number of threads
// (deterministic, bitwise). All arithmetic accumulates in fp32; bf16 inputs use AVX512_BF16
// dot products for q.k and fp32 FMAs for p.v.
//
// Masks (True = may attend; all optional, combined with AND):
//   causal       query i sees key j iff j <= i + Tk - Tq (bottom-right aligned)
//   key_lengths  (B,) int64: keys j >= key_lengths[b] are padding and are never read
//   mask         bool, 4-D, broadcastable to (B, h, Tq, Tk) (size-1 dims are broadcast)
// Query rows that may attend no key return zeros.
//
// Two ops: mha::flash_decode (vectorized under __AVX512F__ / __AVX512BF16__, portable C++
// otherwise) and mha::flash_decode_portable (always the portable loops; for tests).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 256;  // keys per split (a constant: results are thread-independent)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using bf16 = c10::BFloat16;

struct Problem {
  int64_t B, h, h_kv, g, Tq, Tk, dk, dv, G, S;
  const void* q;  // contiguous (B, h, Tq, d_k)
  const void* k;  // (B, h_kv, Tk, d_k), last dim contiguous
  const void* v;  // (B, h_kv, Tk, d_v), last dim contiguous
  int64_t ksb, ksh, kst, vsb, vsh, vst;
  const int64_t* klen;  // (B,) or nullptr
  const bool* mask;     // broadcast strides below, or nullptr
  int64_t msb, msh, msq, msk;
  bool causal;
  float scale_log2;  // scale * log2(e): scores are kept in base 2
};

// ------------------------------------------------------------------ portable building blocks
inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }

template <typename T>
float dot_portable(const T* a, const T* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += to_f(a[i]) * to_f(b[i]);
  return s;
}

template <typename T>
void axpy_portable(float* acc, float p, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += p * to_f(x[i]);
}

// exp2 of n scores minus m, in place; returns their sum. Entries at -inf become 0.
float exp2_sum_portable(float* s, int64_t n, float m) {
  float l = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = s[j] == kNegInf ? 0.f : std::exp2(s[j] - m);
    l += s[j];
  }
  return l;
}

// ------------------------------------------------------------------ AVX-512 building blocks
#ifdef __AVX512F__
inline __mmask16 tail16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline float dot_vec(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    const __mmask16 mk = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail16(n - i);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, a + i), _mm512_maskz_loadu_ps(mk, b + i),
                           acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// 16 bf16 values -> 16 fp32 (exact: bf16 is the top half of an fp32).
inline __m512 load_bf16_as_f32(const bf16* p, __mmask16 mk) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mk, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline float dot_vec(const bf16* a, const bf16* b, int64_t n) {
#ifdef __AVX512BF16__
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i),
                            (__m512bh)_mm512_loadu_si512(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32),
                            (__m512bh)_mm512_loadu_si512(b + i + 32));
  }
  for (; i < n; i += 32) {
    const int64_t r = std::min<int64_t>(32, n - i);
    const __mmask32 mk = r == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << r) - 1ull);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(mk, a + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(mk, b + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail16(n - i);
    acc = _mm512_fmadd_ps(load_bf16_as_f32(a + i, mk), load_bf16_as_f32(b + i, mk), acc);
  }
  return _mm512_reduce_add_ps(acc);
#endif
}

inline __m512 load_f32(const float* p, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, p); }
inline __m512 load_f32(const bf16* p, __mmask16 mk) { return load_bf16_as_f32(p, mk); }

// acc[0:n] += p * x[0:n] for `rows` accumulators sharing one x row (x loaded once per block).
template <typename T>
inline void axpy_vec(float* acc, float p, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail16(n - i);
    const __m512 a = _mm512_maskz_loadu_ps(mk, acc + i);
    _mm512_mask_storeu_ps(acc + i, mk, _mm512_fmadd_ps(_mm512_set1_ps(p), load_f32(x + i, mk), a));
  }
}

// 2^x for x <= 0: x = n + r with r in [-1/2, 1/2]; 2^r by its degree-7 Taylor polynomial
// (relative error < 1e-8 before rounding), then scaled by 2^n.
inline __m512 exp2_vec(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);  // ln2^7 / 7!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428441e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

float exp2_sum_vec(float* s, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(kNegInf);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail16(n - j);
    const __m512 x = _mm512_maskz_loadu_ps(mk, s + j);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(mk, x, ninf, _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp2_vec(_mm512_sub_ps(x, vm)));
    _mm512_mask_storeu_ps(s + j, mk, p);
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif  // __AVX512F__

template <typename T, bool kVec>
inline float dot(const T* a, const T* b, int64_t n) {
#ifdef __AVX512F__
  if constexpr (kVec) return dot_vec(a, b, n);
#endif
  return dot_portable(a, b, n);
}

template <typename T, bool kVec>
inline void axpy(float* acc, float p, const T* x, int64_t n) {
#ifdef __AVX512F__
  if constexpr (kVec) return axpy_vec(acc, p, x, n);
#endif
  axpy_portable(acc, p, x, n);
}

template <bool kVec>
inline float exp2_sum(float* s, int64_t n, float m) {
#ifdef __AVX512F__
  if constexpr (kVec) return exp2_sum_vec(s, n, m);
#endif
  return exp2_sum_portable(s, n, m);
}

// ------------------------------------------------------------------ the two passes
// One item: keys [j0, j1) of K/V head kvh in batch row b, for the G query rows of its group.
// Writes O (G, d_v) unnormalized, m (G,) and l (G,) for this split. scores: G * kChunk floats.
template <typename T, bool kVec>
void split_item(const Problem& P, int64_t b, int64_t kvh, int64_t j0, int64_t j1, float* scores,
                float* O, float* m, float* l) {
  const int64_t G = P.G, n = j1 - j0;
  std::fill(O, O + G * P.dv, 0.f);
  if (n <= 0) {
    std::fill(m, m + G, kNegInf);
    std::fill(l, l + G, 0.f);
    return;
  }
  const T* q = static_cast<const T*>(P.q) + (b * P.h + kvh * P.g) * P.Tq * P.dk;  // (G, d_k)
  const T* k = static_cast<const T*>(P.k) + b * P.ksb + kvh * P.ksh;
  const T* v = static_cast<const T*>(P.v) + b * P.vsb + kvh * P.vsh;
  // scores (G, n) = q (G, d_k) @ k[j0:j1]^T (d_k, n): each K row is read once for all G rows.
  for (int64_t j = j0; j < j1; ++j) {
    const T* kj = k + j * P.kst;
    for (int64_t r = 0; r < G; ++r)
      scores[r * kChunk + (j - j0)] = dot<T, kVec>(q + r * P.dk, kj, P.dk) * P.scale_log2;
  }
  // masks -> -inf; then per row max, exp2, sum
  for (int64_t r = 0; r < G; ++r) {
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
    float mx = kNegInf;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    m[r] = mx;
    l[r] = mx == kNegInf ? 0.f : exp2_sum<kVec>(s, n, mx);
    if (mx == kNegInf) std::fill(s, s + n, 0.f);
  }
  // O (G, d_v) = p (G, n) @ v[j0:j1] (n, d_v): each V row is read once for all G rows.
  for (int64_t j = j0; j < j1; ++j) {
    const T* vj = v + j * P.vst;
    for (int64_t r = 0; r < G; ++r) {
      const float p = scores[r * kChunk + (j - j0)];
      if (p != 0.f) axpy<T, kVec>(O + r * P.dv, p, vj, P.dv);
    }
  }
}

template <typename T, bool kVec>
at::Tensor run(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
               const c10::optional<at::Tensor>& key_lengths, const c10::optional<at::Tensor>& mask,
               double scale, bool causal) {
  const at::Tensor q = q_in.contiguous();  // (B, h, Tq, d_k): small
  Problem P{};
  P.B = q.size(0), P.h = q.size(1), P.Tq = q.size(2), P.dk = q.size(3);
  P.h_kv = k.size(1), P.Tk = k.size(2), P.dv = v.size(3);
  P.g = P.h / P.h_kv, P.G = P.g * P.Tq, P.S = (P.Tk + kChunk - 1) / kChunk;
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
  P.scale_log2 = static_cast<float>(scale) * kLog2e;

  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor O = at::empty({P.B, P.h_kv, P.S, P.G, P.dv}, f32);  // partial outputs
  at::Tensor M = at::empty({P.B, P.h_kv, P.S, P.G}, f32);        // partial maxima (base 2)
  at::Tensor L = at::empty({P.B, P.h_kv, P.S, P.G}, f32);        // partial sums
  float *Op = O.data_ptr<float>(), *Mp = M.data_ptr<float>(), *Lp = L.data_ptr<float>();

  at::parallel_for(0, P.B * P.h_kv * P.S, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(P.G * kChunk);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t s = it % P.S, bh = it / P.S, b = bh / P.h_kv, kvh = bh % P.h_kv;
      const int64_t len = P.klen ? std::min(P.klen[b], P.Tk) : P.Tk;
      const int64_t j0 = s * kChunk, j1 = std::min(j0 + kChunk, len);
      split_item<T, kVec>(P, b, kvh, j0, j1, scores.data(), Op + it * P.G * P.dv,
                          Mp + it * P.G, Lp + it * P.G);
    }
  });

  at::Tensor out = at::empty({P.B, P.h, P.Tq, P.dv}, q.options());  // (B, h, Tq, d_v)
  T* outp = out.data_ptr<T>();
  at::parallel_for(0, P.B * P.h_kv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(P.dv);
    for (int64_t bh = lo; bh < hi; ++bh) {
      for (int64_t r = 0; r < P.G; ++r) {
        float Mx = kNegInf;
        for (int64_t s = 0; s < P.S; ++s) Mx = std::max(Mx, Mp[(bh * P.S + s) * P.G + r]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float Ls = 0.f;
        if (Mx != kNegInf) {
          for (int64_t s = 0; s < P.S; ++s) {
            const int64_t at_ = (bh * P.S + s) * P.G + r;
            if (Lp[at_] == 0.f) continue;
            const float w = std::exp2(Mp[at_] - Mx);
            Ls += Lp[at_] * w;
            const float* o = Op + at_ * P.dv;
            for (int64_t c = 0; c < P.dv; ++c) acc[c] += w * o[c];
          }
        }
        const float inv = Ls > 0.f ? 1.f / Ls : 0.f;
        // row r of group bh is (head = kvh * g + r / Tq, i = r % Tq): contiguous in out.
        T* dst = outp + (bh * P.G + r) * P.dv;
        for (int64_t c = 0; c < P.dv; ++c) dst[c] = static_cast<T>(acc[c] * inv);
      }
    }
  });
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
