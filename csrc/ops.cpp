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

TORCH_LIBRARY(bandpo_lut, m) {
  m.def("bounds(Tensor prob, Tensor? delta, float delta_scalar, Tensor table, float[] grid, int divergence, "
        "bool log_input, float max_ratio) -> (Tensor, Tensor)");
  m.def("clip(Tensor ratio, Tensor prob, Tensor? delta, float delta_scalar, Tensor table, float[] grid, "
        "int divergence, bool log_input, float max_ratio) -> Tensor");
  // The fused policy loss (bandpo_lut/loss.py): per-row sums of w·loss and of w, and the 20 metric counts
  // (float64), from which Python forms any aggregation; the backward recomputes the per-token gradient
  // from the inputs and the gradient of the row sums. clip_kind: 0 band, 1 fixed, 2 dcpo; mode: 0 clip,
  // 1 mask; dual_clip: c > 1, or 0 for none; mask: uint8 (bool) or log_prob's dtype.
  m.def("policy_loss_fwd(Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor? mask, Tensor? delta, "
        "float delta_scalar, Tensor table, float[] grid, int divergence, int clip_kind, float eps_low, "
        "float eps_high, float max_ratio, float dual_clip, int mode) -> (Tensor, Tensor, Tensor)");
  m.def("policy_loss_bwd(Tensor grad_row, Tensor log_prob, Tensor old_log_prob, Tensor advantages, Tensor? mask, "
        "Tensor? delta, float delta_scalar, Tensor table, float[] grid, int divergence, int clip_kind, "
        "float eps_low, float eps_high, float max_ratio, float dual_clip, int mode) -> Tensor");
  // torch.clamp's gradient: grad where lower <= ratio <= upper, i.e. where the clipped value is the ratio.
  m.def("clip_backward(Tensor grad, Tensor ratio, Tensor clipped) -> Tensor");
}

namespace {
at::Tensor clip_backward(const at::Tensor& grad, const at::Tensor& ratio, const at::Tensor& clipped) {
  return at::where(clipped == ratio, grad, at::zeros({}, grad.options()));
}
}  // namespace

// One element-wise formula serves every backend (and traces into aten ops under torch.compile).
TORCH_LIBRARY_IMPL(bandpo_lut, CompositeImplicitAutograd, m) {
  m.impl("clip_backward", &clip_backward);
}
