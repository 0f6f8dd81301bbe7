// Host-side glue of the fused loss shared by the CPU and CUDA implementations: argument checks, the
// parameter struct and the outputs. The kernels read every input as a dense row-major (batch, T) array
// and write every output in the layout it is allocated in (dense, row-major): strided, transposed or
// broadcast inputs are materialised here, so that any layout gives the contiguous call's bits.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "band_host.h"
#include "loss_element.h"

namespace bandpo {

struct LossTensors {
  at::Tensor lp, olp, adv, mask, delta;  // dense row-major (batch, T); mask and delta (in lp's dtype) may be undefined
  DeltaArg delta_arg;                    // the δ as resolved (resolve_delta): its number, its entries' range
};

inline LossTensors check_loss_inputs(const char* op, const at::Tensor& lp, const at::Tensor& olp, const at::Tensor& adv,
                                     const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& delta,
                                     double delta_scalar, c10::ArrayRef<double> grid) {
  TORCH_CHECK(lp.dim() == 2, op, ": log_prob must have shape (batch, T), got ", lp.sizes());
  TORCH_CHECK(is_supported_float(lp.scalar_type()), op, ": log_prob must be floating, got ", lp.scalar_type());
  for (const auto* t : {&olp, &adv}) {
    TORCH_CHECK(t->sizes() == lp.sizes() && t->scalar_type() == lp.scalar_type() && t->device() == lp.device(), op,
                ": old_log_prob and advantages must match log_prob's shape, dtype and device");
  }
  LossTensors inputs{lp.contiguous(), olp.contiguous(), adv.contiguous(), at::Tensor(), at::Tensor(), {}};
  if (mask.has_value()) {
    TORCH_CHECK(mask->sizes() == lp.sizes() && mask->device() == lp.device(), op,
                ": mask must match log_prob's shape and device");
    const auto mt = mask->scalar_type();
    TORCH_CHECK(mt == at::kBool || mt == at::kByte || mt == lp.scalar_type(), op,
                ": mask must be bool, uint8 (a bool mask's bytes) or log_prob's dtype, got ", mt);
    inputs.mask = mt == at::kBool ? mask->contiguous().view(at::kByte) : mask->contiguous();
  }
  if (delta.has_value() && !is_host_scalar_delta(delta)) {
    const auto shape = at::infer_size(delta->sizes(), lp.sizes());  // throws for non-broadcastable shapes
    TORCH_CHECK(c10::IntArrayRef(shape) == lp.sizes(), op, ": delta of shape ", delta->sizes(),
                " does not broadcast to log_prob's shape ", lp.sizes());
  }
  inputs.delta_arg = resolve_delta(op, delta, delta_scalar, grid, lp);
  if (inputs.delta_arg.per_token_mode()) {
    inputs.delta = inputs.delta_arg.per_token->expand(lp.sizes()).contiguous();
  } else if (inputs.delta_arg.all_nan) {
    // A 0-dim δ out of range gives NaN bounds for every token, as out-of-range entries of a per-token δ do.
    inputs.delta = at::full(lp.sizes(), std::numeric_limits<double>::quiet_NaN(), lp.options());
    inputs.delta_arg.per_token = inputs.delta;
  }
  return inputs;
}

// The kernels' view of the inputs from `row` on (the CPU loops take one row at a time, CUDA the whole batch).
template <typename scalar_t>
LossInputs<scalar_t> loss_inputs(const LossTensors& inputs, int64_t row) {
  const int64_t offset = row * inputs.lp.size(1);
  LossInputs<scalar_t> in{};
  in.lp = inputs.lp.data_ptr<scalar_t>() + offset;
  in.olp = inputs.olp.data_ptr<scalar_t>() + offset;
  in.adv = inputs.adv.data_ptr<scalar_t>() + offset;
  in.delta = inputs.delta.defined() ? inputs.delta.data_ptr<scalar_t>() + offset : nullptr;
  if (inputs.mask.defined()) {
    in.mask = static_cast<const char*>(inputs.mask.data_ptr()) + offset * inputs.mask.element_size();
  }
  return in;
}

// The loss's options as the ops receive them (the schema's scalar arguments, csrc/ops.cpp), by name: the
// backends fill it with designated initialisers, so that no two adjacent doubles can be swapped unnoticed.
struct LossOpArgs {
  int64_t divergence;  // Divergence id (clip_kind == band)
  int64_t clip_kind;   // ClipKind id
  double eps_low;      // fixed/dcpo constants
  double eps_high;
  double max_ratio;  // cap of the upper bound (inf: none)
  double dual_clip;  // c > 1, or 0 for none
  int64_t mode;      // LossMode id
  int64_t agg;       // AggKind id (the backward's row_scale already holds it: any valid id there)
  double delta_scalar;
};

// An option id from Python as its enum, or a clear error: the ids `name_of` names are the valid ones.
template <typename E>
E option_from_id(int64_t id, const char* what) {
  const E e = static_cast<E>(id);
  TORCH_CHECK(id >= 0 && id <= std::numeric_limits<int>::max() && name_of(e) != nullptr, "policy_loss: unknown ", what,
              " ", id);
  return e;
}

inline LossParams make_loss_params(const at::Tensor& table, c10::ArrayRef<double> grid, const LossOpArgs& s,
                                   const LossTensors& inputs) {
  const ClipKind clip_kind = option_from_id<ClipKind>(s.clip_kind, "clip kind");
  const LossMode mode = option_from_id<LossMode>(s.mode, "mode");
  const AggKind agg = option_from_id<AggKind>(s.agg, "aggregation");
  TORCH_CHECK(s.dual_clip == 0.0 || s.dual_clip > 1.0, "policy_loss: dual_clip must be > 1 (0 for none)");
  check_prob_and_delta("policy_loss", inputs.olp,
                       inputs.delta.defined() ? c10::optional<at::Tensor>(inputs.delta) : c10::nullopt, table, grid,
                       s.divergence, s.max_ratio, /*band_applies=*/clip_kind == ClipKind::kBand);
  LossParams params{};
  // The band's parameters hold the cap too.
  params.band = make_params(table, grid, s.divergence, /*log_input=*/true, inputs.delta_arg, s.max_ratio);
  params.clip_kind = clip_kind;
  params.eps_low = s.eps_low;
  params.eps_high = s.eps_high;
  params.dual_clip = s.dual_clip;
  params.mode = mode;
  params.agg = agg;
  params.mask_kind = !inputs.mask.defined()                   ? MaskKind::kNone
                     : inputs.mask.scalar_type() == at::kByte ? MaskKind::kBytes
                                                              : MaskKind::kFloat;
  params.per_token_delta = inputs.delta.defined();
  return params;
}

// The forward's outputs: the loss (0-dim), the metric vector (kNumMetrics) in the inputs' dtype, and the
// backward's per-row scale ∂loss/∂S_b (float64, (batch,)).
struct LossOutputs {
  at::Tensor loss, metrics, row_scale;
};

inline LossOutputs empty_loss_outputs(const at::Tensor& lp) {
  return {at::empty({}, lp.options()), at::empty({kNumMetrics}, lp.options()),
          at::empty({lp.size(0)}, lp.options().dtype(at::kDouble))};
}

inline void check_grad_inputs(const char* op, const at::Tensor& grad_loss, const at::Tensor& row_scale,
                              const at::Tensor& lp) {
  TORCH_CHECK(grad_loss.numel() == 1 && grad_loss.device() == lp.device(), op,
              ": grad_loss must be a one-element tensor on log_prob's device");
  TORCH_CHECK(row_scale.dim() == 1 && row_scale.size(0) == lp.size(0) && row_scale.scalar_type() == at::kDouble &&
                  row_scale.device() == lp.device(),
              op, ": row_scale must be the forward's float64 (batch,) tensor");
}

// The two loss ops' entry points, written once for every backend: the schema's arguments (csrc/ops.cpp) checked
// and named (LossOpArgs), then handed to the backend. A backend is a struct with
//   static <RAII guard> device_guard(const at::Tensor& lp);   // CUDA: the device guard; CPU: nothing to guard
//   static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const LossTensors&, const LossOpArgs&,
//                                                                 LossParams);
//   static at::Tensor backward(const at::Tensor& grad_loss, const at::Tensor& row_scale, const LossTensors&,
//                              const LossOpArgs&, LossParams);
// and registers loss_fwd_entry<Backend> / loss_bwd_entry<Backend> (csrc/cpu/loss_cpu.cpp, csrc/cuda/loss_cuda.cu).
// The forward's arguments checked and named: the inputs as the kernels read them, the options and their parameters.
struct LossForwardCall {
  LossTensors inputs;
  LossOpArgs args;
  LossParams params;
};

inline LossForwardCall loss_forward_call(const char* op, const at::Tensor& lp, const at::Tensor& olp,
                                         const at::Tensor& adv, const c10::optional<at::Tensor>& mask,
                                         const c10::optional<at::Tensor>& delta, double delta_scalar,
                                         const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                                         int64_t clip_kind, double eps_low, double eps_high, double max_ratio,
                                         double dual_clip, int64_t mode, int64_t agg) {
  LossForwardCall call{check_loss_inputs(op, lp, olp, adv, mask, delta, delta_scalar, grid),
                       LossOpArgs{.divergence = divergence,
                                  .clip_kind = clip_kind,
                                  .eps_low = eps_low,
                                  .eps_high = eps_high,
                                  .max_ratio = max_ratio,
                                  .dual_clip = dual_clip,
                                  .mode = mode,
                                  .agg = agg,
                                  .delta_scalar = delta_scalar},
                       LossParams{}};
  call.params = make_loss_params(table, grid, call.args, call.inputs);
  return call;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> loss_fwd_entry(
    const at::Tensor& lp, const at::Tensor& olp, const at::Tensor& adv, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& delta, double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid,
    int64_t divergence, int64_t clip_kind, double eps_low, double eps_high, double max_ratio, double dual_clip,
    int64_t mode, int64_t agg) {
  [[maybe_unused]] const auto guard = Backend::device_guard(lp);
  const LossForwardCall call =
      loss_forward_call("policy_loss_fwd", lp, olp, adv, mask, delta, delta_scalar, table, grid, divergence, clip_kind,
                        eps_low, eps_high, max_ratio, dual_clip, mode, agg);
  return Backend::forward(call.inputs, call.args, call.params);
}

template <typename Backend>
at::Tensor loss_bwd_entry(const at::Tensor& grad_loss, const at::Tensor& row_scale, const at::Tensor& lp,
                          const at::Tensor& olp, const at::Tensor& adv, const c10::optional<at::Tensor>& mask,
                          const c10::optional<at::Tensor>& delta, double delta_scalar, const at::Tensor& table,
                          c10::ArrayRef<double> grid, int64_t divergence, int64_t clip_kind, double eps_low,
                          double eps_high, double max_ratio, double dual_clip, int64_t mode) {
  [[maybe_unused]] const auto guard = Backend::device_guard(lp);
  const LossTensors inputs = check_loss_inputs("policy_loss_bwd", lp, olp, adv, mask, delta, delta_scalar, grid);
  check_grad_inputs("policy_loss_bwd", grad_loss, row_scale, lp);
  // The aggregation is folded into row_scale: the backward's LossParams never read `agg`.
  const LossOpArgs args{.divergence = divergence,
                        .clip_kind = clip_kind,
                        .eps_low = eps_low,
                        .eps_high = eps_high,
                        .max_ratio = max_ratio,
                        .dual_clip = dual_clip,
                        .mode = mode,
                        .agg = static_cast<int64_t>(AggKind::kTokenSum),
                        .delta_scalar = delta_scalar};
  return Backend::backward(grad_loss, row_scale, inputs, args, make_loss_params(table, grid, args, inputs));
}

}  // namespace bandpo
