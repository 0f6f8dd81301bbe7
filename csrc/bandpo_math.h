// The band's math, written once for the CPU loops and the CUDA kernels (host-device inline functions).
//
// Conventions (see bandpo_lut/tables/generate.py and the table header for the stored quantities):
//   t = logit(p) and s = log(δ) are the table coordinates; the KL table stores, as uniform cubic B-spline
//   coefficients, q_up = p·r_up and κ = -p·ln(r_lo)/δ. Closed-form divergences (tv, chi2, hellinger) are
//   evaluated directly (float arithmetic for float inputs, see closed_form_bounds), exact to rounding.
//   Outside |t| ≤ t_max the KL bounds come from the asymptotic forms derived in the comments below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

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

BANDPO_HD float fma_any(float a, float b, float c) { return fmaf(a, b, c); }
BANDPO_HD double fma_any(double a, double b, double c) { return fma(a, b, c); }
BANDPO_HD float sqrt_any(float x) { return sqrtf(x); }
BANDPO_HD double sqrt_any(double x) { return sqrt(x); }

struct WideCells;   // csrc/cpu/simd/wide_cells.h
struct BitCells;    // csrc/cpu/simd/bit_cells.h
struct BitPatches;  // csrc/cpu/simd/bit_patches.h

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

// The s axis for a per-token float δ, without the two roundings that `axis_cell(log δ)` makes in float: that of
// s = log δ itself (up to 2.4e-7 for |s| in [4, 8)) and that of the node positions s_min + j·h for a step h that is
// not a float (up to ~2e-7 at the far end). Both move the upper bound by as much relatively where p << δ (there
// q_up ≈ 1 - e^{-δ}, whose log-derivative in s is ≈ 1). Instead, with log δ = e·ln 2 + log z as the kernel's log
// splits it (e a whole number, |log z| < 0.36), the position x = (log δ - s_min)/h is e·A + (log z)/h - B,
// A = ln 2/h and B = s_min/h, kept in two parts: x_int = e·A_hi - B_hi, exact (A_hi and B_hi are multiples of
// 2^-k small enough for every e of the table's δ range), and x_small = (log z)/h + e·A_lo - B_lo, small. The cell
// is j = ⌊x_int + x_small⌋ (held in the axis) and its fraction u = (x_int - j) + x_small: one rounding of a number
// below 1. A j off by one where x lies within an ulp of a node leaves u just outside [0, 1], where the cubic of
// the neighbouring cell agrees with the spline to O(ε³): u is not clamped.
struct TokenSAxis {
  float a_hi, a_lo;      // ln 2/h
  float b_hi, b_lo;      // s_min/h
  float inv_hi, inv_lo;  // 1/h
  int last;              // last cell: ns - 2
};

// δ for the closed forms (closed_form_bounds): itself as a pair, and the lower bound's saturation point p*
// as a pair.
template <typename T>
struct ClosedDelta {
  T hi;      // δ rounded to T
  T lo;      // δ - hi rounded to T: 0 exactly when δ is a T (then closed_gap uses hi alone)
  T sat_hi;  // p* (tv: δ, chi2: δ/(1+δ), hellinger: δ(1 - δ/4)) rounded to T; used only when lo != 0
  T sat_lo;  // p* - sat_hi rounded to T
};

// Where the scalar-δ KL cells in p's bits lie (csrc/kl_bit_cells.h; plain data, for the kernels). Cell k of side s
// covers the x whose bits >> kShift are first_key + k; side 1's cells follow side 0's.
struct BitGrid {
  static constexpr int kBits = 4;            // 2^kBits cells per binade of x
  static constexpr int kShift = 23 - kBits;  // the mantissa bits below the cell's: the fraction
  std::int32_t first_key;                    // bits >> kShift of the first cell's start, on both sides
  int side_cells;                            // per side: from the first cell through the cell of x = 1/2
  float x_lo;                                // the least x on the grid (|t| <= t_max): a float, rounded up
  float x_cell;                              // where x_lo's cell begins
  float x_tail_lo;  // side 0's cells below x_cell begin here (the upper bound's tail); +inf where there are none
  // Per-token δ (the GPU's patches, kl_bit_cells.h fit_bit_patch): δ's cells in its float bits, as x's
  std::int32_t d_first_key;  // bits >> kShift of the cell of δ_min (the table's, as a float)
  int d_cells;               // δ's cells from there through the cell of δ_max
  float d_lo, d_hi;          // the table's δ range as a float δ is moved onto it (delta_in_range)
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
  const float* cell_f;        // scalar δ, KL: [nt - 1][8] power-basis cubics per t cell (q_up, κ), float
  const double* cell_d;       // the same in double, for float64 inputs
  const WideCells* wide;      // CPU only (csrc/cpu/simd/wide_cells.h): the same re-cut into 32 wide cells, or null
  const BitCells* bits;       // CPU only (csrc/cpu/simd/bit_cells.h): the same re-cut into cells in p's bits, or null
  BitGrid bit_grid;           // where the cells in p's bits lie: the CPU's (`bits`), or the GPU's (kCellsBits kernels)
  const float* token_cubics;  // CPU only, per-token δ, KL: the t-cubic table (table_gather.h), or null
  const BitPatches* token_bits;  // CPU only, per-token δ, KL: the patches in p's and δ's bits (bit_patches.h), or null
  TokenSAxis s_axis;             // the table's s axis for a per-token float δ (token_s_axis, on the host)
  ClosedDelta<float> closed_f[3];  // closed forms in float: the scalar δ, δ_min, δ_max (closed_delta, on the host)
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

#if defined(__CUDA_ARCH__)
// min(max(f, 0), 1) for a number f (a NaN would give 0): one saturating instruction on the GPU.
__device__ __forceinline__ float saturate_unit(float f) { return __saturatef(f); }
__device__ __forceinline__ double saturate_unit(double f) { return f < 0.0 ? 0.0 : (f > 1.0 ? 1.0 : f); }
#endif

// One axis of n nodes x0 + i·step in the arithmetic type T, converted from the table's double fields once: the
// GPU kernels build these per thread (GridConsts), since their compilers otherwise convert the fields again at
// every use, for every element.
template <typename T>
struct AxisConsts {
  T lo, hi;       // the first and the last node
  T inv;          // 1/step, rounded from double
  T step;         // the step, rounded to T (exact for the dyadic t step)
  int last_cell;  // n - 2
};

template <typename T>
BANDPO_HD AxisConsts<T> axis_consts(double x0, double step, int n) {
  return AxisConsts<T>{T(x0), T(x0 + (n - 1) * step), T(1.0 / step), T(step), n - 2};
}

// Cell index and exact in-cell fraction of x on an axis of n nodes. x is first clamped into the axis
// (NaN goes to the first cell; callers propagate NaN through other terms). The fraction is computed from
// the node position, which is exact for a dyadic step, rather than from (x - x0)/h, which would round.
template <typename T>
BANDPO_HD int axis_cell(T x, const AxisConsts<T>& a, T& u) {
  const T below_hi = (x <= a.hi) ? x : a.hi;
  const T xc = (x >= a.lo) ? below_hi : a.lo;
  int i = static_cast<int>((xc - a.lo) * a.inv);
#if defined(__CUDA_ARCH__)
  // The same clamps in fewer instructions: integer min/max, and saturation to [0, 1] (f is never NaN: xc is a number).
  i = ::min(::max(i, 0), a.last_cell);
  const T xi = a.lo + T(i) * a.step;
  u = saturate_unit((xc - xi) * a.inv);
#else
  i = i < 0 ? 0 : (i > a.last_cell ? a.last_cell : i);
  const T xi = a.lo + T(i) * a.step;  // exact for a dyadic step (the t axis); rounded once otherwise
  T f = (xc - xi) * a.inv;
  u = f < T(0) ? T(0) : (f > T(1) ? T(1) : f);
#endif
  return i;
}

template <typename T>
BANDPO_HD int axis_cell(T x, double x0, double step, int n, T& u) {
  return axis_cell<T>(x, axis_consts<T>(x0, step, n), u);
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

// The collapsed spline (narrow power-basis cubics `cell_d`, see collapse_cell) at t, in double.
BANDPO_HD void narrow_cells_at(const TableView& tb, const double* cell_d, double t, double& q, double& kappa) {
  double u;
  const int k = axis_cell<double>(t, tb.t_min, tb.t_step, tb.nt, u);
  const double* a = cell_d + 8 * k;
  q = a[0] + u * (a[1] + u * (a[2] + u * a[3]));
  kappa = a[4] + u * (a[5] + u * (a[6] + u * a[7]));
}

// Solve the n×n Vandermonde system V·c = y (Gaussian elimination with partial pivoting; the nodes are Chebyshev
// points of a short interval, so the system is small and well conditioned).
template <int n>
BANDPO_HD void solve_vandermonde(const double* nodes, const double* y, double* c) {
  double a[n][n + 1];
  for (int i = 0; i < n; ++i) {
    double pw = 1.0;
    for (int j = 0; j < n; ++j, pw *= nodes[i]) a[i][j] = pw;
    a[i][n] = y[i];
  }
  for (int col = 0; col < n; ++col) {
    int piv = col;
    for (int r = col + 1; r < n; ++r)
      if (fabs(a[r][col]) > fabs(a[piv][col])) piv = r;
    for (int j = 0; j <= n; ++j) {
      const double s = a[col][j];
      a[col][j] = a[piv][j];
      a[piv][j] = s;
    }
    for (int r = col + 1; r < n; ++r) {
      const double f = a[r][col] / a[col][col];
      for (int j = col; j <= n; ++j) a[r][j] -= f * a[col][j];
    }
  }
  for (int i = n - 1; i >= 0; --i) {
    double s = a[i][n];
    for (int j = i + 1; j < n; ++j) s -= a[i][j] * c[j];
    c[i] = s / a[i][i];
  }
}

// s-axis cell and weights for a scalar δ (host side, double).
BANDPO_HD int delta_weights(const TableView& tb, double delta, double ws[4]) {
  double u;
  const int js = axis_cell<double>(log_any(delta), tb.s_min, tb.s_step, tb.ns, u);
  bspline_weights<double>(u, ws);
  return js;
}

// Full tensor-product evaluation (per-token δ) at cells (it, js) with in-cell fractions (ut, us). The sum is taken of
// the differences from the patch's coefficient (1, 1), which is added last: Σ w_a·w_b·c_ab = c_11 + Σ w_a·w_b·(c_ab -
// c_11), the weights summing to 1; the weights' rounding and the sum's then act on differences of a few per cent of
// the value (in float, ~4e-7 relative becomes ~1e-7).
template <typename T>
BANDPO_HD void spline2d_cells(const TableView& tb, int it, T ut, int js, T us, T& q_up, T& kappa) {
  T wt[4], ws[4];
  bspline_weights<T>(ut, wt);
  bspline_weights<T>(us, ws);
#if defined(__CUDA_ARCH__)
  using Index = int;  // 32-bit offsets: the CUDA entry points refuse tables of 2^31 floats or more
#else
  using Index = std::int64_t;
#endif
  const Index ncol = tb.ns + 2;
  // Row (it + a, js) of plane b is coef + b·(nt + 2)·ncol + (it + a)·ncol + js: one pointer for the patch's first
  // row, and offsets a·ncol and (nt + 2)·ncol that do not depend on the element (the GPU hoists them out of its
  // element loop instead of forming an index product and a widening per row).
  const float* const first = tb.coef + static_cast<Index>(it) * ncol + js;
  const Index plane = static_cast<Index>(tb.nt + 2) * ncol;
  T acc[2];
  for (int b = 0; b < 2; ++b) {
    const T c11 = T(load_ro(first + (b * plane + ncol + 1)));
    T sum = T(0);
    for (int a = 0; a < 4; ++a) {
      const float* row = first + (b * plane + a * ncol);
      sum += wt[a] * (ws[0] * (T(load_ro(row)) - c11) + ws[1] * (T(load_ro(row + 1)) - c11) +
                      ws[2] * (T(load_ro(row + 2)) - c11) + ws[3] * (T(load_ro(row + 3)) - c11));
    }
    acc[b] = c11 + sum;
  }
  q_up = acc[0];
  kappa = acc[1];
}

// e as the kernels' logs split a positive normal float x (csrc/cpu/simd/simd_common.h kLogOff: z in
// [0.69921875, 1.3984375)).
BANDPO_HD int token_log_exponent(float x) { return (float_to_bits(x) - 0x3f330000) >> 23; }

inline TokenSAxis token_s_axis(const TableView& tb) {
  const double h = tb.s_step, a = 0.6931471805599453 / h, b = tb.s_min / h;
  const float d_lo = static_cast<float>(tb.delta_min), d_hi = static_cast<float>(tb.delta_max);
  const int e_abs = std::max(std::abs(token_log_exponent(d_lo)), std::abs(token_log_exponent(d_hi))) + 1;
  // Every |e·A_hi| and |e·A_hi - B_hi| below 2^(24-k): exact as multiples of 2^-k.
  const double bound = e_abs * std::fabs(a) + std::fabs(b) + 4.0;
  const int k = 23 - static_cast<int>(std::ceil(std::log2(bound)));
  const double unit = std::ldexp(1.0, -k);
  TokenSAxis s;
  s.a_hi = static_cast<float>(std::nearbyint(a / unit) * unit);
  s.a_lo = static_cast<float>(a - s.a_hi);
  s.b_hi = static_cast<float>(std::nearbyint(b / unit) * unit);
  s.b_lo = static_cast<float>(b - s.b_hi);
  s.inv_hi = static_cast<float>(1.0 / h);
  s.inv_lo = static_cast<float>(1.0 / h - s.inv_hi);
  s.last = tb.ns - 2;
  return s;
}

// The s cell and fraction of a per-token δ inside the table's range (TokenSAxis): float δ by its exponent and
// log z, double δ by axis_cell of log δ on s_axis (exact enough in double).
template <typename T>
BANDPO_HD int token_s_cell(const AxisConsts<T>& s_axis, const TokenSAxis& a, T d, T& u);

template <>
BANDPO_HD int token_s_cell<double>(const AxisConsts<double>& s_axis, const TokenSAxis&, double d, double& u) {
  return axis_cell<double>(log_any(d), s_axis, u);
}

template <>
BANDPO_HD int token_s_cell<float>(const AxisConsts<float>&, const TokenSAxis& a, float d, float& u) {
  const int e = token_log_exponent(d);
  const float ef = static_cast<float>(e);
  const float log_z = log_any(bits_to_float(float_to_bits(d) - e * (1 << 23)));  // z = d·2^-e, |log z| < 0.36
  const float x_int = fma_any(ef, a.a_hi, -a.b_hi);                              // exact
  const float x_small = fma_any(log_z, a.inv_hi, fma_any(log_z, a.inv_lo, fma_any(ef, a.a_lo, -a.b_lo)));
  const float x = x_int + x_small;
  int j = x >= 0.0f ? static_cast<int>(x) : 0;
  j = j > a.last ? a.last : j;
  u = (x_int - static_cast<float>(j)) + x_small;
  return j;
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
    x = x + T(0);  // -0 -> +0 (round to nearest), every other x unchanged: p = -0 is p = 0, not 1/p = -inf
    p = x;
    one_minus_p = T(1) - x;
    t = log_any(x / one_minus_p);
    p = ((x < T(0)) | (x > T(1))) ? nan : p;
  }
#if !defined(__CUDA_ARCH__)
  one_minus_p = (p != p) ? nan : one_minus_p;
  t = (p != p) ? nan : t;
#endif
  // On the GPU both selects are left out: t is NaN already wherever p is (the logarithm of a NaN or of a negative
  // number: x/(1-x) < 0 for x outside [0, 1], 1 - p = -expm1(x) < 0 for x above the rounding allowance), and
  // 1 - p is read only beyond the grid (kl_tails), where t is a number and p therefore is one.
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
  // log ρ0 + ε₁/ρ0 from a first pass, which leaves an O(p·(ε/ρ0)²) error. Below p = 1e-30 the correction is
  // under 1e-26, far below half an ulp of ρ0 ≥ 1 - e^{-δ_min}: p is held there, which changes no result and keeps
  // the products out of the subnormal range for p near the smallest normal float.
  const T tt = t < T(-1000) ? T(-1000) : t;
  const T pc = p < T(1e-30) ? T(1e-30) : p;
  const T base = T(1) + c.delta + c.log_rho0 - tt;
  const T eps1 = pc * c.exp_neg * base;
  q = c.rho0 + pc * c.exp_neg * (base + eps1 / c.rho0);
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
                                  const AxisConsts<T>& t_axis, T& lo, T& up) {
  const T tmax = t_axis.hi, tmin = t_axis.lo;
  const T q = q_tab < p ? p : (q_tab > T(1) ? T(1) : q_tab);
  const T scale = sizeof(T) == 4 ? T(16777216.0) : T(1152921504606846976.0);  // as in kl_finish
  const T inv_ps = rcp_scaled_prob(p * scale);                                // T(1) / (p * scale), the same bits
  const T inv_p = inv_ps * scale;
  up = (q * scale) * inv_ps;
  lo = exp_any(-(delta * inv_p) * kappa);
  if ((t < tmin) | (t > tmax)) {
    const KlBounds<T> b = kl_tails<T, Consts>(p, one_minus_p, t, inv_ps, tmin, KlBounds<T>{lo, up}, consts);
    lo = b.lo;
    up = b.up;
  }
}

// ---- closed forms (tv, chi2, hellinger) -----------------------------------------------------------------
// Evaluated directly in the arithmetic type T: float for float32 p (and the 16-bit types), double for float64.
// The CPU loop (csrc/cpu/simd/closed_form_cpu.h) and the GPU kernels (band_element.h closed_form) share this code.
//
// Saturation: the exact tests p·f(1/p) + (1-p)·f(0) ≤ δ (upper) and p·f(0) + (1-p)·f(1/(1-p)) ≤ δ (lower),
// written out per divergence. tv and chi2 take the upper one as a minimum (1 + δ/p ≥ 1/p exactly when
// 1 - p ≤ δ; 1 + w ≥ 1/p exactly when 1 - p ≤ δp): both sides meet at the boundary, so rounding can move
// the switch only where the two agree to rounding. The lower test is the sign of the gap below.
//
// The hard case is the lower bound near saturation: a tiny r_lo resting on the gap g = p - δ·(1 - x) = a·(p - p*)
// (tv: x = 0, a = 1, p* = δ; chi2: x = p, a = 1 + δ, p* = δ/(1+δ); hellinger: x = δ/4, a = 1, p* = δ(1 - δ/4)),
// the difference of nearly equal numbers. Why float arithmetic gives g to rounding (closed_gap), p being exact:
//  * δ a float (every per-token δ inside the range, or a scalar δ that is one): g = fma(δ, x, p - δ), where
//    p - δ is exact (Sterbenz: near saturation p is within a factor 2 of δ) and the fma adds δ·x exactly
//    before its one rounding.
//  * δ not a float (a double scalar δ such as 0.05, or a per-token δ moved onto a range end): the saturation
//    point p* is computed once in double-double (saturation_point) and rounded to a float pair hi + lo, with
//    |p* - hi - lo| ≤ 2^-24·|lo| ≤ 2^-24·|p* - hi|. Every float p is at least |p* - hi| from p* (hi is the
//    float nearest p*), so that residue is at most 2^-24·|p - p*|; p - hi is exact (Sterbenz), and
//    g = a·((p - hi) - lo) has three roundings in all: relative error ≤ ~4·2^-24 however small g is. (With δ
//    rounded to float instead, the saturation point would move by up to 2^-24·δ, an unbounded relative error
//    for gaps of that size.)
// The rest of each lower bound is a product and quotient of well-conditioned factors (no cancellation), and
// the upper bounds have no cancellation; tests/runtime/test_closed_forms_f32.py asserts the resulting ulp bounds
// against an exact-gap float64 reference (itself checked against mpmath).
//
// Quotients by p are taken of p·2^k (as in kl_finish), so that a subnormal float p, where 1/p overflows
// although δ/p and δ(1-p)/p may not, still gives finite bounds; scaling by 2^k is exact. The square roots'
// arguments are true quotients (one rounding fewer than a product with 1/p): chi2's and hellinger's lower
// bounds carry their error, hellinger's squared.

// p* = s + e in double-double (for δ in (0, 1], the closed forms' range), then rounded to a pair of T.
template <typename T>
BANDPO_HD void saturation_point(Divergence div, double d, T& hi, T& lo) {
  double s = d, e = 0.0;
  switch (div) {
    case Divergence::kChi2: {  // δ/(1+δ): 1 + δ = a + a_lo exactly (Fast2Sum, δ ≤ 1); the quotient's remainder
      const double a = 1.0 + d, a_lo = (1.0 - a) + d;  // δ - s·a is exact by fma
      s = d / a;
      e = (fma(-s, a, d) - s * a_lo) / a;
      break;
    }
    case Divergence::kHellinger: {  // δ - δ²/4: δ²/4 = q + q_lo exactly (fma), δ - q by Fast2Sum (δ ≥ q)
      const double q = d * (0.25 * d), q_lo = fma(d, 0.25 * d, -q);
      s = d - q;
      e = ((d - s) - q) - q_lo;
      break;
    }
    case Divergence::kTV:
    case Divergence::kKL:
      break;
  }
  hi = static_cast<T>(s);
  lo = static_cast<T>((s - static_cast<double>(hi)) + e);
}

// In double, δ is exact (lo = 0) and p* is never read.
template <typename T>
BANDPO_HD ClosedDelta<T> closed_delta(Divergence div, double d) {
  ClosedDelta<T> c;
  c.hi = static_cast<T>(d);
  c.lo = static_cast<T>(d - static_cast<double>(c.hi));
  c.sat_hi = c.hi;
  c.sat_lo = T(0);
  if (sizeof(T) < sizeof(double)) saturation_point<T>(div, d, c.sat_hi, c.sat_lo);
  return c;
}

// A per-token δ within the range as its dtype rounds it, moved onto the range it stands for (as
// delta_in_range, but onto the ends as double values: lo_end, hi_end = closed_delta(range end)).
// For a T d and a double end e = e.hi + e.lo: d < e exactly when d < e.hi, or d == e.hi and e.lo > 0.
template <typename T>
BANDPO_HD ClosedDelta<T> closed_delta_in_range(const ClosedDelta<T>& lo_end, const ClosedDelta<T>& hi_end, T d) {
  const bool below = (d < lo_end.hi) | ((d == lo_end.hi) & (lo_end.lo > T(0)));
  const bool above = (d > hi_end.hi) | ((d == hi_end.hi) & (hi_end.lo < T(0)));
  ClosedDelta<T> r;
  r.hi = below ? lo_end.hi : (above ? hi_end.hi : d);
  r.lo = below ? lo_end.lo : (above ? hi_end.lo : T(0));
  r.sat_hi = below ? lo_end.sat_hi : hi_end.sat_hi;  // read only when lo != 0, i.e. only when moved onto an end
  r.sat_lo = below ? lo_end.sat_lo : hi_end.sat_lo;
  return r;
}

template <typename T>
BANDPO_HD ClosedDelta<T> closed_delta_in_range(Divergence div, const TableView& tb, T d) {
  return closed_delta_in_range<T>(closed_delta<T>(div, tb.delta_min), closed_delta<T>(div, tb.delta_max), d);
}

// p and 1 - p from a probability (not its log), with prob_terms_t's domain rule; the closed forms need no t.
template <typename T>
BANDPO_HD void prob_and_complement(T x, T& p, T& one_minus_p) {
  const T nan = T(0) / T(0);
  x = x + T(0);  // -0 -> +0, as in prob_terms_t
  p = ((x < T(0)) | (x > T(1))) ? nan : x;
  one_minus_p = (p != p) ? nan : T(1) - x;
}

// The gap g = p - δ·(1 - x) = a·(p - p*) that decides and sets the lower bound (see above for why it is exact
// to rounding however small it is).
template <typename T>
BANDPO_HD T closed_gap(Divergence div, T p, const ClosedDelta<T>& d) {
  T x = T(0), a = T(1);
  switch (div) {
    case Divergence::kChi2:
      x = p;
      a = T(1) + d.hi;
      break;
    case Divergence::kHellinger:
      x = T(0.25) * d.hi;
      break;
    case Divergence::kTV:
    case Divergence::kKL:
      break;
  }
  const T from_delta = fma_any(d.hi, x, p - d.hi);            // δ = hi exactly
  const T from_saturation = a * ((p - d.sat_hi) - d.sat_lo);  // δ = hi + lo, p* as a pair
  return d.lo == T(0) ? from_delta : from_saturation;
}

template <typename T>
BANDPO_HD void closed_form_bounds(Divergence div, T p, T one_minus_p, const ClosedDelta<T>& d, T& lo, T& up) {
  const T scale = sizeof(T) == 4 ? T(16777216.0) : T(1152921504606846976.0);  // 2^24, 2^60
  const T root_scale = sizeof(T) == 4 ? T(4096.0) : T(1073741824.0);          // √scale
  const T inv_ps = T(1) / (p * scale);
  const T inv_p = inv_ps * scale;
  const T gap = closed_gap<T>(div, p, d);
  switch (div) {
    case Divergence::kTV: {  // r = 1 ± δ/p; 1 - δ/p = g/p
      const T up_open = T(1) + (d.hi * scale) * inv_ps;
      up = up_open < inv_p ? up_open : inv_p;
      lo = (gap <= T(0)) ? T(0) : gap / p;
      break;
    }
    case Divergence::kChi2: {  // r = 1 ± w, w = sqrt(δ(1-p)/p); 1 - w = g/(p·(1 + w))
      const T w = sqrt_any((d.hi * one_minus_p) / (p * scale)) * root_scale;
      const T up_open = T(1) + w;
      up = up_open < inv_p ? up_open : inv_p;
      lo = (gap <= T(0)) ? T(0) : gap / (p * up_open);
      break;
    }
    case Divergence::kHellinger: {
      // √(p·r) = √p·cos α ± √(1-p)·sin α with cos α = 1 - δ/2, sin²α = δ(1 - δ/4). Divided by √p: √r = cos α ± v,
      // v = sqrt(sin²α·(1-p)/p); cos²α - v² = (p - sin²α)/p = g/p, so √r_lo = g/(p·(cos α + v)).
      // The upper bound saturates (1/p) once √p ≥ cos α.
      // sin²α rounded once: by the fma from a δ that is a T, else it is p* (saturation_point, in double-double).
      const T ca = T(1) - T(0.5) * d.hi;
      const T s2 = d.lo == T(0) ? fma_any(T(-0.25) * d.hi, d.hi, d.hi) : d.sat_hi;
      const T v2s = (s2 * one_minus_p) / (p * scale);  // v²/2^k
      const T v = sqrt_any(v2s) * root_scale;
      const T c = ca + v;
      const T root_lo = gap / (p * c);
      // (cos α + v)² as cos α·(cos α + 2v) + v², with v² = v2s·2^k: v's rounding enters once, not squared.
      up = (p >= ca * ca) ? inv_p : fma_any(ca, ca + T(2) * v, v2s * scale);
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

// A per-token δ's range in the arithmetic type (the table's double fields converted once, as AxisConsts).
template <typename T>
struct DeltaRange {
  T valid_min, valid_max;  // TableView's, in T
  T lo, hi;                // delta_min, delta_max in T
  bool max_inclusive;
};

template <typename T>
BANDPO_HD DeltaRange<T> delta_range(const TableView& tb) {
  return DeltaRange<T>{T(tb.valid_min), T(tb.valid_max), T(tb.delta_min), T(tb.delta_max), tb.delta_max_inclusive};
}

template <typename T>
BANDPO_HD bool delta_valid(const DeltaRange<T>& r, T d) {
  // Bitwise, no conditional on the (loop-invariant) flag: the CPU loops around this must vectorise.
  const bool hi_ok = (d < r.valid_max) | ((d == r.valid_max) & r.max_inclusive);
  return (d >= r.valid_min) & hi_ok;
}

template <typename T>
BANDPO_HD bool delta_valid(const TableView& tb, T d) {
  return delta_valid<T>(delta_range<T>(tb), d);
}

// A per-token δ within the range as its dtype rounds it, moved onto the range it stands for.
template <typename T>
BANDPO_HD T delta_in_range(const DeltaRange<T>& r, T d) {
  const T below_hi = d > r.hi ? r.hi : d;  // two selects, not a nested one: no branch on the GPU
  return d < r.lo ? r.lo : below_hi;
}

template <typename T>
BANDPO_HD T delta_in_range(const TableView& tb, T d) {
  return delta_in_range<T>(delta_range<T>(tb), d);
}

}  // namespace bandpo
