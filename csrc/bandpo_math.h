// The band's math, written once for the CPU loops and the CUDA kernels (host-device inline functions).
//
// Conventions (see bandpo_lut/tables.py and the table header for the stored quantities):
//   t = logit(p) and s = log(δ) are the table coordinates; the KL table stores, as uniform cubic B-spline
//   coefficients, q_up = p·r_up and κ = -p·ln(r_lo)/δ. Closed-form divergences (tv, chi2, hellinger) are
//   evaluated directly (float arithmetic for float inputs, see closed_form_bounds), exact to rounding.
//   Outside |t| ≤ t_max the KL bounds come from the asymptotic forms derived in the comments below.
#pragma once

#include <cstdint>

#include "divergence.h"
#include "fast_math.h"

namespace bandpo {

// Threads per warp, for the GPU kernels' warp tiles and reductions (a ROCm port on CDNA, whose wavefronts are
// 64 wide, changes this and the shuffle masks).
#if defined(__HIP_PLATFORM_AMD__)
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 32;
#endif

// The table as the kernels see it. Plain data: pointers and sizes only, no at::Tensor.
struct TableView {
  const float* coef;  // [2][nt + 2][ns + 2] B-spline coefficients: [0] q_up, [1] κ; row-major
  int nt;             // nodes along t (coefficients: nt + 2)
  int ns;             // nodes along s (coefficients: ns + 2)
  double t_min;       // first t node; nodes are t_min + i·t_step (t_step a power of two: exact)
  double t_step;
  double s_min;  // first s node (log δ_min); nodes s_min + j·s_step
  double s_step;
  double delta_min;  // the table's δ range
  double delta_max;
  bool delta_max_inclusive;
  double valid_min;  // the range ends rounded to the storage type of a per-token δ: a δ that rounds to an
  double valid_max;  // end counts as that end; outside [valid_min, valid_max] a per-token δ yields NaN
};

// Everything a kernel needs besides the element pointers.
struct BandParams {
  TableView table;
  Divergence divergence;
  bool log_input;    // the probability argument holds log p (more accurate for p near 1)
  double max_ratio;  // upper bounds are capped here (+inf: no cap)
  double delta;      // the scalar δ (when no per-token δ tensor is given)
  int delta_js;      // scalar δ: its s-axis cell and B-spline weights, for collapsing the table
  double delta_ws[4];
  const float* cell_f;   // scalar δ, KL: [nt - 1][8] power-basis cubics per t cell (q_up, κ), float
  const double* cell_d;  // the same in double, for float64 inputs
};

// ---- per-δ constants -------------------------------------------------------------------------------
template <typename T>
struct DeltaConsts {
  T delta;     // δ
  T rho0;      // 1 - e^{-δ}: lim_{p→0} q_up, and lim_{p→1} (1 - r_lo)
  T log_rho0;  // log(1 - e^{-δ})
  T exp_neg;   // e^{-δ}
};

template <typename T>
BANDPO_HD DeltaConsts<T> delta_consts(T delta) {
  DeltaConsts<T> c;
  c.delta = delta;
  c.rho0 = -expm1_any(-delta);
  c.log_rho0 = log_any(c.rho0);
  c.exp_neg = T(1) - c.rho0;
  return c;
}

// ---- B-spline pieces -------------------------------------------------------------------------------
// Uniform cubic B-spline basis on one cell, u in [0, 1].
template <typename T>
BANDPO_HD void bspline_weights(T u, T w[4]) {
  const T u2 = u * u, u3 = u2 * u;
  const T sixth = T(1) / T(6);
  w[0] = (T(1) - T(3) * u + T(3) * u2 - u3) * sixth;
  w[1] = (T(3) * u3 - T(6) * u2 + T(4)) * sixth;
  w[2] = (-T(3) * u3 + T(3) * u2 + T(3) * u + T(1)) * sixth;
  w[3] = u3 * sixth;
}

// Cell index and exact in-cell fraction of x on an axis of n nodes. x is first clamped into the axis
// (NaN goes to the first cell; callers propagate NaN through other terms). The fraction is computed from
// the node position, which is exact for a dyadic step, rather than from (x - x0)/h, which would round.
template <typename T>
BANDPO_HD int axis_cell(T x, double x0, double step, int n, T& u) {
  const T lo = T(x0), hi = T(x0 + (n - 1) * step);
  const T xc = (x >= lo) ? ((x <= hi) ? x : hi) : lo;
  const T inv = T(1.0 / step);
  int i = static_cast<int>((xc - lo) * inv);
  i = i < 0 ? 0 : (i > n - 2 ? n - 2 : i);
  const T xi = lo + T(i) * T(step);  // exact for a dyadic step (the t axis); rounded once otherwise
  T f = (xc - xi) * inv;
  u = f < T(0) ? T(0) : (f > T(1) ? T(1) : f);
  return i;
}

// Collapse the s axis at a fixed δ and convert cell `k` of the t axis to power-basis cubics:
// out[0..3] for q_up and out[4..7] for κ, value = a0 + u·(a1 + u·(a2 + u·a3)). Done once per (table, δ).
BANDPO_HD void collapse_cell(const TableView& tb, int k, int js, const double ws[4], double out[8]) {
  const int ncol = tb.ns + 2;
  for (int b = 0; b < 2; ++b) {
    const float* base = tb.coef + static_cast<std::int64_t>(b) * (tb.nt + 2) * ncol;
    double d[4];
    for (int a = 0; a < 4; ++a) {
      const float* row = base + static_cast<std::int64_t>(k + a) * ncol + js;
      d[a] = ws[0] * load_ro(row) + ws[1] * load_ro(row + 1) + ws[2] * load_ro(row + 2) + ws[3] * load_ro(row + 3);
    }
    out[4 * b + 0] = (d[0] + 4.0 * d[1] + d[2]) / 6.0;
    out[4 * b + 1] = (d[2] - d[0]) / 2.0;
    out[4 * b + 2] = (d[0] - 2.0 * d[1] + d[2]) / 2.0;
    out[4 * b + 3] = (-d[0] + 3.0 * d[1] - 3.0 * d[2] + d[3]) / 6.0;
  }
}

// s-axis cell and weights for a scalar δ (host side, double).
BANDPO_HD int delta_weights(const TableView& tb, double delta, double ws[4]) {
  double u;
  const int js = axis_cell<double>(log_any(delta), tb.s_min, tb.s_step, tb.ns, u);
  bspline_weights<double>(u, ws);
  return js;
}

// Full tensor-product evaluation (per-token δ) at cells (it, js) with in-cell fractions (ut, us).
template <typename T>
BANDPO_HD void spline2d_cells(const TableView& tb, int it, T ut, int js, T us, T& q_up, T& kappa) {
  T wt[4], ws[4];
  bspline_weights<T>(ut, wt);
  bspline_weights<T>(us, ws);
  const int ncol = tb.ns + 2;
  T acc[2];
  for (int b = 0; b < 2; ++b) {
    const float* base = tb.coef + static_cast<std::int64_t>(b) * (tb.nt + 2) * ncol;
    T sum = T(0);
    for (int a = 0; a < 4; ++a) {
      const float* row = base + static_cast<std::int64_t>(it + a) * ncol + js;
      sum += wt[a] * (ws[0] * T(load_ro(row)) + ws[1] * T(load_ro(row + 1)) + ws[2] * T(load_ro(row + 2)) +
                      ws[3] * T(load_ro(row + 3)));
    }
    acc[b] = sum;
  }
  q_up = acc[0];
  kappa = acc[1];
}

// q_up and κ at (t, s).
template <typename T>
BANDPO_HD void spline2d(const TableView& tb, T t, T s, T& q_up, T& kappa) {
  T ut, us;
  const int it = axis_cell<T>(t, tb.t_min, tb.t_step, tb.nt, ut);
  const int js = axis_cell<T>(s, tb.s_min, tb.s_step, tb.ns, us);
  spline2d_cells<T>(tb, it, ut, js, us, q_up, kappa);
}

// ---- probability inputs ----------------------------------------------------------------------------
// A log-probability in (0, kLogProbRounding] is read as 0 (p = 1): trainers and inference engines produce
// such values by rounding (a log-softmax of large logits, bfloat16 storage), and exp of any of them rounds to
// 1 in bfloat16 (half its ulp at 1 is 2^-9). Above it a log-probability is invalid and gives NaN. 2^-9 is
// exact in every dtype the ops take, so the rule is the same in each. Mirrored by the reference
// (bandpo_lut/reference/bounds.py, LOG_PROB_ROUNDING).
constexpr double kLogProbRounding = 0.001953125;  // 2^-9

// p, 1 - p and t = logit(p) from either p or log p. From log p, 1 - p = -expm1(log p) keeps its relative
// precision for p near 1, where p itself rounds to 1. Out-of-domain inputs become NaN.
template <bool LOG, typename T>
BANDPO_HD void prob_terms_t(T x, T& p, T& one_minus_p, T& t) {
  const T nan = T(0) / T(0);
  if (LOG) {
    x = ((x > T(0)) & (x <= T(kLogProbRounding))) ? T(0) : x;
    p = exp_any(x);
    one_minus_p = -expm1_any(x);
    t = x - log_any(one_minus_p);
    p = (x > T(0)) ? nan : p;
  } else {
    p = x;
    one_minus_p = T(1) - x;
    t = log_any(x / one_minus_p);
    p = ((x < T(0)) | (x > T(1))) ? nan : p;
  }
  one_minus_p = (p != p) ? nan : one_minus_p;
  t = (p != p) ? nan : t;
}

template <typename T>
BANDPO_HD void prob_terms(T x, bool log_input, T& p, T& one_minus_p, T& t) {
  if (log_input) {
    prob_terms_t<true, T>(x, p, one_minus_p, t);
  } else {
    prob_terms_t<false, T>(x, p, one_minus_p, t);
  }
}

// ---- KL ----------------------------------------------------------------------------------------------
// Tails beyond the grid, from the exact equation p·log(p/q) + (1-p)·log((1-p)/(1-q)) = δ:
//  * upper, p → 0: q = ρ0 + ε with ε = p·e^{-δ}·(1 + δ + log q - log p) + O(ε²), ρ0 = 1 - e^{-δ};
//    used at t < -t_max (p < 1e-6) in single precision (see kl_tail_upper). Double precision then iterates
//    the exact fixed point q ← 1 - (1-p)·exp(-(δ - p·log(p/q))/(1-p)), which contracts by about p/q.
//  * lower, p → 1: -ln r = (δ + (1-p)·log1p(p(1-r)/(1-p)))/p (exact); with 1 - r ≈ ρ0 and
//    log1p(pρ0/ε) = t + log ρ0 + ε/(pρ0) + O(ε²), ε = 1 - p, no extra transcendental is needed.
//  * upper for t > t_max is 1/p and lower for t < -t_max underflows to 0 (checked by the generator).
template <typename T>
BANDPO_HD void kl_tail_upper(T p, T t, const DeltaConsts<T>& c, T& q) {
  // ε = p·e^{-δ}·(1 + δ + log q - log p); the expansion parameter is p/ρ0 (not p), so log q is taken as
  // log ρ0 + ε₁/ρ0 from a first pass, which leaves an O(p·(ε/ρ0)²) error.
  const T tt = t < T(-1000) ? T(-1000) : t;
  const T base = T(1) + c.delta + c.log_rho0 - tt;
  const T eps1 = p * c.exp_neg * base;
  q = c.rho0 + p * c.exp_neg * (base + eps1 / c.rho0);
}

template <typename T>
BANDPO_HD T kl_tail_lower_log(T inv_p, T one_minus_p, T t, const DeltaConsts<T>& c) {
  const T tt = t > T(1000) ? T(1000) : t;
  return -(c.delta + one_minus_p * (tt + c.log_rho0 + one_minus_p * inv_p / c.rho0)) * inv_p;
}

// Double-precision refinements of the tails by the exact fixed points (scalar code paths only).
BANDPO_HD double kl_refine_upper(double p, double one_minus_p, double q, double delta) {
  for (int i = 0; i < 3; ++i) q = 1.0 - one_minus_p * exp_any(-(delta - p * log_any(p / q)) / one_minus_p);
  return q;
}

BANDPO_HD double kl_refine_lower(double p, double one_minus_p, double r, double delta) {
  for (int i = 0; i < 3; ++i) r = exp_any(-(delta + one_minus_p * log1p_any(p * (1.0 - r) / one_minus_p)) / p);
  return r;
}

// KL bounds from the value pair (q_up, κ) interpolated at the clamped t, plus the tails.
template <typename T>
BANDPO_HD void kl_finish(T p, T one_minus_p, T t, T q_tab, T kappa, const DeltaConsts<T>& c, const TableView& tb, T& lo,
                         T& up) {
  const T tmax = T(tb.t_min + (tb.nt - 1) * tb.t_step), tmin = T(tb.t_min);
  T q = q_tab < p ? p : (q_tab > T(1) ? T(1) : q_tab);
  T q_tail;
  kl_tail_upper<T>(p, t, c, q_tail);
  q = (t < tmin) ? q_tail : q;
  // One division serves every quotient below. It is taken of p·2^k, which keeps it finite for subnormal p
  // (a float32 p < 2.9e-39, where 1/p overflows but q/p does not); scaling by a power of two is exact, so
  // elsewhere these are the bits of q·(1/p).
  const T scale = sizeof(T) == 4 ? T(16777216.0) : T(1152921504606846976.0);  // 2^24, 2^60
  const T inv_ps = T(1) / (p * scale);
  const T inv_p = inv_ps * scale;
  up = (t > tmax) ? inv_p : (q * scale) * inv_ps;
  T L = -(c.delta * inv_p) * kappa;
  L = (t > tmax) ? kl_tail_lower_log<T>(inv_p, one_minus_p, t, c) : L;
  lo = exp_any(L);
  lo = (one_minus_p == T(0)) ? c.exp_neg : lo;
}

// ---- closed forms (tv, chi2, hellinger) -----------------------------------------------------------------
// Evaluated directly in the arithmetic type T: float for float32 p (and the 16-bit types), double for float64.
// The CPU loop (csrc/cpu/closed_form_cpu.h) and the GPU kernels (band_element.h closed_form) share this code.
//
// Saturation: the exact tests p·f(1/p) + (1-p)·f(0) ≤ δ (upper) and p·f(0) + (1-p)·f(1/(1-p)) ≤ δ (lower),
// written out per divergence. tv and chi2 take the upper one as a minimum (1 + δ/p ≥ 1/p exactly when
// 1 - p ≤ δ; 1 + w ≥ 1/p exactly when 1 - p ≤ δp): both sides meet at the boundary, so rounding can move
// the switch only where the two agree to rounding. The lower tests are the sign of the gap below.
//
// The hard case is the lower bound near saturation: a tiny r_lo resting on gap = p - δ·(1 - x) (tv: x = 0,
// chi2: x = p, hellinger: x = δ/4) with p within a factor 2 of δ, the difference of nearly equal numbers.
// Why float is enough there (gap_p_minus_delta_times), for a float p, which is exact:
//  * δ enters as hi + lo (DeltaPair): a scalar δ is a double, and rounding it to float alone would move the
//    saturation point by up to 2^-24·δ, an unbounded relative error of a gap of that size. With the pair,
//    |δ - hi - lo| ≤ 2^-24·|lo| ≤ 2^-24·|δ - hi|, and every float p is at least |δ - hi| from δ (hi is the
//    float nearest δ), so this residue is at most 2^-24 of |p - δ|: the pair is exact to rounding for tv.
//  * p - hi is exact (Sterbenz: p within a factor 2 of hi), the fma adds hi·x to it exactly and rounds once,
//    and the remaining terms lo·(x - 1) + hi·x_lo are below 2^-23·δ, so their rounding is below 2^-47·δ.
//  So gap = (p - δ(1-x))·(1 + θ), |θ| ≤ 2·2^-24, plus at most ~2^-46·δ absolute (zero for tv and for any
//  float δ, i.e. every per-token δ inside the range); the double version of the same code had ~2^-53·δ. The
//  rest of each lower bound is a product of well-conditioned factors (no cancellation), a few roundings each.
// Bounds measured against an exact-gap float64 reference over 10^6 points (tests/test_closed_forms_f32.py):
// see that test for the ulp figures it asserts.
//
// Quotients by p go through 1/(p·2^k) (as in kl_finish), so that a subnormal float p, where 1/p overflows
// although δ/p and δ(1-p)/p may not, still gives finite bounds; scaling by 2^k is exact.

// δ = hi + lo, lo = 0 when δ is a T (a per-token δ inside the range, or any δ in double).
template <typename T>
struct DeltaPair {
  T hi;  // δ rounded to T
  T lo;  // δ - hi rounded to T: |δ - hi - lo| ≤ 2^-24·|lo|
};

template <typename T>
BANDPO_HD DeltaPair<T> delta_pair(double d) {
  const T hi = static_cast<T>(d);
  return {hi, static_cast<T>(d - static_cast<double>(hi))};
}

// A per-token δ within the range as its dtype rounds it, moved onto the range it stands for (as
// delta_in_range, but onto the ends as double values, given as pairs: lo_end, hi_end = delta_pair(range end)).
// For a float d and a double end e = e.hi + e.lo: d < e exactly when d < e.hi, or d == e.hi and e.lo > 0.
template <typename T>
BANDPO_HD DeltaPair<T> delta_pair_in_range(const DeltaPair<T>& lo_end, const DeltaPair<T>& hi_end, T d) {
  const bool below = (d < lo_end.hi) | ((d == lo_end.hi) & (lo_end.lo > T(0)));
  const bool above = (d > hi_end.hi) | ((d == hi_end.hi) & (hi_end.lo < T(0)));
  DeltaPair<T> r;
  r.hi = below ? lo_end.hi : (above ? hi_end.hi : d);
  r.lo = below ? lo_end.lo : (above ? hi_end.lo : T(0));
  return r;
}

template <typename T>
BANDPO_HD DeltaPair<T> delta_pair_in_range(const TableView& tb, T d) {
  return delta_pair_in_range<T>(delta_pair<T>(tb.delta_min), delta_pair<T>(tb.delta_max), d);
}

BANDPO_HD float fma_any(float a, float b, float c) { return fmaf(a, b, c); }
BANDPO_HD double fma_any(double a, double b, double c) { return fma(a, b, c); }
BANDPO_HD float sqrt_any(float x) { return sqrtf(x); }
BANDPO_HD double sqrt_any(double x) { return sqrt(x); }

// p and 1 - p from a probability (not its log), with prob_terms_t's domain rule; the closed forms need no t.
template <typename T>
BANDPO_HD void prob_and_complement(T x, T& p, T& one_minus_p) {
  const T nan = T(0) / T(0);
  p = ((x < T(0)) | (x > T(1))) ? nan : x;
  one_minus_p = (p != p) ? nan : T(1) - x;
}

// p - δ·(1 - x) for δ = d.hi + d.lo and x = x_hi + x_lo (see above for why it is exact to rounding where it
// is small): one rounding of (p - d.hi) + d.hi·x_hi, then the small terms.
template <typename T>
BANDPO_HD T gap_p_minus_delta_times(T p, const DeltaPair<T>& d, T x_hi, T x_lo) {
  return fma_any(d.hi, x_hi, p - d.hi) + (d.lo * (x_hi - T(1)) + d.hi * x_lo);
}

template <typename T>
BANDPO_HD void closed_form_bounds(Divergence div, T p, T one_minus_p, const DeltaPair<T>& d, T& lo, T& up) {
  const T scale = sizeof(T) == 4 ? T(16777216.0) : T(1152921504606846976.0);  // 2^24, 2^60
  const T root_scale = sizeof(T) == 4 ? T(4096.0) : T(1073741824.0);         // √scale
  const T inv_ps = T(1) / (p * scale);
  const T inv_p = inv_ps * scale;
  switch (div) {
    case Divergence::kTV: {  // r = 1 ± δ/p
      const T gap = gap_p_minus_delta_times<T>(p, d, T(0), T(0));  // p - δ
      const T up_open = T(1) + (d.hi * scale) * inv_ps;
      up = up_open < inv_p ? up_open : inv_p;
      lo = (gap <= T(0)) ? T(0) : gap / p;
      break;
    }
    case Divergence::kChi2: {  // r = 1 ± w, w = sqrt(δ(1-p)/p); 1 - w = (p - δ(1-p))/(p·(1 + w))
      const T w = sqrt_any((d.hi * one_minus_p) * inv_ps) * root_scale;
      const T gap = gap_p_minus_delta_times<T>(p, d, p, T(0));  // p - δ(1-p)
      const T up_open = T(1) + w;
      up = up_open < inv_p ? up_open : inv_p;
      lo = (gap <= T(0)) ? T(0) : gap / (p * up_open);
      break;
    }
    case Divergence::kHellinger: {
      // √(p·r) = √p·cos α ± √(1-p)·sin α with cos α = 1 - δ/2, sin²α = δ(1 - δ/4). Divided by √p: √r = cos α ± v,
      // v = sqrt(sin²α·(1-p)/p); cos²α - v² = (p - sin²α)/p, so √r_lo = gap/(p·(cos α + v)): no cancellation.
      // The upper bound saturates (1/p) once √p ≥ cos α.
      const T ca = T(1) - T(0.5) * d.hi, s2 = d.hi * (T(1) - T(0.25) * d.hi);
      const T v = sqrt_any((s2 * one_minus_p) * inv_ps) * root_scale;
      const T gap = gap_p_minus_delta_times<T>(p, d, T(0.25) * d.hi, T(0.25) * d.lo);  // p - δ(1 - δ/4)
      const T c = ca + v;
      const T root_lo = gap / (p * c);
      up = (p >= ca * ca) ? inv_p : c * c;
      lo = (gap <= T(0)) ? T(0) : root_lo * root_lo;
      break;
    }
    case Divergence::kKL:  // no closed form (read from the table): never called for it
      lo = up = T(0) / T(0);
      return;
  }
  up = (one_minus_p == T(0)) ? T(1) : up;  // p = 1 exactly
  lo = (p == T(0)) ? T(0) : lo;
}

// ---- clamp with torch.clamp's NaN semantics ---------------------------------------------------------
template <typename T>
BANDPO_HD T clamp_like_torch(T x, T lo, T up) {
  T y = x < lo ? lo : x;
  y = y > up ? up : y;
  y = (lo != lo) ? lo : y;  // NaN bounds propagate, as torch.clamp's do
  y = (up != up) ? up : y;
  return (x != x) ? x : y;
}

template <typename T>
BANDPO_HD bool delta_valid(const TableView& tb, T d) {
  // Bitwise, no conditional on the (loop-invariant) flag: the CPU loops around this must vectorise.
  const bool hi_ok = (d < T(tb.valid_max)) | ((d == T(tb.valid_max)) & tb.delta_max_inclusive);
  return (d >= T(tb.valid_min)) & hi_ok;
}

// A per-token δ within the range as its dtype rounds it, moved onto the range it stands for.
template <typename T>
BANDPO_HD T delta_in_range(const TableView& tb, T d) {
  const T lo = T(tb.delta_min), hi = T(tb.delta_max);
  return d < lo ? lo : (d > hi ? hi : d);
}

}  // namespace bandpo
