// Which CPU kernel variant runs: picked once per process from the CPU's vector ISA, or forced with the
// environment variable BANDPO_LUT_CPU_VARIANT (avx512, avx2 or baseline) to measure a slower machine's path
// on a faster one. A figure in the benchmark names the variant it measured (`bandpo-lut bench` prints it).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace bandpo {

enum class CpuVariant : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* cpu_variant_name(CpuVariant v) {
  switch (v) {
    case CpuVariant::kAvx512:
      return "avx512";
    case CpuVariant::kAvx2:
      return "avx2";
    case CpuVariant::kBaseline:
      return "baseline";
  }
  return "?";
}

// The best variant this CPU runs: AVX-512 needs F, DQ, BW and VL (x86-64-v4); AVX2 needs AVX2 and FMA.
inline CpuVariant cpu_variant_supported() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return CpuVariant::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuVariant::kAvx2;
#endif
  return CpuVariant::kBaseline;
}

// Runs at import (csrc/facts.h): each message is one C string, which TORCH_CHECK passes on as it is; several
// arguments (or one std::string: c10::str's specialisation misses it) it formats with an ostringstream, the
// iostream code that a statically linked libstdc++ crashed in (issue 26).
inline CpuVariant cpu_variant_from_env() {
  const CpuVariant best = cpu_variant_supported();
  const char* env = std::getenv("BANDPO_LUT_CPU_VARIANT");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best;
  for (CpuVariant v : {CpuVariant::kBaseline, CpuVariant::kAvx2, CpuVariant::kAvx512}) {
    if (std::strcmp(env, cpu_variant_name(v)) != 0) continue;
    TORCH_CHECK(static_cast<int>(v) <= static_cast<int>(best),
                (std::string("bandpo_lut: environment variable BANDPO_LUT_CPU_VARIANT=") + env +
                 " asks for a kernel this CPU cannot run (it supports up to " + cpu_variant_name(best) + ")")
                    .c_str());
    return v;
  }
  TORCH_CHECK(false, (std::string("bandpo_lut: environment variable BANDPO_LUT_CPU_VARIANT=") + env +
                      " is not one of auto, avx512, avx2, baseline")
                         .c_str());
  return best;
}

// Read once; an invalid setting raises at every use (so it is never silently ignored).
inline CpuVariant cpu_variant() {
  static const int v = [] {
    try {
      return static_cast<int>(cpu_variant_from_env());
    } catch (const c10::Error&) {
      return -1;
    }
  }();
  if (v < 0) cpu_variant_from_env();  // raises the message
  return static_cast<CpuVariant>(v);
}

}  // namespace bandpo
