// Constants and tables shared by the fused KL kernel's vector types (csrc/cpu/simd/simd_avx512.h, simd_avx2.h).
// Plain C++: compiled for every target; the vector code that uses it lives under per-ISA pragmas.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "bandpo_math.h"
#include "macros.h"  // BANDPO_SIMD_INLINE
#include "cpu/band_cpu.h"
#include "cpu/simd/table_gather.h"  // cubics_from_cells; included here, outside the per-ISA pragmas
#include "cpu/simd/wide_cells.h"

namespace bandpo {

constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 = kLn2Hi + kLn2Lo; k·kLn2Hi is exact for |k| < 2^9
constexpr float kLn2Lo = 1.428606765330187e-06f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;  // rounded to float: 1.9e-9 above ln 2
// e^r = 1 + r·(c0 + c1·r + ... + c6·r^6): the series to r^7 (the probability's exponential, exp_f32_reduced's).
constexpr float kExpSeries[7] = {1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
// e^r = 1 + r·(c0 + c1·r + ... + c5·r^5) on |r| <= 0.35, minimax in relative error (iteratively reweighted least
// squares in float64, coefficients rounded to float; max relative error 7.2e-8 evaluated in float32 by Horner's
// rule): the lower bound's e^L in the AVX2 and AVX-512 kernels.
constexpr float kExpMinimax[6] = {1.0f,
                                  0.4999999403953552f,
                                  0.16666430234909058f,
                                  0.04166800528764725f,
                                  0.008374198339879513f,
                                  0.001384365139529109f};
constexpr float kFloatMinNormal = 1.17549435e-38f;
constexpr float kFloatMax = 3.40282347e+38f;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kProbScale = 16777216.0f;  // 2^24: quotients by p are of p·2^24, finite for subnormal p (kl_finish)
constexpr std::int32_t kExponentMask = static_cast<std::int32_t>(0xff800000u);  // sign and exponent bits

// log(z) for z in [kLogOff, 2·kLogOff): 2^BITS subintervals (the top BITS mantissa bits of z's offset from
// kLogOff), each with 1/c rounded to float and log c = -log(that float) rounded to float, so that
// z·(1/c) - 1 = r is one FMA rounding and |r| <= 2^-BITS·(2/3): log z = log c + log1p(r).
constexpr std::int32_t kLogOff = 0x3f330000;  // 0.69921875
template <int BITS>
struct LogTableT {
  float invc[1 << BITS];
  float logc[1 << BITS];
  LogTableT() {
    for (int i = 0; i < (1 << BITS); ++i) {
      const float c = bits_to_float(kLogOff + (i << (23 - BITS)) + (1 << (22 - BITS)));  // the midpoint, in bits
      invc[i] = static_cast<float>(1.0 / c);
      logc[i] = static_cast<float>(-std::log(static_cast<double>(invc[i])));
    }
  }
};
template <int BITS>
inline const LogTableT<BITS>& log_table_t() {
  static const LogTableT<BITS> table;
  return table;
}

}  // namespace bandpo
