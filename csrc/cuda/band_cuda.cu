// CUDA implementations of bandpo_lut::bounds and bandpo_lut::clip.
//
// One grid-stride kernel per (dtype, op, δ mode). With a scalar δ each block first collapses the
// table's δ axis into per-cell cubics in shared memory (a few KB, cheaper than a second launch and free
// of host synchronisation); the table itself is read through the read-only cache (load_ro). Runs on the
// current stream; broadcasting and strides are resolved by TensorIterator on the host and passed as a
// plain offset description.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "band_element.h"
#include "band_host.h"

namespace bandpo {
namespace {

constexpr int kMaxDims = 8;
constexpr int kMaxOperands = 4;
constexpr int kThreads = 256;

// Element addressing for up to kMaxOperands operands: outputs first, then [ratio,] prob[, delta].
struct Operands {
  char* data[kMaxOperands];
  int64_t strides[kMaxOperands][kMaxDims];  // bytes, per dimension (innermost first, TensorIterator order)
  int64_t sizes[kMaxDims];
  int ndim;
  int count;
  bool contiguous;   // every operand dense in the same order: offset = i * sizeof(scalar)
  int64_t numel;
};

template <typename scalar_t>
__device__ __forceinline__ scalar_t* at_index(const Operands& A, int k, int64_t i) {
  if (A.contiguous) return reinterpret_cast<scalar_t*>(A.data[k]) + i;
  int64_t off = 0, rem = i;
  for (int d = 0; d < A.ndim; ++d) {
    const int64_t q = rem / A.sizes[d];
    off += (rem - q * A.sizes[d]) * A.strides[k][d];
    rem = q;
  }
  return reinterpret_cast<scalar_t*>(A.data[k] + off);
}

template <typename scalar_t, bool CLIP, bool TOKEN>
__global__ void band_kernel(BandParams P, Operands A) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  acc_t* cells = reinterpret_cast<acc_t*>(smem_raw);
  if (P.divergence == kKL && !TOKEN) {
    for (int k = threadIdx.x; k < P.table.nt - 1; k += blockDim.x) {
      double c8[8];
      collapse_cell(P.table, k, P.delta_js, P.delta_ws, c8);
      for (int j = 0; j < 8; ++j) cells[8 * k + j] = static_cast<acc_t>(c8[j]);
    }
    __syncthreads();
    if constexpr (std::is_same<acc_t, double>::value) {
      P.cell_d = reinterpret_cast<const double*>(cells);
    } else {
      P.cell_f = reinterpret_cast<const float*>(cells);
    }
  }
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(P.delta));
  const int n_out = CLIP ? 1 : 2;
  const int ip = CLIP ? n_out + 1 : n_out;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < A.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const acc_t x = static_cast<acc_t>(*at_index<scalar_t>(A, ip, i));
    const acc_t d = TOKEN ? static_cast<acc_t>(*at_index<scalar_t>(A, ip + 1, i)) : c.delta;
    acc_t l, u;
    band_element<acc_t, TOKEN>(P, c, x, d, l, u);
    if (CLIP) {
      const acc_t r = static_cast<acc_t>(*at_index<scalar_t>(A, n_out, i));
      *at_index<scalar_t>(A, 0, i) = static_cast<scalar_t>(clamp_like_torch<acc_t>(r, l, u));
    } else {
      *at_index<scalar_t>(A, 0, i) = static_cast<scalar_t>(l);
      *at_index<scalar_t>(A, 1, i) = static_cast<scalar_t>(u);
    }
  }
}

int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return 80;
  if (counts[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device] = n > 0 ? n : 80;
  }
  return counts[device];
}

Operands describe(const at::TensorIteratorBase& iter) {
  Operands A{};
  TORCH_CHECK(iter.ntensors() <= kMaxOperands, "bandpo_lut: too many operands");
  TORCH_CHECK(iter.ndim() <= kMaxDims, "bandpo_lut: inputs with more than ", kMaxDims,
              " non-collapsible dimensions are not supported on CUDA; make them contiguous first");
  A.count = iter.ntensors();
  A.ndim = iter.ndim();
  A.numel = iter.numel();
  A.contiguous = iter.is_contiguous();
  for (int d = 0; d < A.ndim; ++d) A.sizes[d] = iter.shape()[d];
  for (int k = 0; k < A.count; ++k) {
    A.data[k] = static_cast<char*>(iter.data_ptr(k));
    for (int d = 0; d < A.ndim; ++d) A.strides[k][d] = iter.strides(k)[d];
  }
  return A;
}

template <bool CLIP>
void launch(at::TensorIterator& iter, const BandParams& P, bool per_token, at::ScalarType dtype, int device) {
  if (iter.numel() == 0) return;
  const Operands A = describe(iter);
  const int64_t blocks_needed = (A.numel + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::min<int64_t>(blocks_needed, static_cast<int64_t>(sm_count(device)) * 8));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "bandpo_lut_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const size_t smem = (P.divergence == kKL && !per_token) ? sizeof(acc_t) * 8 * (P.table.nt - 1) : 0;
    TORCH_CHECK(smem <= 48 * 1024, "bandpo_lut: table too large for the scalar-delta CUDA path");
    if (per_token) {
      band_kernel<scalar_t, CLIP, true><<<blocks, kThreads, smem, stream>>>(P, A);
    } else {
      band_kernel<scalar_t, CLIP, false><<<blocks, kThreads, smem, stream>>>(P, A);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> bounds_cuda(const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                                               double delta_scalar, const at::Tensor& table,
                                               c10::ArrayRef<double> grid, int64_t divergence, bool log_input,
                                               double max_ratio) {
  const c10::cuda::CUDAGuard guard(prob.device());
  BandIter it = make_band_iter("bounds", nullptr, prob, delta, table, grid, divergence, max_ratio);
  const DeltaArg d = resolve_delta(delta, delta_scalar, grid);
  if (d.all_nan) {
    it.lo.fill_(std::numeric_limits<double>::quiet_NaN());
    it.up.fill_(std::numeric_limits<double>::quiet_NaN());
    return {it.lo, it.up};
  }
  const BandParams P = make_params(table, grid, divergence, log_input, d.scalar, max_ratio, prob.scalar_type());
  launch<false>(it.iter, P, d.per_token_mode(), prob.scalar_type(), prob.get_device());
  return {it.lo, it.up};
}

at::Tensor clip_cuda(const at::Tensor& ratio, const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                     double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                     bool log_input, double max_ratio) {
  const c10::cuda::CUDAGuard guard(prob.device());
  BandIter it = make_band_iter("clip", &ratio, prob, delta, table, grid, divergence, max_ratio);
  const DeltaArg d = resolve_delta(delta, delta_scalar, grid);
  if (d.all_nan) {
    it.out.fill_(std::numeric_limits<double>::quiet_NaN());
    return it.out;
  }
  const BandParams P = make_params(table, grid, divergence, log_input, d.scalar, max_ratio, prob.scalar_type());
  launch<true>(it.iter, P, d.per_token_mode(), prob.scalar_type(), prob.get_device());
  return it.out;
}

}  // namespace
}  // namespace bandpo

TORCH_LIBRARY_IMPL(bandpo_lut, CUDA, m) {
  m.impl("bounds", &bandpo::bounds_cuda);
  m.impl("clip", &bandpo::clip_cuda);
}
