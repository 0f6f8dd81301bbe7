// Pieces of the CPU band implementation shared with the fused loss (csrc/cpu/loss_cpu.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "bandpo_math.h"
#include "cpu/wide_cells.h"

// Function multi-versioning: AVX-512 (x86-64-v4), AVX2+FMA (x86-64-v3) and baseline clones, picked at load
// time. The AVX-512 clone, with -mprefer-vector-width=512 (setup.py), runs the vector passes 16 lanes wide:
// measured 1.6x faster than the AVX2 one for the KL clip (2 threads, 24.3 -> 15.0 ms) on this project's Xeon.
// Everything a cloned function calls must be inlined into it (BANDPO_HD, BANDPO_INLINE).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define BANDPO_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BANDPO_CPU_CLONES
#endif
#define BANDPO_INLINE __attribute__((always_inline)) inline

namespace bandpo {

// Scalar-δ KL cell cubics (see collapse_cell), computed once per (table, δ) and cached.
struct CellPolys {
  std::vector<float> f;
  std::vector<double> d;
  std::unique_ptr<WideCells> wide;  // the same re-cut for the SIMD kernel; null where the fit misses
};
std::shared_ptr<const CellPolys> cell_polys(const BandParams& band);

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

// Element i of a run's outputs: the upper bound capped, then the bounds or the clipped ratio (torch.clamp's NaN
// rules), for the blocked loops of band_cpu.cpp and closed_form_cpu.h.
template <bool CLIP>
BANDPO_INLINE void store(const FastRun& run, int64_t i, float l, float u, float cap) {
  u = u > cap ? cap : u;
  if (CLIP) {
    run.out[i] = clamp_like_torch<float>(run.ratio[i], l, u);
  } else {
    run.lo[i] = l;
    run.up[i] = u;
  }
}

// Blocks of kBlock elements; the vectorised passes keep their temporaries on the stack.
constexpr int kBlock = 256;

// Any divergence, either δ mode, from p or log p; the variant for this CPU (cpu_variant.h).
void f32_contiguous(const FastRun& run, bool log_input, bool clip, bool token);

}  // namespace bandpo
