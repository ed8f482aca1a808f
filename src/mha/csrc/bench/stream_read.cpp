// A streaming-read probe for the benchmarks: the sum of a float32 buffer, read once.
//
// Shape legend: n elements. The buffer is cut into one contiguous part per thread; each
// thread reads its part with four independent AVX-512 accumulators (portable loop otherwise),
// so the loop is limited by memory, not by the adds. The decode suite times it on exactly the
// bytes a decoding step reads, to state "% of read bandwidth" against a real streaming read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

double sum_range(const float* p, int64_t n) {
#ifdef __AVX512F__
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  double s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
#else
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
  double s = double(s0) + s1 + s2 + s3;
  for (; i < n; ++i) s += p[i];
  return s;
#endif
}

double stream_read(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "stream_read: x must be a contiguous float32 CPU tensor, got ", x.scalar_type(),
              " on ", x.device());
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), parts = at::get_num_threads();
  std::vector<double> part(parts, 0.0);
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t a = n * t / parts, b = n * (t + 1) / parts;
      part[t] = sum_range(p + a, b - a);
    }
  });
  double s = 0.0;
  for (double v : part) s += v;
  return s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mha, m) { m.def("stream_read(Tensor x) -> float"); }

TORCH_LIBRARY_IMPL(mha, CPU, m) { m.impl("stream_read", &stream_read); }
