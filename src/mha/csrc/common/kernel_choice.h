// The CPU's kernel choice for bf16 inputs, shared by the flash forward and backward: the
// user's MHA_FLASH_BF16 (read here only, once per process) and the kernel measured faster on
// this CPU (handed in by mha.ops.flash_choice); and the decode kernel's MHA_DECODE_BF16 (read
// here only, once per process); and the one rule both follow for a value they cannot honour
// (check_forced; forced_refusal words it, also for the test op that names a kernel).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
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

// The bf16 kernel measured faster on this CPU where AMX does not run: "avx512bf16" (products
// on vdpbf16ps) or "avx512f" (bf16 widened to fp32 when packed, the fp32 tiles). No vendor
// rule decides it: mha.ops.flash_choice times both kernels once per CPU model, caches the
// result beside the built kernels and hands it to each flash extension through its setter op
// (set_flash_bf16_measured) when the extension is loaded, before its first bf16 call. Until
// then it is "" and bf16 is widened to fp32 (no measurement, no claim about the dot-product
// unit). Fixed at the first read, so the process's results stay deterministic: a later setter
// call with another value is refused.
struct MeasuredBf16 {
  std::mutex lock;
  std::string kernel;
  bool read = false;
};

inline MeasuredBf16& measured_bf16() {
  static MeasuredBf16 state;
  return state;
}

// The setter ops' body: `kernel` must be a kernel this extension can run (bf16_tiles: the
// vdpbf16ps kernel is compiled in; avx512f: the fp32 tiles are).
inline void set_flash_bf16_measured(const std::string& kernel, bool bf16_tiles, bool avx512f) {
  TORCH_CHECK((kernel == "avx512bf16" && bf16_tiles) || (kernel == "avx512f" && avx512f),
              "the measured bf16 kernel must be one this build runs (",
              bf16_tiles ? "avx512bf16, " : "", avx512f ? "avx512f" : "none",
              "), got '", kernel, "'");
  MeasuredBf16& m = measured_bf16();
  const std::lock_guard<std::mutex> hold(m.lock);
  TORCH_CHECK(!m.read || m.kernel == kernel, "the measured bf16 kernel is fixed for the process "
              "once a bf16 call has read it ('", m.kernel.empty() ? "none" : m.kernel.c_str(),
              "'); refusing '", kernel, "'");
  m.kernel = kernel;
}

// The measured kernel ("" when none was handed in), fixed from this read on.
inline std::string flash_bf16_measured() {
  MeasuredBf16& m = measured_bf16();
  const std::lock_guard<std::mutex> hold(m.lock);
  m.read = true;
  return m.kernel;
}

}  // namespace mha_common
