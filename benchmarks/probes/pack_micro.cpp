// How fast the fused self-attention forward packs its weights into panels (linear/panels.h):
// the library's packing (16 x 16 transposes of 32-bit words, 16 rows of W read along K with a
// prefetch 4 lines ahead) against the 8 x 8 transposes alone (panels.h's form for widths that
// are not multiples of 16). Stand-alone (no torch); needs AVX-512. One thread, thread CPU time,
// the forms interleaved, median and best of 61 rounds; checks that both give the same panels.
//
//   g++ -O2 -march=native -std=c++17 -I src/mha/csrc benchmarks/probes/pack_micro.cpp \
//       -o /tmp/pack_micro && /tmp/pack_micro
//
// The weights are the seeds' module's: W_qkv (1536 x 512) and W_O (512 x 512), bf16 (2 MB) and
// fp32 (4 MB): in L3, not L2, as between two calls of the module.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <vector>

#include "linear/panels.h"

namespace {

using mha_panels::kPanel;

double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// Panel p of the (N, K2) words w (row stride K2) by 8 x 8 transposes only; N % 64 == 0,
// K2 % 8 == 0.
void pack_8x8(const uint32_t* w, int64_t K2, int64_t p, uint32_t* out) {
  const uint32_t* src = w + p * kPanel * K2;
  for (int64_t k = 0; k < K2; k += 8)
    for (int64_t j = 0; j < kPanel; j += 8)
      mha_panels::transpose8(reinterpret_cast<const float*>(src + j * K2 + k), K2,
                             reinterpret_cast<float*>(out + k * kPanel + j), kPanel);
}

}  // namespace

int main() {
  const int64_t D = 512, Nq = 1536, No = 512, N = Nq + No, rounds = 61;
  std::vector<uint16_t> wb(N * D), pb_lib(N * D), pb_8(N * D);  // bf16: W_qkv then W_O
  std::vector<float> wf(N * D), pf_lib(N * D), pf_8(N * D);
  for (size_t i = 0; i < wb.size(); ++i) wb[i] = uint16_t(uint32_t(i) * 2654435761u >> 9);
  for (size_t i = 0; i < wf.size(); ++i) wf[i] = float(i % 1013) * 0.37f;
  const int64_t panels = N / kPanel;  // 24 of W_qkv, 8 of W_O (same K)
  auto bf16_lib = [&] {
    for (int64_t p = 0; p < Nq / kPanel; ++p)
      mha_panels::pack_panel_bf16(wb.data(), Nq, D / 2, D, p, pb_lib.data() + p * D * kPanel);
    for (int64_t p = 0; p < No / kPanel; ++p)
      mha_panels::pack_panel_bf16(wb.data() + Nq * D, No, D / 2, D, p,
                                  pb_lib.data() + (Nq / kPanel + p) * D * kPanel);
  };
  auto bf16_8 = [&] {
    for (int64_t p = 0; p < panels; ++p)
      pack_8x8(reinterpret_cast<const uint32_t*>(wb.data()), D / 2, p,
               reinterpret_cast<uint32_t*>(pb_8.data()) + p * D / 2 * kPanel);
  };
  auto f32_lib = [&] {
    for (int64_t p = 0; p < panels; ++p)
      mha_panels::pack_panel_f32(wf.data(), N, D, D, 1, p, pf_lib.data() + p * D * kPanel);
  };
  auto f32_8 = [&] {
    for (int64_t p = 0; p < panels; ++p)
      pack_8x8(reinterpret_cast<const uint32_t*>(wf.data()), D, p,
               reinterpret_cast<uint32_t*>(pf_8.data()) + p * D * kPanel);
  };
  const char* names[4] = {"bf16 W_qkv + W_O, panels.h", "bf16 W_qkv + W_O, 8 x 8 only",
                          "fp32 W_qkv + W_O, panels.h", "fp32 W_qkv + W_O, 8 x 8 only"};
  std::vector<double> t[4];
  for (int r = 0; r < rounds; ++r)
    for (int v = 0; v < 4; ++v) {
      const double t0 = cpu_now();
      if (v == 0) bf16_lib();
      if (v == 1) bf16_8();
      if (v == 2) f32_lib();
      if (v == 3) f32_8();
      t[v].push_back(cpu_now() - t0);
    }
  for (int v = 0; v < 4; ++v) {
    std::sort(t[v].begin(), t[v].end());
    std::printf("%-30s median %7.1f us   best %7.1f us\n", names[v], t[v][rounds / 2] * 1e6,
                t[v][0] * 1e6);
  }
  std::printf("same panels: bf16 %s, fp32 %s\n", pb_lib == pb_8 ? "yes" : "NO",
              pf_lib == pf_8 ? "yes" : "NO");
  return pb_lib == pb_8 && pf_lib == pf_8 ? 0 : 1;
}
