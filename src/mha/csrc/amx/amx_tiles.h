// Intel AMX set-up shared by the flash and decode kernels: the tile configuration block, the
// once-per-process permission Linux requires, and loading a configuration safely.
//
// MHA_AMX_TILES is defined where the tile kernels are compiled: a target with AMX-TILE and
// AMX-BF16 (-march=native on such a CPU), or a build with MHA_AMX_EMULATE on an AVX-512 CPU
// with AVX512_BF16, whose tile instructions run in software (amx/amx_emulate.h; then
// MHA_AMX_EMULATED is defined too).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MHA_AMX_TILES 1
#elif defined(MHA_AMX_EMULATE) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define MHA_AMX_TILES 1
#define MHA_AMX_EMULATED 1
#include "amx/amx_emulate.h"
#endif

#if defined(MHA_AMX_TILES)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace mha_amx {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out the AMX register state only on request, once per process (the software
// tiles need nothing).
inline bool amx_permitted() {
#if defined(MHA_AMX_EMULATED)
  return true;
#else
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#endif
}

// GCC does not know ldtilecfg reads c and may drop the stores that filled it (seen in a decode
// build): force them to memory first.
inline void load_tile_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace mha_amx

#endif  // MHA_AMX_TILES
