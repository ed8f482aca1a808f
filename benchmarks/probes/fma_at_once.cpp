// Does a core run slower while the other one runs too? A register-only fp32 FMA loop (12 zmm
// chains, no memory), GFLOP per second of its thread's CPU time, on one thread and on two at
// once, samples alternating; only samples in which every thread ran the whole time (thread CPU
// / wall >= 0.97) count, so a shared machine's descheduling does not enter. Equal figures: no
// clock drop from running both cores.
//   g++ -O3 -march=native -fopenmp benchmarks/probes/fma_at_once.cpp -o /tmp/fma_at_once
//   OMP_WAIT_POLICY=PASSIVE /tmp/fma_at_once 60
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

static double now(clockid_t c) {
  timespec t;
  clock_gettime(c, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

__attribute__((noinline)) static float fma_loop(long n, float seed) {
  __m512 a[12];
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
  _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(seed + float(i));
  for (long k = 0; k < n; ++k) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

static double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 30;
  const long n = 2000000;                       // ~3 ms per sample
  const double flop = 12.0 * 16.0 * 2.0 * double(n);
  std::vector<double> rate[3];                  // [1]: one thread, [2]: two at once
  volatile float sink = 0.f;
  for (int round = 0; round < rounds; ++round) {
    for (int t = 1; t <= 2; ++t) {
      double cpu[2], wall[2];
#pragma omp parallel num_threads(t)
      {
        const int id = omp_get_thread_num();
#pragma omp barrier
        const double w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
        const float r = fma_loop(n, float(id));
        cpu[id] = now(CLOCK_THREAD_CPUTIME_ID) - c0;
        wall[id] = now(CLOCK_MONOTONIC) - w0;
#pragma omp critical
        sink = sink + r;
      }
      bool whole = omp_get_max_threads() >= t;
      for (int i = 0; i < t; ++i) whole = whole && cpu[i] >= 0.97 * wall[i];
      if (whole)
        for (int i = 0; i < t; ++i) rate[t].push_back(flop / cpu[i] / 1e9);
    }
  }
  std::printf("one thread:        %zu samples, %.1f GFLOP per CPU second\n", rate[1].size(),
              median(rate[1]));
  std::printf("two threads at once: %zu thread samples, %.1f GFLOP per CPU second per thread\n",
              rate[2].size(), median(rate[2]));
  return 0;
}
