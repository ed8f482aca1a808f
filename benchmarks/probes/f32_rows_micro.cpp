// The fp32 projections of the fused self-attention forward: whole-K row tiles (csrc/linear/rows.h,
// what self_attention_f32 runs) against the chunked form of mha::linear (an fp32 block in memory,
// K in chunks of 128 so the panel's slice stays in L1), on the seeds' QKV projection
// (640 x 1536 x 512) in 8 groups of 80 rows from packed fp32 panels (docs/module.md, "The fused
// forward"). Stand-alone (no torch); needs AVX-512. One thread, thread CPU time, the two
// interleaved, best of 30 rounds, three times.
//
//   g++ -O2 -march=native -std=c++17 -I src/mha/csrc benchmarks/probes/f32_rows_micro.cpp \
//       -o /tmp/f32_rows_micro && /tmp/f32_rows_micro
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>

#include "common/gemm_tiles.h"
#include "linear/panels.h"
#include "linear/rows.h"

namespace {

double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

constexpr int64_t M = 640, N = 1536, K = 512, R = 80, P = N / 64, kChunk = 128;

}  // namespace

int main() {
  std::vector<float> x(M * K), w(N * K), wp(P * K * 64), out(M * N), bias(N);
  std::mt19937 g(0);
  std::normal_distribution<float> nd;
  for (auto* v : {&x, &w, &bias})
    for (float& e : *v) e = nd(g);
  for (int64_t p = 0; p < P; ++p)  // (N, K) -> (P, K, 64)
    mha_panels::pack_panel_f32(w.data(), N, K, K, 1, p, wp.data() + p * K * 64);
  auto whole = [&] {  // rows.h, as self_attention_f32 projects a group
    for (int64_t gr = 0; gr < M / R; ++gr)
      mha_rows::project<float>(R, N, K, x.data() + gr * R * K, K, wp.data(), bias.data(),
                               out.data() + gr * R * N, N);
  };
  auto chunked = [&] {  // linear.cpp's blocked_gemm on the same groups
    for (int64_t gr = 0; gr < M / R; ++gr) {
      float* c = out.data() + gr * R * N;  // (R, N) of this group
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < 64; ++j) c[r * N + p * 64 + j] = bias[p * 64 + j];
        for (int64_t k0 = 0; k0 < K; k0 += kChunk)
          mha_gemm::gemm<float>(R, 64, kChunk, x.data() + gr * R * K + k0, K, 1,
                                wp.data() + (p * K + k0) * 64, 64, c + p * 64, N, true);
      }
    }
  };
  const double flops = 2.0 * M * N * K;
  for (int rep = 0; rep < 3; ++rep) {
    double bw = 1e9, bc = 1e9;
    for (int i = 0; i < 30; ++i) {
      double t = cpu_now();
      whole();
      bw = std::min(bw, cpu_now() - t);
      t = cpu_now();
      chunked();
      bc = std::min(bc, cpu_now() - t);
    }
    std::printf("QKV 640x1536x512: whole-K tiles %.3f ms (%.0f GFLOP/s), chunked %.3f ms "
                "(%.0f GFLOP/s)\n", bw * 1e3, flops / bw / 1e9, bc * 1e3, flops / bc / 1e9);
  }
  return 0;
}
