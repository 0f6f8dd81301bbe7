// The op schemas, declared once. Backends register implementations in csrc/cpu and csrc/cuda; the
// fake (meta) kernels and autograd formulas are registered from Python (bandpo_lut/runtime/_ops.py).
//
//   prob         p_old, or log p_old when log_input is true
//   delta        optional per-element δ (same dtype and device as prob, broadcastable); when absent the
//                scalar delta_scalar is used and the table's δ axis is collapsed once per (table, δ)
//   table        (2, n_t + 2, n_s + 2) float32 B-spline coefficients on prob's device (their definition:
//                bandpo_lut/tables/generate.py)
//   grid         the table's grid and δ range, in the order of csrc/table_grid.h's GridField (Python packs it
//                by the names in bandpo_lut._C's facts, "grid_fields")
//   divergence   the id of csrc/divergence.h's enum Divergence (bandpo_lut.tables.divergences' compiled_id)
//   max_ratio    cap of the upper bound (inf: none)
#include <ATen/ATen.h>
#include <torch/library.h>

TORCH_LIBRARY(bandpo_lut, m) {
  m.def(
      "bounds(Tensor prob, Tensor? delta, float delta_scalar, Tensor table, float[] grid, int divergence, "
      "bool log_input, float max_ratio) -> (Tensor, Tensor)");
  m.def(
      "clip(Tensor ratio, Tensor prob, Tensor? delta, float delta_scalar, Tensor table, float[] grid, "
      "int divergence, bool log_input, float max_ratio) -> Tensor");
  // The fused policy loss (bandpo_lut/runtime/loss.py, specified by bandpo_lut/reference/policy_loss.py). The forward
  // returns the aggregated loss (0-dim), the metric vector (the counts, then the fractions, of
  // bandpo_lut/runtime/loss_spec.py's METRICS; log_prob's dtype) and row_scale, ∂loss/∂(row b's Σ w·loss) in float64,
  // which is all the backward needs besides the inputs: it recomputes each token's terms. clip_kind, mode and
  // agg are the positions in settings.py's CLIPS, MODES and AGGS; dual_clip: c > 1, or 0 for none; mask: bool,
  // uint8 (0/1) or log_prob's dtype (weights); delta: broadcastable to log_prob's (batch, T) shape.
  m.def(
      "policy_loss_fwd(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor? mask, Tensor? delta, "
      "float delta_scalar, Tensor table, float[] grid, int divergence, int clip_kind, float eps_low, "
      "float eps_high, float max_ratio, float dual_clip, int mode, int agg) -> (Tensor loss, Tensor metrics, "
      "Tensor row_scale)");
  // The forward that also returns each token's gradient factor ∂(w·loss_t)/∂log_prob_t (log_prob's shape, float32 for
  // 16-bit inputs), so that the backward is grad_loss · row_scale times it: CPU only (the eager route with a gradient
  // to take, bandpo_lut/runtime/_ops.py `_EagerLoss`; the GPU recomputes in policy_loss_bwd).
  m.def(
      "policy_loss_fwd_grad(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor? mask, Tensor? delta, "
      "float delta_scalar, Tensor table, float[] grid, int divergence, int clip_kind, float eps_low, "
      "float eps_high, float max_ratio, float dual_clip, int mode, int agg) -> (Tensor loss, Tensor metrics, "
      "Tensor row_scale, Tensor grad_factor)");
  // The backward of that route: grad_loss · row_scale[b] (in float64, rounded to the factor's type) times each token's
  // factor, and +0 for an ignored token (mask 0) whatever grad_loss is, as policy_loss_bwd gives it. CPU only.
  m.def("policy_loss_bwd_factor(Tensor grad_loss, Tensor row_scale, Tensor grad_factor, Tensor? mask) -> Tensor");
  m.def(
      "policy_loss_bwd(Tensor grad_loss, Tensor row_scale, Tensor log_prob, Tensor old_log_prob, "
      "Tensor advantages, Tensor? mask, Tensor? delta, float delta_scalar, Tensor table, float[] grid, "
      "int divergence, int clip_kind, float eps_low, float eps_high, float max_ratio, float dual_clip, "
      "int mode) -> Tensor");
  // torch.clamp's gradient: grad where lower <= ratio <= upper, i.e. where the clipped value is the ratio.
  m.def("clip_backward(Tensor grad, Tensor ratio, Tensor clipped) -> Tensor");
}

namespace {
at::Tensor clip_backward(const at::Tensor& grad, const at::Tensor& ratio, const at::Tensor& clipped) {
  return at::where(clipped == ratio, grad, at::zeros({}, grad.options()));
}
}  // namespace

// One element-wise formula serves every backend (and traces into aten ops under torch.compile).
TORCH_LIBRARY_IMPL(bandpo_lut, CompositeImplicitAutograd, m) { m.impl("clip_backward", &clip_backward); }
