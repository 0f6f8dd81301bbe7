// The op schemas, declared once. Backends register implementations in csrc/cpu and csrc/cuda; the
// fake (meta) kernels and autograd formulas are registered from Python (bandpo_lut/_ops.py).
//
//   prob         p_old, or log p_old when log_input is true
//   delta        optional per-element δ (same dtype and device as prob, broadcastable); when absent the
//                scalar delta_scalar is used and the table's δ axis is collapsed once per (table, δ)
//   table        (2, n_t + 2, n_s + 2) float32 B-spline coefficients on prob's device (see tables.py)
//   grid         [t_min, t_step, s_min, s_step, delta_min, delta_max, delta_max_inclusive]
//   divergence   0 kl, 1 tv, 2 chi2, 3 hellinger (csrc/bandpo_math.h)
//   max_ratio    cap of the upper bound (inf: none)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <sstream>
#include <string>

#include "loss_element.h"

TORCH_LIBRARY(bandpo_lut, m) {
  m.def(
      "bounds(Tensor prob, Tensor? delta, float delta_scalar, Tensor table, float[] grid, int divergence, "
      "bool log_input, float max_ratio) -> (Tensor, Tensor)");
  m.def(
      "clip(Tensor ratio, Tensor prob, Tensor? delta, float delta_scalar, Tensor table, float[] grid, "
      "int divergence, bool log_input, float max_ratio) -> Tensor");
  // The fused policy loss (bandpo_lut/loss.py, specified by bandpo_lut/reference/policy_loss.py). The forward
  // returns the aggregated loss (0-dim), the metric vector (the counts, then the fractions, of
  // bandpo_lut/loss_spec.py's METRICS; log_prob's dtype) and row_scale, ∂loss/∂(row b's Σ w·loss) in float64,
  // which is all the backward needs besides the inputs: it recomputes each token's terms. clip_kind, mode and
  // agg are the positions in loss_spec's CLIPS, MODES and AGGS; dual_clip: c > 1, or 0 for none; mask: bool,
  // uint8 (0/1) or log_prob's dtype (weights); delta: broadcastable to log_prob's (batch, T) shape.
  m.def(
      "policy_loss_fwd(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor? mask, Tensor? delta, "
      "float delta_scalar, Tensor table, float[] grid, int divergence, int clip_kind, float eps_low, "
      "float eps_high, float max_ratio, float dual_clip, int mode, int agg) -> (Tensor loss, Tensor metrics, "
      "Tensor row_scale)");
  m.def(
      "policy_loss_bwd(Tensor grad_loss, Tensor row_scale, Tensor log_prob, Tensor old_log_prob, "
      "Tensor advantages, Tensor? mask, Tensor? delta, float delta_scalar, Tensor table, float[] grid, "
      "int divergence, int clip_kind, float eps_low, float eps_high, float max_ratio, float dual_clip, "
      "int mode) -> Tensor");
  // The C++ side of the loss's Python<->C++ contract (ids, sizes, thresholds) as JSON, for the test that
  // keeps bandpo_lut/loss_spec.py and csrc/loss_element.h in step.
  m.def("policy_loss_contract() -> str");
  // torch.clamp's gradient: grad where lower <= ratio <= upper, i.e. where the clipped value is the ratio.
  m.def("clip_backward(Tensor grad, Tensor ratio, Tensor clipped) -> Tensor");
}

namespace {
std::string policy_loss_contract() {
  using namespace bandpo;
  std::ostringstream o;
  o.precision(17);
  o << "{\"clip\": {\"band\": " << kClipBand << ", \"fixed\": " << kClipFixed << ", \"dcpo\": " << kClipDcpo
    << "}, \"mode\": {\"clip\": " << kModeClip << ", \"mask\": " << kModeMask
    << "}, \"agg\": {\"token-mean\": " << kAggTokenMean << ", \"token-sum\": " << kAggTokenSum
    << ", \"seq-mean-token-mean\": " << kAggSeqMeanTokenMean << ", \"seq-mean-token-sum\": " << kAggSeqMeanTokenSum
    << "}, \"n_counts\": " << kNumCounts << ", \"n_metrics\": " << kNumMetrics
    << ", \"log_ratio_clamp\": " << kLogRatioClamp << ", \"lowprob\": " << kLowProb << ", \"bucket_edges\": [";
  for (int k = 0; k < kNumBuckets; ++k) o << (k ? ", " : "") << bucket_edge(k);
  o << "], \"fractions\": [";
  for (int f = 0; f < kNumFractions; ++f) {
    const FractionDef d = fraction_def(f);
    o << (f ? ", " : "") << "[" << d.num << ", " << d.den << "]";
  }
  o << "]}";
  return o.str();
}

at::Tensor clip_backward(const at::Tensor& grad, const at::Tensor& ratio, const at::Tensor& clipped) {
  return at::where(clipped == ratio, grad, at::zeros({}, grad.options()));
}
}  // namespace

// One element-wise formula serves every backend (and traces into aten ops under torch.compile).
TORCH_LIBRARY_IMPL(bandpo_lut, CompositeImplicitAutograd, m) {
  m.impl("clip_backward", &clip_backward);
  m.impl("policy_loss_contract", &policy_loss_contract);
}
