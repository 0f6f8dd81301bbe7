// KL with a scalar δ read from cells in p's float bits, for every backend: no t = logit p (a division and a
// logarithm per element) on the grid.
//
// x = min(p, 1 - p) (1 - p is exact for p >= 1/2); the cell is x's exponent and its top kBits mantissa bits
// (2^kBits cells per binade), with one set of cells for p <= 1/2 (side 0) and one for p > 1/2 (side 1); the fraction
// in the cell is the remaining mantissa bits as a float in [0, 1), exact. Each cell holds the cubics of q_up and κ in
// that fraction ([q0..q3, κ0..κ3], the narrow cells' layout), interpolated once per (table, δ) at four Chebyshev
// nodes (fit_bit_cell): tools/bit_cells_fit.py measures that such cubics stay within ~1e-8 of the spline.
//
// From x_lo (where t reaches the grid's end, |t| = t_max) up, the cells carry the collapsed spline (narrow_cells_at);
// the cell that holds x_lo only its part above x_lo (a cubic across the spline's end would fit its kink). Side 0 may
// also have cells below that one, down to the smallest normal float (BitGrid::x_tail_lo; the CPU's layout): the upper
// bound's tail (kl_tail_upper, in double) with κ held at its value at the grid's end. An element that no cell covers
// takes the tails (kl_bits_tails), and only it forms t.
//
// Layouts: the CPU kernels keep side 0's cells down to 2^-126, so that rare tokens take the main path too
// (csrc/cpu/simd/bit_cells.h); the GPU kernels stage the cells in shared memory and start both sides at x_lo's cell
// (csrc/cuda/cells_cuda.cu), the elements below it taking the tails behind a branch, as beyond the grid in t.
//
// Per-token δ (the GPU kernels, and the CPU's AVX2 kernel: csrc/cpu/simd/bit_patches.h): δ has cells in its float bits
// as x does, from the cell of the table's δ_min to that of δ_max, and each pair (cell of x, cell of δ) a patch: the
// bicubics of q_up and κ in the two fractions, fitted once per table to the tensor-product spline (fit_bit_patch;
// 12.8 MB for the shipped table). An element reads one patch: no logarithm of δ, no B-spline weights
// (kl_bits_token_delta).
#pragma once

#include <cmath>
#include <cstdint>

#include "bandpo_math.h"

namespace bandpo {

constexpr double kBitCellsTolerance = 1e-7;

// The grid for a table (host): false where the table's t grid is not symmetric (one x_lo for both sides) or its
// end lies outside (1e-30, 0.25). tail_cells: side 0's cells go on below x_lo's cell down to the smallest normal
// float.
inline bool bit_grid_for(const TableView& tb, bool tail_cells, BitGrid& g) {
  const double t_min = tb.t_min, t_max = tb.t_min + (tb.nt - 1) * tb.t_step;
  if (!(tb.nt >= 2 && t_min < 0.0 && t_max == -t_min)) return false;
  const double x_lo = 1.0 / (1.0 + std::exp(t_max));  // x where |t| = t_max
  float xf = static_cast<float>(x_lo);
  if (static_cast<double>(xf) < x_lo) xf = std::nextafter(xf, 1.0f);
  if (!(xf > 1e-30f && xf < 0.25f)) return false;
  const std::int32_t lo_key = float_to_bits(xf) >> BitGrid::kShift;
  const float min_normal = bits_to_float(0x00800000);
  g.first_key = tail_cells ? float_to_bits(min_normal) >> BitGrid::kShift : lo_key;
  g.side_cells = (float_to_bits(0.5f) >> BitGrid::kShift) - g.first_key + 1;
  g.x_lo = xf;
  g.x_cell = bits_to_float(lo_key << BitGrid::kShift);
  g.x_tail_lo = tail_cells ? min_normal : bits_to_float(0x7f800000);
  g.d_lo = static_cast<float>(tb.delta_min);
  g.d_hi = static_cast<float>(tb.delta_max);
  if (!(g.d_lo >= min_normal && g.d_lo <= g.d_hi && g.d_hi < 1e30f)) return false;
  g.d_first_key = float_to_bits(g.d_lo) >> BitGrid::kShift;
  g.d_cells = (float_to_bits(g.d_hi) >> BitGrid::kShift) - g.d_first_key + 1;
  return true;
}

// 0.5·(1 - cos(π(2i + 1)/8)), i < 4: the four Chebyshev nodes of [0, 1] every fit here interpolates at (a function:
// a namespace-scope array is not visible to device code)
BANDPO_HD double chebyshev_node4(int i) {
  constexpr double kNodes[4] = {0.03806023374435663, 0.3086582838174551, 0.6913417161825448, 0.9619397662556434};
  return kNodes[i];
}

// Where the cell of `key` (a float's bits >> kShift) begins, and its width: 1/2^kBits of its binade.
BANDPO_HD void bit_key_span(std::int32_t key, double& start, double& width) {
  start = static_cast<double>(bits_to_float(key << BitGrid::kShift));
  width = static_cast<double>(bits_to_float((key >> BitGrid::kBits) << 23)) / (1 << BitGrid::kBits);
}

// Cell c's place (0 <= c < 2·side_cells): its side, start x0 and width w in x, the fraction f_lo where its fitted part
// begins (x_lo inside x_lo's cell, else 0), and whether it lies below x_lo's cell (side 0's tail cells). Side 1 has
// no cells below x_lo's cell in use (its elements there take the tails): such a cell is given x_lo's cell's place, so
// that it holds finite values.
struct BitCellPlace {
  int side;
  bool tail;
  double x0, w, f_lo;
};

BANDPO_HD BitCellPlace bit_cell_place(const BitGrid& g, int c) {
  const int side = c >= g.side_cells ? 1 : 0;
  const std::int32_t lo_key = float_to_bits(g.x_cell) >> BitGrid::kShift;
  std::int32_t key = g.first_key + (c - side * g.side_cells);
  if (side == 1 && key < lo_key) key = lo_key;
  BitCellPlace pl;
  pl.side = side;
  pl.tail = key < lo_key;
  bit_key_span(key, pl.x0, pl.w);
  pl.f_lo = pl.tail ? 0.0 : fmax(0.0, (static_cast<double>(g.x_lo) - pl.x0) / pl.w);
  return pl;
}

// t = logit x on the grid for the side's p (p = x on side 0, 1 - x on side 1), clamped to the grid.
BANDPO_HD double bit_cell_t(const TableView& tb, int side, double x) {
  const double t = log_any(x) - log1p_any(-x);
  const double ts = side ? -t : t;
  return fmin(fmax(ts, tb.t_min), tb.t_min + (tb.nt - 1) * tb.t_step);
}

// Two cubics in the fraction over [f_lo, 1] into out[0..3] and out[4..7], through four Chebyshev nodes of what
// value_at(f, a, b) gives; returns their largest relative difference from it at 9 check points (NaN for NaN values).
template <typename ValueAt>
BANDPO_HD double fit_cell_cubics(double f_lo, const ValueAt& value_at, float out[8]) {
  constexpr int n = 4;
  double nodes[n], ya[n], yb[n], ca[n], cb[n];
  for (int i = 0; i < n; ++i) {
    nodes[i] = f_lo + (1.0 - f_lo) * chebyshev_node4(i);
    value_at(nodes[i], ya[i], yb[i]);
  }
  solve_vandermonde<n>(nodes, ya, ca);
  solve_vandermonde<n>(nodes, yb, cb);
  for (int j = 0; j < n; ++j) {
    out[j] = static_cast<float>(ca[j]);
    out[4 + j] = static_cast<float>(cb[j]);
  }
  double worst = 0.0;
  for (int i = 0; i <= 8; ++i) {  // check points: the fitted part's ends and 7 between
    const double f = f_lo + (1.0 - f_lo) * i / 8.0;
    double a, b;
    value_at(f, a, b);
    const double fa = ca[0] + f * (ca[1] + f * (ca[2] + f * ca[3]));
    const double fb = cb[0] + f * (cb[1] + f * (cb[2] + f * cb[3]));
    const double da = fabs(fa / a - 1.0), db = fabs(fb / b - 1.0);
    if (!(da == da && db == db)) {  // a damaged table
      const double zero = 0.0;
      return zero / zero;
    }
    worst = fmax(worst, fmax(da, db));
  }
  return worst;
}

// The scalar-δ cubics of cell c (q_up, κ) into out[8], fitted to what the cell carries: the collapsed spline
// `cell_d` (see collapse_cell) from x_lo up, the upper bound's tail of δ's constants `dc` (with κ held at the grid's
// end) in side 0's tail cells; returns the fit's error (fit_cell_cubics).
BANDPO_HD double fit_bit_cell(const TableView& tb, const double* cell_d, const DeltaConsts<double>& dc,
                              const BitGrid& g, int c, float out[8]) {
  const BitCellPlace pl = bit_cell_place(g, c);
  double kappa_end, q_unused;
  narrow_cells_at(tb, cell_d, tb.t_min, q_unused, kappa_end);
  return fit_cell_cubics(
      pl.f_lo,
      [&](double f, double& q, double& kappa) {
        const double x = pl.x0 + pl.w * f;
        if (pl.tail) {
          kl_tail_upper<double>(x, log_any(x) - log1p_any(-x), dc, q);
          kappa = kappa_end;
        } else {
          narrow_cells_at(tb, cell_d, bit_cell_t(tb, pl.side, x), q, kappa);
        }
      },
      out);
}

// Per-token δ: the patch of p's cell c and δ's cell k (0 <= k < d_cells; δ's cells are in its float bits as x's,
// from the cell of δ_min through that of δ_max, each fitted over its part in [d_lo, d_hi]): for q_up and κ the bicubic
// in the two fractions (f for x, g for δ) through 4 × 4 Chebyshev nodes of the table's tensor-product spline, as
// out[16·plane + 4·n + m], the coefficient of f^m·g^n; returns the largest relative difference from the spline at
// 7 × 7 check points (NaN for NaN values). No tail cells: the per-token cells start at x_lo's.
constexpr int kPatchValues = 32;
// The patches of a table whose ranges are far wider than the shipped one's (12.8 MB) would be a large allocation per
// device (and per process on the CPU): such a table reads its spline.
constexpr double kMaxPatchBytes = 256.0 * 1024 * 1024;

// Whether a table's per-token patches exist: its grid without tail cells (bit_grid_for), and their size in bounds.
inline bool bit_patch_grid(const TableView& tb, BitGrid& g) {
  return bit_grid_for(tb, /*tail_cells=*/false, g) &&
         2.0 * g.side_cells * g.d_cells * kPatchValues * sizeof(float) <= kMaxPatchBytes;
}

BANDPO_HD double fit_bit_patch(const TableView& tb, const BitGrid& g, int c, int k, float out[kPatchValues]) {
  constexpr int n = 4;
  const BitCellPlace pl = bit_cell_place(g, c);
  double d0, dw;
  bit_key_span(g.d_first_key + k, d0, dw);
  const double g_lo = fmax(0.0, (static_cast<double>(g.d_lo) - d0) / dw);
  double g_hi = fmin(1.0, (static_cast<double>(g.d_hi) - d0) / dw);
  // δ_max at its cell's start (a power of two): the spline is constant past it, the cubic fits that
  g_hi = g_hi - g_lo < 1.0 / 1024 ? 1.0 : g_hi;
  const double s_max = tb.s_min + (tb.ns - 1) * tb.s_step;
  const auto value_at = [&](double f, double gd, double v[2]) {
    double ut, us;
    const int it = axis_cell<double>(bit_cell_t(tb, pl.side, pl.x0 + pl.w * f), tb.t_min, tb.t_step, tb.nt, ut);
    const double s = fmin(fmax(log_any(d0 + dw * gd), tb.s_min), s_max);
    const int js = axis_cell<double>(s, tb.s_min, tb.s_step, tb.ns, us);
    spline2d_cells<double>(tb, it, ut, js, us, v[0], v[1]);
  };
  double fn[n], gn[n], val[2][n][n];
  for (int i = 0; i < n; ++i) {
    fn[i] = pl.f_lo + (1.0 - pl.f_lo) * chebyshev_node4(i);
    gn[i] = g_lo + (g_hi - g_lo) * chebyshev_node4(i);
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double v[2];
      value_at(fn[i], gn[j], v);
      val[0][i][j] = v[0];
      val[1][i][j] = v[1];
    }
  }
  double coef[2][n][n];  // [plane][n: power of g][m: power of f]
  for (int b = 0; b < 2; ++b) {
    double in_g[n][n];  // [i: f node][n]
    for (int i = 0; i < n; ++i) solve_vandermonde<n>(gn, val[b][i], in_g[i]);
    for (int q = 0; q < n; ++q) {
      double y[n], cm[n];
      for (int i = 0; i < n; ++i) y[i] = in_g[i][q];
      solve_vandermonde<n>(fn, y, cm);
      for (int m = 0; m < n; ++m) coef[b][q][m] = cm[m];
    }
  }
  for (int b = 0; b < 2; ++b)
    for (int q = 0; q < n; ++q)
      for (int m = 0; m < n; ++m) out[16 * b + 4 * q + m] = static_cast<float>(coef[b][q][m]);
  double worst = 0.0;
  for (int i = 0; i <= 6; ++i) {
    for (int j = 0; j <= 6; ++j) {
      const double f = pl.f_lo + (1.0 - pl.f_lo) * i / 6.0, gd = g_lo + (g_hi - g_lo) * j / 6.0;
      double v[2];
      value_at(f, gd, v);
      for (int b = 0; b < 2; ++b) {
        double acc = 0.0;
        for (int q = n - 1; q >= 0; --q) {
          const double a = coef[b][q][0] + f * (coef[b][q][1] + f * (coef[b][q][2] + f * coef[b][q][3]));
          acc = acc * gd + a;
        }
        const double d = fabs(acc / v[b] - 1.0);
        if (!(d == d)) {  // a damaged table
          const double zero = 0.0;
          return zero / zero;
        }
        worst = fmax(worst, d);
      }
    }
  }
  return worst;
}

// p, 1 - p and what t would be formed from (the log-probability after the rounding rule, or p), with prob_terms_t's
// domain rule; t itself is formed by the tails only.
template <bool LOG, bool HAVE_EXP = false>
BANDPO_HD void prob_terms_bits(float x, float& p, float& one_minus_p, float& arg, float exp_x = 0.0f) {
  const float nan = bits_to_float(0x7fc00000);
  if (LOG) {
    const bool rounded = (x > 0.0f) & (x <= static_cast<float>(kLogProbRounding));
    x = rounded ? 0.0f : x;
    p = HAVE_EXP ? (rounded ? 1.0f : exp_x) : exp_any(x);
    one_minus_p = -expm1_any(x);
    p = (x > 0.0f) ? nan : p;
  } else {
    x = x + 0.0f;  // -0 -> +0 (prob_terms_t)
    p = ((x < 0.0f) | (x > 1.0f)) ? nan : x;
    one_minus_p = 1.0f - x;
  }
  one_minus_p = (p != p) ? nan : one_minus_p;
  arg = x;
}

// The elements no cell covers (kl_bits_finish): side 0 (p <= 1/2) below x_lo, where the upper bound is its tail and
// the lower bound 0 (r_lo underflows float64 there: bandpo_lut.tables.reader), and side 1 below x_lo, where the upper
// bound is 1/p and the lower bound its tail (kl_tail_lower_log; e^{-δ} at p = 1); NaN p keeps the main path's NaN.
// The side, not t, decides: t of an x just below x_lo may round onto the grid's end.
// `consts()` gives the δ constants (a per-token δ's: an expm1 and a log, here only).
template <bool LOG, typename Consts>
BANDPO_HD_COLD KlBounds<float> kl_bits_tails(float p, float one_minus_p, float arg, bool side, float inv_ps,
                                             Consts consts, KlBounds<float> b) {
  if (p != p) return b;
  const DeltaConsts<float> c = consts();
  const float scale = 16777216.0f;  // as in kl_finish
  const float t = LOG ? arg - log_any(one_minus_p) : log_any(arg / one_minus_p);
  if (!side) {
    float q_tail;
    kl_tail_upper<float>(p, t, c, q_tail);
    b.up = (q_tail * scale) * inv_ps;
    b.lo = 0.0f;
  } else {
    const float inv_p = inv_ps * scale;
    b.up = inv_p;
    b.lo = exp_any(kl_tail_lower_log<float>(inv_p, one_minus_p, t, c));
    b.lo = (one_minus_p == 0.0f) ? c.exp_neg : b.lo;
  }
  return b;
}

// An element's place in the cells: x = min(p, 1 - p), its side (p > 1/2; false for NaN), its cell (clamped into the
// side's cells: x below the first cell, 0 and NaN read a cell whose values the tails or the NaN replace) and the
// fraction, the mantissa bits below the cell's (exact).
struct BitCellOf {
  float x;
  bool side;
  int cell;
  float u;
};

BANDPO_HD BitCellOf bit_cell_of(const BitGrid& g, float p, float one_minus_p) {
  BitCellOf e;
  e.side = one_minus_p < p;
  e.x = e.side ? one_minus_p : p;
  const std::int32_t b = float_to_bits(e.x);
  int k = (b >> BitGrid::kShift) - g.first_key;
  k = k < 0 ? 0 : (k > g.side_cells - 1 ? g.side_cells - 1 : k);
  e.cell = k + (e.side ? g.side_cells : 0);
  e.u = static_cast<float>(b & ((1 << BitGrid::kShift) - 1)) * (1.0f / (1 << BitGrid::kShift));
  return e;
}

// The bounds from the cells' (q_up, κ) (kl_finish_branched's main path: q clamped to [p, 1], one reciprocal of
// p·2^24, e^L), and for the elements no cell covers the tails, with the δ constants `consts()` (called only there).
template <bool LOG, typename Consts>
BANDPO_HD void kl_bits_finish(const BitGrid& g, const BitCellOf& e, float p, float one_minus_p, float arg, float q_tab,
                              float kappa, float delta, const Consts& consts, float& lo, float& up) {
  const float q = q_tab < p ? p : (q_tab > 1.0f ? 1.0f : q_tab);
  const float scale = 16777216.0f;                  // as in kl_finish
  const float inv_ps = rcp_scaled_prob(p * scale);  // 1/(p·2^24)
  up = (q * scale) * inv_ps;
  lo = exp_any(-(delta * (inv_ps * scale)) * kappa);
  const bool covered = (e.x >= g.x_lo) | (!e.side & (e.x >= g.x_tail_lo) & (e.x < g.x_cell));
  if (!covered) {
    const KlBounds<float> b = kl_bits_tails<LOG>(p, one_minus_p, arg, e.side, inv_ps, consts, KlBounds<float>{lo, up});
    lo = b.lo;
    up = b.up;
  }
}

// The bounds of one element (before the cap) from p or log p (LOG; HAVE_EXP: exp_x is exp_any(x)), reading the
// scalar-δ cells of `g` (2·side_cells rows of 8 floats): one exponential and two cubics on the main path.
template <bool LOG, bool HAVE_EXP = false>
BANDPO_HD void kl_bits_scalar_delta(const BitGrid& g, const float* cells, const DeltaConsts<float>& c, float x,
                                    float& lo, float& up, float exp_x = 0.0f) {
  float p, one_minus_p, arg;
  prob_terms_bits<LOG, HAVE_EXP>(x, p, one_minus_p, arg, exp_x);
  const BitCellOf e = bit_cell_of(g, p, one_minus_p);
  const float* a = cells + 8 * e.cell;
  const float u = e.u;
  const float q = a[0] + u * (a[1] + u * (a[2] + u * a[3]));
  const float kappa = a[4] + u * (a[5] + u * (a[6] + u * a[7]));
  kl_bits_finish<LOG>(g, e, p, one_minus_p, arg, q, kappa, c.delta, [c] { return c; }, lo, up);
}

// Per-token δ (already on the table's range, delta_in_range): the patch of p's cell and δ's cell (`patches`:
// [2·side_cells][d_cells][kPatchValues], fit_bit_patch), its two bicubics at the element's fractions. No logarithm of
// δ, no B-spline weights: δ's cell and fraction come from its bits as x's do.
template <bool LOG, bool HAVE_EXP = false>
BANDPO_HD void kl_bits_token_delta(const BitGrid& g, const float* patches, float x, float delta, float& lo, float& up,
                                   float exp_x = 0.0f) {
  float p, one_minus_p, arg;
  prob_terms_bits<LOG, HAVE_EXP>(x, p, one_minus_p, arg, exp_x);
  const BitCellOf e = bit_cell_of(g, p, one_minus_p);
  const std::int32_t db = float_to_bits(delta);
  int kd = (db >> BitGrid::kShift) - g.d_first_key;
  kd = kd < 0 ? 0 : (kd > g.d_cells - 1 ? g.d_cells - 1 : kd);
  const float gd = static_cast<float>(db & ((1 << BitGrid::kShift) - 1)) * (1.0f / (1 << BitGrid::kShift));
#if defined(__CUDA_ARCH__)
  using Index = int;  // 32-bit offsets: cells × δ cells × 32 stays far below 2^31 (bit_grid_for's ranges)
#else
  using Index = std::int64_t;
#endif
  const float* a = patches + (static_cast<Index>(e.cell) * g.d_cells + kd) * kPatchValues;
  const float f = e.u;
  float v[2];
  for (int b = 0; b < 2; ++b) {
    float acc = 0.0f;
    for (int q = 3; q >= 0; --q) {
      float r[4];  // the f-cubic of g^q: 16 bytes, 16-byte aligned in the device array
      load_ro4(a + 16 * b + 4 * q, r);
      const float c = r[0] + f * (r[1] + f * (r[2] + f * r[3]));
      acc = q == 3 ? c : fma_any(acc, gd, c);
    }
    v[b] = acc;
  }
  kl_bits_finish<LOG>(
      g, e, p, one_minus_p, arg, v[0], v[1], delta, [delta] { return delta_consts<float>(delta); }, lo, up);
}

}  // namespace bandpo
