// One element of the band: (probability or log-probability, δ) -> (lower, upper), for every backend.
//
// `acc_t` is the arithmetic type (float for float32/bfloat16/float16 inputs, double for float64).
// PER_TOKEN selects a per-element δ (full 2-D spline) versus the scalar δ whose s axis was collapsed
// into per-cell cubics (`BandParams::cell_f` / `cell_d`) once per (table, δ).
#pragma once

#include <type_traits>

#include "bandpo_math.h"
#include "kl_bit_cells.h"

namespace bandpo {

template <typename acc_t>
BANDPO_HD const acc_t* cell_table(const BandParams& band);

template <>
BANDPO_HD const float* cell_table<float>(const BandParams& band) {
  return band.cell_f;
}
template <>
BANDPO_HD const double* cell_table<double>(const BandParams& band) {
  return band.cell_d;
}

// The table's grid and δ range and the cap in the arithmetic type: what the element code reads of BandParams'
// double fields, converted once. The GPU kernels build it once per thread (their compilers would convert the
// fields again for every element); band_element without it builds it per call.
template <typename acc_t>
struct GridConsts {
  AxisConsts<acc_t> t, s;   // the t and s axes
  DeltaRange<acc_t> delta;  // a per-token δ's range
  acc_t max_ratio;          // the cap of the upper bound
  acc_t invalid;            // what an invalid per-token δ gives on the GPU: 0/0 divided on the device (zero_by_zero)
};

template <typename acc_t>
BANDPO_HD GridConsts<acc_t> grid_consts(const BandParams& band) {
  const TableView& tb = band.table;
  return GridConsts<acc_t>{axis_consts<acc_t>(tb.t_min, tb.t_step, tb.nt),
                           axis_consts<acc_t>(tb.s_min, tb.s_step, tb.ns), delta_range<acc_t>(tb),
                           static_cast<acc_t>(band.max_ratio), zero_by_zero(acc_t(0))};
}

// Float64 inputs: beyond the grid the asymptotic tail values are refined by the exact fixed points
// (single precision needs no refinement: the asymptotic forms are already below its rounding).
template <typename acc_t>
BANDPO_HD void kl_refine_tails(const TableView& tb, acc_t p, acc_t one_minus_p, acc_t t, const DeltaConsts<acc_t>& c,
                               acc_t& lo, acc_t& up) {
  if constexpr (std::is_same<acc_t, double>::value) {
    const double tmin = tb.t_min, tmax = tb.t_min + (tb.nt - 1) * tb.t_step;
    if (t < tmin && p > 0.0) up = kl_refine_upper(p, one_minus_p, up * p, c.delta) / p;
    if (t > tmax && one_minus_p > 0.0) lo = kl_refine_lower(p, one_minus_p, lo, c.delta);
  }
}

// KL with a scalar δ: the hot path (one log, one exp, two cubics per element). LOG: x is log p; HAVE_EXP: exp_x is
// exp_any(x) (see prob_terms_t).
template <bool LOG, typename acc_t, bool HAVE_EXP = false>
BANDPO_HD void kl_scalar_delta_t(const BandParams& band, const GridConsts<acc_t>& g, const acc_t* cells,
                                 const DeltaConsts<acc_t>& c, acc_t x, acc_t& lo, acc_t& up, acc_t exp_x = acc_t(0)) {
  acc_t p, one_minus_p, t, u;
  prob_terms_t<LOG, acc_t, HAVE_EXP>(x, p, one_minus_p, t, exp_x);
  const int k = axis_cell<acc_t>(t, g.t, u);
  const acc_t* a = cells + 8 * k;
  const acc_t q = a[0] + u * (a[1] + u * (a[2] + u * a[3]));
  const acc_t kappa = a[4] + u * (a[5] + u * (a[6] + u * a[7]));
#if defined(__CUDA_ARCH__)
  kl_finish_branched<acc_t>(p, one_minus_p, t, q, kappa, c.delta, [c] { return c; }, g.t, lo, up);
#else
  kl_finish<acc_t>(p, one_minus_p, t, q, kappa, c, band.table, lo, up);
#endif
  kl_refine_tails<acc_t>(band.table, p, one_minus_p, t, c, lo, up);
}

// What the probability argument holds, where the caller knows it at compile time (the fused loss always passes
// log-probabilities: its GPU kernels then carry one prob_terms, not both); kRuntime reads band.log_input.
// kLogProbExp: log-probabilities, and the caller passes exp_any(x) too (the loss needs p itself: one exp, not two).
enum class ProbInput : int { kRuntime = 0, kProb = 1, kLogProb = 2, kLogProbExp = 3 };

template <ProbInput IN>
BANDPO_HD bool is_log_input(const BandParams& band) {
  return IN == ProbInput::kRuntime ? band.log_input : (IN == ProbInput::kLogProb || IN == ProbInput::kLogProbExp);
}

template <typename acc_t, ProbInput IN = ProbInput::kRuntime>
BANDPO_HD void kl_scalar_delta(const BandParams& band, const GridConsts<acc_t>& g, const acc_t* cells,
                               const DeltaConsts<acc_t>& c, acc_t x, acc_t& lo, acc_t& up, acc_t exp_x = acc_t(0)) {
  if (IN == ProbInput::kLogProbExp) {
    kl_scalar_delta_t<true, acc_t, true>(band, g, cells, c, x, lo, up, exp_x);
  } else if (is_log_input<IN>(band)) {
    kl_scalar_delta_t<true, acc_t>(band, g, cells, c, x, lo, up);
  } else {
    kl_scalar_delta_t<false, acc_t>(band, g, cells, c, x, lo, up);
  }
}

// KL with a per-token δ.
template <typename acc_t, ProbInput IN = ProbInput::kRuntime>
BANDPO_HD void kl_token_delta(const BandParams& band, const GridConsts<acc_t>& g, acc_t x, acc_t delta, acc_t& lo,
                              acc_t& up, acc_t exp_x = acc_t(0)) {
  acc_t p, one_minus_p, t;
  if (IN == ProbInput::kLogProbExp) {
    prob_terms_t<true, acc_t, true>(x, p, one_minus_p, t, exp_x);
  } else {
    prob_terms<acc_t>(x, is_log_input<IN>(band), p, one_minus_p, t);
  }
  acc_t q, kappa, ut, us;
  const int it = axis_cell<acc_t>(t, g.t, ut);
  const int js = token_s_cell<acc_t>(g.s, band.s_axis, delta, us);
  spline2d_cells<acc_t>(band.table, it, ut, js, us, q, kappa);
#if defined(__CUDA_ARCH__)
  // The δ constants (an expm1 and a log) only for elements beyond the grid.
  const auto consts = [delta] { return delta_consts<acc_t>(delta); };
  kl_finish_branched<acc_t>(p, one_minus_p, t, q, kappa, delta, consts, g.t, lo, up);
  if constexpr (std::is_same<acc_t, double>::value) {
    const double tmin = band.table.t_min, tmax = band.table.t_min + (band.table.nt - 1) * band.table.t_step;
    if ((t < tmin) | (t > tmax)) kl_refine_tails<acc_t>(band.table, p, one_minus_p, t, consts(), lo, up);
  }
#else
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(delta);
  kl_finish<acc_t>(p, one_minus_p, t, q, kappa, c, band.table, lo, up);
  kl_refine_tails<acc_t>(band.table, p, one_minus_p, t, c, lo, up);
#endif
}

// KL with a scalar δ from the cells in p's bits (kl_bit_cells.h: band.bit_grid, band.cell_f), float arithmetic only.
template <ProbInput IN>
BANDPO_HD void kl_bits_delta(const BandParams& band, const DeltaConsts<float>& c, float x, float& lo, float& up,
                             float exp_x) {
  if (IN == ProbInput::kLogProbExp) {
    kl_bits_scalar_delta<true, true>(band.bit_grid, band.cell_f, c, x, lo, up, exp_x);
  } else if (is_log_input<IN>(band)) {
    kl_bits_scalar_delta<true>(band.bit_grid, band.cell_f, c, x, lo, up);
  } else {
    kl_bits_scalar_delta<false>(band.bit_grid, band.cell_f, c, x, lo, up);
  }
}

// KL with a per-token δ from the patches in the bits of p and of δ (kl_bit_cells.h fit_bit_patch: band.bit_grid,
// band.cell_f), float arithmetic only; δ already on the table's range.
template <ProbInput IN>
BANDPO_HD void kl_bits_token(const BandParams& band, float x, float delta, float& lo, float& up, float exp_x) {
  if (IN == ProbInput::kLogProbExp) {
    kl_bits_token_delta<true, true>(band.bit_grid, band.cell_f, x, delta, lo, up, exp_x);
  } else if (is_log_input<IN>(band)) {
    kl_bits_token_delta<true>(band.bit_grid, band.cell_f, x, delta, lo, up);
  } else {
    kl_bits_token_delta<false>(band.bit_grid, band.cell_f, x, delta, lo, up);
  }
}

// Closed forms (closed_form_bounds) in the arithmetic type, except from a float log-probability: there p = e^x
// is not exact in float, and the lower bounds near saturation rest on p - δ(...) to its last bit, so that case
// takes p and the bounds in double. delta_given: the per-token δ as given (before delta_in_range).
template <typename acc_t, bool PER_TOKEN>
BANDPO_HD void closed_form(const BandParams& band, acc_t x, acc_t delta_given, acc_t& lo, acc_t& up) {
  if (std::is_same<acc_t, float>::value && !band.log_input) {
    float p, one_minus_p, l, u;
    prob_and_complement<float>(static_cast<float>(x), p, one_minus_p);
    const ClosedDelta<float> d =
        PER_TOKEN ? closed_delta_in_range<float>(band.closed_f[1], band.closed_f[2], static_cast<float>(delta_given))
                  : band.closed_f[0];
    closed_form_bounds<float>(band.divergence, p, one_minus_p, d, l, u);
    lo = static_cast<acc_t>(l);
    up = static_cast<acc_t>(u);
    return;
  }
  // float64 inputs, and log p of any dtype (p = e^x is not exact in float: see closed_form_bounds)
  double p, one_minus_p, t, l, u;
  prob_terms<double>(static_cast<double>(x), band.log_input, p, one_minus_p, t);
  const ClosedDelta<double> d =
      PER_TOKEN ? closed_delta_in_range<double>(band.divergence, band.table, static_cast<double>(delta_given))
                : closed_delta<double>(band.divergence, band.delta);
  closed_form_bounds<double>(band.divergence, p, one_minus_p, d, l, u);
  lo = static_cast<acc_t>(l);
  up = static_cast<acc_t>(u);
}

// Which divergences a call can meet, where the caller knows it at compile time: the GPU kernels are
// instantiated per family (band_cuda.cu, loss_cuda.cu), so that a KL kernel carries no float64 closed-form
// code in its element loop (nor its registers), and a closed-form kernel no table read. kAny decides per call
// (the CPU loops).
enum class DivPath : int { kAny = 0, kTable = 1, kClosed = 2 };

// The path for a divergence known at run time (host side: picks the kernel instantiation).
inline DivPath div_path_of(Divergence d) { return reads_table(d) ? DivPath::kTable : DivPath::kClosed; }

// Any divergence, any δ mode; applies the δ-range check (per-token δ) and the max_ratio cap. g: grid_consts(band).
// BITS: a KL band reads the cells in p's bits (float arithmetic; the GPU's kCellsBits and kCellsBitsToken kernels).
template <typename acc_t, bool PER_TOKEN, DivPath PATH = DivPath::kAny, ProbInput IN = ProbInput::kRuntime,
          bool BITS = false>
BANDPO_HD void band_element(const BandParams& band, const GridConsts<acc_t>& g, const DeltaConsts<acc_t>& c, acc_t x,
                            acc_t delta, acc_t& lo, acc_t& up,
                            acc_t exp_x = acc_t(0)) {  // exp_x: with ProbInput::kLogProbExp only
  const bool ok = !PER_TOKEN || delta_valid<acc_t>(g.delta, delta);
  const acc_t delta_given = delta;
  if (PER_TOKEN) delta = delta_in_range<acc_t>(g.delta, delta);
  const bool table = PATH == DivPath::kAny ? reads_table(band.divergence) : PATH == DivPath::kTable;
  if (table) {
    if constexpr (PER_TOKEN && BITS) {
      static_assert(std::is_same<acc_t, float>::value, "the cells in p's bits are read in float");
      kl_bits_token<IN>(band, x, delta, lo, up, exp_x);
    } else if (PER_TOKEN) {
      kl_token_delta<acc_t, IN>(band, g, x, delta, lo, up, exp_x);
    } else if constexpr (BITS) {
      static_assert(std::is_same<acc_t, float>::value, "the cells in p's bits are read in float");
      kl_bits_delta<IN>(band, c, x, lo, up, exp_x);
    } else {
      kl_scalar_delta<acc_t, IN>(band, g, cell_table<acc_t>(band), c, x, lo, up, exp_x);
    }
  } else {
    closed_form<acc_t, PER_TOKEN>(band, x, delta_given, lo, up);
  }
  if (!ok) {
#if defined(__CUDA_ARCH__)
    lo = up = g.invalid;  // the runtime 0/0 once per thread (band kernels) instead of one division per element
#else
    lo = up = acc_t(0) / acc_t(0);
#endif
  }
  const acc_t cap = g.max_ratio;
  up = up > cap ? cap : up;
}

template <typename acc_t, bool PER_TOKEN, DivPath PATH = DivPath::kAny, ProbInput IN = ProbInput::kRuntime>
BANDPO_HD void band_element(const BandParams& band, const DeltaConsts<acc_t>& c, acc_t x, acc_t delta, acc_t& lo,
                            acc_t& up, acc_t exp_x = acc_t(0)) {
  band_element<acc_t, PER_TOKEN, PATH, IN>(band, grid_consts<acc_t>(band), c, x, delta, lo, up, exp_x);
}

}  // namespace bandpo
