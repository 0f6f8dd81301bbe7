// KL with a scalar δ, re-cut for SIMD registers: the table's t axis as 32 wide cells with one degree-6
// polynomial per cell for q_up and for κ, fitted once per (table, δ) on the host.
//
// Why: a vector kernel reads 32 entries of a table held in two registers with one permute (vpermt2ps),
// but cannot afford a gather from the table's 448 narrow cells. Both functions are analytic in t = logit p
// (nearest singularities at distance ~π from the real axis, from p = σ(t)), so seven Chebyshev samples per
// cell of width 0.875 reproduce the collapsed B-spline to a few 1e-8 relative: below the spline's own error.
// Every fit is checked against the spline at 9 points per cell; a table whose fit misses
// kWideCellsTolerance (e.g. a user-generated table over a wider t range) keeps the narrow-cell path.
#pragma once

#include <cmath>
#include <cstddef>

#include "bandpo_math.h"

namespace bandpo {

struct WideCells {
  static constexpr int kCells = 32;
  static constexpr int kDegree = 6;
  float t_min;  // the table's t range, as the kernel's float arithmetic sees it
  float t_max;
  float width;      // cell c starts at fmaf(c, width, t_min) (exact for the shipped grid: 0.875)
  float inv_width;  // 1/width, rounded: used for the cell index only
  // Coefficient-major: q[j][c] is the v^j coefficient of cell c, with v = t - (cell start) in t units (no
  // scaling, which would round), so that coefficient j of all cells is one 32-float row = two 512-bit
  // registers.
  alignas(64) float q[kDegree + 1][kCells];
  alignas(64) float kappa[kDegree + 1][kCells];
  double fit_error;  // the largest relative difference from the spline seen at the check points
};

constexpr double kWideCellsTolerance = 1e-7;

// Fit the wide cells from the narrow ones; returns whether the fit meets kWideCellsTolerance.
inline bool fit_wide_cells(const TableView& tb, const double* cell_d, WideCells& out) {
  constexpr int n = WideCells::kDegree + 1;
  const double t0 = tb.t_min, t1 = tb.t_min + (tb.nt - 1) * tb.t_step;
  const double width = (t1 - t0) / WideCells::kCells;
  out.t_min = static_cast<float>(t0);
  out.t_max = static_cast<float>(t1);
  out.width = static_cast<float>(width);
  out.inv_width = static_cast<float>(1.0 / width);
  double nodes[n];
  for (int i = 0; i < n; ++i) nodes[i] = width * 0.5 * (1.0 + std::cos(M_PI * (i + 0.5) / n));
  double worst = 0.0;
  for (int c = 0; c < WideCells::kCells; ++c) {
    const double start = std::fma(static_cast<float>(c), out.width, out.t_min);  // as the kernel computes it
    double yq[n], yk[n], cq[n], ck[n];
    for (int i = 0; i < n; ++i) narrow_cells_at(tb, cell_d, start + nodes[i], yq[i], yk[i]);
    solve_vandermonde<n>(nodes, yq, cq);
    solve_vandermonde<n>(nodes, yk, ck);
    for (int j = 0; j < n; ++j) {
      out.q[j][c] = static_cast<float>(cq[j]);
      out.kappa[j][c] = static_cast<float>(ck[j]);
    }
    for (int i = 0; i <= 8; ++i) {  // check points: the cell ends and 7 interior points between the nodes
      const double u = width * i / 8.0;
      double q, kappa, fq = 0.0, fk = 0.0;
      narrow_cells_at(tb, cell_d, start + u, q, kappa);
      for (int j = n - 1; j >= 0; --j) {
        fq = fq * u + cq[j];
        fk = fk * u + ck[j];
      }
      worst = std::fmax(worst, std::fmax(std::fabs(fq / q - 1.0), std::fabs(fk / kappa - 1.0)));
    }
  }
  out.fit_error = worst;
  return worst <= kWideCellsTolerance;  // NaN (a damaged table) fails too
}

}  // namespace bandpo
