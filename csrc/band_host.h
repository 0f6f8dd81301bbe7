// Host-side glue shared by the CPU and CUDA implementations: argument checks, the parameter struct,
// output allocation. Kernels never see at::Tensor; they get a BandParams and raw pointers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "bandpo_math.h"
#include "table_grid.h"

namespace bandpo {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// A 0-dim δ tensor on the CPU holds one δ for every element (the form a δ takes when torch.compile made it
// a symbolic float): it is read on the host, which never synchronises with a device, and takes the
// scalar-δ path. Any other δ tensor is per element.
inline bool is_host_scalar_delta(const c10::optional<at::Tensor>& delta) {
  return delta.has_value() && delta->dim() == 0 && delta->device().is_cpu();
}

// x rounded to the storage type `t` of a δ tensor, back in double.
inline double round_to(at::ScalarType t, double x) {
  switch (t) {
    case at::kFloat:
      return static_cast<double>(static_cast<float>(x));
    case at::kHalf:
      return static_cast<double>(static_cast<float>(c10::Half(static_cast<float>(x))));
    case at::kBFloat16:
      return static_cast<double>(static_cast<float>(c10::BFloat16(static_cast<float>(x))));
    default:
      return x;
  }
}

// Whether every value of dtype `from` is exact in dtype `to`.
inline bool converts_exactly(at::ScalarType from, at::ScalarType to) {
  return from == to || to == at::kDouble || (to == at::kFloat && from != at::kDouble);
}

// The δ the kernels get: a per-element tensor in p's dtype, or one number (the scalar argument, or a host 0-dim
// tensor, which like any δ tensor gives NaN bounds when out of range: then `all_nan`). Whether a δ tensor's
// entry is in range is decided in the tensor's own dtype: the range ends rounded to it (an entry that rounds
// across an end in its own dtype, bfloat16's 9.995e-4 for 1e-3, is that end). [valid_min, valid_max] is that
// range in the kernels' terms (bandpo_math.h delta_valid).
struct DeltaArg {
  c10::optional<at::Tensor> per_token;
  double scalar;
  bool all_nan;
  double valid_min;
  double valid_max;
  bool per_token_mode() const { return per_token.has_value(); }
};

inline DeltaArg resolve_delta(const char* op, const c10::optional<at::Tensor>& delta, double delta_scalar,
                              c10::ArrayRef<double> grid, const at::Tensor& prob) {
  TORCH_CHECK(grid.size() == kGridLen, op, ": grid must have ", kGridLen, " entries");
  const double dmin = grid[kDeltaMin], dmax = grid[kDeltaMax];
  const bool max_inclusive = grid[kDeltaMaxInclusive] != 0.0;
  if (!delta.has_value()) return {c10::nullopt, delta_scalar, false, dmin, dmax};
  const at::ScalarType own = delta->scalar_type();
  TORCH_CHECK(is_supported_float(own), op, ": delta must be a floating tensor, got ", own);
  const double lo = round_to(own, dmin), hi = round_to(own, dmax);
  if (is_host_scalar_delta(delta)) {
    const double d = delta->item<double>();
    const bool ok = d >= lo && (d < hi || (d == hi && max_inclusive));
    return {c10::nullopt, ok ? std::min(std::max(d, dmin), dmax) : dmin, !ok, dmin, dmax};
  }
  TORCH_CHECK(delta->device() == prob.device(), op, ": delta is on ", delta->device(), " but p_old is on ",
              prob.device());
  const at::ScalarType compute = prob.scalar_type();
  if (converts_exactly(own, compute)) return {delta->to(compute), delta_scalar, false, lo, hi};
  // Narrowed (a float64 δ with float32 p): rounding to p's dtype could move an entry across an end, so the range
  // is applied in δ's own dtype here, out-of-range entries become NaN, and the kernels pass every other entry.
  const at::Tensor in_range = delta->ge(lo).logical_and(max_inclusive ? delta->le(hi) : delta->lt(hi));
  const double inf = std::numeric_limits<double>::infinity();
  return {delta->to(compute).masked_fill(in_range.logical_not(), std::numeric_limits<double>::quiet_NaN()),
          delta_scalar, false, -inf, inf};
}

// band_applies: false for the loss's baseline clips, which read neither the table nor the δ range.
inline void check_prob_and_delta(const char* op, const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                                 const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                                 double max_ratio, bool band_applies = true) {
  TORCH_CHECK(is_supported_float(prob.scalar_type()), op,
              ": p_old/log_p_old must be float32, float64, float16 or "
              "bfloat16, got ",
              prob.scalar_type());
  if (is_host_scalar_delta(delta)) {
    TORCH_CHECK(is_supported_float(delta->scalar_type()), op, ": delta must be a floating tensor, got ",
                delta->scalar_type());
  } else if (delta.has_value()) {  // resolved (resolve_delta): in p's dtype
    TORCH_CHECK(delta->scalar_type() == prob.scalar_type(), op, ": delta tensor dtype ", delta->scalar_type(),
                " differs from p_old's ", prob.scalar_type());
    TORCH_CHECK(delta->device() == prob.device(), op, ": delta is on ", delta->device(), " but p_old is on ",
                prob.device());
  }
  TORCH_CHECK(divergence >= 0 && divergence < kNumDivergences, op, ": unknown divergence id ", divergence,
              " (compiled: 0..", kNumDivergences - 1, ", csrc/divergence.h)");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 3 && table.size(0) == 2 && table.is_contiguous(), op,
              ": table must be a contiguous float32 tensor of shape (2, n_t + 2, n_s + 2)");
  const auto div = static_cast<Divergence>(divergence);
  if (band_applies && reads_table(div)) {
    TORCH_CHECK(table.size(1) >= 6 && table.size(2) >= 6, op, ": table of shape ", table.sizes(), " is too small for ",
                info_of(div).name, ", which reads its table");
  }
  TORCH_CHECK(table.device() == prob.device(), op, ": table is on ", table.device(), " but p_old is on ",
              prob.device());
  TORCH_CHECK(grid.size() == kGridLen, op, ": grid must have ", kGridLen, " entries");
  TORCH_CHECK(max_ratio >= 1.0, op, ": max_ratio must be >= 1, got ", max_ratio);
}

// delta: from resolve_delta (its number, and the range of a per-token δ's entries).
inline BandParams make_params(const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence, bool log_input,
                              const DeltaArg& delta_arg, double max_ratio) {
  const double delta = delta_arg.scalar;
  BandParams band{};
  band.table.coef = table.data_ptr<float>();
  band.table.nt = std::max(0, static_cast<int>(table.size(1)) - 2);  // 0 for a placeholder (closed forms)
  band.table.ns = std::max(0, static_cast<int>(table.size(2)) - 2);
  band.table.t_min = grid[kTMin];
  band.table.t_step = grid[kTStep];
  band.table.s_min = grid[kSMin];
  band.table.s_step = grid[kSStep];
  band.table.delta_min = grid[kDeltaMin];
  band.table.delta_max = grid[kDeltaMax];
  band.table.delta_max_inclusive = grid[kDeltaMaxInclusive] != 0.0;
  band.table.valid_min = delta_arg.valid_min;
  band.table.valid_max = delta_arg.valid_max;
  band.divergence = static_cast<Divergence>(divergence);  // checked by check_prob_and_delta
  band.log_input = log_input;
  band.max_ratio = std::isnan(max_ratio) ? std::numeric_limits<double>::infinity() : max_ratio;
  band.delta = delta;
  band.delta_js = band.table.ns > 0 ? delta_weights(band.table, delta, band.delta_ws) : 0;
  band.cell_f = nullptr;
  band.cell_d = nullptr;
  band.wide = nullptr;
  band.bits = nullptr;
  band.token_cubics = nullptr;
  band.token_bits = nullptr;
  band.s_axis = band.table.ns > 1 ? token_s_axis(band.table) : TokenSAxis{};
  band.closed_f[0] = closed_delta<float>(band.divergence, delta);
  band.closed_f[1] = closed_delta<float>(band.divergence, band.table.delta_min);
  band.closed_f[2] = closed_delta<float>(band.divergence, band.table.delta_max);
  return band;
}

// Broadcast shape of the element-wise inputs (a clear error when they cannot broadcast).
inline std::vector<int64_t> broadcast_shape(const char* op, std::initializer_list<at::Tensor> ts) {
  std::vector<int64_t> shape;
  for (const auto& t : ts) {
    if (!t.defined()) continue;
    try {
      shape = at::infer_size(shape, t.sizes());
    } catch (const c10::Error&) {
      TORCH_CHECK(false, op, ": shapes ", c10::IntArrayRef(shape), " and ", t.sizes(), " cannot be broadcast");
    }
  }
  return shape;
}

// The element-wise iteration of `bounds` (outputs lo, up) or `clip` (output out, when ratio is given) over
// the broadcast inputs, after the argument checks. Outputs are allocated contiguous in the broadcast
// shape, as the fake kernels promise; the iterator only resolves strides.
struct BandIter {
  at::TensorIterator iter;
  at::Tensor lo, up, out;
};

inline BandIter make_band_iter(const char* op, const at::Tensor* ratio, const at::Tensor& prob,
                               const c10::optional<at::Tensor>& delta, const at::Tensor& table,
                               c10::ArrayRef<double> grid, int64_t divergence, double max_ratio) {
  check_prob_and_delta(op, prob, delta, table, grid, divergence, max_ratio);
  if (ratio) {
    TORCH_CHECK(ratio->scalar_type() == prob.scalar_type(), op, ": ratio dtype ", ratio->scalar_type(),
                " differs from p_old's ", prob.scalar_type());
    TORCH_CHECK(ratio->device() == prob.device(), op, ": ratio is on ", ratio->device(), " but p_old is on ",
                prob.device());
  }
  const at::Tensor none;
  const bool per_token = delta.has_value() && !is_host_scalar_delta(delta);
  const auto shape = broadcast_shape(op, {ratio ? *ratio : none, prob, per_token ? *delta : none});
  BandIter b;
  auto cfg = at::TensorIteratorConfig();
  if (ratio) {
    b.out = at::empty(shape, prob.options());
    cfg.add_output(b.out).add_const_input(*ratio);
  } else {
    b.lo = at::empty(shape, prob.options());
    b.up = at::empty(shape, prob.options());
    cfg.add_output(b.lo).add_output(b.up);
  }
  cfg.add_const_input(prob);
  if (per_token) cfg.add_const_input(*delta);
  cfg.check_all_same_dtype(true).resize_outputs(false);
  b.iter = cfg.build();
  return b;
}

}  // namespace bandpo
