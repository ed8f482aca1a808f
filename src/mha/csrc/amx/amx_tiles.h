// Intel AMX set-up shared by the flash and decode kernels: the tile configuration block, the
// once-per-process permission Linux requires (and why the tiles cannot run when they cannot:
// tiles_unavailable, compiled in every build), and loading a configuration safely.
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

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(MHA_AMX_TILES)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#endif

namespace mha_amx {

// MHA_TEST_AMX_REFUSED=1 (tests only): act as if the OS refused the tile state, so that the
// fallback of an AMX CPU whose kernel says no runs on any build with tiles (native or software).
inline bool refusal_forced() {
  static const bool forced = [] {
    const char* env = std::getenv("MHA_TEST_AMX_REFUSED");
    return env != nullptr && std::string(env) == "1";
  }();
  return forced;
}

// Whether this CPU reports AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and
// AVX512_BF16 (leaf 7 subleaf 1: EAX bit 5), for the words of tiles_unavailable.
inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1u) && (d >> 22 & 1u);
#else
  return false;
#endif
}

inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a >> 5 & 1u;
#else
  return false;
#endif
}

// Why the AMX tiles cannot run in this process, or "" when they can: the build has none (and
// why), or the OS refuses the tile state. Linux hands out the AMX register state only on
// request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), asked once per process here,
// before the first tile instruction; software tiles need nothing. Fixed per process.
inline const std::string& tiles_unavailable() {
  static const std::string why = []() -> std::string {
#if !defined(MHA_AMX_TILES)
    if (cpu_has_amx_bf16())
      return "no AMX tiles in this build: the CPU has amx_bf16 but the compiler did not target "
             "it";
    if (cpu_has_avx512_bf16())
      return "no AMX tiles in this build: the CPU lacks amx_bf16 (a MHA_AMX_EMULATE=1 build "
             "runs them on software tiles, for tests)";
    return "no AMX tiles in this build: the CPU lacks amx_bf16 (and avx512_bf16, which "
           "software tiles need)";
#else
    if (refusal_forced())
      return "the OS refuses the AMX tile state (MHA_TEST_AMX_REFUSED=1)";
#if defined(MHA_AMX_EMULATED)
    return "";
#else
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0) return "";
    return std::string("the OS refuses the AMX tile state: arch_prctl(ARCH_REQ_XCOMP_PERM, "
                       "XTILEDATA) failed (") + std::strerror(errno) + ")";
#endif
#endif
  }();
  return why;
}

}  // namespace mha_amx

#if defined(MHA_AMX_TILES)
namespace mha_amx {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether the tiles may run in this process (tiles_unavailable above says why not).
inline bool amx_permitted() { return tiles_unavailable().empty(); }

// GCC does not know ldtilecfg reads c and may drop the stores that filled it (seen in a decode
// build): force them to memory first.
inline void load_tile_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace mha_amx

#endif  // MHA_AMX_TILES
