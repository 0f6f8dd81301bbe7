// The one CPU dispatcher: which kernel variant runs, and how every CPU kernel (the band's blocked loops, the
// closed forms, the fused KL kernel, the loss's token pass) gets its per-ISA code.
//
// The choice: made once per process, when the library loads (at `import bandpo_lut`), from the CPU's vector ISA, or
// forced with the environment variable BANDPO_LUT_CPU_VARIANT (auto, avx512, avx2 or baseline) to measure a slower
// machine's path on a faster one; a later change of the variable is ignored, by the kernels and the facts alike.
// A figure in the benchmark names the variant it measured (`bandpo-lut bench` prints it). An invalid setting
// is an error (ValueError in Python) at every op that reads it: the ops call cpu_variant() on the calling
// thread, before any parallel region, so the error is raised, never thrown where nothing catches it.
//
// The mechanism: a kernel's entry points are compiled once per variant (BANDPO_CPU_VARIANTS, csrc/macros.h, or, for the
// intrinsics kernel, a body compiled under each variant's target pragma, cpu/simd/kl_simd.h) and put in a
// PerVariant table; pick() returns the entry for cpu_variant(). Forcing a variant therefore steers every kernel.
// float64 has one implementation (the per-element code, compiled for the baseline ISA): nothing to steer.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "macros.h"

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

// The variable's accepted values on this CPU, for the error messages: auto, then the variants up to the best.
inline std::string cpu_variants_accepted() {
  std::string s = "auto";
  for (int v = 0; v <= static_cast<int>(cpu_variant_supported()); ++v) {
    s += ", ";
    s += cpu_variant_name(static_cast<CpuVariant>(v));
  }
  return s;
}

// The variant the environment asks for, or ValueError naming the variable, the value and the accepted values.
// May run at import (csrc/facts.h): each message is one C string, which TORCH_CHECK passes on as it is; several
// arguments (or one std::string: c10::str's specialisation misses it) it formats with an ostringstream, the
// iostream code that a statically linked libstdc++ crashed in.
inline CpuVariant cpu_variant_from_env() {
  const CpuVariant best = cpu_variant_supported();
  const char* env = std::getenv("BANDPO_LUT_CPU_VARIANT");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best;
  for (CpuVariant v : {CpuVariant::kBaseline, CpuVariant::kAvx2, CpuVariant::kAvx512}) {
    if (std::strcmp(env, cpu_variant_name(v)) != 0) continue;
    TORCH_CHECK_VALUE(static_cast<int>(v) <= static_cast<int>(best),
                      (std::string("bandpo_lut: environment variable BANDPO_LUT_CPU_VARIANT='") + env +
                       "' asks for a kernel this CPU cannot run; accepted here: " + cpu_variants_accepted())
                          .c_str());
    return v;
  }
  TORCH_CHECK_VALUE(false, (std::string("bandpo_lut: environment variable BANDPO_LUT_CPU_VARIANT='") + env +
                            "' is not a CPU kernel variant; accepted: auto, avx512, avx2, baseline (this CPU: " +
                            cpu_variants_accepted() + ")")
                               .c_str());
  return best;
}

// The variable as read once per process, when the library loads (facts.h reads it at import): the variant every
// kernel runs and the one the facts report (facts(), `bandpo-lut info`, bench), so that a later change of the
// environment changes neither. An invalid setting keeps its message, raised by every CPU op.
struct CpuVariantChoice {
  int variant;        // a CpuVariant, or -1 when the setting was invalid
  std::string error;  // the message of an invalid setting
};

inline const CpuVariantChoice& cpu_variant_choice() {
  static const CpuVariantChoice choice = [] {
    try {
      return CpuVariantChoice{static_cast<int>(cpu_variant_from_env()), std::string()};
    } catch (const c10::Error& e) {
      return CpuVariantChoice{-1, std::string(e.what_without_backtrace()) +
                                      " (read once, when bandpo_lut was imported: set it before the import)"};
    }
  }();
  return choice;
}

// Each CPU op calls this first, on the calling thread (see the file comment).
inline CpuVariant cpu_variant() {
  const CpuVariantChoice& choice = cpu_variant_choice();
  TORCH_CHECK_VALUE(choice.variant >= 0, choice.error.c_str());  // one C string (see cpu_variant_from_env)
  return static_cast<CpuVariant>(choice.variant);
}

// A kernel's entry point per variant; pick() is the one place a variant's code is chosen.
template <typename Fn>
struct PerVariant {
  Fn baseline, avx2, avx512;
};

template <typename Fn>
Fn pick(const PerVariant<Fn>& fns) {
  switch (cpu_variant()) {  // exhaustive (-Werror=switch)
    case CpuVariant::kAvx512:
      return fns.avx512;
    case CpuVariant::kAvx2:
      return fns.avx2;
    case CpuVariant::kBaseline:
      return fns.baseline;
  }
  return fns.baseline;
}

}  // namespace bandpo
