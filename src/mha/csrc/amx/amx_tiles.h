// Intel AMX set-up shared by the flash and decode kernels: the tile configuration block, the
// once-per-process permission Linux requires, and loading a configuration safely.
#pragma once

#if defined(__AMX_TILE__)
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

// Linux hands out the AMX register state only on request, once per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// GCC does not know ldtilecfg reads c and may drop the stores that filled it (seen in a decode
// build): force them to memory first.
inline void load_tile_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace mha_amx

#endif  // __AMX_TILE__
