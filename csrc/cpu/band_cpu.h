// Pieces of the CPU band implementation shared with the fused loss (csrc/cpu/loss_cpu.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "bandpo_math.h"
#include "macros.h"
#include "cpu/simd/bit_cells.h"
#include "cpu/simd/bit_patches.h"
#include "cpu/simd/wide_cells.h"

namespace bandpo {

// Scalar-δ KL cell cubics (see collapse_cell), computed once per (table, δ) and cached.
struct CellPolys {
  std::vector<float> f;
  std::vector<double> d;
  std::unique_ptr<WideCells> wide;  // the same re-cut for the AVX-512 kernel; null where the fit misses
  std::unique_ptr<BitCells> bits;   // the same re-cut for the AVX2 kernel; null where the fit misses
};
std::shared_ptr<const CellPolys> cell_polys(const BandParams& band);

// What the CPU kernels read besides the table itself, for a KL band (nothing for the closed forms): the scalar δ's
// cell cubics, or the per-token δ's t-cubic table (cpu/simd/table_gather.h) and, for the AVX2 kernel, its patches in
// the bits of p and δ (cpu/simd/bit_patches.h), computed once per table (and δ) and cached; `attach_tables` points
// `band` at them and returns what keeps them alive.
struct CpuTables {
  std::shared_ptr<const CellPolys> cells;
  std::shared_ptr<const LineAlignedFloats> token_cubics;
  std::shared_ptr<const BitPatches> patches;  // null where they do not exist (bit_patches.h)
};
CpuTables attach_tables(BandParams& band, bool per_token);

// A contiguous float32 run for the vectorised loops: bounds (lo/up) or clip (out) of n elements.
struct FastRun {
  const BandParams* band;
  const DeltaConsts<float>* c;
  const float* x;      // p or log p
  const float* delta;  // per-token δ, or null
  const float* ratio;  // clip only
  float* lo;           // bounds only
  float* up;
  float* out;  // clip only
  int64_t n;
};

// clamp_like_torch(x, lo, up) for the band's bounds (lo and up ≥ +0, or NaN), with the lower bound compared on its
// bits, so that a subnormal lower bound is never the operand of a floating-point instruction (see exp_f32).
// Non-negative floats order as their bits do (as signed integers); a negative x is below every lo ≥ +0 except -0
// against +0 (equal: x stays -0, as in clamp_like_torch), so -0 compares as +0. The selects are bit masks: a loop
// the compiler leaves scalar still has no branch that depends on the data.
BANDPO_INLINE float clamp_to_band(float x, float lo, float up) {
  const std::int32_t xi = float_to_bits(x), li = float_to_bits(lo), ui = float_to_bits(up);
  const std::int32_t xs = xi & -static_cast<std::int32_t>(xi != INT32_MIN);
  const std::int32_t below = -static_cast<std::int32_t>(xs < li);
  std::int32_t yi = (li & below) | (xi & ~below);
  const std::int32_t above = -static_cast<std::int32_t>(yi > ui);
  yi = (ui & above) | (yi & ~above);
  const std::int32_t lo_nan = -static_cast<std::int32_t>((li & 0x7fffffff) > 0x7f800000);  // lo != lo
  yi = (li & lo_nan) | (yi & ~lo_nan);
  const float y = (up != up) ? up : bits_to_float(yi);
  return (x != x) ? x : y;
}

// Element i of a run's outputs: the upper bound capped, then the bounds or the clipped ratio (torch.clamp's NaN
// rules), for the blocked loops of band_cpu.cpp and closed_form_cpu.h.
template <bool CLIP>
BANDPO_INLINE void store(const FastRun& run, int64_t i, float l, float u, float cap) {
  u = u > cap ? cap : u;
  if (CLIP) {
    run.out[i] = clamp_to_band(run.ratio[i], l, u);
  } else {
    run.lo[i] = l;
    run.up[i] = u;
  }
}

// Blocks of kBlock elements; the vectorised passes keep their temporaries on the stack.
constexpr int kBlock = 256;

// Any divergence, either δ mode, from p or log p; the code of the variant cpu_variant() picks (cpu_variant.h).
void f32_contiguous(const FastRun& run, bool log_input, bool clip, bool token);

}  // namespace bandpo
