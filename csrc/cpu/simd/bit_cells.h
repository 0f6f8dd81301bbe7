// KL with a scalar δ, re-cut into cells in the float bits of p: for the AVX2 kernel, which then needs no t = logit p
// (a division and a logarithm per element) on the grid, nor in the upper bound's tail.
//
// x = min(p, 1 - p) (1 - p is exact for p >= 1/2); the cell is x's exponent and its top kBits mantissa bits
// (2^kBits cells per binade), with one set of cells for p <= 1/2 and one for p > 1/2; the fraction in the cell is
// the remaining mantissa bits as a float in [0, 1), exact. Each cell holds the cubics of q_up and κ in that fraction
// ([q0..q3, κ0..κ3], the narrow cells' layout), interpolated once per (table, δ) on the host at four Chebyshev
// nodes: tools/bit_cells_fit.py measures that such cubics stay within ~1e-8 of the spline.
//
// Where they come from: from x_lo (where t reaches the grid's end, |t| = t_max) up, the collapsed spline
// (narrow_cells_at); the cell that holds x_lo on its part above x_lo (the spline ends there: a cubic across its end
// would fit the kink). Below that cell, for p -> 0 down to the smallest normal float, the upper bound's tail
// (kl_tail_upper, in double) and κ held at its value at the grid's end, which is what the kernels used there: the
// lower bound underflows to 0 below x_lo (the reader's float64 check). What the cells do not cover takes the tails'
// pass: p -> 1 below x_lo, the part of x_lo's cell below x_lo, subnormal p and x = 0. Every fit is checked; a table
// whose fit misses kBitCellsTolerance, or whose t grid is not symmetric, keeps the blocked loops (cells in t).
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
  static constexpr int kFirstBinade = -126;  // the cells begin at the smallest normal float
  std::vector<float> cells;                  // [2 * side_cells][8]: side 0 (p <= 1/2), then side 1 (p > 1/2)
  int side_cells = 0;                        // per side: binades kFirstBinade .. -2, and the cell of x = 1/2
  std::int32_t base = 0;                     // (bits of 2^kFirstBinade) >> kShift: the first cell's key
  float x_lo = 0.0f;                         // the least x on the grid (|t| <= t_max): a float, rounded up
  float x_cell = 0.0f;                       // where x_lo's cell begins: side 0's tail cells end there
  double fit_error = 0.0;                    // the largest relative difference from what each cell carries
};

constexpr double kBitCellsTolerance = 1e-7;

// Fit the bit cells from the narrow ones (collapse_cell's `cell_d`) and δ's tail; returns whether the fit meets
// kBitCellsTolerance.
inline bool fit_bit_cells(const TableView& tb, const double* cell_d, double delta, BitCells& out) {
  constexpr int per_binade = 1 << BitCells::kBits;
  const double t_min = tb.t_min, t_max = tb.t_min + (tb.nt - 1) * tb.t_step;
  if (!(t_min < 0.0 && t_max == -t_min)) return false;  // one x_lo for both sides
  const double x_lo = 1.0 / (1.0 + std::exp(t_max));    // x where |t| = t_max
  float xf = static_cast<float>(x_lo);
  if (static_cast<double>(xf) < x_lo) xf = std::nextafter(xf, 1.0f);
  if (!(xf > 1e-30f && xf < 0.25f)) return false;
  out.x_lo = xf;
  out.side_cells = (-1 - BitCells::kFirstBinade) * per_binade + 1;
  out.base = (127 + BitCells::kFirstBinade) << BitCells::kBits;
  const int lo_cell = (float_to_bits(xf) >> BitCells::kShift) - out.base;  // the cell that holds x_lo
  out.x_cell = bits_to_float((lo_cell + out.base) << BitCells::kShift);
  out.cells.assign(2 * static_cast<size_t>(out.side_cells) * 8, 0.0f);
  const DeltaConsts<double> dc = delta_consts<double>(delta);
  double kappa_end, q_unused;
  narrow_cells_at(tb, cell_d, t_min, q_unused, kappa_end);
  double worst = 0.0;
  for (int side = 0; side < 2; ++side) {
    for (int c = 0; c < out.side_cells; ++c) {
      const int e = BitCells::kFirstBinade + c / per_binade;
      const double x0 = std::ldexp(1.0 + static_cast<double>(c % per_binade) / per_binade, e);
      const double w = std::ldexp(1.0 / per_binade, e);
      const bool tail = c < lo_cell;  // side 0: the upper bound's tail; side 1: never read (the tails' pass)
      if (tail && side == 1) continue;
      const double f_lo = tail ? 0.0 : std::fmax(0.0, (static_cast<double>(xf) - x0) / w);
      // what the cell carries at x0 + w·f: (q_up, κ)
      const auto value_at = [&](double f, double& q, double& kappa) {
        const double x = x0 + w * f;
        const double t = std::log(x) - std::log1p(-x);
        if (tail) {
          kl_tail_upper<double>(x, t, dc, q);
          kappa = kappa_end;
        } else {
          narrow_cells_at(tb, cell_d, std::fmin(std::fmax(side ? -t : t, t_min), t_max), q, kappa);
        }
      };
      constexpr int n = 4;
      double nodes[n], yq[n], yk[n], cq[n], ck[n];
      for (int i = 0; i < n; ++i) {
        nodes[i] = f_lo + (1.0 - f_lo) * 0.5 * (1.0 - std::cos(M_PI * (2 * i + 1) / (2 * n)));
        value_at(nodes[i], yq[i], yk[i]);
      }
      solve_vandermonde<n>(nodes, yq, cq);
      solve_vandermonde<n>(nodes, yk, ck);
      float* a = &out.cells[(static_cast<size_t>(side) * out.side_cells + c) * 8];
      for (int j = 0; j < n; ++j) {
        a[j] = static_cast<float>(cq[j]);
        a[4 + j] = static_cast<float>(ck[j]);
      }
      for (int i = 0; i <= 8; ++i) {  // check points: the fitted part's ends and 7 between
        const double f = f_lo + (1.0 - f_lo) * i / 8.0;
        double q, kappa;
        value_at(f, q, kappa);
        const double fq = cq[0] + f * (cq[1] + f * (cq[2] + f * cq[3]));
        const double fk = ck[0] + f * (ck[1] + f * (ck[2] + f * ck[3]));
        worst = std::fmax(worst, std::fmax(std::fabs(fq / q - 1.0), std::fabs(fk / kappa - 1.0)));
      }
    }
    for (int c = 0; side == 1 && c < lo_cell; ++c) {  // finite values for lanes the tails' pass overwrites
      for (int j = 0; j < 8; ++j)
        out.cells[(static_cast<size_t>(out.side_cells) + c) * 8 + j] =
            out.cells[(static_cast<size_t>(out.side_cells) + lo_cell) * 8 + j];
    }
  }
  out.fit_error = worst;
  return worst <= kBitCellsTolerance;  // NaN (a damaged table) fails too
}

}  // namespace bandpo
