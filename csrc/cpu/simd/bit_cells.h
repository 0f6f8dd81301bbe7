// The CPU's cells in p's bits (csrc/kl_bit_cells.h): side 0's cells go on below x_lo's cell down to the smallest normal
// float, so that a rare token takes the main path (the AVX2 kernel's tails' pass is left with p -> 1 below x_lo, the
// part of x_lo's cell below x_lo, subnormal p and x = 0). Fitted once per (table, δ) on the host and cached with the
// narrow cells (cell_polys); a table whose fit misses kBitCellsTolerance, or whose t grid is not symmetric, keeps the
// cells in t.
#pragma once

#include <cstddef>
#include <vector>

#include "cpu/simd/cache_lines.h"
#include "kl_bit_cells.h"

namespace bandpo {

// What the cells hold is scaled for the kernel's one division, by p·2^24 (kl_simd_body.inc kl_up_scaled_v): q_up
// times 2^24 (exact) and κ times -δ·2^24 (the coefficients scaled in double, rounded once more), so that the upper
// bound and the lower bound's exponent are one multiplication each by 1/(p·2^24).
constexpr double kBitCellScale = 16777216.0;  // 2^24, the kernel's kProbScale (simd_common.h)

struct BitCells {
  LineAlignedFloats cells;  // [2 * grid.side_cells][8]: side 0 (p <= 1/2), then side 1 (p > 1/2); each cell's
                            // two cubics interleaved, [q0 κ0 q1 κ1 q2 κ2 q3 κ3] (table_gather.h cubics_from_pairs),
                            // scaled: 2^24·q_up and -δ·2^24·κ
  BitGrid grid;             // side 0 from 2^-126 (x_tail_lo), side 1's cells below x_lo's cell unused
  double fit_error = 0.0;   // the largest relative difference from what each cell carries
};

// Two cubics' coefficients a[0..3], b[0..3] as the AVX2 kernel reads them: out = [a0 b0 a1 b1 a2 b2 a3 b3]
// (table_gather.h cubics_from_pairs).
inline void interleave_cubics(const float* a, const float* b, float* out) {
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = a[j];
    out[2 * j + 1] = b[j];
  }
}

// Fit the bit cells from the narrow ones (collapse_cell's `cell_d`) and δ's tail; returns whether the fit meets
// kBitCellsTolerance.
inline bool fit_bit_cells(const TableView& tb, const double* cell_d, double delta, BitCells& out) {
  if (!bit_grid_for(tb, /*tail_cells=*/true, out.grid)) return false;
  const int n = 2 * out.grid.side_cells;
  out.cells.assign(static_cast<std::size_t>(n) * 8, 0.0f);
  const DeltaConsts<double> dc = delta_consts<double>(delta);
  double worst = 0.0;
  for (int c = 0; c < n; ++c) {
    float fit[8];  // fit_bit_cell's order: q0..q3, then κ0..κ3
    const double e = fit_bit_cell(tb, cell_d, dc, out.grid, c, fit);
    for (int j = 0; j < 4; ++j) {
      fit[j] = static_cast<float>(kBitCellScale * fit[j]);
      fit[4 + j] = static_cast<float>(-delta * kBitCellScale * fit[4 + j]);
    }
    interleave_cubics(fit, fit + 4, &out.cells[static_cast<std::size_t>(c) * 8]);
    worst = (e > worst || e != e) ? e : worst;
    if (e != e) break;
  }
  out.fit_error = worst;
  return worst <= kBitCellsTolerance;  // NaN (a damaged table) fails too
}

}  // namespace bandpo
