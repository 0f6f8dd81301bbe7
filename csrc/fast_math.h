// Branch-free float32 log/exp/expm1 for the CPU kernels, so that the compiler can vectorise whole loops
// (glibc's scalar logf/expf calls block auto-vectorisation). On the GPU the CUDA math library is used.
//
// Accuracy against double-precision libm (sampled: every 97th normal float for log, [-87, 88] for exp,
// [-20, 20] for expm1): log 1.9 ulp, exp 1.2 ulp, expm1 4.0 ulp (near |x| = 0.35, where it switches
// from its series to exp - 1). The ops' end-to-end accuracy is tested against mpmath (tests/runtime/test_band.py).
// NaN in gives NaN out; ±inf and 0 follow C.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "macros.h"  // BANDPO_HD: force-inlined, host and device

namespace bandpo {

BANDPO_HD float bits_to_float(std::int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
#endif
}

BANDPO_HD std::int32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  std::int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
#endif
}

// A read of table memory: through the read-only (texture) cache on the GPU, a plain load on the host.
BANDPO_HD float load_ro(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// Four floats of table memory at a 16-byte aligned address, read as one (LDG.128 on the GPU).
BANDPO_HD void load_ro4(const float* p, float out[4]) {
#if defined(__CUDA_ARCH__)
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
#else
  for (int i = 0; i < 4; ++i) out[i] = p[i];
#endif
}

// log(x): x = m·2^e with m in [√½, √2), log m = 2·atanh(z), z = (m-1)/(m+1), |z| ≤ 0.1716, whose odd
// series to z^11 is exact to 2e-10 relative; e·ln2 is added in two parts (Cody–Waite).
BANDPO_HD float log_f32(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  std::int32_t ix = float_to_bits(x);
  // Subnormals: scale by 2^23 first so that the exponent extraction below stays valid.
  const bool sub = x < 1.17549435e-38f;
  const float xs = sub ? x * 8388608.0f : x;
  ix = float_to_bits(xs);
  // Exponent relative to the mantissa range [√½, √2): subtract the bits of √½ so the split is at √½.
  const std::int32_t k = (ix - 0x3f3504f3) >> 23;
  const float m = bits_to_float(ix - (k << 23));
  const float e = static_cast<float>(k) - (sub ? 23.0f : 0.0f);
  const float z = (m - 1.0f) / (m + 1.0f);
  const float z2 = z * z;
  const float series =
      z2 * (2.0f / 3.0f + z2 * (2.0f / 5.0f + z2 * (2.0f / 7.0f + z2 * (2.0f / 9.0f + z2 * (2.0f / 11.0f)))));
  const float logm = 2.0f * z + z * series;
  const float r = e * 0.693145751953125f + (logm + e * 1.428606765330187e-06f);
  // Special values: log(0) = -inf, log(x<0) = NaN, log(inf) = inf, log(NaN) = NaN.
  const float inf = bits_to_float(0x7f800000);
  float out = r;
  out = (x == 0.0f) ? -inf : out;
  out = (x < 0.0f) ? bits_to_float(0x7fc00000) : out;
  out = (x == inf) ? inf : out;
  out = (x != x) ? x : out;
  return out;
#endif
}

// e^x = e^r·2^n with n = round(x/ln2) and r = x - n·ln2 (two-part): returns the series of e^r to r^7
// (|r| ≤ 0.347, exact to 5e-9) and n, for exp_f32 and exp_f32_normal. Rounds to nearest by the 1.5·2^23
// trick: no libm call, so the baseline-ISA loop vectorises too.
BANDPO_HD float exp_f32_reduced(float xc, float& n) {
  n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  return 1.0f +
         r * (1.0f +
              r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
}

// exp(x): n = round(x/ln2), r = x - n·ln2 (two-part), e^r by its Taylor series to r^7 (|r| ≤ 0.347, exact
// to 5e-9), times 2^n. No floating-point operation produces or reads a subnormal on the way (Intel cores take a
// microcode assist for each one, docs/performance.md): a result of 2^-126 or more is e^r·2^n in two exact halves
// (n up to 128), with n held at -125 or more; a result below that (n ≤ -126: a subnormal, or 0 below -103.97) is
// assembled from its bits, y = e^r·2^(n+149) being exact and below 2^24: the float with the bits round(y) (to
// nearest even) is round(y)·2^-149, the correctly rounded subnormal, as the multiplication by 2^n would round it.
BANDPO_HD float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);  // NaN passes through untouched
  float n;
  const float pr = exp_f32_reduced(xc, n);
  const std::int32_t ni = static_cast<std::int32_t>(xc == xc ? n : 0.0f);
  const std::int32_t nn = ni < -125 ? -125 : ni;
  const std::int32_t n1 = nn / 2, n2 = nn - n1;
  const float normal = pr * bits_to_float((n1 + 127) << 23) * bits_to_float((n2 + 127) << 23);
  const std::int32_t ns = (ni > -126 ? -126 : ni) + 149;  // in [-1, 23]
  const float y = pr * bits_to_float((ns + 127) << 23);   // in [0.35, 2^24), exact
  // y + 2^23 has unit spacing below 2^24: it rounds y to an integer; y ≥ 2^23 already is one.
  const float yr = y < 8388608.0f ? (y + 8388608.0f) - 8388608.0f : y;
  const float tiny = bits_to_float(static_cast<std::int32_t>(yr));
  const float out = ni < -125 ? tiny : normal;
  return (x != x) ? x : out;
#endif
}

// exp(x) for results in the normal range only (x clamped to [-87, 88.7]): one scaling instead of two.
// For ratios e^d with |d| <= 20 and for probabilities whose subnormal tail does not matter.
BANDPO_HD float exp_f32_normal(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  const float xc = x < -87.0f ? -87.0f : (x > 88.7f ? 88.7f : x);
  float n;
  const float pr = exp_f32_reduced(xc, n);
  const std::int32_t ni = static_cast<std::int32_t>(xc == xc ? n : 0.0f);
  const float out = pr * bits_to_float((ni + 127) << 23);
  return (x != x) ? x : out;
#endif
}

// 1/a rounded to nearest, for a = +0, NaN or a normal float below 2^126: a = p·2^24 for a probability p (the KL
// band's one reciprocal, bandpo_math.h kl_finish_branched; p is never -0 there: prob_terms turns -0 into +0).
// On the GPU: the instructions nvcc emits for 1.0f / a (rcp.rn.f32) on its fast path, an approximate reciprocal
// refined by one Newton step in fma, which sm_90 takes for every a with exponent field in [1, 252] (its test:
// ((bits + 0x1800000) & 0x7f800000) > 0x1ffffff), i.e. every such a but +0 and NaN; here without the test and
// the call to the slow path: +0 gets that path's +inf by a select, NaN stays NaN. The same bits, two branches
// and their bookkeeping fewer per element.
BANDPO_HD float rcp_scaled_prob(float a) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  const float e = -fmaf(a, r, -1.0f);  // a·r - 1 is never subnormal here: the flush the fast path applies is moot
  const float y = fmaf(r, e, r);
  return a == 0.0f ? __int_as_float(0x7f800000) : y;
#else
  return 1.0f / a;
#endif
}
BANDPO_HD double rcp_scaled_prob(double a) { return 1.0 / a; }

// 0/0: on the GPU an IEEE division of +0 by +0 at run time (nvcc leaves `T(0) / T(0)` to run time where it does not
// fold it, and the device's NaN is what that division returns); on the host the same expression as ever.
BANDPO_HD float zero_by_zero(float zero) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("div.rn.f32 %0, %1, %1;" : "=f"(r) : "f"(zero));
  return r;
#else
  return zero / zero;
#endif
}
BANDPO_HD double zero_by_zero(double zero) {
#if defined(__CUDA_ARCH__)
  double r;
  asm("div.rn.f64 %0, %1, %1;" : "=d"(r) : "d"(zero));
  return r;
#else
  return zero / zero;
#endif
}

BANDPO_HD double exp_normal_any(double x) { return ::exp(x); }
BANDPO_HD float exp_normal_any(float x) { return exp_f32_normal(x); }

// expm1(x): the Taylor series where |x| < 0.35 (no cancellation), exp(x) - 1 elsewhere.
BANDPO_HD float expm1_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expm1f(x);
#else
  const float s =
      x * (1.0f + x * (0.5f + x * (1.0f / 6 +
                                   x * (1.0f / 24 + x * (1.0f / 120 +
                                                         x * (1.0f / 720 + x * (1.0f / 5040 + x * (1.0f / 40320))))))));
  const float big = exp_f32(x) - 1.0f;
  const float ax = x < 0.0f ? -x : x;
  return ax < 0.35f ? s : big;
#endif
}

// The same interface in double precision (scalar library calls; float64 inputs are the accuracy path).
BANDPO_HD double log_any(double x) { return ::log(x); }
BANDPO_HD double exp_any(double x) { return ::exp(x); }
BANDPO_HD double expm1_any(double x) { return ::expm1(x); }
BANDPO_HD double log1p_any(double x) { return ::log1p(x); }
BANDPO_HD float log_any(float x) { return log_f32(x); }
BANDPO_HD float exp_any(float x) { return exp_f32(x); }
BANDPO_HD float expm1_any(float x) { return expm1_f32(x); }

}  // namespace bandpo
