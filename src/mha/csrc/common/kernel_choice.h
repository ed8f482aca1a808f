// The CPU's kernel choice for bf16 inputs, shared by the flash forward and backward: the
// user's MHA_FLASH_BF16 (read here only, once per process) and the vendor rule; and the decode
// kernel's MHA_DECODE_BF16 (read here only, once per process); and the one rule both follow
// for a value they cannot honour (check_forced).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace mha_common {

// MHA_FLASH_BF16 as set when first asked (nothing when unset); fixed for the process, so
// results stay deterministic.
inline const std::optional<std::string>& flash_bf16_override() {
  static const std::optional<std::string> value = []() -> std::optional<std::string> {
    if (const char* env = std::getenv("MHA_FLASH_BF16")) return std::string(env);
    return std::nullopt;
  }();
  return value;
}

// MHA_DECODE_BF16 as set when first asked (nothing when unset): the decode kernel's bf16 q.k,
// `amx` or `avx512bf16`. Fixed for the process, like MHA_FLASH_BF16.
inline const std::optional<std::string>& decode_bf16_override() {
  static const std::optional<std::string> value = []() -> std::optional<std::string> {
    if (const char* env = std::getenv("MHA_DECODE_BF16")) return std::string(env);
    return std::nullopt;
  }();
  return value;
}

// One value a forcing variable may take, and why this build / CPU / OS cannot run it ("" when
// it can).
struct Choice {
  std::string name, why_not;
};

// The rule for every variable that forces a kernel: an unknown value, or one this build / CPU /
// OS cannot run, is refused with the variable, the value, the choices and why; never a quiet
// fallback to another kernel. Raised where the value is used (each call that would read it).
inline void check_forced(const char* var, const std::string& value,
                         const std::vector<Choice>& choices) {
  std::string names, here;
  for (const Choice& c : choices) {
    names += (names.empty() ? "" : ", ") + c.name;
    if (c.why_not.empty()) here += (here.empty() ? "" : ", ") + c.name;
  }
  for (const Choice& c : choices)
    if (c.name == value) {
      TORCH_CHECK(c.why_not.empty(), var, "=", value, " cannot run here: ", c.why_not,
                  " (choices this build can run: ", here.empty() ? "none" : here,
                  "; unset it for the CPU's default)");
      return;
    }
  TORCH_CHECK(false, var, "=", value, " is not a choice: expected one of ", names,
              " (this build can run: ", here.empty() ? "none" : here,
              "; unset it for the CPU's default)");
}

// Whether the including translation unit targets AVX-512F (each unit has its own flags;
// namespace-scope constexpr: internal linkage, one value per unit).
#if defined(__AVX512F__)
constexpr bool kUnitAvx512f = true;
#else
constexpr bool kUnitAvx512f = false;
#endif

// MHA_FLASH_BF16's choices (the forward's bf16 tile kernels; the backward's products follow
// them), given what the translation unit compiled in and why the AMX tiles cannot run ("" when
// they can).
inline std::vector<Choice> flash_bf16_choices(bool avx512f, bool bf16_tiles,
                                              const std::string& amx_why_not) {
  return {{"avx512bf16",
           bf16_tiles ? "" : "this build lacks avx512bf16 (the CPU has no AVX512_BF16)"},
          {"avx512f", avx512f ? "" : "this build lacks avx512f (the CPU has no AVX-512F)"},
          {"portable", ""},
          {"amx", amx_why_not}};
}

// Whether bf16 products belong on vdpbf16ps on this CPU: AMD Zen 4/5 run it at twice the fp32
// FMA rate; Intel cores at half the fp32 FMA FLOP rate (measured), so there bf16 is widened to
// fp32 instead.
inline bool bf16_dot_is_fast() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool fast = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return fast;
#else
  return false;
#endif
}

}  // namespace mha_common
