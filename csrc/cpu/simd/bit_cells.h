// KL with a scalar δ, re-cut into cells in the float bits of p: for the AVX2 kernel, which then needs no t = logit p
// (a division and a logarithm per element) on the grid.
//
// x = min(p, 1 - p) (1 - p is exact for p >= 1/2); the cell is x's exponent and its top kBits mantissa bits
// (2^kBits cells per binade), with one set of cells for p <= 1/2 and one for p > 1/2; the fraction in the cell is
// the remaining mantissa bits as a float in [0, 1), exact. Each cell holds the cubics of q_up and κ in that fraction
// ([q0..q3, κ0..κ3], the narrow cells' layout), interpolated once per (table, δ) on the host at four Chebyshev
// nodes from the collapsed spline (narrow_cells_at): tools/bit_cells_fit.py measures that such cubics stay within
// ~1e-8 of the spline. The cells begin at x_lo, where t reaches the grid's end; below it (and at x = 0) an element
// is beyond the grid and takes the tails, as before. The cell that holds x_lo is fitted on its part above x_lo
// (the spline ends there: a cubic across its end would fit the kink). Every fit is checked against the spline; a
// table whose fit misses kBitCellsTolerance, or whose t grid is not symmetric, keeps the narrow cells in t.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "bandpo_math.h"
#include "cpu/simd/wide_cells.h"  // narrow_cells_at, solve_vandermonde

namespace bandpo {

struct BitCells {
  static constexpr int kBits = 4;            // 2^kBits cells per binade of x
  static constexpr int kShift = 23 - kBits;  // the mantissa bits below the cell's: the fraction
  std::vector<float> cells;                  // [2 * side_cells][8]: side 0 (p <= 1/2), then side 1 (p > 1/2)
  int side_cells = 0;                        // per side: from x_lo's binade up to the cell of x = 1/2
  std::int32_t base = 0;                     // (bits of 2^e_first) >> kShift: the first cell's key
  float x_lo = 0.0f;                         // the least x on the grid (|t| <= t_max): a float, rounded up
  double fit_error = 0.0;                    // the largest relative difference from the spline at the checks
};

constexpr double kBitCellsTolerance = 1e-7;

// Fit the bit cells from the narrow ones (collapse_cell's `cell_d`); returns whether the fit meets
// kBitCellsTolerance.
inline bool fit_bit_cells(const TableView& tb, const double* cell_d, BitCells& out) {
  constexpr int per_binade = 1 << BitCells::kBits;
  const double t_min = tb.t_min, t_max = tb.t_min + (tb.nt - 1) * tb.t_step;
  if (!(t_min < 0.0 && t_max == -t_min)) return false;  // one x_lo for both sides
  const double x_lo = 1.0 / (1.0 + std::exp(t_max));    // x where |t| = t_max
  float xf = static_cast<float>(x_lo);
  if (static_cast<double>(xf) < x_lo) xf = std::nextafter(xf, 1.0f);
  if (!(xf > 0.0f && xf < 0.25f)) return false;
  const int e_first = std::ilogb(xf);
  out.x_lo = xf;
  out.side_cells = (-1 - e_first) * per_binade + 1;  // binades e_first .. -2, and x = 1/2's cell
  out.base = (127 + e_first) << BitCells::kBits;
  out.cells.assign(2 * static_cast<size_t>(out.side_cells) * 8, 0.0f);
  double worst = 0.0;
  for (int side = 0; side < 2; ++side) {
    int first_used = -1;
    for (int c = 0; c < out.side_cells; ++c) {
      const int e = e_first + c / per_binade;
      const double x0 = std::ldexp(1.0 + static_cast<double>(c % per_binade) / per_binade, e);
      const double w = std::ldexp(1.0 / per_binade, e);
      const double f_lo = std::fmax(0.0, (static_cast<double>(xf) - x0) / w);
      if (f_lo >= 1.0) continue;  // below x_lo: never read for an element on the grid (filled below)
      if (first_used < 0) first_used = c;
      // t at x0 + w·f, on the grid
      const auto t_at = [&](double f) {
        const double x = x0 + w * f;
        const double t = std::log(x) - std::log1p(-x);
        return std::fmin(std::fmax(side ? -t : t, t_min), t_max);
      };
      constexpr int n = 4;
      double nodes[n], yq[n], yk[n], cq[n], ck[n];
      for (int i = 0; i < n; ++i) {
        nodes[i] = f_lo + (1.0 - f_lo) * 0.5 * (1.0 - std::cos(M_PI * (2 * i + 1) / (2 * n)));
        narrow_cells_at(tb, cell_d, t_at(nodes[i]), yq[i], yk[i]);
      }
      solve_vandermonde<n>(nodes, yq, cq);
      solve_vandermonde<n>(nodes, yk, ck);
      float* a = &out.cells[(static_cast<size_t>(side) * out.side_cells + c) * 8];
      for (int j = 0; j < n; ++j) {
        a[j] = static_cast<float>(cq[j]);
        a[4 + j] = static_cast<float>(ck[j]);
      }
      for (int i = 0; i <= 8; ++i) {  // check points: the used part's ends and 7 between
        const double f = f_lo + (1.0 - f_lo) * i / 8.0;
        double q, kappa;
        narrow_cells_at(tb, cell_d, t_at(f), q, kappa);
        const double fq = cq[0] + f * (cq[1] + f * (cq[2] + f * cq[3]));
        const double fk = ck[0] + f * (ck[1] + f * (ck[2] + f * ck[3]));
        worst = std::fmax(worst, std::fmax(std::fabs(fq / q - 1.0), std::fabs(fk / kappa - 1.0)));
      }
    }
    for (int c = 0; c < first_used; ++c) {  // finite values for the index clamp of x below x_lo
      for (int j = 0; j < 8; ++j) {
        out.cells[(static_cast<size_t>(side) * out.side_cells + c) * 8 + j] =
            out.cells[(static_cast<size_t>(side) * out.side_cells + first_used) * 8 + j];
      }
    }
  }
  out.fit_error = worst;
  return worst <= kBitCellsTolerance;  // NaN (a damaged table) fails too
}

}  // namespace bandpo
