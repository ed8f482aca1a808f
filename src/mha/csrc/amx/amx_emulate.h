// A software model of the AMX tile unit, for builds on CPUs without AMX (MHA_AMX_EMULATE,
// set by `MHA_AMX_EMULATE=1` at build time: mha/ops/build.py). The AMX kernels are written
// against GCC's tile intrinsics (_tile_loadd, _tile_stored, _tile_zero, _tile_dpbf16ps,
// _tile_loadconfig, _tile_release); here those names become calls into eight 1 KiB tile
// registers per thread, so the kernels' logic (tile layouts, pair packing, edges, masking,
// NaN paths) runs and is tested on any AVX-512 machine. Timing means nothing in such a build.
//
// What is modelled (Intel SDM, TILELOADD / TILESTORED / TILEZERO / TDPBF16PS, palette 1):
// a tile holds rows[t] rows of colsb[t] bytes from the last configuration; a load reads
// exactly those bytes (row r at base + r * stride) and zeroes the rest of the tile; a store
// writes exactly them; TDPBF16PS adds, for every row m < rows[c] and fp32 column n <
// colsb[c] / 4, sum over k < colsb[a] / 4 of a[m][2k] b[k][2n] + a[m][2k+1] b[k][2n+1], pair by
// pair in order (bf16 products are exact in fp32). Not modelled: the hardware's flush of
// denormal inputs and outputs to zero. A tile used outside its configuration (the hardware
// faults) aborts the process here: that is a kernel bug, never a user's error.
#pragma once

#include <immintrin.h>  // first: the macros below must not rename its own declarations

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace mha_amx_emu {

struct Registers {
  alignas(64) uint8_t data[8][16][64];
  uint8_t rows[8];
  uint16_t colsb[8];
  bool configured;
};

inline Registers& registers() {
  thread_local Registers r{};
  return r;
}

inline void check(bool ok) {
  if (!ok) std::abort();  // a tile used outside its configuration: a kernel bug
}

// The 64-byte configuration block: palette at 0, colsb[16] (uint16) at 16, rows[16] at 48.
inline void loadconfig(const void* config) {
  const auto* c = static_cast<const uint8_t*>(config);
  Registers& r = registers();
  check(c[0] == 1);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    check(colsb <= 64 && c[48 + t] <= 16);
    r.colsb[t] = colsb;
    r.rows[t] = c[48 + t];
  }
  std::memset(r.data, 0, sizeof r.data);
  r.configured = true;
}

inline void release() {
  Registers& r = registers();
  std::memset(r.data, 0, sizeof r.data);
  r.configured = false;
}

inline void load(int t, const void* base, int64_t stride) {
  Registers& r = registers();
  check(r.configured && t >= 0 && t < 8);
  std::memset(r.data[t], 0, sizeof r.data[t]);
  const auto* src = static_cast<const uint8_t*>(base);
  for (int m = 0; m < r.rows[t]; ++m) std::memcpy(r.data[t][m], src + m * stride, r.colsb[t]);
}

inline void store(int t, void* base, int64_t stride) {
  Registers& r = registers();
  check(r.configured && t >= 0 && t < 8);
  auto* dst = static_cast<uint8_t*>(base);
  for (int m = 0; m < r.rows[t]; ++m) std::memcpy(dst + m * stride, r.data[t][m], r.colsb[t]);
}

inline void zero(int t) {
  Registers& r = registers();
  check(r.configured && t >= 0 && t < 8);
  std::memset(r.data[t], 0, sizeof r.data[t]);
}

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// C (rows[c] x colsb[c]/4 fp32) += A (rows[c] x K pairs) B (K rows x colsb[c]/4 pairs), K =
// colsb[a] / 4; the shapes must agree as the instruction requires.
inline void dpbf16ps(int c, int a, int b) {
  Registers& r = registers();
  check(r.configured && c != a && c != b && a != b);
  const int M = r.rows[c], N = r.colsb[c] / 4, K = r.colsb[a] / 4;
  check(r.rows[a] == M && r.rows[b] == K && r.colsb[b] == r.colsb[c]);
  for (int m = 0; m < M; ++m) {
    float acc[16];
    std::memcpy(acc, r.data[c][m], 64);
    uint16_t arow[32];
    std::memcpy(arow, r.data[a][m], 64);
    for (int k = 0; k < K; ++k) {
      uint16_t brow[32];
      std::memcpy(brow, r.data[b][k], 64);
      const float a0 = bf16_to_float(arow[2 * k]), a1 = bf16_to_float(arow[2 * k + 1]);
      for (int n = 0; n < N; ++n) {
        acc[n] += a0 * bf16_to_float(brow[2 * n]);
        acc[n] += a1 * bf16_to_float(brow[2 * n + 1]);
      }
    }
    std::memcpy(r.data[c][m], acc, 4 * N);
    if (N < 16) std::memset(r.data[c][m] + 4 * N, 0, 64 - 4 * N);
  }
}

}  // namespace mha_amx_emu

#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadd(t, base, stride) ::mha_amx_emu::load((t), (base), (stride))
#define _tile_stream_loadd(t, base, stride) ::mha_amx_emu::load((t), (base), (stride))
#define _tile_stored(t, base, stride) ::mha_amx_emu::store((t), (base), (stride))
#define _tile_zero(t) ::mha_amx_emu::zero(t)
#define _tile_dpbf16ps(c, a, b) ::mha_amx_emu::dpbf16ps((c), (a), (b))
#define _tile_loadconfig(config) ::mha_amx_emu::loadconfig(config)
#define _tile_release() ::mha_amx_emu::release()
