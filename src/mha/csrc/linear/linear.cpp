// The module's projections (x W^T + b) on AVX-512 register tiles, forward and backward: fp32
// (mha::linear) and, where the CPU has AVX512_BF16, bf16 on vdpbf16ps (mha::linear_bf16, the
// section "bf16 operands" below).
//
// Shape legend: M rows of x (B * T), K input features, N output features, P = ceil(N / 64)
// column panels. x (M, K) with a contiguous last dim (any row stride), the weight W (N, K) in
// nn.Linear layout (any strides), bias (N,) or none; out (M, N) contiguous, in x's dtype.
//
// torch's fp32 matmul runs MKL's AVX2 path on AMD CPUs (~40 % of the FMA peak here); these are
// the 6 x 64 FMA tiles of the flash kernels (gemm_tiles.h). Each call first packs W^T into
// 64-column panels (P, K, 64) in a buffer of its own, as BLAS libraries pack B: O(N K) moves
// against the GEMM's O(M N K), and nothing derived from the weight outlives the call, so a
// weight changed by any means (in place, through .data, through numpy) is always read as it is.
// Work items are then (panel, 96-row block) pairs handed out by at::parallel_for; each item
// walks K in chunks of 128 so the panel's 128 x 64 slice (32 KB) stays in L1 while every 6-row
// tile of the block passes over it. Each output element is summed in the same order whatever
// the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common/gemm_tiles.h"
#include "linear/panels.h"

namespace mha_linear {
namespace {

using mha_panels::pack_panel_bf16;

constexpr int64_t kPanel = mha_panels::kPanel;  // output columns per packed panel
constexpr int64_t kRows = 96;     // rows of x per work item (16 tiles of 6)
constexpr int64_t kChunk = 128;   // K per pass over a row block (the panel slice stays in L1)

// C (M, N, row stride ldc) = init + A (M, K) B (K, N), on the tiles of gemm_tiles.h: items are
// (64-column panel, 96-row block) pairs over at::parallel_for, each walking K in chunks of 128
// so the panel's slice of B stays in L1 while the block's 6-row tiles pass over it. A(r, k) =
// a[r sam + k sak]; B row-major (ldb) or, when `packed`, panels [N / 64][K][64]. C starts as
// the bias broadcast over rows (bias != nullptr) or 0. Each output element is summed in the
// same order whatever the thread count.
void blocked_gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                  const float* b, int64_t ldb, bool packed, const float* bias, float* c,
                  int64_t ldc) {
  const int64_t panels = (N + kPanel - 1) / kPanel, blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, panels * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t % panels, m0 = (t / panels) * kRows, rows = std::min(kRows, M - m0);
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      float* cb = c + m0 * ldc + n0;  // (rows, cols) of C
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) cb[r * ldc + j] = bias ? bias[n0 + j] : 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {  // C += A[:, k0:k1] B[k0:k1, panel]
        const int64_t kc = std::min(kChunk, K - k0);
        const float* bb = packed ? b + (p * K + k0) * kPanel : b + k0 * ldb + n0;
        mha_gemm::gemm<float>(rows, cols, kc, a + m0 * sam + k0 * sak, sam, sak, bb,
                              packed ? kPanel : ldb, cb, ldc, true);
      }
    }
  });
}

void check_f32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "mha linear: ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}


// wp (P, K, 64) = W^T in 64-column panels, zero past N: wp[p][k][j] = W(64 p + j, k), with
// W(n, k) = w[n sn + k sk] (panels.h). On the calling thread: a second parallel region (a
// barrier more per call) cost more than the O(N K) moves it spread (see
// benchmarks/probes/linear.py).
void pack_panels(const float* w, int64_t N, int64_t K, int64_t sn, int64_t sk, float* wp) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < panels; ++p)
    mha_panels::pack_panel_f32(w, N, K, sn, sk, p, wp + p * K * kPanel);
}

// out (M, N) = x (M, K) W^T + bias, W (N, K) read through its strides and packed for this call.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias) {
  check_f32_cpu(x, "x");
  check_f32_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "mha linear: x must be 2-D (M, K) with a contiguous last dim, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.size(0) % 16 == 0,
              "mha linear: weight must be (N, K) with K=", K, " and N % 16 == 0, got ",
              w.sizes());
  const int64_t N = w.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    check_f32_cpu(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N,
                "mha linear: bias must be (N,) = (", N, ",), got ", bias->sizes());
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  at::Tensor wp = at::empty({(N + kPanel - 1) / kPanel, K, kPanel}, w.options());  // (P, K, 64)
  pack_panels(w.data_ptr<float>(), N, K, w.stride(0), w.stride(1), wp.data_ptr<float>());
  blocked_gemm(M, N, K, x.data_ptr<float>(), x.stride(0), 1, wp.data_ptr<float>(), 0, true,
               b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), N);
  return out;
}

// The gradients of out = x W^T + b without transposing anything: grad_x (M, K) = grad_out
// (M, N) W (N, K), W row-major; grad_w (N, K) = grad_out^T (N, M) x (M, K), grad_out read
// through its strides as A(n, m). K % 16 == 0 (the output columns of both).
std::tuple<at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad_out,
                                                   const at::Tensor& x, const at::Tensor& w,
                                                   bool need_x, bool need_w) {
  check_f32_cpu(grad_out, "grad_out");
  check_f32_cpu(x, "x");
  check_f32_cpu(w, "weight");
  TORCH_CHECK(grad_out.dim() == 2 && x.dim() == 2 && w.dim() == 2 &&
                  grad_out.size(0) == x.size(0) && grad_out.size(1) == w.size(0) &&
                  x.size(1) == w.size(1) && w.size(1) % 16 == 0,
              "mha linear backward: expected grad_out (M, N), x (M, K), weight (N, K) with "
              "K % 16 == 0, got ", grad_out.sizes(), ", ", x.sizes(), ", ", w.sizes());
  const at::Tensor g = grad_out.contiguous(), xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = g.size(0), N = g.size(1), K = xc.size(1);
  at::Tensor gx, gw;
  if (need_x) {
    gx = at::empty({M, K}, x.options());
    if (M > 0 && K > 0)
      blocked_gemm(M, K, N, g.data_ptr<float>(), N, 1, wc.data_ptr<float>(), K, false, nullptr,
                   gx.data_ptr<float>(), K);
  }
  if (need_w) {
    gw = at::empty({N, K}, w.options());
    if (N > 0 && K > 0)
      blocked_gemm(N, K, M, g.data_ptr<float>(), 1, N, xc.data_ptr<float>(), K, false, nullptr,
                   gw.data_ptr<float>(), K);
  }
  return {gx, gw};
}

#if defined(MHA_GEMM_BF16)
// ---------------------------------------------------------------------------- bf16 operands
// The same GEMM on vdpbf16ps: bf16 operands, products summed in fp32 (exact products of bf16
// values, fp32 sums as torch's bf16 GEMM makes them), each output rounded to bf16 once. K runs
// over pairs (K2 = K / 2, K even). The weight is packed inside the parallel region, one panel
// at a time by the thread that uses it (items run panel-major, so a thread's range of items
// covers a few panels, each packed once into its own buffer while it is hot in L2): the packing
// is spread over the threads without a second parallel region.

// out (M, N, bf16, row stride ldc) = bf16(A (M, 2 K2) W^T + bias): A(r, k) = a[r sam + k],
// W (N, 2 K2) rows sn apart (sn even, 4-byte aligned: pairs read as 32 bits), bias fp32 (N,)
// or null. Items are (panel, 96-row block) pairs, panel-major; each sums into an fp32 block
// (96 x 64, 24 KB) over K chunks of 128 pairs (the panel's 128 x 64 pair slice, 32 KB, stays
// in L1) and rounds it once. Each output is summed in the same order whatever the threads.
void blocked_gemm_bf16(int64_t M, int64_t N, int64_t K2, const uint16_t* a, int64_t sam,
                       const uint16_t* w, int64_t sn, const float* bias, uint16_t* out,
                       int64_t ldc) {
  const int64_t panels = (N + kPanel - 1) / kPanel, blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, panels * blocks, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float cb[kRows * kPanel];         // (rows, 64) fp32 sums of this item
    std::vector<uint16_t> wp(K2 * kPanel * 2);    // (K2, 64, 2) the current panel
    int64_t packed = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / blocks, m0 = (t % blocks) * kRows, rows = std::min(kRows, M - m0);
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      if (p != packed) pack_panel_bf16(w, N, K2, sn, p, wp.data()), packed = p;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) cb[r * kPanel + j] = bias ? bias[n0 + j] : 0.f;
      for (int64_t k0 = 0; k0 < K2; k0 += kChunk) {  // C += A[:, pairs k0:k1] W^T[k0:k1, panel]
        const int64_t kc = std::min(kChunk, K2 - k0);
        mha_gemm::gemm<uint16_t>(rows, cols, kc, a + m0 * sam + 2 * k0, sam, 0,
                                 wp.data() + k0 * kPanel * 2, kPanel, cb, kPanel, true);
      }
      for (int64_t r = 0; r < rows; ++r)  // one rounding per output
        for (int64_t j = 0; j < cols; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + r) * ldc + n0 + j),
                              mha_tiles::to_bf16(_mm512_loadu_ps(cb + r * kPanel + j)));
    }
  });
}

void check_bf16_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, "mha linear_bf16: ", name,
              " must be a bfloat16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* bits_mut(at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Rows of `t` (2-D) with a contiguous last dim, an even row stride and a 4-byte aligned start
// (its bf16 pairs can be read as 32 bits): t itself, or a contiguous copy.
at::Tensor pair_rows(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && (t.stride(0) % 2 == 0 || t.size(0) <= 1) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  return ok ? t : t.contiguous();
}

// out (M, N) bf16 = x (M, K) W^T + bias on the bf16 tiles: x with a contiguous last dim, K
// even, W (N, K) with N % 16 == 0 (copied when its rows are not pairs in place).
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias) {
  check_bf16_cpu(x, "x");
  check_bf16_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "mha linear_bf16: x must be 2-D (M, K) with a contiguous last dim and K even, got ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.size(0) % 16 == 0,
              "mha linear_bf16: weight must be (N, K) with K=", K, " and N % 16 == 0, got ",
              w.sizes());
  const int64_t N = w.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    check_bf16_cpu(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N,
                "mha linear_bf16: bias must be (N,) = (", N, ",), got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();  // exact: every bf16 is an fp32
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xp = pair_rows(x), wr = pair_rows(w);
  blocked_gemm_bf16(M, N, K / 2, bits(xp), xp.stride(0), bits(wr), wr.stride(0),
                    b.defined() ? b.data_ptr<float>() : nullptr, bits_mut(out), N);
  return out;
}

// The gradients of out = x W^T + b on the same tiles, each rounded to bf16 once:
// grad_x (M, K) = grad_out (M, N) W (N, K), with W^T (K, N) copied as the "weight";
// grad_w (N, K) = grad_out^T (N, M) x (M, K), with grad_out^T and x^T copied to rows of even
// length (M rounded up, zero-padded: the pairs run over M). N and K % 16 == 0. The copies are
// O(M N + M K + N K) against the products' O(M N K).
std::tuple<at::Tensor, at::Tensor> linear_bf16_backward(const at::Tensor& grad_out,
                                                        const at::Tensor& x, const at::Tensor& w,
                                                        bool need_x, bool need_w) {
  check_bf16_cpu(grad_out, "grad_out");
  check_bf16_cpu(x, "x");
  check_bf16_cpu(w, "weight");
  TORCH_CHECK(grad_out.dim() == 2 && x.dim() == 2 && w.dim() == 2 &&
                  grad_out.size(0) == x.size(0) && grad_out.size(1) == w.size(0) &&
                  x.size(1) == w.size(1) && w.size(1) % 16 == 0 && w.size(0) % 16 == 0,
              "mha linear_bf16 backward: expected grad_out (M, N), x (M, K), weight (N, K) with "
              "N, K % 16 == 0, got ", grad_out.sizes(), ", ", x.sizes(), ", ", w.sizes());
  const at::Tensor g = grad_out.contiguous();
  const int64_t M = g.size(0), N = g.size(1), K = x.size(1);
  at::Tensor gx, gw;
  if (need_x) gx = linear_bf16(g, w.t().contiguous(), std::nullopt);  // (M, N) x (K, N)^T
  if (need_w) {
    gw = at::zeros({N, K}, w.options());
    if (M > 0) {
      const int64_t Mp = (M + 1) / 2 * 2;
      at::Tensor gt = at::zeros({N, Mp}, g.options());  // (N, Mp) = grad_out^T, zero-padded
      gt.narrow(1, 0, M).copy_(g.t());
      at::Tensor xt = at::zeros({K, Mp}, x.options());  // (K, Mp) = x^T, zero-padded
      xt.narrow(1, 0, M).copy_(x.t());
      blocked_gemm_bf16(N, K, Mp / 2, bits(gt), Mp, bits(xt), Mp, nullptr, bits_mut(gw), K);
    }
  }
  return {gx, gw};
}
#endif  // MHA_GEMM_BF16

// Whether the bf16 tiles (vdpbf16ps) are compiled in: mha::linear_bf16 exists.
bool linear_bf16_tiles() {
#if defined(MHA_GEMM_BF16)
  return true;
#else
  return false;
#endif
}

// Whether the tiles are the AVX-512 ones (else the portable loops of gemm_tiles.h).
bool linear_vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace mha_linear

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_backward(Tensor grad_out, Tensor x, Tensor w, bool need_x, bool need_w) -> "
        "(Tensor, Tensor)");
  m.def("linear_vectorized() -> bool", &mha_linear::linear_vectorized);
  m.def("linear_bf16_tiles() -> bool", &mha_linear::linear_bf16_tiles);
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_bf16_backward(Tensor grad_out, Tensor x, Tensor w, bool need_x, bool need_w) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("linear", &mha_linear::linear);
  m.impl("linear_backward", &mha_linear::linear_backward);
#if defined(MHA_GEMM_BF16)
  m.impl("linear_bf16", &mha_linear::linear_bf16);
  m.impl("linear_bf16_backward", &mha_linear::linear_bf16_backward);
#endif
}
