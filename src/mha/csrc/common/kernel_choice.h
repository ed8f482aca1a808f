// The CPU's kernel choice for bf16 inputs, shared by the flash forward and backward: the
// user's MHA_FLASH_BF16 (read here only, once per process) and the vendor rule; and the decode
// kernel's MHA_DECODE_BF16 (read here only, once per process).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

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
