// The module's projections (x W^T + b) in fp32 on AVX-512 register tiles, for inference.
//
// Shape legend: M rows of x (B * T), K input features, N output features, P = ceil(N / 64)
// column panels. x (M, K) with a contiguous last dim (any row stride), the weight pre-packed by
// mha/linear.py as panels wp (P, K, 64) (W^T, 64 output columns per panel, zero past N), bias
// (N,) or none; out (M, N) contiguous, fp32.
//
// torch's fp32 matmul runs MKL's AVX2 path on AMD CPUs (~40 % of the FMA peak here); these are
// the 6 x 64 FMA tiles of the flash kernels (gemm_tiles.h). Work items are (panel, 96-row
// block) pairs handed out by at::parallel_for; each item walks K in chunks of 128 so the
// panel's 128 x 64 slice (32 KB) stays in L1 while every 6-row tile of the block passes over
// it. Each output element is summed in the same order whatever the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "gemm_tiles.h"

namespace mha_linear {
namespace {

constexpr int64_t kPanel = 64;    // output columns per packed panel
constexpr int64_t kRows = 96;     // rows of x per work item (16 tiles of 6)
constexpr int64_t kChunk = 128;   // K per pass over a row block (the panel slice stays in L1)

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& wp,
                         const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "mha linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat,
              "mha linear: float32 only, got x ", x.scalar_type(), " and weight ",
              wp.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "mha linear: x must be 2-D (M, K) with a contiguous last dim, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(wp.dim() == 3 && wp.size(1) == K && wp.size(2) == kPanel && wp.is_contiguous() &&
                  wp.size(0) * kPanel >= N && N > (wp.size(0) - 1) * kPanel && N % 16 == 0,
              "mha linear: packed weight must be (ceil(N / 64), K, 64) contiguous with N % 16 "
              "== 0, got ", wp.sizes(), " for K=", K, ", N=", N);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "mha linear: bias must be float32 (N,) = (", N, ",), got ", bias->sizes());
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wpp = wp.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t lda = x.stride(0), panels = wp.size(0), blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, panels * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t % panels, m0 = (t / panels) * kRows, rows = std::min(kRows, M - m0);
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      float* c = op + m0 * N + n0;  // (rows, cols) of out, row stride N
      for (int64_t r = 0; r < rows; ++r)  // C starts as the bias (or 0)
        for (int64_t j = 0; j < cols; ++j) c[r * N + j] = bp ? bp[n0 + j] : 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {  // C += x[:, k0:k1] W^T[k0:k1, panel]
        const int64_t kc = std::min(kChunk, K - k0);
        mha_gemm::gemm<float>(rows, cols, kc, xp + m0 * lda + k0, lda, 1,
                              wpp + (p * K + k0) * kPanel, kPanel, c, N, true);
      }
    }
  });
  return out;
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
  m.def("linear_packed(Tensor x, Tensor wp, Tensor? bias, int N) -> Tensor");
  m.def("linear_vectorized() -> bool", &mha_linear::linear_vectorized);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) { m.impl("linear_packed", &mha_linear::linear_packed); }
