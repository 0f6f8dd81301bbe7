// Host-side glue shared by the CPU and CUDA implementations: argument checks, the parameter struct,
// output allocation. Kernels never see at::Tensor; they get a BandParams and raw pointers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <limits>

#include "bandpo_math.h"

namespace bandpo {

// grid = [t_min, t_step, s_min, s_step, delta_min, delta_max, delta_max_inclusive], from the table header.
constexpr int kGridLen = 7;

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_prob_and_delta(const char* op, const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                                 const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                                 double max_ratio) {
  TORCH_CHECK(is_supported_float(prob.scalar_type()), op, ": p_old/log_p_old must be float32, float64, float16 or "
              "bfloat16, got ", prob.scalar_type());
  if (delta.has_value()) {
    TORCH_CHECK(delta->scalar_type() == prob.scalar_type(), op, ": delta tensor dtype ", delta->scalar_type(),
                " differs from p_old's ", prob.scalar_type());
    TORCH_CHECK(delta->device() == prob.device(), op, ": delta is on ", delta->device(), " but p_old is on ",
                prob.device());
  }
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 3 && table.size(0) == 2 && table.is_contiguous(),
              op, ": table must be a contiguous float32 tensor of shape (2, n_t + 2, n_s + 2)");
  TORCH_CHECK(table.size(1) >= 6 && table.size(2) >= 6, op, ": table is too small");
  TORCH_CHECK(table.device() == prob.device(), op, ": table is on ", table.device(), " but p_old is on ",
              prob.device());
  TORCH_CHECK(grid.size() == kGridLen, op, ": grid must have ", kGridLen, " entries");
  TORCH_CHECK(divergence >= kKL && divergence <= kHellinger, op, ": unknown divergence id ", divergence);
  TORCH_CHECK(max_ratio >= 1.0, op, ": max_ratio must be >= 1, got ", max_ratio);
}

inline BandParams make_params(const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                              bool log_input, double delta, double max_ratio) {
  BandParams P{};
  P.table.coef = table.data_ptr<float>();
  P.table.nt = static_cast<int>(table.size(1)) - 2;
  P.table.ns = static_cast<int>(table.size(2)) - 2;
  P.table.t_min = grid[0];
  P.table.t_step = grid[1];
  P.table.s_min = grid[2];
  P.table.s_step = grid[3];
  P.table.delta_min = grid[4];
  P.table.delta_max = grid[5];
  P.table.delta_max_inclusive = grid[6] != 0.0;
  P.divergence = static_cast<int>(divergence);
  P.log_input = log_input;
  P.max_ratio = std::isnan(max_ratio) ? std::numeric_limits<double>::infinity() : max_ratio;
  P.delta = delta;
  P.delta_js = delta_weights(P.table, delta, P.delta_ws);
  P.cell_f = nullptr;
  P.cell_d = nullptr;
  return P;
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
  const auto shape = broadcast_shape(op, {ratio ? *ratio : none, prob, delta.has_value() ? *delta : none});
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
  if (delta.has_value()) cfg.add_const_input(*delta);
  cfg.check_all_same_dtype(true).resize_outputs(false);
  b.iter = cfg.build();
  return b;
}

}  // namespace bandpo
