// The band's math, written once for the CPU loops and the CUDA kernels (host-device inline functions).
//
// Conventions (see bandpo_lut/tables.py and the table header for the stored quantities):
//   t = logit(p) and s = log(δ) are the table coordinates; the KL table stores, as uniform cubic B-spline
//   coefficients, q_up = p·r_up and κ = -p·ln(r_lo)/δ. Closed-form divergences (tv, chi2, hellinger) are
//   evaluated directly in double precision, which is faster than the lookup and exact to rounding.
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

struct WideCells;  // csrc/cpu/wide_cells.h

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
  const float* cell_f;    // scalar δ, KL: [nt - 1][8] power-basis cubics per t cell (q_up, κ), float
  const double* cell_d;   // the same in double, for float64 inputs
  const WideCells* wide;  // CPU only (csrc/cpu/wide_cells.h): the same re-cut into 32 wide cells, or null
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
// exp_x: exp_any(x) where the caller has it (LOG only; the fused loss needs p = e^x itself), else computed here.
// A log-probability read as 0 gets p = 1 = exp_any(0) exactly: the same bits either way.
template <bool LOG, typename T, bool HAVE_EXP = false>
BANDPO_HD void prob_terms_t(T x, T& p, T& one_minus_p, T& t, T exp_x = T(0)) {
  const T nan = T(0) / T(0);
  if (LOG) {
    const bool rounded = (x > T(0)) & (x <= T(kLogProbRounding));
    x = rounded ? T(0) : x;
    p = HAVE_EXP ? (rounded ? T(1) : exp_x) : exp_any(x);
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

// A function the GPU kernels call out of line: code for rare elements, kept out of the element loop (its
// instructions and its registers). On the host a plain inline function.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define BANDPO_HD_COLD __host__ __device__ __noinline__
#else
#define BANDPO_HD_COLD inline
#endif

template <typename T>
struct KlBounds {
  T lo, up;
};

// The tails of kl_finish_branched, for an element beyond the grid (t < t_min or t > t_max, or t = +inf at p = 1):
// kl_finish's tail values, by the same expressions. inv_ps = 1/(p·scale) as kl_finish computes it.
template <typename T, typename Consts>
BANDPO_HD_COLD KlBounds<T> kl_tails(T p, T one_minus_p, T t, T inv_ps, T tmin, KlBounds<T> b, Consts consts) {
  const DeltaConsts<T> c = consts();
  const T scale = sizeof(T) == 4 ? T(16777216.0) : T(1152921504606846976.0);  // as in kl_finish
  if (t < tmin) {
    T q_tail;
    kl_tail_upper<T>(p, t, c, q_tail);
    b.up = (q_tail * scale) * inv_ps;
  } else {
    const T inv_p = inv_ps * scale;
    b.up = inv_p;
    b.lo = exp_any(kl_tail_lower_log<T>(inv_p, one_minus_p, t, c));
    b.lo = (one_minus_p == T(0)) ? c.exp_neg : b.lo;
  }
  return b;
}

// kl_finish with the tails behind a branch instead of computed for every element and selected: the same
// values (the same expressions, in the same order), for the GPU, where the common element (|logit p| ≤ t_max)
// then issues none of the tails' instructions (two divisions, their selects and, with a per-token δ, the δ
// constants: `consts()` returns the DeltaConsts of `delta` and is called only beyond the grid), and the tails
// run out of line (kl_tails). The CPU loops keep the branch-free kl_finish, which they vectorise. p = 1
// exactly gives t = +inf, so the p = 1 rule (lo = e^{-δ}) lies in the t > t_max branch; NaN t takes neither.
template <typename T, typename Consts>
BANDPO_HD void kl_finish_branched(T p, T one_minus_p, T t, T q_tab, T kappa, T delta, const Consts& consts,
                                  const TableView& tb, T& lo, T& up) {
  const T tmax = T(tb.t_min + (tb.nt - 1) * tb.t_step), tmin = T(tb.t_min);
  const T q = q_tab < p ? p : (q_tab > T(1) ? T(1) : q_tab);
  const T scale = sizeof(T) == 4 ? T(16777216.0) : T(1152921504606846976.0);  // as in kl_finish
  const T inv_ps = T(1) / (p * scale);
  const T inv_p = inv_ps * scale;
  up = (q * scale) * inv_ps;
  lo = exp_any(-(delta * inv_p) * kappa);
  if ((t < tmin) | (t > tmax)) {
    const KlBounds<T> b = kl_tails<T, Consts>(p, one_minus_p, t, inv_ps, tmin, KlBounds<T>{lo, up}, consts);
    lo = b.lo;
    up = b.up;
  }
}

// ---- closed forms (double) ---------------------------------------------------------------------------
// Saturation is decided by the exact tests p·f(1/p) + (1-p)·f(0) ≤ δ and p·f(0) + (1-p)·f(1/(1-p)) ≤ δ,
// written out per divergence; the lower roots are written without cancellation where possible.
// Near saturation the lower bounds are tiny and rest on a difference of nearly equal numbers: p - δ·x with
// p within a factor 2 of δ. Written as (p - δ) + δ·(1 - x), the first difference is exact (Sterbenz) and the
// product enters exactly (its rounding error recovered by an FMA), so the gap has one rounding.
BANDPO_HD double gap_p_minus_delta_times(double p, double delta, double one_minus_x) {
  const double prod = delta * one_minus_x;
  const double err = fma(delta, one_minus_x, -prod);  // delta·(1-x) = prod + err exactly
  return ((p - delta) + prod) + err;
}

BANDPO_HD void closed_form_bounds(Divergence div, double p, double one_minus_p, double delta, double& lo, double& up) {
  switch (div) {
    case Divergence::kTV: {  // r = 1 ± δ/p
      up = (one_minus_p <= delta) ? 1.0 / p : 1.0 + delta / p;
      lo = (p <= delta) ? 0.0 : (p - delta) / p;
      break;
    }
    case Divergence::kChi2: {  // r = 1 ± sqrt(δ(1-p)/p)
      const double w = sqrt(delta * one_minus_p / p);
      const double gap = gap_p_minus_delta_times(p, delta, p);  // p - δ(1-p)
      up = (one_minus_p <= delta * p) ? 1.0 / p : 1.0 + w;
      lo = (gap <= 0.0) ? 0.0 : gap / (p * (1.0 + w));
      break;
    }
    case Divergence::kHellinger: {  // √q = √p·cos α ± √(1-p)·sin α, cos α = 1 - δ/2
      // a - b is written as (p - sin²α)/(a + b) (a² - b² = p - sin²α): no cancellation near saturation.
      const double ca = 1.0 - 0.5 * delta, s2 = delta * (1.0 - 0.25 * delta);
      const double a = sqrt(p) * ca, b = sqrt(one_minus_p * s2);
      const double gap = gap_p_minus_delta_times(p, delta, 0.25 * delta);  // p - sin²α = p - δ(1 - δ/4)
      const double a_minus_b = gap / (a + b);
      up = (sqrt(p) >= ca) ? 1.0 / p : (a + b) * (a + b) / p;
      lo = (gap <= 0.0) ? 0.0 : a_minus_b * a_minus_b / p;
      break;
    }
    case Divergence::kKL:  // no closed form (read from the table): never called for it
      lo = up = 0.0 / 0.0;
      return;
  }
  if (one_minus_p == 0.0) up = 1.0;  // p = 1 exactly
  if (p == 0.0) lo = 0.0;
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
