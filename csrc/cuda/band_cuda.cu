// CUDA implementations of bandpo_lut::bounds and bandpo_lut::clip.
//
// Two grid-stride kernels per (dtype, op, cells mode, divergence path: KL or closed form, see DivPath; for KL also
// per input kind, p or log p, see ProbInput: each KL kernel then carries one way from its input to t = logit p),
// launched as one resident wave on the current stream:
//  * dense operands (every one contiguous in the same order, 16-byte aligned): each thread moves kVec
//    elements per step with vector loads and stores, 64-bit indices (no element limit);
//  * anything else (strides, broadcasting): TensorIterator's offsets with precomputed magic-number
//    divisions (at::cuda::detail::OffsetCalculator), 32-bit per sub-iteration (the iterator splits larger
//    ones); more dimensions than it handles are materialised first.
// With a scalar δ the KL band reads cell cubics made once per (device, table, δ) (cells_cuda.cu), staged in shared
// memory by the common prologue (kernel_common.cuh): all its reads are LDS.128 (sm_90 SASS). In float arithmetic
// (float32, float16, bfloat16) they are the cells in p's bits (kl_bit_cells.h: no logit, no division on the grid),
// in float64 the cells in t.
// Both kernels compute every element with the same code (band_value), so a layout never changes a bit.
//
// tv, chi2 and hellinger (band_element.h closed_form) run in float32 for float32/16-bit p: their lower bounds
// cancel near saturation (tv: p - δ, chi2: p - δ(1-p), hellinger: p - δ(1 - δ/4)), and closed_gap
// (bandpo_math.h) takes that difference exactly to rounding in float (an fma, or the saturation point as a float
// pair for a δ that is no float). From log p they stay in float64: p = e^x is not exact in float (the fused
// loss always takes this path).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <ATen/cuda/detail/OffsetCalculator.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "band_element.h"
#include "band_host.h"
#include "cuda/kernel_common.cuh"

namespace bandpo {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxOperands = 4;  // outputs first (lo, up | out), then [ratio,] prob[, delta]
using Offsets = OffsetCalculator<kMaxOperands>;

// Elements per thread and step on the dense path: 16 bytes of float32 or float64, 8 of a half type.
template <typename scalar_t>
constexpr int vec_size() {
  return sizeof(scalar_t) >= 8 ? 2 : 4;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// The operands' base pointers, in iterator order (kernels get no at::Tensor).
struct Pointers {
  char* data[kMaxOperands];
};

// Operand positions: outputs, then [ratio,] prob[, delta].
template <bool CLIP>
struct Slots {
  static constexpr int n_out = CLIP ? 1 : 2;
  static constexpr int ratio = 1;            // clip only
  static constexpr int prob = CLIP ? 2 : 2;  // bounds: lo, up, prob; clip: out, ratio, prob
  static constexpr int delta = 3;
};

// One element: the bounds (CLIP false: out0 = lo, out1 = up) or the clipped ratio (out0), in acc_t.
template <typename acc_t, bool CLIP, bool PER_TOKEN, DivPath PATH, ProbInput IN, bool BITS>
__device__ __forceinline__ void band_value(const BandParams& band, const GridConsts<acc_t>& g,
                                           const DeltaConsts<acc_t>& c, acc_t x, acc_t d, acc_t r, acc_t& out0,
                                           acc_t& out1) {
  acc_t l, u;
  band_element<acc_t, PER_TOKEN, PATH, IN, BITS>(band, g, c, x, d, l, u);
  if (CLIP) {
    out0 = clamp_like_torch<acc_t>(r, l, u);
  } else {
    out0 = l;
    out1 = u;
  }
}

template <typename scalar_t, bool CLIP, int CELLS, DivPath PATH, ProbInput IN>
__global__ void __launch_bounds__(kThreads)
    band_dense_kernel(BandParams band, GridConsts<at::opmath_type<scalar_t>> g, const void* cells_src, int n_cells,
                      Pointers io, int64_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool PER_TOKEN = per_token_mode(CELLS);
  constexpr int V = vec_size<scalar_t>();
  using S = Slots<CLIP>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  set_cells<acc_t>(band, cells_prologue<CELLS, acc_t>(static_cast<const acc_t*>(cells_src), n_cells, smem_raw));
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(band.delta));
  g.invalid = zero_by_zero(acc_t(0));  // the device's 0/0, not the host's (device_grid_consts)
  const scalar_t* prob = reinterpret_cast<const scalar_t*>(io.data[S::prob]);
  const scalar_t* ratio = reinterpret_cast<const scalar_t*>(io.data[S::ratio]);
  const scalar_t* delta = reinterpret_cast<const scalar_t*>(io.data[S::delta]);
  scalar_t* out0 = reinterpret_cast<scalar_t*>(io.data[0]);
  scalar_t* out1 = reinterpret_cast<scalar_t*>(io.data[1]);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * V;
  const int64_t whole = numel - numel % V;  // the elements of whole steps: i < whole is i + V <= numel (i % V == 0)
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  for (; i < whole; i += stride) {
    // Every load of the step first (kVec elements in flight per operand), then the math, then the stores.
    const Vec<scalar_t, V> xv = *reinterpret_cast<const Vec<scalar_t, V>*>(prob + i);
    Vec<scalar_t, V> rv{}, dv{}, o0, o1;
    if (CLIP) rv = *reinterpret_cast<const Vec<scalar_t, V>*>(ratio + i);
    if (PER_TOKEN) dv = *reinterpret_cast<const Vec<scalar_t, V>*>(delta + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      acc_t a0, a1 = acc_t(0);
      band_value<acc_t, CLIP, PER_TOKEN, PATH, IN, bits_mode(CELLS)>(
          band, g, c, static_cast<acc_t>(xv.v[k]), PER_TOKEN ? static_cast<acc_t>(dv.v[k]) : c.delta,
          CLIP ? static_cast<acc_t>(rv.v[k]) : acc_t(0), a0, a1);
      o0.v[k] = static_cast<scalar_t>(a0);
      o1.v[k] = static_cast<scalar_t>(a1);
    }
    *reinterpret_cast<Vec<scalar_t, V>*>(out0 + i) = o0;
    if (!CLIP) *reinterpret_cast<Vec<scalar_t, V>*>(out1 + i) = o1;
  }
  // The tail, fewer than V elements: the one thread whose next step starts at `whole`.
  for (int64_t j = i; j < numel; ++j) {
    acc_t a0, a1 = acc_t(0);
    band_value<acc_t, CLIP, PER_TOKEN, PATH, IN, bits_mode(CELLS)>(
        band, g, c, static_cast<acc_t>(prob[j]), PER_TOKEN ? static_cast<acc_t>(delta[j]) : c.delta,
        CLIP ? static_cast<acc_t>(ratio[j]) : acc_t(0), a0, a1);
    out0[j] = static_cast<scalar_t>(a0);
    if (!CLIP) out1[j] = static_cast<scalar_t>(a1);
  }
}

template <typename scalar_t, bool CLIP, int CELLS, DivPath PATH, ProbInput IN>
__global__ void __launch_bounds__(kThreads)
    band_strided_kernel(BandParams band, GridConsts<at::opmath_type<scalar_t>> g, const void* cells_src, int n_cells,
                        Pointers io, Offsets offsets, uint32_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool PER_TOKEN = per_token_mode(CELLS);
  using S = Slots<CLIP>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  set_cells<acc_t>(band, cells_prologue<CELLS, acc_t>(static_cast<const acc_t*>(cells_src), n_cells, smem_raw));
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(band.delta));
  g.invalid = zero_by_zero(acc_t(0));  // the device's 0/0, not the host's (device_grid_consts)
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += gridDim.x * blockDim.x) {
    const auto off = offsets.get(i);  // byte offsets, one per operand
    const acc_t x = static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(io.data[S::prob] + off[S::prob]));
    const acc_t d =
        PER_TOKEN ? static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(io.data[S::delta] + off[S::delta])) : c.delta;
    const acc_t r =
        CLIP ? static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(io.data[S::ratio] + off[S::ratio])) : acc_t(0);
    acc_t a0, a1 = acc_t(0);
    band_value<acc_t, CLIP, PER_TOKEN, PATH, IN, bits_mode(CELLS)>(band, g, c, x, d, r, a0, a1);
    *reinterpret_cast<scalar_t*>(io.data[0] + off[0]) = static_cast<scalar_t>(a0);
    if (!CLIP) *reinterpret_cast<scalar_t*>(io.data[1] + off[1]) = static_cast<scalar_t>(a1);
  }
}

Pointers pointers_of(const at::TensorIteratorBase& iter) {
  Pointers io{};
  for (int k = 0; k < iter.ntensors(); ++k) io.data[k] = static_cast<char*>(iter.data_ptr(k));
  return io;
}

// TensorIterator's offsets for up to kMaxOperands operands (absent ones get zero strides).
Offsets offsets_of(const at::TensorIteratorBase& iter) {
  const int64_t zeros[MAX_DIMS] = {0};
  const int64_t* strides[kMaxOperands];
  for (int k = 0; k < kMaxOperands; ++k) strides[k] = k < iter.ntensors() ? iter.strides(k).data() : zeros;
  return Offsets(iter.ndim(), iter.shape().data(), strides);
}

bool dense_and_aligned(const at::TensorIteratorBase& iter, int vec_bytes) {
  if (!iter.is_contiguous()) return false;
  for (int k = 0; k < iter.ntensors(); ++k) {
    if (reinterpret_cast<uintptr_t>(iter.data_ptr(k)) % vec_bytes != 0) return false;
  }
  return true;
}

template <typename scalar_t, bool CLIP, int CELLS, DivPath PATH, ProbInput IN>
void launch_mode(at::TensorIteratorBase& iter, const BandParams& band, const CellsPlan& plan, int device,
                 cudaStream_t stream) {
  constexpr int V = vec_size<scalar_t>();
  const size_t smem = CELLS == kCellsShared || CELLS == kCellsBits ? plan.smem : 0;
  const GridConsts<at::opmath_type<scalar_t>> g = device_grid_consts<at::opmath_type<scalar_t>>(band);
  // Above 48 KB a kernel launches with its cells only once opted in, and each instantiation (dense or strided, p or
  // log p) is its own kernel: the one launched is opted in here (the plan checked the bytes against the dense one).
  const auto opt_in = [&](const void* kernel) {
    if (smem > 0) TORCH_INTERNAL_ASSERT(shared_cells_bytes(kernel, smem, 0, device) == smem, "band: cells refused");
  };
  if (dense_and_aligned(iter, V * sizeof(scalar_t))) {
    const auto kernel = band_dense_kernel<scalar_t, CLIP, CELLS, PATH, IN>;
    opt_in((const void*)kernel);
    const int64_t needed =
        (iter.numel() + static_cast<int64_t>(kThreads) * V - 1) / (static_cast<int64_t>(kThreads) * V);
    const int blocks =
        static_cast<int>(std::min<int64_t>(needed, resident_blocks((const void*)kernel, kThreads, smem, device)));
    kernel<<<blocks, kThreads, smem, stream>>>(band, g, plan.src, plan.n_cells, pointers_of(iter), iter.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const auto kernel = band_strided_kernel<scalar_t, CLIP, CELLS, PATH, IN>;
  opt_in((const void*)kernel);
  const int resident = resident_blocks((const void*)kernel, kThreads, smem, device);
  for (auto& sub : iter.with_32bit_indexing()) {  // one sub-iterator unless there are 2^31 or more elements
    const int64_t needed = (sub.numel() + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(std::min<int64_t>(needed, resident));
    kernel<<<blocks, kThreads, smem, stream>>>(band, g, plan.src, plan.n_cells, pointers_of(sub), offsets_of(sub),
                                               static_cast<uint32_t>(sub.numel()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The KL kernels, one per input kind (p or log p: read once here, never per element). The closed forms keep one
// kernel for both (kRuntime): from log p they compute in double (band_element.h closed_form).
template <typename scalar_t, bool CLIP, int CELLS>
void launch_table(at::TensorIteratorBase& iter, const BandParams& band, const CellsPlan& plan, int device,
                  cudaStream_t stream) {
  if (band.log_input) {
    launch_mode<scalar_t, CLIP, CELLS, DivPath::kTable, ProbInput::kLogProb>(iter, band, plan, device, stream);
  } else {
    launch_mode<scalar_t, CLIP, CELLS, DivPath::kTable, ProbInput::kProb>(iter, band, plan, device, stream);
  }
}

template <bool CLIP>
void launch(at::TensorIteratorBase& iter, const BandParams& band, bool per_token, at::ScalarType dtype, int device) {
  if (iter.numel() == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "bandpo_lut_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // The KL band's fast paths: float arithmetic reads the cells in p's bits (scalar δ: from shared memory, else
    // the cells in t from global memory; per-token δ: the patches in the bits of p and δ, else the table), double
    // the cells in t (scalar δ, shared memory) or the table (per-token δ).
    constexpr bool kBits = std::is_same<acc_t, float>::value;
    constexpr int kFast = kBits ? kCellsBits : kCellsShared;
    // Shared memory is planned for the dense kernel from p; the others have the same static use (none) and are opted
    // in at their launch (launch_mode).
    const CellsPlan plan =
        plan_cells<acc_t>(band, per_token, /*band_applies=*/true,
                          (const void*)band_dense_kernel<scalar_t, CLIP, kFast, DivPath::kTable, ProbInput::kProb>, 0,
                          device, stream, kBits);
    const bool table = div_path_of(band.divergence) == DivPath::kTable;
    if (plan.mode == kFast) {  // a table-read divergence only
      BandParams with_grid = band;
      with_grid.bit_grid = plan.grid;
      launch_table<scalar_t, CLIP, kFast>(iter, with_grid, plan, device, stream);
    } else if (plan.mode == kCellsGlobal) {
      if (table) {
        launch_table<scalar_t, CLIP, kCellsGlobal>(iter, band, plan, device, stream);
      } else {
        launch_mode<scalar_t, CLIP, kCellsGlobal, DivPath::kClosed, ProbInput::kRuntime>(iter, band, plan, device,
                                                                                         stream);
      }
    } else if (plan.mode == kCellsBitsToken) {  // float arithmetic, a table-read divergence only
      if constexpr (kBits) {
        BandParams with_grid = band;
        with_grid.bit_grid = plan.grid;
        launch_table<scalar_t, CLIP, kCellsBitsToken>(iter, with_grid, plan, device, stream);
      }
    } else if (table) {
      launch_table<scalar_t, CLIP, kCellsNone>(iter, band, plan, device, stream);
    } else {
      launch_mode<scalar_t, CLIP, kCellsNone, DivPath::kClosed, ProbInput::kRuntime>(iter, band, plan, device, stream);
    }
  });
}

// Inputs with more non-collapsible dimensions than the offset calculator handles (alternating broadcasts
// reach that even from contiguous tensors) are materialised dense in the broadcast shape; the copies live in
// the caller's `keep` (the iterator borrows its operands).
struct Dense {
  at::Tensor ratio, prob;
  c10::optional<at::Tensor> delta;
};

bool too_many_dims(const BandIter& it) { return it.iter.ndim() > MAX_DIMS; }

void materialise(Dense& keep, at::IntArrayRef shape, const at::Tensor* ratio, const at::Tensor& prob,
                 const c10::optional<at::Tensor>& delta) {
  if (ratio) keep.ratio = ratio->expand(shape).contiguous();
  keep.prob = prob.expand(shape).contiguous();
  if (delta.has_value()) keep.delta = delta->expand(shape).contiguous();
}

std::tuple<at::Tensor, at::Tensor> bounds_cuda(const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                                               double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid,
                                               int64_t divergence, bool log_input, double max_ratio) {
  const c10::cuda::CUDAGuard guard(prob.device());
  const DeltaArg d = resolve_delta("bounds", delta, delta_scalar, grid, prob);
  BandIter it = make_band_iter("bounds", nullptr, prob, d.per_token, table, grid, divergence, max_ratio);
  if (d.all_nan) {
    it.lo.fill_(std::numeric_limits<double>::quiet_NaN());
    it.up.fill_(std::numeric_limits<double>::quiet_NaN());
    return {it.lo, it.up};
  }
  Dense keep;
  if (too_many_dims(it)) {
    materialise(keep, it.lo.sizes(), nullptr, prob, d.per_token);
    it = make_band_iter("bounds", nullptr, keep.prob, keep.delta, table, grid, divergence, max_ratio);
  }
  const BandParams band = make_params(table, grid, divergence, log_input, d, max_ratio);
  check_table_offsets("bounds", band.table);
  launch<false>(it.iter, band, d.per_token_mode(), prob.scalar_type(), prob.get_device());
  return {it.lo, it.up};
}

at::Tensor clip_cuda(const at::Tensor& ratio, const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                     double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                     bool log_input, double max_ratio) {
  const c10::cuda::CUDAGuard guard(prob.device());
  const DeltaArg d = resolve_delta("clip", delta, delta_scalar, grid, prob);
  BandIter it = make_band_iter("clip", &ratio, prob, d.per_token, table, grid, divergence, max_ratio);
  if (d.all_nan) {
    it.out.fill_(std::numeric_limits<double>::quiet_NaN());
    return it.out;
  }
  Dense keep;
  if (too_many_dims(it)) {
    materialise(keep, it.out.sizes(), &ratio, prob, d.per_token);
    it = make_band_iter("clip", &keep.ratio, keep.prob, keep.delta, table, grid, divergence, max_ratio);
  }
  const BandParams band = make_params(table, grid, divergence, log_input, d, max_ratio);
  check_table_offsets("clip", band.table);
  launch<true>(it.iter, band, d.per_token_mode(), prob.scalar_type(), prob.get_device());
  return it.out;
}

}  // namespace
}  // namespace bandpo

TORCH_LIBRARY_IMPL(bandpo_lut, CUDA, m) {
  m.impl("bounds", &bandpo::bounds_cuda);
  m.impl("clip", &bandpo::clip_cuda);
}
