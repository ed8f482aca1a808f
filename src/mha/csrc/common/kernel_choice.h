// The CPU's kernel choice for bf16 inputs, shared by the flash forward and backward: the
// user's MHA_FLASH_BF16 (read here only, once per process) and the vendor rule; and the decode
// kernel's MHA_DECODE_BF16 (read here only, once per process); and the one rule both follow
// for a value they cannot honour (check_forced; forced_refusal words it, also for the test op
// that names a kernel).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "common/isa_words.h"

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
// fallback to another kernel. The words (mha.ops.forcing.refusal says the same in Python):
// "<what>=<value> is not a choice: ..." or "<what>=<value> cannot run here: <why> ...", ending
// with `otherwise` (what to do instead); "" when the value can run.
inline std::string forced_refusal(const std::string& what, const std::string& value,
                                  const std::vector<Choice>& choices,
                                  const std::string& otherwise) {
  std::string names, here;
  for (const Choice& c : choices) {
    names += (names.empty() ? "" : ", ") + c.name;
    if (c.why_not.empty()) here += (here.empty() ? "" : ", ") + c.name;
  }
  if (here.empty()) here = "none";
  for (const Choice& c : choices)
    if (c.name == value) {
      if (c.why_not.empty()) return "";
      return what + "=" + value + " cannot run here: " + c.why_not +
             " (choices this build can run: " + here + "; " + otherwise + ")";
    }
  return what + "=" + value + " is not a choice: expected one of " + names +
         " (this build can run: " + here + "; " + otherwise + ")";
}

// The rule for a forcing variable, raised where the value is used (each call that would read
// it).
inline void check_forced(const char* var, const std::string& value,
                         const std::vector<Choice>& choices) {
  const std::string refusal =
      forced_refusal(var, value, choices, "unset it for the CPU's default");
  TORCH_CHECK(refusal.empty(), refusal);
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
           bf16_tiles ? "" : build_lacks("avx512bf16", "AVX512_BF16", cpu_has_avx512_bf16())},
          {"avx512f", avx512f ? "" : build_lacks("avx512f", "AVX-512F", cpu_has_avx512f())},
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
