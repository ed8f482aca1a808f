// Weight-stationary projections for a few rows (decode): out (M, N) = x (M, K) W^T + bias, with
// W packed once, in bf16 or int8, into the layout its inner loop streams.
//
// Shape legend: M rows of x (1..~16 tokens), K input features, N output features, P =
// ceil(N / 32) panels of 32 output columns, Kp = K rounded up to even (k pairs). Packed weights
// (built by mha/ops/gemv.py, never here):
//   bf16: (P, Kp / 2, 32, 2)  — per k pair, 32 columns x (k even, k odd): 128 bytes
//   int8: (P, Kp / 2, 2, 32)  — per k pair, (k even, k odd) x 32 columns: 64 bytes, and one
//         fp32 scale per output column, (P * 32,): W(n, k) = q(n, k) * scale(n)
// zero past N and past K. x (M, K) fp32 with a contiguous last dim; bias (N,) fp32 or none;
// out (M, N) fp32, contiguous.
//
// With M ~ 1 a projection reads each weight once and does 1 multiply-add with it: the time is
// the weight's bytes over the read bandwidth. So the weight is stored narrow (bf16: half of
// fp32's bytes, int8: a quarter) and in exactly the order it is consumed: a thread walks its
// panels front to back, one sequential stream. In registers each weight is widened to fp32
// exactly (bf16: a shift or a mask of the 32-bit pair; int8: sign-extend and convert) and
// multiplied by the fp32 activation with an FMA, so the products are exact and only the fp32
// sums round (no rounding of x to bf16, unlike vdpbf16ps). k even and k odd sum into separate
// accumulators (two independent FMA chains per register) and meet at the end. Panels are handed
// to threads by at::parallel_for; each output element is summed in the same order whatever the
// thread count (weights under 1 MB run on the calling thread). Rows of x are taken 4 at a time
// over the same panel (it stays in L1/L2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mha_gemv {
namespace {

constexpr int64_t kCols = 32;  // output columns per panel
constexpr int64_t kRowTile = 4;  // rows of x per pass over a panel
constexpr int64_t kParallelBytes = 1 << 20;  // weights below this run on the calling thread
constexpr int64_t kTaskBytes = 256 << 10;  // weights per parallel task, at least

enum class Kind { kBf16, kInt8 };

// The weights of panel p at k pair kp, as floats: w[parity][j] = W(32 p + j, 2 kp + parity).
// Portable path (and the reference for the AVX-512 one).
inline void pair_scalar(Kind kind, const void* packed, int64_t Kp, int64_t p, int64_t kp,
                        float w[2][kCols]) {
  if (kind == Kind::kBf16) {
    const uint16_t* b = static_cast<const uint16_t*>(packed) + ((p * (Kp / 2) + kp) * kCols) * 2;
    for (int64_t j = 0; j < kCols; ++j)
      for (int par = 0; par < 2; ++par) {
        const uint32_t bits = uint32_t(b[j * 2 + par]) << 16;
        std::memcpy(&w[par][j], &bits, 4);
      }
  } else {
    const int8_t* q = static_cast<const int8_t*>(packed) + ((p * (Kp / 2) + kp) * 2) * kCols;
    for (int par = 0; par < 2; ++par)
      for (int64_t j = 0; j < kCols; ++j) w[par][j] = float(q[par * kCols + j]);
  }
}

// acc[r][j] = sum over k of x(m0 + r, k) W(32 p + j, k), rows r < rows, portable loops.
void panel_scalar(Kind kind, const void* packed, int64_t K, int64_t Kp, int64_t p,
                  const float* x, int64_t sx, int64_t m0, int64_t rows, float acc[][kCols]) {
  float even[kRowTile][kCols] = {}, odd[kRowTile][kCols] = {};
  float w[2][kCols];
  for (int64_t kp = 0; kp < Kp / 2; ++kp) {
    pair_scalar(kind, packed, Kp, p, kp, w);
    const bool has_odd = 2 * kp + 1 < K;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + (m0 + r) * sx;
      for (int64_t j = 0; j < kCols; ++j) {
        even[r][j] += w[0][j] * xr[2 * kp];
        if (has_odd) odd[r][j] += w[1][j] * xr[2 * kp + 1];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kCols; ++j) acc[r][j] = even[r][j] + odd[r][j];
}

#if defined(__AVX512F__)
// The AVX-512 twin of panel_scalar for exactly R rows (same sums, same order per element).
template <Kind kind, int R>
void panel_avx512(const void* packed, int64_t K, int64_t Kp, int64_t p, const float* x,
                  int64_t sx, int64_t m0, float acc[][kCols]) {
  __m512 ev[R][2], od[R][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) ev[r][c] = od[r][c] = _mm512_setzero_ps();
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * sx;
  const int64_t pairs = K / 2;  // full pairs; an odd K leaves one even-only pair
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  auto widen = [&](int64_t kp, __m512 e[2], __m512 o[2]) {
    if constexpr (kind == Kind::kBf16) {
      const uint16_t* b = static_cast<const uint16_t*>(packed) + (p * (Kp / 2) + kp) * kCols * 2;
      for (int c = 0; c < 2; ++c) {  // 16 (even, odd) bf16 pairs = 16 columns
        const __m512i v = _mm512_loadu_si512(b + c * 32);
        e[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        o[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      }
    } else {
      const int8_t* q = static_cast<const int8_t*>(packed) + (p * (Kp / 2) + kp) * 2 * kCols;
      for (int c = 0; c < 2; ++c) {
        e[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 16))));
        o[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kCols + c * 16))));
      }
    }
  };
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512 e[2], o[2];
    widen(kp, e, o);
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(xr[r][2 * kp]), xo = _mm512_set1_ps(xr[r][2 * kp + 1]);
      for (int c = 0; c < 2; ++c) {
        ev[r][c] = _mm512_fmadd_ps(e[c], xe, ev[r][c]);
        od[r][c] = _mm512_fmadd_ps(o[c], xo, od[r][c]);
      }
    }
  }
  if (K % 2) {  // the last k has no odd partner (its packed slot is zero, x has no element)
    __m512 e[2], o[2];
    widen(pairs, e, o);
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(xr[r][K - 1]);
      for (int c = 0; c < 2; ++c) ev[r][c] = _mm512_fmadd_ps(e[c], xe, ev[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c)
      _mm512_storeu_ps(acc[r] + c * 16, _mm512_add_ps(ev[r][c], od[r][c]));
}

template <Kind kind>
void panel_rows(const void* packed, int64_t K, int64_t Kp, int64_t p, const float* x,
                int64_t sx, int64_t m0, int64_t rows, float acc[][kCols]) {
  switch (rows) {
    case 1: return panel_avx512<kind, 1>(packed, K, Kp, p, x, sx, m0, acc);
    case 2: return panel_avx512<kind, 2>(packed, K, Kp, p, x, sx, m0, acc);
    case 3: return panel_avx512<kind, 3>(packed, K, Kp, p, x, sx, m0, acc);
    default: return panel_avx512<kind, 4>(packed, K, Kp, p, x, sx, m0, acc);
  }
}
#endif

// acc rows r < rows of panel p: the vector loop where the CPU has AVX-512, else the portable one.
void panel(Kind kind, const void* packed, int64_t K, int64_t Kp, int64_t p, const float* x,
           int64_t sx, int64_t m0, int64_t rows, float acc[][kCols]) {
#if defined(__AVX512F__)
  if (kind == Kind::kBf16)
    panel_rows<Kind::kBf16>(packed, K, Kp, p, x, sx, m0, rows, acc);
  else
    panel_rows<Kind::kInt8>(packed, K, Kp, p, x, sx, m0, rows, acc);
#else
  panel_scalar(kind, packed, K, Kp, p, x, sx, m0, rows, acc);
#endif
}

// out (M, N) = x W^T (* scale) + bias over the panels, threads over panels.
void run(Kind kind, const void* packed, const float* scale, int64_t M, int64_t N, int64_t K,
         const float* x, int64_t sx, const float* bias, float* out) {
  const int64_t P = (N + kCols - 1) / kCols, Kp = K + K % 2;
  // Threads only for a weight of kParallelBytes or more (SmolLM2: the MLP and the lm_head; its
  // q/k/v/o weights, 0.2-0.7 MB, stay on the calling thread), in tasks of >= kTaskBytes: a
  // parallel region costs microseconds to fork and join on idle cores. SmolLM2's 8k decode step
  // on the idle epyc-zen5-avx512 (docs/llm.md): 1 MB against 8 MB (the lm_head only) 0.93x the time,
  // 256 KB within noise of 1 MB. On cores shared with other processes a region waits at its
  // join for a worker that is not running, and 1 MB lost to 8 MB there (docs/llm.md).
  const int64_t bytes = Kp * kCols * (kind == Kind::kBf16 ? 2 : 1);  // per panel
  const int64_t grain = bytes * P < kParallelBytes
                            ? P + 1
                            : std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(bytes, 1));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float acc[kRowTile][kCols];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kCols, cols = std::min(kCols, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, M - m0);
        panel(kind, packed, K, Kp, p, x, sx, m0, rows, acc);
        for (int64_t r = 0; r < rows; ++r) {
          float* o = out + (m0 + r) * N + n0;
          for (int64_t j = 0; j < cols; ++j) {
            float v = scale ? acc[r][j] * scale[n0 + j] : acc[r][j];
            o[j] = bias ? v + bias[n0 + j] : v;
          }
        }
      }
    }
  });
}

// The op: x (M, K) fp32 or bf16 (contiguous last dim), packed as in the header, scale (P * 32,)
// fp32 for int8 (none for bf16), bias (N,) or none -> (M, N) in x's dtype (summed in fp32).
// Shapes were checked by the Python side (mha/ops/gemv.py); these checks guard the memory.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& scale, int64_t N, int64_t K,
                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat ||
                                      x.scalar_type() == at::kBFloat16),
              "mha gemv: x must be a float32 or bfloat16 CPU tensor, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "mha gemv: x must be (M, K) with K=", K, ", got ",
              x.sizes());
  const int64_t P = (N + kCols - 1) / kCols, Kp = K + K % 2;
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(packed.is_contiguous() && (int8 || packed.scalar_type() == at::kBFloat16) &&
                  packed.numel() == P * Kp * kCols,
              "mha gemv: packed must be a contiguous bf16 or int8 tensor of ", P * Kp * kCols,
              " elements, got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(int8 == scale.has_value(), "mha gemv: scale is needed with int8 weights only");
  if (int8)
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == P * kCols,
                "mha gemv: scale must be a contiguous float32 (", P * kCols, ",), got ",
                scale->sizes());
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "mha gemv: bias must be a contiguous float32 (", N, ",), got ", bias->sizes());
  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  if (xf.stride(1) != 1) xf = xf.contiguous();
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  if (M > 0 && N > 0) {
    if (K == 0)
      out.copy_(bias.has_value() ? bias->expand({M, N}) : at::zeros({M, N}, xf.options()));
    else
      run(int8 ? Kind::kInt8 : Kind::kBf16, packed.data_ptr(),
          int8 ? scale->data_ptr<float>() : nullptr, M, N, K, xf.data_ptr<float>(),
          xf.stride(0), bias.has_value() ? bias->data_ptr<float>() : nullptr,
          out.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Whether the panels run the AVX-512 loop (else the portable one).
bool gemv_vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace mha_gemv

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("gemv(Tensor x, Tensor packed, Tensor? scale, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_vectorized() -> bool", &mha_gemv::gemv_vectorized);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) { m.impl("gemv", &mha_gemv::gemv); }
