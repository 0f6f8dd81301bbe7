// CUDA implementation of the fused policy loss: bandpo_lut::policy_loss_fwd / policy_loss_bwd.
//
// Grid: (chunks of a row, rows). Each thread accumulates its tokens' row sums and counts in double, a warp
// shuffle and a shared-memory pass reduce them per block, and one atomicAdd per value and block lands them
// in the (zero-initialised) outputs. The backward is element-wise and recomputes each token's terms.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "loss_host.h"

namespace bandpo {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerThread = 8;
constexpr int kSums = kNumCounts + 2;   // counts, then the row's Σ w·loss and Σ w

template <typename acc_t>
__device__ void setup_cells(LossParams& L, acc_t* cells) {
  if (L.clip_kind == kClipBand && L.band.divergence == kKL && !L.per_token_delta) {
    for (int k = threadIdx.x; k < L.band.table.nt - 1; k += blockDim.x) {
      double c8[8];
      collapse_cell(L.band.table, k, L.band.delta_js, L.band.delta_ws, c8);
      for (int j = 0; j < 8; ++j) cells[8 * k + j] = static_cast<acc_t>(c8[j]);
    }
    __syncthreads();
    if constexpr (std::is_same<acc_t, double>::value) {
      L.band.cell_d = reinterpret_cast<const double*>(cells);
    } else {
      L.band.cell_f = reinterpret_cast<const float*>(cells);
    }
  }
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ bool token_at(const LossParams& L, const DeltaConsts<acc_t>& c, const scalar_t* lp,
                                         const scalar_t* olp, const scalar_t* adv, const void* mask,
                                         const scalar_t* delta, int64_t i, acc_t& w, TokenTerms<acc_t>& o) {
  if (L.mask_kind == kMaskBytes) {
    w = static_cast<const uint8_t*>(mask)[i] ? acc_t(1) : acc_t(0);
  } else if (L.mask_kind == kMaskFloat) {
    w = static_cast<acc_t>(static_cast<const scalar_t*>(mask)[i]);
  } else {
    w = acc_t(1);
  }
  if (w == acc_t(0)) return false;
  const acc_t o_lp = static_cast<acc_t>(olp[i]);
  const acc_t p = exp_any(o_lp);
  const acc_t d = delta ? static_cast<acc_t>(delta[i]) : c.delta;
  acc_t lo, up;
  if (L.per_token_delta) {
    clip_bounds<acc_t, true>(L, c, o_lp, p, d, lo, up);
  } else {
    clip_bounds<acc_t, false>(L, c, o_lp, p, d, lo, up);
  }
  token_terms<acc_t>(L, static_cast<acc_t>(lp[i]), o_lp, static_cast<acc_t>(adv[i]), w, p, lo, up, o);
  return true;
}

template <typename scalar_t>
__global__ void loss_fwd_kernel(LossParams L, const scalar_t* lp, const scalar_t* olp, const scalar_t* adv,
                                const void* mask, const scalar_t* delta, int64_t n, double* row_sum, double* row_w,
                                double* counts) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  setup_cells<acc_t>(L, reinterpret_cast<acc_t*>(smem_raw));
  __shared__ double partial[kThreads / 32][kSums];
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(L.band.delta));
  const int64_t row = blockIdx.y;
  const int64_t base = row * n;
  double sums[kSums];
  for (int k = 0; k < kSums; ++k) sums[k] = 0.0;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kTokensPerThread;
  for (int64_t j = blockIdx.x * chunk + threadIdx.x; j < n && j < (blockIdx.x + 1) * chunk; j += blockDim.x) {
    acc_t w;
    TokenTerms<acc_t> o;
    if (token_at<scalar_t, acc_t>(L, c, lp, olp, adv, mask, delta, base + j, w, o)) {
      add_counts<acc_t, double>(o, w, sums);
      sums[kNumCounts] += static_cast<double>(o.value);
      sums[kNumCounts + 1] += static_cast<double>(w);
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int k = 0; k < kSums; ++k) {
    double v = sums[k];
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) partial[warp][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < kSums) {
    double v = 0.0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) v += partial[w][threadIdx.x];
    if (v != 0.0 || threadIdx.x >= kNumCounts) {
      double* dst = threadIdx.x < kNumCounts ? counts + threadIdx.x
                    : (threadIdx.x == kNumCounts ? row_sum + row : row_w + row);
      atomicAdd(dst, v);
    }
  }
}

template <typename scalar_t>
__global__ void loss_bwd_kernel(LossParams L, const double* grad_row, const scalar_t* lp, const scalar_t* olp,
                                const scalar_t* adv, const void* mask, const scalar_t* delta, int64_t n,
                                scalar_t* grad) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  setup_cells<acc_t>(L, reinterpret_cast<acc_t*>(smem_raw));
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(L.band.delta));
  const int64_t row = blockIdx.y;
  const acc_t g = static_cast<acc_t>(grad_row[row]);
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kTokensPerThread;
  for (int64_t j = blockIdx.x * chunk + threadIdx.x; j < n && j < (blockIdx.x + 1) * chunk; j += blockDim.x) {
    acc_t w;
    TokenTerms<acc_t> o;
    const int64_t i = row * n + j;
    const bool counted = token_at<scalar_t, acc_t>(L, c, lp, olp, adv, mask, delta, i, w, o);
    grad[i] = static_cast<scalar_t>(counted ? g * o.grad : acc_t(0));
  }
}

dim3 loss_grid(int64_t B, int64_t n) {
  const int64_t chunk = static_cast<int64_t>(kThreads) * kTokensPerThread;
  TORCH_CHECK(B <= 65535, "policy_loss (CUDA): at most 65535 rows, got ", B);
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, (n + chunk - 1) / chunk)), static_cast<unsigned>(B));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> loss_fwd_cuda(
    const at::Tensor& lp, const at::Tensor& olp, const at::Tensor& adv, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& delta, double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid,
    int64_t divergence, int64_t clip_kind, double eps_low, double eps_high, double max_ratio, double dual_clip,
    int64_t mode) {
  const c10::cuda::CUDAGuard guard(lp.device());
  const LossTensors T = check_loss_inputs("policy_loss_fwd", lp, olp, adv, mask, delta);
  const LossParams L = make_loss_params(table, grid, divergence, clip_kind, eps_low, eps_high, max_ratio, dual_clip,
                                        mode, delta_scalar, T);
  const int64_t B = lp.size(0), n = lp.size(1);
  auto f64 = lp.options().dtype(at::kDouble);
  at::Tensor row_sum = at::zeros({B}, f64), row_w = at::zeros({B}, f64), counts = at::zeros({kNumCounts}, f64);
  if (B == 0 || n == 0) return {row_sum, row_w, counts};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(lp.get_device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "policy_loss_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const size_t smem = sizeof(acc_t) * 8 * (L.band.table.nt - 1);
    loss_fwd_kernel<scalar_t><<<loss_grid(B, n), kThreads, smem, stream>>>(
        L, T.lp.data_ptr<scalar_t>(), T.olp.data_ptr<scalar_t>(), T.adv.data_ptr<scalar_t>(),
        T.mask.defined() ? T.mask.data_ptr() : nullptr, T.delta.defined() ? T.delta.data_ptr<scalar_t>() : nullptr, n,
        row_sum.data_ptr<double>(), row_w.data_ptr<double>(), counts.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {row_sum, row_w, counts};
}

at::Tensor loss_bwd_cuda(const at::Tensor& grad_row, const at::Tensor& lp, const at::Tensor& olp,
                         const at::Tensor& adv, const c10::optional<at::Tensor>& mask,
                         const c10::optional<at::Tensor>& delta, double delta_scalar, const at::Tensor& table,
                         c10::ArrayRef<double> grid, int64_t divergence, int64_t clip_kind, double eps_low,
                         double eps_high, double max_ratio, double dual_clip, int64_t mode) {
  const c10::cuda::CUDAGuard guard(lp.device());
  const LossTensors T = check_loss_inputs("policy_loss_bwd", lp, olp, adv, mask, delta);
  TORCH_CHECK(grad_row.dim() == 1 && grad_row.size(0) == lp.size(0) && grad_row.device() == lp.device(),
              "policy_loss_bwd: grad_row must be a (batch,) tensor on log_prob's device");
  const at::Tensor g = grad_row.to(at::kDouble).contiguous();
  const LossParams L = make_loss_params(table, grid, divergence, clip_kind, eps_low, eps_high, max_ratio, dual_clip,
                                        mode, delta_scalar, T);
  const int64_t B = lp.size(0), n = lp.size(1);
  at::Tensor grad = at::empty_like(T.lp);
  if (B == 0 || n == 0) return grad;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(lp.get_device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "policy_loss_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const size_t smem = sizeof(acc_t) * 8 * (L.band.table.nt - 1);
    loss_bwd_kernel<scalar_t><<<loss_grid(B, n), kThreads, smem, stream>>>(
        L, g.data_ptr<double>(), T.lp.data_ptr<scalar_t>(), T.olp.data_ptr<scalar_t>(), T.adv.data_ptr<scalar_t>(),
        T.mask.defined() ? T.mask.data_ptr() : nullptr, T.delta.defined() ? T.delta.data_ptr<scalar_t>() : nullptr, n,
        grad.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad;
}

}  // namespace
}  // namespace bandpo

TORCH_LIBRARY_IMPL(bandpo_lut, CUDA, m) {
  m.impl("policy_loss_fwd", &bandpo::loss_fwd_cuda);
  m.impl("policy_loss_bwd", &bandpo::loss_bwd_cuda);
}
