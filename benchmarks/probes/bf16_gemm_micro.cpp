// How close the bf16 projections of the fused self-attention forward come to the vdpbf16ps
// peak: the measurements behind csrc/linear/rows.h (docs/module.md, "The fused
// forward"). Stand-alone (no torch); needs AVX512_BF16. One thread, thread CPU time, the
// variants interleaved, best and mean of 30 rounds.
//
//   g++ -O2 -march=native -std=c++17 -I src/mha/csrc benchmarks/probes/bf16_gemm_micro.cpp \
//       -o /tmp/bf16_gemm_micro && /tmp/bf16_gemm_micro
//
// 1. peak: 24 independent vdpbf16ps chains, operands in registers;
// 2. tile on L1: the 6 x 64 register tile's loop (6 pair broadcasts, 4 panel loads, 24
//    vdpbf16ps per pair of K) over 128 pairs held in L1;
// 3. the QKV projection of the seeds' module, 640 x 1536 x 512, in 8 groups of 80 rows from
//    packed panels: chunked (an fp32 (80, 64) block, K in chunks of 128 pairs, as
//    mha::linear_bf16) and whole-K tiles (rows.h);
// 4. W_O's shape, 640 x 512 x 512, alone and after the QKV projection in each group of 80 rows
//    (the fused call's order, attention left out);
// 5. packing W_qkv into panels (panels.h), as the fused call does on each call (0 GFLOP).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <vector>

#include "common/gemm_tiles.h"
#include "linear/panels.h"
#include "linear/rows.h"

namespace {

using mha_common::kLanes;
using mha_panels::kPanel;

double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

float sink = 0.f;  // keeps the accumulators alive

template <int R>
void keep(const __m512 (&x)[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) sink += _mm512_reduce_add_ps(x[r][v]);
}

void peak(int64_t n) {  // n iterations of 24 vdpbf16ps
  __m512 x[6][4];
  for (int r = 0; r < 6; ++r)  // distinct starts: no two chains compute the same thing
    for (int v = 0; v < 4; ++v) x[r][v] = _mm512_set1_ps(float(4 * r + v));
  __m512bh a[2], b[4];  // 24 + 6 registers: nothing spills
  for (int r = 0; r < 2; ++r) a[r] = (__m512bh)_mm512_set1_epi32(0x3f803f80 + r);
  for (int v = 0; v < 4; ++v) b[v] = (__m512bh)_mm512_set1_epi32(0x3f803f80 + 16 * v);
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) x[r][v] = _mm512_dpbf16_ps(x[r][v], a[r % 2], b[v]);
  }
  keep(x);
}

void tile_l1(int64_t n, const uint16_t* a, const uint16_t* panel) {  // n passes over 128 pairs
  __m512 x[6][4];
  mha_tiles::acc_zero(x);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* p = panel;
    __asm__ volatile("" : "+r"(p));
    for (int64_t k = 0; k < 128; ++k) {
      __m512bh bv[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v)
        bv[v] = (__m512bh)_mm512_loadu_si512(p + (k * kPanel + v * kLanes) * 2);
      mha_tiles::acc_rank2_bf16(x, bv, a + 2 * k, 256);
    }
  }
  keep(x);
}

// The chunked form: an fp32 (R, 64) block per panel, K in chunks of 128 pairs, then rounded.
void project_chunked(int64_t R, int64_t N, int64_t K2, const uint16_t* a, int64_t lda,
                     const uint16_t* wp, const float* bias, float* cb, uint16_t* out,
                     int64_t ldo) {
  for (int64_t p = 0; p < N / kPanel; ++p) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < kPanel; j += kLanes)
        _mm512_storeu_ps(cb + r * kPanel + j, _mm512_loadu_ps(bias + p * kPanel + j));
    for (int64_t k0 = 0; k0 < K2; k0 += 128)
      mha_gemm::gemm<uint16_t>(R, kPanel, std::min<int64_t>(128, K2 - k0), a + 2 * k0, lda, 0,
                               wp + (p * K2 + k0) * kPanel * 2, kPanel, cb, kPanel, true);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < kPanel; j += kLanes)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + p * kPanel + j),
                            mha_tiles::to_bf16(_mm512_loadu_ps(cb + r * kPanel + j)));
  }
}

}  // namespace

int main() {
  const int64_t M = 640, D = 512, N = 1536, K2 = D / 2, G = 80, rounds = 30;
  std::vector<uint16_t> x(M * D), w(N * D), wp(N * K2 * 2), out(M * N);
  std::vector<float> bias(N, 0.5f), cb(G * kPanel);
  for (size_t i = 0; i < x.size(); ++i) x[i] = uint16_t(0x3f00 + i % 97);
  for (size_t i = 0; i < w.size(); ++i) w[i] = uint16_t(0x3c00 + i % 89);
  for (int64_t p = 0; p < N / kPanel; ++p)
    mha_panels::pack_panel_bf16(w.data(), N, K2, D, p, wp.data() + p * K2 * kPanel * 2);
  const double flops = 2.0 * M * N * D;
  struct Variant {
    const char* name;
    double flops;
    void (*run)(void*);
  };
  struct Ctx {
    std::vector<uint16_t>*x, *wp, *out;
    std::vector<float>*bias, *cb;
    std::vector<uint16_t>* w;
  } ctx{&x, &wp, &out, &bias, &cb, &w};
  const Variant variants[] = {
      {"peak (registers)", 24.0 * 64 * 200000, [](void*) { peak(200000); }},
      {"6x64 tile, data in L1", 24.0 * 64 * 128 * 2000,
       [](void* c) {
         auto* k = static_cast<Ctx*>(c);
         tile_l1(2000, k->x->data(), k->wp->data());
       }},
      {"QKV 640x1536x512, chunked", flops,
       [](void* c) {
         auto* k = static_cast<Ctx*>(c);
         for (int64_t g = 0; g < 640 / 80; ++g)
           project_chunked(80, 1536, 256, k->x->data() + g * 80 * 512, 512, k->wp->data(),
                           k->bias->data(), k->cb->data(), k->out->data() + g * 80 * 1536, 1536);
       }},
      {"QKV 640x1536x512, whole-K tiles", flops,
       [](void* c) {
         auto* k = static_cast<Ctx*>(c);
         for (int64_t g = 0; g < 640 / 80; ++g)
           mha_rows::project<uint16_t>(80, 1536, 256, k->x->data() + g * 80 * 512, 512,
                                       k->wp->data(), k->bias->data(),
                                       k->out->data() + g * 80 * 1536, 1536);
       }},
      {"W_O 640x512x512, whole-K tiles", 2.0 * M * D * D,
       [](void* c) {  // W_O's shape: the first 8 panels as its weight
         auto* k = static_cast<Ctx*>(c);
         for (int64_t g = 0; g < 640 / 80; ++g)
           mha_rows::project<uint16_t>(80, 512, 256, k->x->data() + g * 80 * 512, 512,
                                       k->wp->data(), k->bias->data(),
                                       k->out->data() + g * 80 * 512, 512);
       }},
      {"QKV + W_O per group of 80 rows", flops + 2.0 * M * D * D,
       [](void* c) {  // the fused call's projections without attention: Q, K, V in L2, then
         auto* k = static_cast<Ctx*>(c);  // W_O (8 panels) on the group's first 512 columns
         static std::vector<uint16_t> qkv(80 * 1536);
         for (int64_t g = 0; g < 640 / 80; ++g) {
           mha_rows::project<uint16_t>(80, 1536, 256, k->x->data() + g * 80 * 512, 512,
                                       k->wp->data(), k->bias->data(), qkv.data(), 1536);
           mha_rows::project<uint16_t>(80, 512, 256, qkv.data(), 1536,
                                       k->wp->data() + 8 * 256 * 128, k->bias->data(),
                                       k->out->data() + g * 80 * 512, 512);
         }
       }},
      {"pack W_qkv (1536 x 512) into panels", 0.0,
       [](void* c) {  // what the fused call does to both weights (2048 rows) on each call
         auto* k = static_cast<Ctx*>(c);
         const int64_t n = int64_t(k->w->size()) / 512;  // 1536 rows (not a constant:
         for (int64_t p = 0; p < n / kPanel; ++p)         // the tail loop stays unfolded)
           mha_panels::pack_panel_bf16(k->w->data(), n, 256, 512, p,
                                       k->wp->data() + p * 256 * 128);
       }},
  };
  const int nv = sizeof(variants) / sizeof(variants[0]);
  std::vector<double> best(nv, 1e30), sum(nv, 0.0);
  for (int rep = 0; rep < rounds; ++rep)
    for (int v = 0; v < nv; ++v) {
      const double t0 = cpu_now();
      variants[v].run(&ctx);
      const double t = cpu_now() - t0;
      best[v] = std::min(best[v], t), sum[v] += t;
    }
  for (int v = 0; v < nv; ++v)
    std::printf("%-36s best %8.3f ms = %5.0f GFLOP/s   mean %8.3f ms\n", variants[v].name,
                best[v] * 1e3, variants[v].flops / best[v] / 1e9, sum[v] / rounds * 1e3);
  std::printf("(checksum %g %d)\n", double(sink), int(out[12345]));
  return 0;
}
