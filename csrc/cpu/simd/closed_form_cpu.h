// The CPU loop of the closed-form divergences (tv, chi2, hellinger) over a contiguous float32 run, for
// f32_contiguous (band_cpu.cpp), inlined into its AVX-512 / AVX2 / baseline clones.
//
// From p: closed_form_bounds in float, one branch-free pass that GCC vectorises (selects, an fma, a sqrt and
// two divisions per element; no libm call is left with -fno-math-errno, see setup.py), 16 lanes wide in the
// AVX-512 clone. From log p: p = e^x is not exact in float, and the lower bounds near saturation need it to the
// last bit (band_element.h closed_form), so that case stays in double, element by element (scalar libm).
#pragma once

#include <limits>

#include "bandpo_math.h"
#include "cpu/band_cpu.h"

namespace bandpo {
namespace closed_cpu {

// From p, in float.
template <Divergence DIV, bool CLIP, bool PER_TOKEN>
BANDPO_INLINE void run_from_p(const FastRun& run) {
  const BandParams& band = *run.band;
  const float cap = static_cast<float>(band.max_ratio);
  const TableView tb = band.table;
  const ClosedDelta<float> d0 = band.closed_f[0], lo_end = band.closed_f[1], hi_end = band.closed_f[2];
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float* __restrict x = run.x;
  const float* __restrict dl = run.delta;
  for (int64_t i = 0; i < run.n; ++i) {
    float p, one_minus_p, l, u;
    prob_and_complement<float>(x[i], p, one_minus_p);
    const ClosedDelta<float> d = PER_TOKEN ? closed_delta_in_range<float>(lo_end, hi_end, dl[i]) : d0;
    closed_form_bounds<float>(DIV, p, one_minus_p, d, l, u);
    if (PER_TOKEN) {
      const bool ok = delta_valid<float>(tb, dl[i]);
      l = ok ? l : nan;
      u = ok ? u : nan;
    }
    store<CLIP>(run, i, l, u, cap);
  }
}

// From log p, in double (see above).
template <Divergence DIV, bool CLIP, bool PER_TOKEN>
BANDPO_INLINE void run_from_log_p(const FastRun& run) {
  const BandParams& band = *run.band;
  const float cap = static_cast<float>(band.max_ratio);
  const TableView tb = band.table;
  const ClosedDelta<double> d0 = closed_delta<double>(DIV, band.delta);
  const float* __restrict x = run.x;
  const float* __restrict dl = run.delta;
  for (int64_t i = 0; i < run.n; ++i) {
    double p, one_minus_p, t, l, u;
    prob_terms_t<true, double>(static_cast<double>(x[i]), p, one_minus_p, t);
    const ClosedDelta<double> d = PER_TOKEN ? closed_delta_in_range<double>(DIV, tb, static_cast<double>(dl[i])) : d0;
    closed_form_bounds<double>(DIV, p, one_minus_p, d, l, u);
    if (PER_TOKEN) {
      const bool ok = delta_valid<float>(tb, dl[i]);
      l = ok ? l : std::numeric_limits<double>::quiet_NaN();
      u = ok ? u : std::numeric_limits<double>::quiet_NaN();
    }
    store<CLIP>(run, i, static_cast<float>(l), static_cast<float>(u), cap);
  }
}

}  // namespace closed_cpu

// tv, chi2 or hellinger over a contiguous float32 run; LOG: run.x holds log p.
template <Divergence DIV, bool LOG, bool CLIP, bool PER_TOKEN>
BANDPO_INLINE void closed_f32_run(const FastRun& run) {
  if (LOG) {
    closed_cpu::run_from_log_p<DIV, CLIP, PER_TOKEN>(run);
  } else {
    closed_cpu::run_from_p<DIV, CLIP, PER_TOKEN>(run);
  }
}

}  // namespace bandpo
