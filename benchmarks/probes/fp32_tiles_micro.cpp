// The fp32 forward's two products alone, by register tile shape: how near the FMA peak the
// S = Q K^T and O = alpha O + P V loops of src/mha/csrc/flash/flash_attn_kernels.h run when
// nothing else (softmax, packing, output) shares the core (docs/kernel.md, "What stands
// between the kernel and the peak"). Stand-alone (no torch), one thread, CPU time of the
// thread, best of 7 runs; % of the FMA peak that a register-only vfmadd231ps loop measures.
// The last line times both products in the forward's order (key block by key block, S and P
// stored by the Q K^T tiles) against the two run apart: a time ratio, free of the peak's noise.
//
//   g++ -O3 -march=native -std=c++17 benchmarks/probes/fp32_tiles_micro.cpp -o /tmp/fp32_tiles
//   /tmp/fp32_tiles 64 16     # d = 64, 16 key blocks (K^T and V: 1 MiB, from L2)
//   /tmp/fp32_tiles 64 64     # 4 MiB: from L3
//   /tmp/fp32_tiles 128 16
//
// Shape legend: one 48-row query block (Q [48][d]) against NKB key blocks of 128 keys, K^T
// packed [d][128] per block, V [128][d] per block, S / P [48][128], O [48][d]. A tile R x NV
// holds R rows by NV 16-lane vectors (R NV accumulators); "kc" walks P V in key chunks.
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace {

#define INL __attribute__((always_inline)) inline
constexpr int kL = 16, kNb = 128, kRows = 48;
int d = 64, nkb = 16;
float *q, *kt, *v, *s, *p, *o, *alpha, *q2, *o2;

double now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// S[R][16 NV] = Q[R][d] K^T[d][16 NV] (one K^T row of NV vectors loaded, R Q broadcasts per k)
template <int R, int NV>
INL void qk(const float* qa, const float* k, float* sa, float* pa = nullptr) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NV; ++x) acc[r][x] = _mm512_setzero_ps();
  for (int kk = 0; kk < d; ++kk) {
    __m512 kv[NV];
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) kv[x] = _mm512_loadu_ps(k + kk * kNb + x * kL);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(qa[r * d + kk]);
#pragma GCC unroll 4
      for (int x = 0; x < NV; ++x) acc[r][x] = _mm512_fmadd_ps(b, kv[x], acc[r][x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NV; ++x) _mm512_storeu_ps(sa + r * kNb + x * kL, acc[r][x]);
  if (pa)  // P too (the fused tile stores S and P from its registers)
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < NV; ++x) _mm512_storeu_ps(pa + r * kNb + x * kL, acc[r][x]);
}

// O[R][16 CV] = (scaled ? alpha O : O) + P[R][n] V[n][16 CV]
template <int R, int CV, bool Scaled>
INL void pv(const float* pa, const float* va, int n, float* oa, const float* al) {
  __m512 acc[R][CV];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(Scaled ? al[r] : 1.f);
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(oa + r * d + c * kL), a);
  }
  for (int j = 0; j < n; ++j) {
    __m512 vv[CV];
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) vv[c] = _mm512_loadu_ps(va + j * d + c * kL);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(pa[r * kNb + j]);
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_fmadd_ps(b, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) _mm512_storeu_ps(oa + r * d + c * kL, acc[r][c]);
}

template <int R, int NV>
void qk_block(const float* k) {  // all 48 rows, 128 keys in chunks of 16 NV
  for (int c0 = 0; c0 < kNb; c0 += NV * kL)
    for (int r0 = 0; r0 + R <= kRows; r0 += R) qk<R, NV>(q + r0 * d, k + c0, s + r0 * kNb + c0);
}

template <int R, int CV, int KC>
void pv_block(const float* va) {  // KC keys at a time over every row tile (KC = 128: whole block)
  for (int c0 = 0; c0 < d; c0 += CV * kL) {
    for (int r0 = 0; r0 + R <= kRows; r0 += R)
      pv<R, CV, true>(p + r0 * kNb, va + c0, KC, o + r0 * d + c0, alpha + r0);
    for (int k0 = KC; k0 < kNb; k0 += KC)
      for (int r0 = 0; r0 + R <= kRows; r0 += R)
        pv<R, CV, false>(p + r0 * kNb + k0, va + k0 * d + c0, KC, o + r0 * d + c0, alpha + r0);
  }
}

// The forward's order: per key block, Q K^T over the 8 row tiles in two 64-key chunks (S and
// P = S stored, as the fused tile stores both), then P V over the 8 row tiles (O rescaled):
// the two products interleaved block by block, their K^T, V, S, P and O sharing L1 and L2.
// qa / oa: the query block's Q and O (q, o; or a second block's q2, o2). s_only: the tiles
// store P alone (the stores the phases make), P V reads it.
void interleaved_block(const float* k, const float* va, const float* qa, float* oa,
                       bool s_only = false) {
  for (int c0 = 0; c0 < kNb; c0 += 4 * kL)
    for (int r0 = 0; r0 < kRows; r0 += 6)
      qk<6, 4>(qa + r0 * d, k + c0, s_only ? p + r0 * kNb + c0 : s + r0 * kNb + c0,
               s_only ? nullptr : p + r0 * kNb + c0);
  for (int c0 = 0; c0 < d; c0 += 4 * kL)
    for (int r0 = 0; r0 < kRows; r0 += 6)
      pv<6, 4, true>(p + r0 * kNb, va + c0, kNb, oa + r0 * d + c0, alpha + r0);
}

template <class F>
double best_seconds(F f) {
  f();
  double best = 1e30;
  for (int t = 0; t < 7; ++t) {
    const double t0 = now();
    for (int i = 0; i < 20; ++i) f();
    best = std::min(best, (now() - t0) / 20);
  }
  return best;
}

double fma_peak() {  // GFLOP/s of 24 independent vfmadd231ps chains
  __m512 a[24];
  for (auto& x : a) x = _mm512_setzero_ps();
  const __m512 b = _mm512_set1_ps(1.0001f), c = _mm512_set1_ps(1e-7f);
  const long n = 50000000;
  const double t0 = now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) {
      a[j] = _mm512_fmadd_ps(a[j], b, c);
      asm volatile("" : : "v"(a[j]));
    }
  }
  const double t = now() - t0;
  float sum = 0.f;
  for (auto& x : a) sum += _mm512_reduce_add_ps(x);
  if (sum == 1.2345f) std::puts("");
  return double(n) * 24 * 32 / t / 1e9;
}

float* filled(size_t n) {
  auto* x = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
  for (size_t i = 0; i < n; ++i) x[i] = 0.01f * float((i * 7) % 13);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) d = std::atoi(argv[1]);  // a multiple of 64
  if (argc > 2) nkb = std::atoi(argv[2]);
  q = filled(size_t(kRows) * d), kt = filled(size_t(nkb) * d * kNb);
  v = filled(size_t(nkb) * kNb * d), s = filled(kRows * kNb), p = filled(kRows * kNb);
  o = filled(size_t(kRows) * d), alpha = filled(kRows);
  q2 = filled(size_t(kRows) * d), o2 = filled(size_t(kRows) * d);
  for (int r = 0; r < kRows; ++r) alpha[r] = 1.f;
  const double peak = fma_peak(), flop = 2.0 * kRows * kNb * d * nkb;
  std::printf("d=%d, %d key blocks (K^T + V %.1f MiB), FMA peak %.1f GFLOP/s (one thread)\n", d,
              nkb, 2.0 * nkb * kNb * d * 4 / (1 << 20), peak);
  auto qk_pct = [&](void (*f)(const float*)) {
    return 100 * flop / best_seconds([&] { for (int b = 0; b < nkb; ++b) f(kt + size_t(b) * d * kNb); }) / 1e9 / peak;
  };
  auto pv_pct = [&](void (*f)(const float*)) {
    return 100 * flop / best_seconds([&] { for (int b = 0; b < nkb; ++b) f(v + size_t(b) * kNb * d); }) / 1e9 / peak;
  };
  std::printf("Q K^T 6x4 %.1f %%, 12x2 %.1f %%, 8x2 %.1f %%, 4x4 %.1f %%\n", qk_pct(qk_block<6, 4>),
              qk_pct(qk_block<12, 2>), qk_pct(qk_block<8, 2>), qk_pct(qk_block<4, 4>));
  std::printf("P V   6x4 %.1f %%, 12x2 %.1f %%, 6x4 kc64 %.1f %%, 6x4 kc32 %.1f %%\n",
              pv_pct(pv_block<6, 4, 128>), pv_pct(pv_block<12, 2, 128>),
              pv_pct(pv_block<6, 4, 64>), pv_pct(pv_block<6, 4, 32>));
  // Both products in the forward's block-by-block order, against the two phases above run one
  // after the other: time ratios, timed round-robin (medians of 9 rounds), so the peak's own
  // noise stays out. "one store": the tiles store one of S, P; "pair": two query blocks take
  // each key block before the next one.
  const auto kblk = [&](int b) { return kt + size_t(b) * d * kNb; };
  const auto vblk = [&](int b) { return v + size_t(b) * kNb * d; };
  const auto phases = [&] {
    for (int b = 0; b < nkb; ++b) qk_block<6, 4>(kblk(b));
    for (int b = 0; b < nkb; ++b) pv_block<6, 4, 128>(vblk(b));
  };
  const auto inter = [&] { for (int b = 0; b < nkb; ++b) interleaved_block(kblk(b), vblk(b), q, o); };
  const auto one = [&] {
    for (int b = 0; b < nkb; ++b) interleaved_block(kblk(b), vblk(b), q, o, true);
  };
  const auto pair = [&] {
    for (int b = 0; b < nkb; ++b) {
      interleaved_block(kblk(b), vblk(b), q, o);
      interleaved_block(kblk(b), vblk(b), q2, o2);
    }
  };
  double r_inter[9], r_one[9], r_pair[9];
  for (int i = 0; i < 9; ++i) {
    const double tp = best_seconds(phases), ti = best_seconds(inter), t1 = best_seconds(one),
                 t2 = best_seconds(pair);
    r_inter[i] = ti / tp, r_one[i] = t1 / tp, r_pair[i] = t2 / (2 * tp);
  }
  std::sort(r_inter, r_inter + 9), std::sort(r_one, r_one + 9), std::sort(r_pair, r_pair + 9);
  std::printf("both products per key block / the two phases (time): interleaved %.3f, "
              "one store %.3f, pair %.3f\n", r_inter[4], r_one[4], r_pair[4]);
}
