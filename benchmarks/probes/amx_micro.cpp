// What the AMX tile unit costs, and whether it overlaps AVX-512 work: the measurements
// behind the bf16 key loop in src/mha/csrc/flash/flash_attn.cpp (docs/kernel.md, "bf16 on AMX").
// Stand-alone (no torch); needs a CPU with AMX and Linux >= 5.16. Times in TSC cycles per
// iteration (rdtsc; the TSC runs at a fixed rate, not the core clock), minimum of 5 runs.
//
//   g++ -O2 -march=native benchmarks/amx_micro.cpp -o /tmp/amx_micro && /tmp/amx_micro
//
// One "step" is the kernel's unit of work at d = 64: a 16-row group against a 128-key block,
// S = Q K^T (16 products) and O += P V (16 products), with a softmax-like AVX-512 pass over S.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int kKeys = 128, kD = 64, kBlocks = 32;  // 32 K / V blocks = 1 MiB: L2, not L1
alignas(64) uint16_t q[16 * kD], p[16 * kKeys];
alignas(64) uint16_t kt[kBlocks][kD * kKeys], v[kBlocks][kKeys * kD];  // pair layouts
alignas(64) float s[16 * kKeys], o[16 * kD];
int blk = 0;  // which K / V block a step reads (0 unless a case streams them)

template <class F>
void run(const char* name, F f) {
  const int n = 20000;
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    f();
    const uint64_t t0 = __rdtsc();
    for (int i = 0; i < n; ++i) f();
    best = std::min(best, double(__rdtsc() - t0) / n);
  }
  std::printf("%-62s %7.0f\n", name, best);
}

// 16 rows x 128 keys: t = s c - m, 2^t (degree-3 polynomial), row sums, bf16 P: the kernel's
// softmax fast path without its bookkeeping.
void softmax_like() {
  const __m512 c = _mm512_set1_ps(0.18f), mneg = _mm512_set1_ps(-1.f);
  for (int r = 0; r < 16; ++r) {
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < kKeys; j += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 x = _mm512_fmadd_ps(_mm512_load_ps(s + r * kKeys + j + 16 * h), c, mneg);
        const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(0.078f), f, _mm512_set1_ps(0.226f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.696f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
        e[h] = _mm512_scalef_ps(y, x);
      }
      sum = _mm512_add_ps(sum, _mm512_add_ps(e[0], e[1]));
      _mm512_store_si512(p + r * kKeys + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    _mm512_storeu_ps(o + r * 16, sum);  // somewhere to put it
  }
}

void products16() {  // 16 products on tiles already loaded (4 accumulators)
  for (int i = 0; i < 4; ++i) {
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 6);
  }
}

// O (tiles O0-O3, 64 columns) += P V over the block's 128 keys: P through tile PT, V through
// VA and VB alternately. A macro: GCC's tile intrinsics need the tile numbers as literals.
#define PV_STEP(PT, VA, VB, O0, O1, O2, O3)                                  \
  for (int kc = 0; kc < 4; ++kc) {                                          \
    _tile_loadd(PT, p + kc * 32, kKeys * 2);                                \
    const uint16_t* vb = v[blk] + kc * 16 * kD * 2;                         \
    _tile_loadd(VA, vb, kD * 4); _tile_dpbf16ps(O0, PT, VA);                \
    _tile_loadd(VB, vb + 32, kD * 4); _tile_dpbf16ps(O1, PT, VB);           \
    _tile_loadd(VA, vb + 64, kD * 4); _tile_dpbf16ps(O2, PT, VA);           \
    _tile_loadd(VB, vb + 96, kD * 4); _tile_dpbf16ps(O3, PT, VB);           \
  }

// A step with O in memory: S in 4 accumulators per 64 keys (Q reloaded per chunk), O loaded
// and stored around P V.
void step_o_in_memory() {
  const uint16_t* k = kt[blk];
  for (int c0 = 0; c0 < 8; c0 += 4) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int kc = 0; kc < 2; ++kc) {
      _tile_loadd(4, q + kc * 32, kD * 2);
      const uint16_t* kb = k + (kc * 16 * kKeys + c0 * 16) * 2;
      _tile_loadd(5, kb, kKeys * 4); _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, kb + 32, kKeys * 4); _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, kb + 64, kKeys * 4); _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, kb + 96, kKeys * 4); _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, s + c0 * 16, kKeys * 4); _tile_stored(1, s + c0 * 16 + 16, kKeys * 4);
    _tile_stored(2, s + c0 * 16 + 32, kKeys * 4); _tile_stored(3, s + c0 * 16 + 48, kKeys * 4);
  }
  _tile_loadd(0, o, kD * 4); _tile_loadd(1, o + 16, kD * 4);
  _tile_loadd(2, o + 32, kD * 4); _tile_loadd(3, o + 48, kD * 4);
  PV_STEP(4, 5, 6, 0, 1, 2, 3);  // P in 4, V through 5 and 6, O in 0-3
  _tile_stored(0, o, kD * 4); _tile_stored(1, o + 16, kD * 4);
  _tile_stored(2, o + 32, kD * 4); _tile_stored(3, o + 48, kD * 4);
}

// The kernel's step (d <= 64): O in tiles 4-7 and Q in tiles 2-3 for the whole key loop; S 16 keys at
// a time in tile 0 (K in 1), then P in 0 and V in 1.
void step_resident() {
  const uint16_t* k = kt[blk];
  for (int c = 0; c < 8; ++c) {
    _tile_zero(0);
    _tile_loadd(1, k + c * 32, kKeys * 4); _tile_dpbf16ps(0, 2, 1);
    _tile_loadd(1, k + 16 * kKeys * 2 + c * 32, kKeys * 4); _tile_dpbf16ps(0, 3, 1);
    _tile_stored(0, s + c * 16, kKeys * 4);
  }
  PV_STEP(0, 1, 1, 4, 5, 6, 7);  // P in 0, V through 1, O in 4-7
}

}  // namespace

int main() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::puts("AMX not granted by the OS");
    return 1;
  }
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  // bf16 0.0078: non-zero data (zeros run the tile unit measurably faster)
  std::fill_n(q, 16 * kD, uint16_t(0x3c00)); std::fill_n(p, 16 * kKeys, uint16_t(0x3c00));
  std::fill_n(&kt[0][0], kBlocks * kD * kKeys, uint16_t(0x3c00));
  std::fill_n(&v[0][0], kBlocks * kKeys * kD, uint16_t(0x3c00));
  std::printf("%-62s %7s\n", "case", "TSC/it");
  run("16 tile products (operands resident)", products16);
  run("softmax-like AVX-512 pass over 16 x 128 scores", softmax_like);
  run("both, back to back (overlap would make this < the sum)", [] { products16(); softmax_like(); });
  run("8 products + 4 tile stores of their accumulators", [] {
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5);
    _tile_stored(0, s, 64); _tile_stored(1, s + 256, 64); _tile_stored(2, s + 512, 64); _tile_stored(3, s + 768, 64);
  });
  run("8 products + 4 tile loads into other tiles", [] {
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5);
    _tile_loadd(6, v[0], 64); _tile_loadd(7, v[0] + 512, 64); _tile_loadd(6, v[0] + 1024, 64); _tile_loadd(7, v[0] + 1536, 64);
  });
  blk = 0;
  run("step, O in memory, K / V in L1 (32 products)", step_o_in_memory);
  run("step, O and Q resident, K / V in L1 (32 products)", step_resident);
  run("step, O in memory, K / V streamed from L2", [] { step_o_in_memory(); blk = (blk + 1) % kBlocks; });
  run("step, O and Q resident, K / V streamed from L2", [] { step_resident(); blk = (blk + 1) % kBlocks; });
  _tile_release();
  return 0;
}
