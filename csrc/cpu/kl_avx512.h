// The KL band with a scalar δ, float32, AVX-512: one fused pass, 16 elements per step, nothing through memory
// but the inputs and outputs. The element math is that of csrc/bandpo_math.h (prob_terms_t, kl_finish and
// its tails, clamp_like_torch), written here with 512-bit intrinsics; the differences, each chosen for speed
// and each as accurate as the scalar code (tests/test_ops*.py compare both with mpmath):
//   * the table is the 32 wide cells of wide_cells.h, read with one two-register permute per coefficient;
//   * log is table-driven (16 entries in a register, |r| <= 1/32, a degree-5 series) and exp rescales with
//     vscalefps, which rounds subnormal results once;
//   * the tails beyond |t| <= t_max are evaluated only for the 16-element vectors that have such an element.
// A token's bits do not depend on its position: the last partial vector runs the same code under a mask.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define BANDPO_HAVE_AVX512_KERNEL 1
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bandpo_math.h"
#include "cpu/band_cpu.h"
#include "cpu/wide_cells.h"

// The helpers are force-inlined into the kernel (same target); the entry point is a plain call from
// code compiled for any x86-64, taken only where the CPU has AVX-512 (cpu_variant.h).
#define BANDPO_AVX512_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi,bmi2")))
#define BANDPO_AVX512 BANDPO_AVX512_TARGET __attribute__((always_inline))

namespace bandpo {
namespace avx512 {

// log(z) for z in [kLogOff, 2·kLogOff): 16 subintervals (the top 4 mantissa bits of z's offset), each with
// 1/c rounded to float and log(c) = -log(that float) rounded to float, so that z·(1/c) - 1 is exact
// in an FMA's single rounding and |r| <= 1/32.
constexpr std::int32_t kLogOff = 0x3f330000;  // 0.69921875
struct LogTable {
  alignas(64) float invc[16];
  alignas(64) float logc[16];
  LogTable() {
    for (int i = 0; i < 16; ++i) {
      const float c = bits_to_float(kLogOff + (i << 19) + (1 << 18));  // the subinterval's midpoint (in bits)
      invc[i] = static_cast<float>(1.0 / c);
      logc[i] = static_cast<float>(-std::log(static_cast<double>(invc[i])));
    }
  }
};
inline const LogTable& log_table() {
  static const LogTable table;
  return table;
}

struct Consts {
  __m512 invc, logc;
};

// log x for finite positive normal x (0, subnormals, inf and NaN give finite garbage, which every caller
// either never feeds or masks away: see the callers). Absolute error ~1e-8 + 1 ulp.
BANDPO_AVX512 inline __m512 log_v(__m512 x, const Consts& k) {
  const __m512i ix = _mm512_castps_si512(x);
  const __m512i tmp = _mm512_sub_epi32(ix, _mm512_set1_epi32(kLogOff));
  const __m512i idx = _mm512_srli_epi32(tmp, 19);  // the permute reads its low 4 bits
  const __m512 e = _mm512_cvtepi32_ps(_mm512_srai_epi32(tmp, 23));
  const __m512 z = _mm512_castsi512_ps(
      _mm512_sub_epi32(ix, _mm512_and_si512(tmp, _mm512_set1_epi32(static_cast<std::int32_t>(0xff800000u)))));
  const __m512 r = _mm512_fmsub_ps(z, _mm512_permutexvar_ps(idx, k.invc), _mm512_set1_ps(1.0f));
  const __m512 y0 = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693145751953125f), _mm512_permutexvar_ps(idx, k.logc));
  // log1p(r) = r + r²·(-1/2 + r·(1/3 + r·(-1/4 + r/5))), truncation error < 2e-10 for |r| <= 1/32
  __m512 s = _mm512_fmadd_ps(r, _mm512_set1_ps(0.2f), _mm512_set1_ps(-0.25f));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(1.0f / 3.0f));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(-0.5f));
  const __m512 lo = _mm512_fmadd_ps(e, _mm512_set1_ps(1.428606765330187e-06f), r);
  return _mm512_add_ps(y0, _mm512_fmadd_ps(_mm512_mul_ps(r, r), s, lo));
}

// e^x for x <= 89 (NaN propagates; -inf and anything below -104 give 0): e^r by its series to r^7 as in
// exp_f32_reduced, then ·2^n with vscalefps, which also rounds subnormal results correctly.
BANDPO_AVX512 inline __m512 exp_v(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // max(c, NaN) is NaN (the second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 s = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 5040), _mm512_set1_ps(1.0f / 720));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(1.0f / 120));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(1.0f / 24));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(1.0f / 6));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(0.5f));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(1.0f));
  s = _mm512_fmadd_ps(r, s, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(s, n);
}

// expm1(x) for x <= 0 given e^x: the series where |x| < 0.35 (as expm1_f32), e^x - 1 elsewhere.
BANDPO_AVX512 inline __m512 expm1_v(__m512 x, __m512 ex) {
  __m512 s = _mm512_fmadd_ps(x, _mm512_set1_ps(1.0f / 40320), _mm512_set1_ps(1.0f / 5040));
  s = _mm512_fmadd_ps(x, s, _mm512_set1_ps(1.0f / 720));
  s = _mm512_fmadd_ps(x, s, _mm512_set1_ps(1.0f / 120));
  s = _mm512_fmadd_ps(x, s, _mm512_set1_ps(1.0f / 24));
  s = _mm512_fmadd_ps(x, s, _mm512_set1_ps(1.0f / 6));
  s = _mm512_fmadd_ps(x, s, _mm512_set1_ps(0.5f));
  s = _mm512_fmadd_ps(x, s, _mm512_set1_ps(1.0f));
  s = _mm512_mul_ps(x, s);
  const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(0.35f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(small, _mm512_sub_ps(ex, _mm512_set1_ps(1.0f)), s);
}

// p, 1 - p and t = logit p (prob_terms_t); out-of-domain inputs give p = NaN.
template <bool LOG>
BANDPO_AVX512 inline void prob_terms_v(__m512 x, const Consts& k, __m512& p, __m512& omp, __m512& t) {
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m512 zero = _mm512_setzero_ps();
  if (LOG) {
    const __mmask16 pos = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
    const __mmask16 rounding = pos & _mm512_cmp_ps_mask(x, _mm512_set1_ps(float(kLogProbRounding)), _CMP_LE_OQ);
    x = _mm512_mask_blend_ps(rounding, x, zero);
    p = exp_v(x);
    omp = _mm512_sub_ps(zero, expm1_v(x, p));
    // 1 - p = 0 (x = 0) or subnormal: t is only used beyond t_max there, where any t > t_max gives the
    // same result to float precision (kl_tail_lower_log's t enters multiplied by 1 - p).
    t = _mm512_sub_ps(x, log_v(omp, k));
    p = _mm512_mask_blend_ps(pos & ~rounding, p, nan);
    omp = _mm512_mask_blend_ps(pos & ~rounding, omp, nan);
  } else {
    omp = _mm512_sub_ps(_mm512_set1_ps(1.0f), x);
    // p/(1-p) is 0 at p = 0, +inf at p = 1 and subnormal for p < 1.2e-38: there log_v gives a finite t far
    // beyond the grid, which selects the tail formulas, whose t enters multiplied by p or by 1 - p.
    t = log_v(_mm512_div_ps(x, omp), k);
    const __mmask16 bad = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ) | _mm512_cmp_ps_mask(x, _mm512_set1_ps(1.0f), _CMP_GT_OQ);
    p = _mm512_mask_blend_ps(bad, x, nan);
    omp = _mm512_mask_blend_ps(bad, omp, nan);
  }
}

// kl_finish for 16 elements: (q_tab, κ) from the wide cells, the tails, the cap.
struct DeltaV {
  __m512 delta, rho0, inv_rho0, log_rho0, exp_neg, neg_delta;
};

BANDPO_AVX512 inline void kl_finish_v(__m512 p, __m512 omp, __m512 t, __m512 q, __m512 kappa, const DeltaV& c,
                                      const WideCells& w, __m512& lo, __m512& up) {
  const __m512 one = _mm512_set1_ps(1.0f);
  q = _mm512_min_ps(_mm512_max_ps(q, p), one);
  const __mmask16 below = _mm512_cmp_ps_mask(t, _mm512_set1_ps(w.t_min), _CMP_LT_OQ);
  const __mmask16 above = _mm512_cmp_ps_mask(t, _mm512_set1_ps(w.t_max), _CMP_GT_OQ);
  // One division for every quotient, of p·2^24 (finite for subnormal p), as in kl_finish.
  const __m512 scale = _mm512_set1_ps(16777216.0f);
  const __m512 inv_ps = _mm512_div_ps(one, _mm512_mul_ps(p, scale));
  const __m512 inv_p = _mm512_mul_ps(inv_ps, scale);
  up = _mm512_mul_ps(_mm512_mul_ps(q, scale), inv_ps);
  __m512 L = _mm512_mul_ps(_mm512_mul_ps(c.neg_delta, inv_p), kappa);
  if (below | above) {  // rare: p < 8e-7 or 1 - p < 8e-7 somewhere in these 16
    // kl_tail_upper
    const __m512 tt = _mm512_max_ps(t, _mm512_set1_ps(-1000.0f));
    const __m512 base = _mm512_sub_ps(_mm512_add_ps(_mm512_add_ps(one, c.delta), c.log_rho0), tt);
    const __m512 pe = _mm512_mul_ps(p, c.exp_neg);
    const __m512 eps1 = _mm512_mul_ps(pe, base);
    const __m512 q_tail = _mm512_fmadd_ps(pe, _mm512_fmadd_ps(eps1, c.inv_rho0, base), c.rho0);
    up = _mm512_mask_blend_ps(below, up, _mm512_mul_ps(_mm512_mul_ps(q_tail, scale), inv_ps));
    up = _mm512_mask_blend_ps(above, up, inv_p);
    // kl_tail_lower_log
    const __m512 tu = _mm512_min_ps(t, _mm512_set1_ps(1000.0f));
    const __m512 inner = _mm512_add_ps(_mm512_add_ps(tu, c.log_rho0), _mm512_mul_ps(_mm512_mul_ps(omp, inv_p), c.inv_rho0));
    const __m512 L_tail = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_fmadd_ps(omp, inner, c.delta)), inv_p);
    L = _mm512_mask_blend_ps(above, L, L_tail);
  }
  lo = exp_v(L);
  lo = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(omp, _mm512_setzero_ps(), _CMP_EQ_OQ), lo, c.exp_neg);
}

// The run: bounds (lo, up) or clip (out) of run.n contiguous floats.
template <bool LOG, bool CLIP>
BANDPO_AVX512 inline void kl_run(const FastRun& run, const WideCells& w) {
  const LogTable& lt = log_table();
  const Consts k{_mm512_load_ps(lt.invc), _mm512_load_ps(lt.logc)};
  const DeltaConsts<float>& c0 = *run.c;
  const DeltaV c{_mm512_set1_ps(c0.delta),    _mm512_set1_ps(c0.rho0),      _mm512_set1_ps(1.0f / c0.rho0),
                 _mm512_set1_ps(c0.log_rho0), _mm512_set1_ps(c0.exp_neg), _mm512_set1_ps(-c0.delta)};
  const __m512 cap = _mm512_set1_ps(static_cast<float>(run.band->max_ratio));
  const __m512 t0 = _mm512_set1_ps(w.t_min), t1 = _mm512_set1_ps(w.t_max);
  const __m512 width = _mm512_set1_ps(w.width), inv_w = _mm512_set1_ps(w.inv_width);
  const __m512 last = _mm512_set1_ps(static_cast<float>(WideCells::kCells) - 1.0f);
  constexpr int D = WideCells::kDegree;
  for (int64_t i = 0; i < run.n; i += 16) {
    const int64_t left = run.n - i;
    const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(m, run.x + i);
    __m512 p, omp, t;
    prob_terms_v<LOG>(x, k, p, omp, t);
    // Cell and the offset in it, v = t - start (exact for the shipped grid), t clamped onto the grid (t is
    // finite or, from a NaN log p, NaN: max(NaN, c) is c).
    const __m512 tc = _mm512_min_ps(_mm512_max_ps(t, t0), t1);
    const __m512 cell = _mm512_min_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(tc, t0), inv_w), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
        last);
    const __m512 u = _mm512_sub_ps(tc, _mm512_fmadd_ps(cell, width, t0));
    const __m512i idx = _mm512_cvttps_epi32(cell);
    __m512 q = _mm512_permutex2var_ps(_mm512_load_ps(&w.q[D][0]), idx, _mm512_load_ps(&w.q[D][16]));
    __m512 kappa = _mm512_permutex2var_ps(_mm512_load_ps(&w.kappa[D][0]), idx, _mm512_load_ps(&w.kappa[D][16]));
    for (int j = D - 1; j >= 0; --j) {
      q = _mm512_fmadd_ps(q, u, _mm512_permutex2var_ps(_mm512_load_ps(&w.q[j][0]), idx, _mm512_load_ps(&w.q[j][16])));
      kappa = _mm512_fmadd_ps(
          kappa, u, _mm512_permutex2var_ps(_mm512_load_ps(&w.kappa[j][0]), idx, _mm512_load_ps(&w.kappa[j][16])));
    }
    __m512 lo, up;
    kl_finish_v(p, omp, t, q, kappa, c, w, lo, up);
    up = _mm512_min_ps(cap, up);  // min(c, NaN) is NaN
    if (CLIP) {
      const __m512 r = _mm512_maskz_loadu_ps(m, run.ratio + i);
      // clamp_like_torch: a NaN ratio stays NaN; a NaN bound (only ever both, from a NaN p) gives NaN.
      __m512 y = _mm512_min_ps(_mm512_max_ps(r, lo), up);
      y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), y, r);
      _mm512_mask_storeu_ps(run.out + i, m, y);
    } else {
      _mm512_mask_storeu_ps(run.lo + i, m, lo);
      _mm512_mask_storeu_ps(run.up + i, m, up);
    }
  }
}

}  // namespace avx512

// Entry point: float32 KL with a scalar δ over a contiguous run, from p or log p, bounds or clip.
BANDPO_AVX512_TARGET inline void kl_scalar_avx512(const FastRun& run, const WideCells& w, bool log_input, bool clip) {
  if (log_input) {
    clip ? avx512::kl_run<true, true>(run, w) : avx512::kl_run<true, false>(run, w);
  } else {
    clip ? avx512::kl_run<false, true>(run, w) : avx512::kl_run<false, false>(run, w);
  }
}

}  // namespace bandpo
#endif
