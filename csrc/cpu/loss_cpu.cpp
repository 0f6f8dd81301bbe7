// CPU implementation of the fused policy loss: bandpo_lut::policy_loss_fwd / policy_loss_bwd.
//
// Rows are split into fixed chunks of kRowsPerChunk rows, spread across threads (at::parallel_for). Within a
// row, blocks of kBlock tokens first get their bounds from the vectorised band loop (float32 band) or the
// per-element code, then one pass computes ratio, surrogate and the counts. Every sum is formed in a fixed
// order (row by row, chunk by chunk) whatever the number of threads, then one finish (loss_element.h) forms
// the aggregated loss, the metric vector and the backward's per-row scale. The backward recomputes what it
// needs from the inputs, so nothing of the input's size is saved.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "band_host.h"
#include "cpu/band_cpu.h"
#include "cpu/cpu_variant.h"
#include "loss_host.h"

namespace bandpo {
namespace {

constexpr int64_t kRowsPerChunk = 8;  // the fixed partition of rows whose partial counts are summed in order

// A token's weight (the generic loops; the float32 loops take the mask kind as a template argument).
template <typename scalar_t, typename acc_t>
inline acc_t weight(const LossParams& params, const LossInputs<scalar_t>& in, int64_t i) {
  return mask_weight_any<scalar_t, acc_t>(params.mask_kind, in.mask, i);
}

// Bounds of tokens [i0, i0 + m) of a row into lo/up (the generic loops; float32 rows take row_f32).
template <typename scalar_t, typename acc_t>
void block_bounds(const LossParams& params, const DeltaConsts<acc_t>& c, const LossInputs<scalar_t>& in, int64_t i0,
                  int m, acc_t* lo, acc_t* up) {
  for (int i = 0; i < m; ++i) {
    const acc_t olp = static_cast<acc_t>(in.olp[i0 + i]);
    const acc_t d = in.delta ? static_cast<acc_t>(in.delta[i0 + i]) : c.delta;
    const acc_t p = exp_any(olp);
    if (params.per_token_delta) {
      clip_bounds<acc_t, true>(params, c, olp, p, d, lo[i], up[i]);
    } else {
      clip_bounds<acc_t, false>(params, c, olp, p, d, lo[i], up[i]);
    }
  }
}

// ---- float32 rows: branch-free blocked passes that vectorise --------------------------------------------
constexpr int kSums = kNumCounts + 2;  // the 20 counts, then Σ w·loss and Σ w
// The blocks form the counts and Σ w·loss; Σ w is the token count's sum (each token adds w to both), taken from it.
constexpr int kBlockSums = kNumCounts + 1;

// Bounds of a block for the baselines (band bounds come from the vectorised band loop); clip_bounds caps. The fixed
// clip's bounds are two constants (no p: the exp is DCPO's alone), so they are formed once and filled; DCPO's loop
// has its kind fixed at compile time, so that it vectorises without the other kinds' code in it.
BANDPO_INLINE void baseline_bounds_f32(const LossParams& params, const float* __restrict olp, int m,
                                       float* __restrict lo, float* __restrict up) {
  const DeltaConsts<float> unused{};
  if (params.clip_kind == ClipKind::kFixed) {
    float lo_c, up_c;
    clip_bounds<float, false>(params, unused, 0.0f, 0.5f, 0.0f, lo_c, up_c);
    for (int i = 0; i < m; ++i) {
      lo[i] = lo_c;
      up[i] = up_c;
    }
    return;
  }
  LossParams dcpo = params;
  dcpo.clip_kind = ClipKind::kDcpo;  // the only other baseline
  for (int i = 0; i < m; ++i) {
    const float p = exp_f32(olp[i]);
    clip_bounds<float, false>(dcpo, unused, olp[i], p, 0.0f, lo[i], up[i]);
  }
}

// p_old's place among the counts' edges (loss_element.h ProbPlace) from its float32 log-probability: for each edge,
// the least float x whose exponential, rounded to float, reaches the edge (as a float, the type the comparison has in
// float32 arithmetic); then p ≥ edge ⟺ olp ≥ x, and p < kLowProb ⟺ olp < its x. The token pass compares olp with
// these instead of forming p = e^olp (one exponential per token fewer), and decides as the correctly rounded p would
// (float64's exponential rounded to float: the correctly rounded one but where e^x lies within ~1e-16 of a rounding
// boundary, which no threshold here does; tests/runtime/test_cpu_variants.py checks the counts around every edge).
struct LogProbEdges {
  float at[kNumBuckets];  // olp ≥ at[k] ⟺ p ≥ bucket_edge(k)
  float low;              // olp < low ⟺ p < kLowProb
};

// The least float x (-inf to +inf) with float(e^x) ≥ edge: a bisection over the floats in order.
float least_log_reaching(float edge) {
  const auto key = [](float x) {  // the floats' order as unsigned integers
    const auto b = static_cast<std::uint32_t>(float_to_bits(x));
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  };
  const auto from_key = [](std::uint32_t k) {
    return bits_to_float(static_cast<std::int32_t>((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k));
  };
  const auto reaches = [edge](float x) { return static_cast<float>(std::exp(static_cast<double>(x))) >= edge; };
  std::uint32_t lo = key(-std::numeric_limits<float>::infinity()), hi = key(std::numeric_limits<float>::infinity());
  if (reaches(from_key(lo))) return from_key(lo);
  while (hi - lo > 1) {  // reaches(lo) is false, reaches(hi) true
    const std::uint32_t mid = lo + (hi - lo) / 2;
    (reaches(from_key(mid)) ? hi : lo) = mid;
  }
  return from_key(hi);
}

const LogProbEdges& log_prob_edges() {
  static const LogProbEdges edges = [] {
    LogProbEdges e{};
    for (int k = 0; k < kNumBuckets; ++k) e.at[k] = least_log_reaching(static_cast<float>(bucket_edge(k)));
    e.low = least_log_reaching(static_cast<float>(kLowProb));
    return e;
  }();
  return edges;
}

// Tokens [0, m) of a block: forward (SUMS), every token's contribution to the kBlockSums sums into sums[k][i]
// (ignored tokens and [m, kBlock): exactly 0, whatever their inputs); GRAD, the gradient
// g · ∂(w·loss_t)/∂log_prob_t into grad[i] (the backward; the forward that keeps the gradient factor, g = 1).
template <MaskKind MASK, bool SUMS, bool GRAD>
BANDPO_INLINE void token_block_f32(const LossParams& params, const float* __restrict lp, const float* __restrict olp,
                                   const float* __restrict adv, const void* __restrict mask, const float* __restrict lo,
                                   const float* __restrict up, int m, float g, float* __restrict grad,
                                   float (*__restrict sums)[kBlock]) {
  const LogProbEdges edges = log_prob_edges();  // a copy: its floats stay in registers
#pragma omp simd
  for (int i = 0; i < m; ++i) {
    const float w = mask_weight<MASK, float, float>(mask, i);
    const bool skip = w == 0.0f;
    TokenTerms<float> o;
    // p_old only places the token among the counts' edges, decided from olp (LogProbEdges): o.p is not read.
    token_terms<float>(params, lp[i], olp[i], adv[i], w, /*p=*/0.0f, lo[i], up[i], o);
    if (SUMS) {
      const float x = olp[i];
      const ProbPlace place{{x >= edges.at[0], x >= edges.at[1], x >= edges.at[2], x >= edges.at[3], x >= edges.at[4]},
                            x < edges.low};
      count_terms<float>(o, w, place, &sums[0][i], kBlock);  // w == 0 gives 0 in every count
      sums[kNumCounts][i] = keep_if(!skip, o.value);
    }
    // An ignored token's gradient is +0 whatever g is (g · 0 would be -0 for a negative g and NaN for an infinite
    // or NaN one); g = 1: the factor itself, bit for bit.
    if (GRAD) grad[i] = keep_if(!skip, g * o.grad);
  }
  if (SUMS && m < kBlock) {
    for (int k = 0; k < kBlockSums; ++k)
      for (int i = m; i < kBlock; ++i) sums[k][i] = 0.0f;
  }
}

// Accumulator lanes: lane j sums tokens j, j + kLanes, ... of a block in float32, then adds that to its
// float64 lane; the order is fixed by the code, whatever vector width the clone runs. Straight vector adds
// (the constant inner loops become whole registers); no horizontal sum until the end of the row.
constexpr int kLanes = 16;
BANDPO_INLINE void reduce_block(const float (*__restrict sums)[kBlock], double (*__restrict lanes)[kLanes]) {
  for (int k = 0; k < kBlockSums; ++k) {
    float acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = sums[k][j];
    for (int i = kLanes; i < kBlock; i += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += sums[k][i + j];
    for (int j = 0; j < kLanes; ++j) lanes[k][j] += static_cast<double>(acc[j]);
  }
}

// The mask of the tokens from i on.
template <MaskKind MASK>
BANDPO_INLINE const void* mask_at(const void* mask, int64_t i) {
  return MASK == MaskKind::kBytes   ? static_cast<const void*>(static_cast<const uint8_t*>(mask) + i)
         : MASK == MaskKind::kFloat ? static_cast<const void*>(static_cast<const float*>(mask) + i)
                                    : nullptr;
}

template <MaskKind MASK, bool FWD, bool GRAD>
BANDPO_INLINE void row_f32_impl(const LossParams& params, const LossInputs<float>& in, int64_t n, double* totals,
                                float g, float* grad_row) {
  alignas(64) float lo[kBlock], up[kBlock];
  alignas(64) float w_b[MASK == MaskKind::kNone ? 1 : kBlock];
  alignas(64) float sums[FWD ? kBlockSums : 1][kBlock];
  alignas(64) double lanes[FWD ? kBlockSums : 1][kLanes] = {};
  const DeltaConsts<float> c = delta_consts<float>(static_cast<float>(params.band.delta));
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int m = static_cast<int>(n - i0 < kBlock ? n - i0 : kBlock);
    // The token pass's other inputs, fetched while the band pass computes (loaded cold, they stalled it).
    for (int i = 0; i < m; i += 64 / sizeof(float)) {
      __builtin_prefetch(in.lp + i0 + i);
      __builtin_prefetch(in.adv + i0 + i);
    }
    if (params.clip_kind == ClipKind::kBand) {
      FastRun run{&params.band, &c, in.olp + i0, in.delta ? in.delta + i0 : nullptr, nullptr, lo, up, nullptr, m};
      f32_contiguous(run, /*log_input=*/true, /*clip=*/false, params.per_token_delta);
    } else {
      baseline_bounds_f32(params, in.olp + i0, m, lo, up);
    }
    // The token pass reads the weights as floats: a byte mask in that loop would make the compiler take 32 tokens per
    // step (one byte vector), four float vectors of every intermediate, more than the registers hold.
    constexpr MaskKind kTokenMask = MASK == MaskKind::kNone ? MaskKind::kNone : MaskKind::kFloat;
    if (MASK != MaskKind::kNone) {
      const void* mask = mask_at<MASK>(in.mask, i0);
      for (int i = 0; i < m; ++i) w_b[i] = mask_weight<MASK, float, float>(mask, i);
    }
    token_block_f32<kTokenMask, FWD, GRAD>(params, in.lp + i0, in.olp + i0, in.adv + i0, w_b, lo, up, m, g,
                                           GRAD ? grad_row + i0 : nullptr, sums);
    if (FWD) reduce_block(sums, lanes);
  }
  if (FWD) {
    for (int k = 0; k < kBlockSums; ++k)
      for (int j = 0; j < kLanes; ++j) totals[k] += lanes[k][j];
    for (int j = 0; j < kLanes; ++j) totals[kNumCounts + 1] += lanes[kNTokens][j];  // Σ w: the same sum
  }
}

// One row, forward (totals[kSums] += its sums; with grad_row, also the gradient factor ∂(w·loss_t)/∂log_prob_t
// there) or backward (grad_row = g · ∂(Σ w·loss)/∂log_prob), compiled per CPU variant (BANDPO_CPU_VARIANTS): the
// token pass runs the variant the band runs (cpu_variant.h).
template <MaskKind MASK>
BANDPO_INLINE void row_f32_mask(const LossParams& params, const LossInputs<float>& in, int64_t n, double* totals,
                                float g, float* grad_row, bool forward) {
  if (!forward) return row_f32_impl<MASK, false, true>(params, in, n, totals, g, grad_row);
  if (grad_row != nullptr) return row_f32_impl<MASK, true, true>(params, in, n, totals, 1.0f, grad_row);
  return row_f32_impl<MASK, true, false>(params, in, n, totals, g, grad_row);
}

template <CpuVariant>
BANDPO_INLINE void row_f32_body(const LossParams& params, const LossInputs<float>& in, int64_t n, double* totals,
                                float g, float* grad_row, bool forward) {
  switch (params.mask_kind) {
    case MaskKind::kBytes:
      return row_f32_mask<MaskKind::kBytes>(params, in, n, totals, g, grad_row, forward);
    case MaskKind::kFloat:
      return row_f32_mask<MaskKind::kFloat>(params, in, n, totals, g, grad_row, forward);
    case MaskKind::kNone:
      return row_f32_mask<MaskKind::kNone>(params, in, n, totals, g, grad_row, forward);
  }
}

BANDPO_CPU_VARIANTS(void, row_f32,
                    (const LossParams& params, const LossInputs<float>& in, int64_t n, double* totals, float g,
                     float* grad_row, bool forward),
                    row_f32_body, (params, in, n, totals, g, grad_row, forward))

// The float32 rows take row_f32; other dtypes the generic per-element loops (returns false).
template <typename scalar_t>
inline bool fast_row(const LossParams&, const LossInputs<scalar_t>&, int64_t, double*, float, scalar_t*, bool) {
  return false;
}
template <>
inline bool fast_row<float>(const LossParams& params, const LossInputs<float>& in, int64_t n, double* totals, float g,
                            float* grad_row, bool forward) {
  pick(row_f32_variants)(params, in, n, totals, g, grad_row, forward);
  return true;
}

// The KL band's CPU tables (kept alive by the returned value) into the parameters, when the band needs them.
CpuTables attach_loss_tables(LossParams& params) {
  if (params.clip_kind != ClipKind::kBand) return {};
  return attach_tables(params.band, params.per_token_delta);
}

// One row's Σ w·loss, Σ w and counts (totals[kSums], zeroed by the caller), the generic per-element loop; with
// factor, each token's ∂(w·loss_t)/∂log_prob_t there (0 for ignored tokens).
template <typename scalar_t, typename acc_t>
void row_sums_generic(const LossParams& params, const DeltaConsts<acc_t>& c, const LossInputs<scalar_t>& in, int64_t n,
                      double* totals, acc_t* factor) {
  acc_t lo[kBlock], up[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int m = static_cast<int>(n - i0 < kBlock ? n - i0 : kBlock);
    block_bounds<scalar_t, acc_t>(params, c, in, i0, m, lo, up);
    for (int i = 0; i < m; ++i) {
      const acc_t w = weight<scalar_t, acc_t>(params, in, i0 + i);
      if (factor) factor[i0 + i] = acc_t(0);
      if (w == acc_t(0)) continue;  // ignored tokens contribute nothing, whatever their inputs
      const acc_t olp_i = static_cast<acc_t>(in.olp[i0 + i]);
      TokenTerms<acc_t> o;
      token_terms<acc_t>(params, static_cast<acc_t>(in.lp[i0 + i]), olp_i, static_cast<acc_t>(in.adv[i0 + i]), w,
                         exp_any(olp_i), lo[i], up[i], o);
      add_counts<acc_t, double>(o, w, totals);
      if (factor) factor[i0 + i] = o.grad;
      totals[kNumCounts] += static_cast<double>(o.value);
      totals[kNumCounts + 1] += static_cast<double>(w);
    }
  }
}

// The forward; with `factor` (a tensor of log_prob's shape in its float type, at::opmath_type), also each token's
// gradient factor ∂(w·loss_t)/∂log_prob_t, which the backward scales by row_scale · grad_loss (policy_loss_fwd_grad).
std::tuple<at::Tensor, at::Tensor, at::Tensor> loss_forward(const LossTensors& inputs, const LossOpArgs& args,
                                                            LossParams params, at::Tensor factor = {}) {
  cpu_variant();  // an invalid BANDPO_LUT_CPU_VARIANT raises here, on the calling thread, not in a worker
  const CpuTables keep = attach_loss_tables(params);
  const at::Tensor& lp = inputs.lp;
  const int64_t B = lp.size(0), n = lp.size(1);
  const int64_t chunks = (B + kRowsPerChunk - 1) / kRowsPerChunk;
  std::vector<double> row_s(B), row_w(B), chunk_counts(chunks * kNumCounts, 0.0);
  LossOutputs out = empty_loss_outputs(lp);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "bandpo_lut::policy_loss_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(params.band.delta));  // resolved: a host δ too
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t chunk = c0; chunk < c1; ++chunk) {
        double* counts = &chunk_counts[chunk * kNumCounts];
        for (int64_t b = chunk * kRowsPerChunk; b < std::min(B, (chunk + 1) * kRowsPerChunk); ++b) {
          const LossInputs<scalar_t> in = loss_inputs<scalar_t>(inputs, b);
          double totals[kSums] = {0};
          acc_t* factor_row = factor.defined() ? factor.data_ptr<acc_t>() + b * n : nullptr;
          // (fast_row writes float32 rows only, whose factor is float32 too)
          if (!fast_row<scalar_t>(params, in, n, totals, 0.0f, reinterpret_cast<scalar_t*>(factor_row),
                                  /*forward=*/true)) {
            row_sums_generic<scalar_t, acc_t>(params, c, in, n, totals, factor_row);
          }
          for (int k = 0; k < kNumCounts; ++k) counts[k] += totals[k];
          row_s[b] = totals[kNumCounts];
          row_w[b] = totals[kNumCounts + 1];
        }
      }
    });
    LossTotals tot{};
    for (int64_t b = 0; b < B; ++b) add_row(tot, row_s[b], row_w[b]);
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int k = 0; k < kNumCounts; ++k) tot.counts[k] += chunk_counts[chunk * kNumCounts + k];
    *out.loss.data_ptr<scalar_t>() = static_cast<scalar_t>(aggregate_loss(params.agg, tot));
    write_metrics<scalar_t>(tot, out.metrics.data_ptr<scalar_t>());
    double* scale = out.row_scale.data_ptr<double>();
    for (int64_t b = 0; b < B; ++b) scale[b] = row_scale(params.agg, tot, row_w[b]);
  });
  return {out.loss, out.metrics, out.row_scale};
}

at::Tensor loss_backward(const at::Tensor& grad_loss, const at::Tensor& row_scale, const LossTensors& inputs,
                         const LossOpArgs& args, LossParams params) {
  cpu_variant();  // an invalid BANDPO_LUT_CPU_VARIANT raises here, on the calling thread, not in a worker
  const double g = grad_loss.to(at::kDouble).item<double>();  // a CPU tensor: no synchronisation
  const at::Tensor scale = row_scale.contiguous();
  const CpuTables keep = attach_loss_tables(params);
  const at::Tensor& lp = inputs.lp;
  const int64_t B = lp.size(0), n = lp.size(1);
  at::Tensor grad = at::empty(lp.sizes(), lp.options());  // dense row-major: the layout the loops write
  const double* S = scale.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "bandpo_lut::policy_loss_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(params.band.delta));  // resolved: a host δ too
    scalar_t* out = grad.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      acc_t lo[kBlock], up[kBlock];
      for (int64_t b = b0; b < b1; ++b) {
        const LossInputs<scalar_t> in = loss_inputs<scalar_t>(inputs, b);
        const acc_t gb = static_cast<acc_t>(g * S[b]);
        scalar_t* o_row = out + b * n;
        if (fast_row<scalar_t>(params, in, n, nullptr, static_cast<float>(gb), o_row, /*forward=*/false)) continue;
        for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
          const int m = static_cast<int>(n - i0 < kBlock ? n - i0 : kBlock);
          block_bounds<scalar_t, acc_t>(params, c, in, i0, m, lo, up);
          for (int i = 0; i < m; ++i) {
            const acc_t w = weight<scalar_t, acc_t>(params, in, i0 + i);
            acc_t gi = acc_t(0);
            if (w != acc_t(0)) {
              const acc_t olp_i = static_cast<acc_t>(in.olp[i0 + i]);
              TokenTerms<acc_t> o;
              token_terms<acc_t>(params, static_cast<acc_t>(in.lp[i0 + i]), olp_i, static_cast<acc_t>(in.adv[i0 + i]),
                                 w, exp_any(olp_i), lo[i], up[i], o);
              gi = gb * o.grad;
            }
            o_row[i0 + i] = static_cast<scalar_t>(gi);
          }
        }
      }
    });
  });
  return grad;
}

// policy_loss_fwd_grad: the forward, and each token's gradient factor ∂(w·loss_t)/∂log_prob_t (log_prob's shape, its
// float type: at::opmath_type), which the backward scales by grad_loss · row_scale (bandpo_lut/runtime/_ops.py,
// `_EagerLoss`): the band is formed once per step instead of once in each pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> loss_fwd_grad(
    const at::Tensor& lp, const at::Tensor& olp, const at::Tensor& adv, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& delta, double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid,
    int64_t divergence, int64_t clip_kind, double eps_low, double eps_high, double max_ratio, double dual_clip,
    int64_t mode, int64_t agg) {
  const LossForwardCall call =
      loss_forward_call("policy_loss_fwd_grad", lp, olp, adv, mask, delta, delta_scalar, table, grid, divergence,
                        clip_kind, eps_low, eps_high, max_ratio, dual_clip, mode, agg);
  at::Tensor factor = at::empty(lp.sizes(), lp.options().dtype(at::toOpMathType(lp.scalar_type())));
  auto [loss, metrics, row_scale] = loss_forward(call.inputs, call.args, call.params, factor);
  return {loss, metrics, row_scale, factor};
}

// policy_loss_bwd_factor: the backward from policy_loss_fwd_grad's factor, one pass: token i of row b gets
// keep_if(w_i != 0, g·S_b · factor_i), g·S_b in float64 rounded to the factor's type as policy_loss_bwd rounds it,
// so a kept token has policy_loss_bwd's bits and an ignored one its +0 (the product alone would give -0 for a
// negative g, NaN for an infinite or NaN one).
template <typename acc_t, typename mask_t>
void scale_factor_rows(const double* S, double g, const acc_t* factor, const mask_t* mask, int64_t B, int64_t n,
                       acc_t* out) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const acc_t gb = static_cast<acc_t>(g * S[b]);
      const acc_t* f = factor + b * n;
      acc_t* o = out + b * n;
      if (mask == nullptr) {
        for (int64_t i = 0; i < n; ++i) o[i] = gb * f[i];
      } else {
        const mask_t* m = mask + b * n;
        for (int64_t i = 0; i < n; ++i) o[i] = keep_if(m[i] != mask_t(0), gb * f[i]);
      }
    }
  });
}

at::Tensor loss_bwd_factor(const at::Tensor& grad_loss, const at::Tensor& row_scale, const at::Tensor& factor,
                           const c10::optional<at::Tensor>& mask) {
  constexpr const char* op = "policy_loss_bwd_factor";
  TORCH_CHECK(factor.dim() == 2 && (factor.scalar_type() == at::kFloat || factor.scalar_type() == at::kDouble), op,
              ": grad_factor: expected a 2-D float32 or float64 tensor (policy_loss_fwd_grad's), got ", factor.dim(),
              "-D ", factor.scalar_type());
  const int64_t B = factor.size(0), n = factor.size(1);
  TORCH_CHECK(row_scale.dim() == 1 && row_scale.size(0) == B && row_scale.scalar_type() == at::kDouble, op,
              ": row_scale: expected a float64 tensor of shape (", B, ",), got ", row_scale.scalar_type(), " of shape ",
              row_scale.sizes());
  TORCH_CHECK(grad_loss.numel() == 1, op, ": grad_loss: expected one element, got ", grad_loss.numel());
  const double g = grad_loss.to(at::kDouble).item<double>();  // a CPU tensor: no synchronisation
  const at::Tensor f = factor.contiguous();
  const at::Tensor S = row_scale.contiguous();
  at::Tensor grad = at::empty(f.sizes(), f.options());
  AT_DISPATCH_FLOATING_TYPES(f.scalar_type(), op, [&] {
    const scalar_t* fp = f.data_ptr<scalar_t>();
    scalar_t* out = grad.data_ptr<scalar_t>();
    if (!mask.has_value()) {
      scale_factor_rows<scalar_t, scalar_t>(S.data_ptr<double>(), g, fp, nullptr, B, n, out);
      return;
    }
    const at::ScalarType md = mask->scalar_type();
    TORCH_CHECK(md == at::kBool || md == at::kByte || at::isFloatingType(md), op,
                ": mask: expected bool, uint8 or floating weights, got ", md);
    at::Tensor m = mask->expand({B, n});
    // weights in another floating type: which are 0 is decided in their own type (a cast could round one to 0)
    if (at::isFloatingType(md) && md != f.scalar_type()) m = m.ne(0);
    m = m.contiguous();
    if (m.scalar_type() == f.scalar_type()) {
      scale_factor_rows<scalar_t, scalar_t>(S.data_ptr<double>(), g, fp, m.data_ptr<scalar_t>(), B, n, out);
    } else {
      const uint8_t* bytes = static_cast<const uint8_t*>(m.data_ptr());  // bool is one byte, 0 or 1
      scale_factor_rows<scalar_t, uint8_t>(S.data_ptr<double>(), g, fp, bytes, B, n, out);
    }
  });
  return grad;
}

// The CPU backend of loss_fwd_entry / loss_bwd_entry (loss_host.h).
struct CpuLoss {
  struct NoGuard {};
  static NoGuard device_guard(const at::Tensor&) { return {}; }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const LossTensors& inputs, const LossOpArgs& s,
                                                                LossParams params) {
    return loss_forward(inputs, s, params);
  }
  static at::Tensor backward(const at::Tensor& grad_loss, const at::Tensor& row_scale, const LossTensors& inputs,
                             const LossOpArgs& s, LossParams params) {
    return loss_backward(grad_loss, row_scale, inputs, s, params);
  }
};

}  // namespace
}  // namespace bandpo

TORCH_LIBRARY_IMPL(bandpo_lut, CPU, m) {
  m.impl("policy_loss_fwd", &bandpo::loss_fwd_entry<bandpo::CpuLoss>);
  m.impl("policy_loss_bwd", &bandpo::loss_bwd_entry<bandpo::CpuLoss>);
  m.impl("policy_loss_fwd_grad", &bandpo::loss_fwd_grad);
  m.impl("policy_loss_bwd_factor", &bandpo::loss_bwd_factor);
}
