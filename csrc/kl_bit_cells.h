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
  return true;
}

// The cubics of cell c (0 <= c < 2·side_cells) into out[8], fitted at four Chebyshev nodes to what the cell carries
// (from the collapsed spline `cell_d`, see collapse_cell, or below x_lo's cell the tail of δ's constants `dc`);
// returns the largest relative difference from it at 9 check points (NaN for a damaged table). Side 1 has no cells
// below x_lo's cell in use (its elements there take the tails): such a cell gets x_lo's cell's cubics, finite values.
BANDPO_HD double fit_bit_cell(const TableView& tb, const double* cell_d, const DeltaConsts<double>& dc,
                              const BitGrid& g, int c, float out[8]) {
  constexpr int kPerBinade = 1 << BitGrid::kBits;
  const int side = c >= g.side_cells ? 1 : 0;
  const std::int32_t lo_key = float_to_bits(g.x_cell) >> BitGrid::kShift;
  std::int32_t key = g.first_key + (c - side * g.side_cells);
  if (side == 1 && key < lo_key) key = lo_key;
  const bool tail = key < lo_key;  // side 0 only
  const double x0 = static_cast<double>(bits_to_float(key << BitGrid::kShift));
  const double w = static_cast<double>(bits_to_float((key >> BitGrid::kBits) << 23)) / kPerBinade;
  const double x_lo = static_cast<double>(g.x_lo);
  const double f_lo = tail ? 0.0 : fmax(0.0, (x_lo - x0) / w);
  const double t_min = tb.t_min, t_max = tb.t_min + (tb.nt - 1) * tb.t_step;
  double kappa_end, q_unused;
  narrow_cells_at(tb, cell_d, t_min, q_unused, kappa_end);
  // what the cell carries at x0 + w·f: (q_up, κ)
  const auto value_at = [&](double f, double& q, double& kappa) {
    const double x = x0 + w * f;
    const double t = log_any(x) - log1p_any(-x);
    if (tail) {
      kl_tail_upper<double>(x, t, dc, q);
      kappa = kappa_end;
    } else {
      const double ts = side ? -t : t;
      narrow_cells_at(tb, cell_d, fmin(fmax(ts, t_min), t_max), q, kappa);
    }
  };
  constexpr int n = 4;
  // 0.5·(1 - cos(π(2i + 1)/8)): the Chebyshev nodes of [0, 1]
  constexpr double kNodes[n] = {0.03806023374435663, 0.3086582838174551, 0.6913417161825448, 0.9619397662556434};
  double nodes[n], yq[n], yk[n], cq[n], ck[n];
  for (int i = 0; i < n; ++i) {
    nodes[i] = f_lo + (1.0 - f_lo) * kNodes[i];
    value_at(nodes[i], yq[i], yk[i]);
  }
  solve_vandermonde<n>(nodes, yq, cq);
  solve_vandermonde<n>(nodes, yk, ck);
  for (int j = 0; j < n; ++j) {
    out[j] = static_cast<float>(cq[j]);
    out[4 + j] = static_cast<float>(ck[j]);
  }
  double worst = 0.0;
  for (int i = 0; i <= 8; ++i) {  // check points: the fitted part's ends and 7 between
    const double f = f_lo + (1.0 - f_lo) * i / 8.0;
    double q, kappa;
    value_at(f, q, kappa);
    const double fq = cq[0] + f * (cq[1] + f * (cq[2] + f * cq[3]));
    const double fk = ck[0] + f * (ck[1] + f * (ck[2] + f * ck[3]));
    const double dq = fabs(fq / q - 1.0), dk = fabs(fk / kappa - 1.0);
    if (!(dq == dq && dk == dk)) {  // a damaged table
      const double zero = 0.0;
      return zero / zero;
    }
    worst = fmax(worst, fmax(dq, dk));
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

// The elements no cell covers (kl_bits_scalar_delta): side 0 (p <= 1/2) below x_lo, where the upper bound is its
// tail and the lower bound 0 (r_lo underflows float64 there: bandpo_lut.tables.reader), and side 1 below x_lo, where
// the upper bound is 1/p and the lower bound its tail (kl_tail_lower_log; e^{-δ} at p = 1); NaN p keeps the main
// path's NaN. The side, not t, decides: t of an x just below x_lo may round onto the grid's end.
template <bool LOG>
BANDPO_HD_COLD KlBounds<float> kl_bits_tails(float p, float one_minus_p, float arg, bool side, float inv_ps,
                                             const DeltaConsts<float>& c, KlBounds<float> b) {
  if (p != p) return b;
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

// The bounds of one element (before the cap) from p or log p (LOG; HAVE_EXP: exp_x is exp_any(x)), reading the cells
// of `g` (2·side_cells rows of 8 floats): one exponential and two cubics on the main path.
template <bool LOG, bool HAVE_EXP = false>
BANDPO_HD void kl_bits_scalar_delta(const BitGrid& g, const float* cells, const DeltaConsts<float>& c, float x,
                                    float& lo, float& up, float exp_x = 0.0f) {
  float p, one_minus_p, arg;
  prob_terms_bits<LOG, HAVE_EXP>(x, p, one_minus_p, arg, exp_x);
  const bool side = one_minus_p < p;  // p > 1/2 (false for NaN)
  const float xm = side ? one_minus_p : p;
  const std::int32_t b = float_to_bits(xm);
  int k = (b >> BitGrid::kShift) - g.first_key;  // NaN: clamped below, its bounds are NaN anyway
  k = k < 0 ? 0 : (k > g.side_cells - 1 ? g.side_cells - 1 : k);
  k += side ? g.side_cells : 0;
  const float u = static_cast<float>(b & ((1 << BitGrid::kShift) - 1)) * (1.0f / (1 << BitGrid::kShift));
  const float* a = cells + 8 * k;
  const float q_tab = a[0] + u * (a[1] + u * (a[2] + u * a[3]));
  const float kappa = a[4] + u * (a[5] + u * (a[6] + u * a[7]));
  const float q = q_tab < p ? p : (q_tab > 1.0f ? 1.0f : q_tab);
  const float scale = 16777216.0f;                  // as in kl_finish
  const float inv_ps = rcp_scaled_prob(p * scale);  // 1/(p·2^24)
  up = (q * scale) * inv_ps;
  lo = exp_any(-(c.delta * (inv_ps * scale)) * kappa);
  const bool covered = (xm >= g.x_lo) | (!side & (xm >= g.x_tail_lo) & (xm < g.x_cell));
  if (!covered) {
    const KlBounds<float> b = kl_bits_tails<LOG>(p, one_minus_p, arg, side, inv_ps, c, KlBounds<float>{lo, up});
    lo = b.lo;
    up = b.up;
  }
}

}  // namespace bandpo
