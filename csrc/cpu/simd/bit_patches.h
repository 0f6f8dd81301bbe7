// The CPU's per-token δ patches in the bits of p and δ (csrc/kl_bit_cells.h fit_bit_patch, the GPU's layout: cells
// from x_lo's on both sides, δ's cells from δ_min's): one patch per (cell of x, cell of δ), the bicubics of q_up and κ
// in the two fractions. Fitted once per table on the host (δ does not enter: a patch spans its δ cell) and cached
// (band_cpu.cpp); read by the AVX2 kernel (kl_simd_body.inc kl_token_bits_run_w). A table whose grid does not allow
// them, whose patches would exceed kMaxPatchBytes, or one of whose fits misses kBitCellsTolerance keeps the t-cubic
// table.
//
// The CPU layout of a patch: four rows of 8 floats, row n the coefficients of g^n, q_up's and κ's interleaved
// ([q_0 κ_0 q_1 κ_1 q_2 κ_2 q_3 κ_3], index m the power of f), times 2^24 (exact) as the kernel divides by p·2^24
// (kl_simd_body.inc kl_up_scaled_v): the powers of g are summed with whole rows (one 256-bit multiply-add per power),
// which leaves one cell row per element in the layout of the scalar-δ cells (bit_cells.h, table_gather.h
// cubics_from_pairs).
//
// The tails (x below x_lo) need δ's constants per element (1 - e^{-δ} and its logarithm: kl_tail_upper,
// kl_tail_lower_log): a last row of patches, one per δ cell after the cells of x (fit_tail_patches), carries them as
// cubics in δ's fraction (not scaled), constant in x's, so that the main path's patch read gives a tail element its δ's
// constants in place of q_up and κ (whose tails it does not use) instead of an expm1 and a logarithm of its own δ, or
// a second read.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "cpu/simd/bit_cells.h"  // interleave_cubics
#include "cpu/simd/cache_lines.h"
#include "kl_bit_cells.h"

namespace bandpo {

struct BitPatches {
  LineAlignedFloats patches;  // [2 * grid.side_cells + 1][grid.d_cells][kPatchValues], the CPU layout above; the
                              // last row: the tail patches (fit_tail_patches)
  BitGrid grid;               // bit_patch_grid's
  double fit_error = 0.0;     // the largest relative difference from the spline (fit_bit_patch)
};

// Patches [begin, end) (index c · d_cells + k) in the CPU layout; returns the worst fit error among them (NaN if any
// fit gave NaN).
inline double fit_bit_patches_range(const TableView& tb, const BitGrid& g, std::int64_t begin, std::int64_t end,
                                    float* patches) {
  double worst = 0.0;
  for (std::int64_t i = begin; i < end; ++i) {
    float fit[kPatchValues];  // fit_bit_patch's order: [plane][n][m]
    const double e = fit_bit_patch(tb, g, static_cast<int>(i / g.d_cells), static_cast<int>(i % g.d_cells), fit);
    for (float& v : fit) v *= static_cast<float>(kBitCellScale);
    for (int n = 0; n < 4; ++n) interleave_cubics(fit + 4 * n, fit + 16 + 4 * n, patches + i * kPatchValues + 8 * n);
    if (!(e <= worst)) worst = e;  // NaN sticks
    if (worst != worst) break;
  }
  return worst;
}

// The tail patches: for each of δ's cells (the whole cell: both are smooth for δ > 0) the cubics of ρ0 = -expm1(-δ)
// and log ρ0 in δ's fraction, as a patch whose row n holds their coefficients of g^n where q_0 and κ_0 go, and zeros
// in x's powers: read at any fraction of x it gives (ρ0, log ρ0) where a patch gives (q_up, κ), bit for bit the
// cubics in δ's fraction (the x cubic adds u·0 to them). `out`: d_cells patches; returns the largest relative fit
// error (fit_cell_cubics).
inline double fit_tail_patches(const BitGrid& g, float* out) {
  std::fill(out, out + static_cast<std::size_t>(g.d_cells) * kPatchValues, 0.0f);
  double worst = 0.0;
  for (int k = 0; k < g.d_cells; ++k) {
    double d0, dw;
    bit_key_span(g.d_first_key + k, d0, dw);
    float fit[8];
    const double e = fit_cell_cubics(
        0.0,
        [&](double f, double& a, double& b) {
          a = -std::expm1(-(d0 + dw * f));
          b = std::log(a);
        },
        fit);
    float* const patch = out + static_cast<std::size_t>(k) * kPatchValues;
    for (int n = 0; n < 4; ++n) {
      patch[8 * n] = fit[n];          // ρ0's coefficient of g^n, as q_0
      patch[8 * n + 1] = fit[4 + n];  // log ρ0's, as κ_0
    }
    if (!(e <= worst)) worst = e;
  }
  return worst;
}

}  // namespace bandpo
