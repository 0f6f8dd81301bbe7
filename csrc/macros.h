// Every BANDPO_* macro of the kernels (the generated build facts aside, csrc/build_info.h), in one place.
// Plain preprocessor: included by host-device headers compiled by nvcc as well as by the CPU files.
#pragma once

// ---- inlining ----------------------------------------------------------------------------------------------
// BANDPO_HD: the shared element math (fast_math.h, bandpo_math.h, ...), host and device, force-inlined: the CPU
// loops only vectorise when no call remains in their body. __HIPCC__: the same functions under hipcc (ROCm).
#if defined(__CUDACC__) || defined(__HIPCC__)
#define BANDPO_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define BANDPO_HD inline __attribute__((always_inline))
#else
#define BANDPO_HD inline
#endif

// BANDPO_HD_COLD: a function the GPU kernels call out of line (code for rare elements, kept out of the element
// loop: its instructions and its registers). On the host a plain inline function.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define BANDPO_HD_COLD __host__ __device__ __noinline__
#else
#define BANDPO_HD_COLD inline
#endif

// BANDPO_INLINE: CPU-only code force-inlined into each variant's entry point (BANDPO_CPU_VARIANTS), so that it
// is compiled for that variant's ISA. BANDPO_SIMD_INLINE: the same for the intrinsics kernel (cpu/simd/), where
// no call may cross from code of one target to another.
#define BANDPO_INLINE __attribute__((always_inline)) inline
#define BANDPO_SIMD_INLINE inline __attribute__((always_inline))
// The same for a lambda the intrinsics kernel hands to a pass (after its parameter list): GCC otherwise may keep a
// large one out of line, called per vector with its constants reloaded (the per-token tails: +50% on their decades).
#define BANDPO_SIMD_LAMBDA __attribute__((always_inline))

// ---- CPU variants (csrc/cpu/cpu_variant.h is the dispatcher) --------------------------------------------------
// BANDPO_CPU_MULTIVERSION: GCC on x86-64 compiles the CPU kernels once per variant (AVX-512 = x86-64-v4,
// AVX2+FMA = x86-64-v3, baseline); elsewhere only the baseline code exists and every variant runs it.
// BANDPO_HAVE_KL_SIMD: the intrinsics KL kernel exists (cpu/simd/kl_simd.h). BANDPO_HAVE_X86_GATHER: the table
// reads may use x86 intrinsics (cpu/simd/table_gather.h; checked at run time, clang included).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BANDPO_CPU_MULTIVERSION 1
#define BANDPO_HAVE_KL_SIMD 1
#define BANDPO_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define BANDPO_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
#else
#define BANDPO_CPU_MULTIVERSION 0
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#define BANDPO_HAVE_X86_GATHER 1
#endif

// BANDPO_CPU_VARIANTS(RET, NAME, PARAMS, BODY, ARGS): a CPU kernel's per-ISA entry points, the one mechanism by
// which every CPU kernel gets its per-variant code. Defines NAME_avx512, NAME_avx2 (compiled for x86-64-v4 and
// -v3) and NAME_baseline, each `RET NAME_x PARAMS { return BODY<variant> ARGS; }`, and NAME_variants, their
// bandpo::PerVariant table, for bandpo::pick (cpu_variant.h). BODY is a template over bandpo::CpuVariant,
// force-inlined (BANDPO_INLINE), so its code is compiled for each target; an intrinsics kernel compiled under
// its own target pragma is called from the BODY of its variant (`if constexpr`).
#if BANDPO_CPU_MULTIVERSION
#define BANDPO_CPU_VARIANTS(RET, NAME, PARAMS, BODY, ARGS)                                           \
  BANDPO_TARGET_AVX512 RET NAME##_avx512 PARAMS { return BODY<::bandpo::CpuVariant::kAvx512> ARGS; } \
  BANDPO_TARGET_AVX2 RET NAME##_avx2 PARAMS { return BODY<::bandpo::CpuVariant::kAvx2> ARGS; }       \
  RET NAME##_baseline PARAMS { return BODY<::bandpo::CpuVariant::kBaseline> ARGS; }                  \
  constexpr ::bandpo::PerVariant<RET(*) PARAMS> NAME##_variants{NAME##_baseline, NAME##_avx2, NAME##_avx512};
#else
#define BANDPO_CPU_VARIANTS(RET, NAME, PARAMS, BODY, ARGS)                          \
  RET NAME##_baseline PARAMS { return BODY<::bandpo::CpuVariant::kBaseline> ARGS; } \
  constexpr ::bandpo::PerVariant<RET(*) PARAMS> NAME##_variants{NAME##_baseline, NAME##_baseline, NAME##_baseline};
#endif
