// The fused KL kernel (scalar δ, float32, contiguous runs): one body (csrc/cpu/simd/kl_simd_body.inc) compiled for
// AVX-512 (16 lanes, wide cells in t read by register permutes) and for AVX2+FMA (8 lanes, cells in p's bits read as
// rows), each under its own target pragma and namespace. band_cpu.cpp's per-variant entry points
// (BANDPO_CPU_VARIANTS, csrc/macros.h) call the kernel of their variant; the baseline ISA keeps the blocked loops.
//
// A token's bits do not depend on its position in the run: the last, partial vector runs the same code under a
// lane mask.
#pragma once

#include "macros.h"  // BANDPO_HAVE_KL_SIMD

#if defined(BANDPO_HAVE_KL_SIMD)

#include "cpu/simd/simd_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi,bmi2")
#include "cpu/simd/simd_avx512.h"
namespace bandpo {
namespace avx512 {
#include "cpu/simd/kl_simd_body.inc"
}  // namespace avx512
}  // namespace bandpo
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2")
#include "cpu/simd/simd_avx2.h"
namespace bandpo {
namespace avx2 {
#include "cpu/simd/kl_simd_body.inc"
}  // namespace avx2
}  // namespace bandpo
#pragma GCC pop_options

#endif
