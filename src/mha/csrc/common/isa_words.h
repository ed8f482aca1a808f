// Why a translation unit lacks an instruction set its kernels could use: the CPU has none, or
// the CPU has it and the build's flags do not target it (a build for another -march, or a
// compiler that does not know the extension). The build passes its -march as MHA_MARCH
// (mha.ops.build.flags); a unit compiled without it is described by "the build's flags".
// Plain C++ (no torch), so the words can be checked by a program of their own.
#pragma once

#include <string>

namespace mha_common {

#define MHA_ISA_STR_(x) #x
#define MHA_ISA_STR(x) MHA_ISA_STR_(x)

// "-march=native" (what mha build passes), or "" when the unit was compiled without MHA_MARCH.
inline std::string build_march() {
#if defined(MHA_MARCH)
  return "-march=" MHA_ISA_STR(MHA_MARCH);
#else
  return "";
#endif
}

// Whether the CPU running this process has AVX-512F / AVX512_BF16 (and the OS keeps their
// registers), whatever the unit was compiled for.
inline bool cpu_has_avx512f() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0;
#else
  return false;
#endif
}

inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") != 0;
#else
  return false;
#endif
}

// "this build lacks <ext> (<why>)": ext as the kernels name it ("avx512bf16"), cpu_name as
// the CPU's documentation does ("AVX512_BF16"), cpu_has from the functions above.
inline std::string build_lacks(const std::string& ext, const std::string& cpu_name,
                               bool cpu_has) {
  const std::string head = "this build lacks " + ext + " (the CPU has ";
  if (!cpu_has) return head + "no " + cpu_name + ")";
  const std::string march = build_march();
  if (march == "-march=native")  // the flags follow the CPU: the compiler does not know it
    return head + cpu_name + ", but the compiler did not target it under " + march + ")";
  return head + cpu_name + ", but the build's flags" + (march.empty() ? "" : " (" + march + ")") +
         " do not target it)";
}

}  // namespace mha_common
