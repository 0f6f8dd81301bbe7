// CUDA implementation of the fused policy loss: bandpo_lut::policy_loss_fwd / policy_loss_bwd.
//
// Forward: two or three launches, whatever the batch, plus one small collapse the first time a (table, δ) is used.
//  1. loss_tokens_kernel, a resident grid of warps walking warp tiles: a tile is K·32 consecutive tokens
//     of one row (K <= kMaxK chosen so that a row is split evenly), so no grid dimension depends on the
//     number of rows. Each warp writes its tile's Σ w·loss and Σ w; each thread accumulates the counts of
//     all its tiles (integers as 32-bit integers when the mask is 0/1: exact and half the registers), and
//     each block writes one row of count partials. No atomics.
//  2. loss_rows_kernel (only when rows span several tiles): each row's sums over its tiles, in order; then
//     loss_finish_kernel, one block: the rows and the counts over the blocks, in order, and the finish shared
//     with the CPU (loss_element.h): the aggregated loss, the metric vector and the backward's row scale.
// Every sum is formed in an order fixed by the shapes and the device: the loss is bit-identical run to run.
// Backward: one element-wise launch over the same tiles.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <type_traits>

#include "cuda/kernel_common.cuh"
#include "loss_host.h"

namespace bandpo {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr int kMaxK = 4;  // tokens per lane and tile, at most (loaded before any math)
constexpr int kFinishThreads = 512;
// Resident blocks of kThreads per SM that the element kernels are compiled for: 3 (at most 80 registers) for
// float arithmetic, 2 (128) for double, whose band and tails need more, and for the forward with a weighted
// mask, whose twenty float64 count accumulators would spill at 80 (ptxas -v, sm_90).
template <typename scalar_t, bool WEIGHTED = false>
constexpr int kMinBlocks = (sizeof(at::opmath_type<scalar_t>) == 8 || WEIGHTED) ? 2 : 3;

// The warp tiles of a (batch, T) problem: tiles_per_row tiles of k·kWarpSize tokens per row (the last may
// be partial).
struct Tiles {
  int64_t rows, n;  // batch, T
  int64_t per_row;  // tiles per row
  int k;            // tokens per lane and tile (1..kMaxK)
  __host__ __device__ int64_t count() const { return rows * per_row; }
};

Tiles make_tiles(int64_t B, int64_t n) {
  Tiles tiles{B, n, 1, 1};
  const int64_t full = static_cast<int64_t>(kWarpSize) * kMaxK;
  tiles.per_row = std::max<int64_t>(1, (n + full - 1) / full);
  const int64_t per_tile = (n + tiles.per_row - 1) / tiles.per_row;
  tiles.k = static_cast<int>(std::max<int64_t>(1, (per_tile + kWarpSize - 1) / kWarpSize));
  return tiles;
}

// One tile's inputs, loaded before any math (kMaxK tokens per lane in flight per operand).
template <typename acc_t>
struct TileInputs {
  acc_t lp[kMaxK], olp[kMaxK], adv[kMaxK], w[kMaxK], d[kMaxK];
};

template <typename scalar_t, typename acc_t, bool PER_TOKEN>
__device__ __forceinline__ void load_tile(const LossParams& params, const LossInputs<scalar_t>& in, const Tiles& tiles,
                                          int64_t base, int64_t j0, int lane, TileInputs<acc_t>& loaded) {
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    const int64_t j = j0 + static_cast<int64_t>(k) * kWarpSize + lane;
    const bool ok = (k < tiles.k) & (j < tiles.n);
    const int64_t i = base + (ok ? j : 0);
    loaded.w[k] = ok ? mask_weight_any<scalar_t, acc_t>(params.mask_kind, in.mask, i) : acc_t(0);
    loaded.lp[k] = ok ? static_cast<acc_t>(in.lp[i]) : acc_t(0);
    loaded.olp[k] = ok ? static_cast<acc_t>(in.olp[i]) : acc_t(0);
    loaded.adv[k] = ok ? static_cast<acc_t>(in.adv[i]) : acc_t(0);
    loaded.d[k] = (ok & PER_TOKEN) ? static_cast<acc_t>(in.delta[i]) : acc_t(0);
  }
}

template <typename acc_t, bool PER_TOKEN, DivPath PATH>
__device__ __forceinline__ void token_at(const LossParams& params, const GridConsts<acc_t>& g,
                                         const DeltaConsts<acc_t>& c, const TileInputs<acc_t>& loaded, int k,
                                         TokenTerms<acc_t>& o) {
  const acc_t p = exp_any(loaded.olp[k]);
  acc_t lo, up;
  clip_bounds<acc_t, PER_TOKEN, PATH>(params, g, c, loaded.olp[k], p, PER_TOKEN ? loaded.d[k] : c.delta, lo, up);
  token_terms<acc_t>(params, loaded.lp[k], loaded.olp[k], loaded.adv[k], loaded.w[k], p, lo, up, o);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {  // a fixed tree: the same order every run
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// Per-thread count accumulators: integer-valued counts in 32-bit integers when every weight is 0 or 1
// (exact), in double for weighted masks; the two real-valued sums always in double.
template <bool WEIGHTED>
struct CountAcc {
  using cnt_t = std::conditional_t<WEIGHTED, double, unsigned>;
  cnt_t n[kNumCounts];
  double kl, width;
  __device__ void zero() {
#pragma unroll
    for (int k = 0; k < kNumCounts; ++k) n[k] = cnt_t(0);
    kl = width = 0.0;
  }
  // Called for tokens with w != 0 only: unless WEIGHTED, w is then 1, and is passed as the constant 1 so that
  // each integer count folds to its condition (a predicated add; no float-to-integer conversion).
  template <typename acc_t>
  __device__ void add(const TokenTerms<acc_t>& o, acc_t w) {
    acc_t c[kNumCounts];
    count_terms<acc_t>(o, WEIGHTED ? w : acc_t(1), c, 1);
#pragma unroll
    for (int k = 0; k < kNumCounts; ++k) {
      if (k == kPpoKlSum) {
        kl += static_cast<double>(c[k]);
      } else if (k == kBandWidthSum) {
        width += static_cast<double>(c[k]);
      } else if (WEIGHTED) {
        n[k] += static_cast<cnt_t>(c[k]);  // 0 or w
      } else {
        n[k] += (c[k] != acc_t(0)) ? 1u : 0u;  // c[k] is 0 or 1
      }
    }
  }
  __device__ double value(int k) const {
    return k == kPpoKlSum ? kl : (k == kBandWidthSum ? width : static_cast<double>(n[k]));
  }
};

// Pass 1. tile_sums: [per_row][rows] (Σ w·loss, Σ w) of each tile; block_counts: [gridDim.x][kNumCounts].
template <typename scalar_t, int CELLS, bool WEIGHTED, DivPath PATH>
__global__ void __launch_bounds__(kThreads, kMinBlocks<scalar_t, WEIGHTED>)
    loss_tokens_kernel(LossParams params, GridConsts<at::opmath_type<scalar_t>> g, const void* cells_src, int n_cells,
                       LossInputs<scalar_t> in, Tiles tiles, double2* tile_sums, double* block_counts) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool PER_TOKEN = per_token_mode(CELLS);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ double warp_counts[kWarpsPerBlock][kNumCounts];
  set_cells<acc_t>(params.band, cells_prologue<CELLS, acc_t>(static_cast<const acc_t*>(cells_src), n_cells, smem_raw));
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(params.band.delta));
  g.invalid = zero_by_zero(acc_t(0));  // the device's 0/0, not the host's (device_grid_consts)
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t tile_len = static_cast<int64_t>(tiles.k) * kWarpSize;
  CountAcc<WEIGHTED> acc;
  acc.zero();
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; tile < tiles.count(); tile += n_warps) {
    const int64_t row = tile / tiles.per_row, part = tile - row * tiles.per_row;
    TileInputs<acc_t> loaded;
    load_tile<scalar_t, acc_t, PER_TOKEN>(params, in, tiles, row * tiles.n, part * tile_len, lane, loaded);
    double s = 0.0, w_sum = 0.0;
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (loaded.w[k] != acc_t(0)) {  // ignored tokens contribute nothing, whatever their inputs
        TokenTerms<acc_t> o;
        token_at<acc_t, PER_TOKEN, PATH>(params, g, c, loaded, k, o);
        acc.add(o, loaded.w[k]);
        s += static_cast<double>(o.value);
        w_sum += static_cast<double>(loaded.w[k]);
      }
    }
    s = warp_sum(s);
    w_sum = warp_sum(w_sum);
    if (lane == 0) tile_sums[part * tiles.rows + row] = make_double2(s, w_sum);
  }
#pragma unroll
  for (int k = 0; k < kNumCounts; ++k) {
    const double v = warp_sum(acc.value(k));
    if (lane == 0) warp_counts[warp][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < kNumCounts) {
    double v = 0.0;
    for (int w = 0; w < kWarpsPerBlock; ++w) v += warp_counts[w][threadIdx.x];
    block_counts[static_cast<int64_t>(blockIdx.x) * kNumCounts + threadIdx.x] = v;
  }
}

// Pass 2a (rows split into several tiles only): each row's (Σ w·loss, Σ w) over its tiles, in tile order.
__global__ void __launch_bounds__(kThreads) loss_rows_kernel(Tiles tiles, const double2* tile_sums, double2* row_sums) {
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < tiles.rows;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s = 0.0, w = 0.0;
    for (int64_t part = 0; part < tiles.per_row; ++part) {  // [part][row]: neighbouring threads read neighbours
      const double2 v = tile_sums[part * tiles.rows + b];
      s += v.x;
      w += v.y;
    }
    row_sums[b] = make_double2(s, w);
  }
}

// Pass 2b, one block. Writes the loss, the metric vector and row_scale (which first holds each row's Σ w).
template <typename scalar_t>
__global__ void __launch_bounds__(kFinishThreads)
    loss_finish_kernel(AggKind agg, int64_t rows, const double2* row_sums, const double* block_counts, int n_blocks,
                       scalar_t* loss, scalar_t* metrics, double* row_scale_out) {
  constexpr int kVals = 4 + kNumCounts;  // s, w, row_mean, n_rows, counts
  constexpr int kWarps = kFinishThreads / kWarpSize;
  __shared__ double warp_vals[kWarps][kVals];
  __shared__ LossTotals totals;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  LossTotals mine{};
  for (int64_t b = threadIdx.x; b < rows; b += blockDim.x) {
    const double2 v = row_sums[b];
    add_row(mine, v.x, v.y);
    row_scale_out[b] = v.y;
  }
  for (int blk = threadIdx.x; blk < n_blocks; blk += blockDim.x) {
    for (int k = 0; k < kNumCounts; ++k) mine.counts[k] += block_counts[static_cast<int64_t>(blk) * kNumCounts + k];
  }
  const double vals[4] = {mine.s, mine.w, mine.row_mean, mine.n_rows};
  for (int k = 0; k < kVals; ++k) {
    const double v = warp_sum(k < 4 ? vals[k] : mine.counts[k - 4]);
    if (lane == 0) warp_vals[warp][k] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    LossTotals grand{};
    for (int w = 0; w < kWarps; ++w) {
      grand.s += warp_vals[w][0];
      grand.w += warp_vals[w][1];
      grand.row_mean += warp_vals[w][2];
      grand.n_rows += warp_vals[w][3];
      for (int k = 0; k < kNumCounts; ++k) grand.counts[k] += warp_vals[w][4 + k];
    }
    *loss = static_cast<scalar_t>(aggregate_loss(agg, grand));
    write_metrics<scalar_t>(grand, metrics);
    totals = grand;
  }
  __syncthreads();
  for (int64_t b = threadIdx.x; b < rows; b += blockDim.x) row_scale_out[b] = row_scale(agg, totals, row_scale_out[b]);
}

template <typename scalar_t, int CELLS, DivPath PATH>
__global__ void __launch_bounds__(kThreads, kMinBlocks<scalar_t>)
    loss_grad_kernel(LossParams params, GridConsts<at::opmath_type<scalar_t>> g, const void* cells_src, int n_cells,
                     LossInputs<scalar_t> in, Tiles tiles, const double* grad_loss, const double* row_scale,
                     scalar_t* grad) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool PER_TOKEN = per_token_mode(CELLS);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  set_cells<acc_t>(params.band, cells_prologue<CELLS, acc_t>(static_cast<const acc_t*>(cells_src), n_cells, smem_raw));
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(params.band.delta));
  g.invalid = zero_by_zero(acc_t(0));  // the device's 0/0, not the host's (device_grid_consts)
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t n_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t tile_len = static_cast<int64_t>(tiles.k) * kWarpSize;
  const double grad_out = *grad_loss;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; tile < tiles.count(); tile += n_warps) {
    const int64_t row = tile / tiles.per_row, part = tile - row * tiles.per_row;
    const int64_t base = row * tiles.n, j0 = part * tile_len;
    const acc_t gb = static_cast<acc_t>(grad_out * row_scale[row]);
    TileInputs<acc_t> loaded;
    load_tile<scalar_t, acc_t, PER_TOKEN>(params, in, tiles, base, j0, lane, loaded);
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      const int64_t j = j0 + static_cast<int64_t>(k) * kWarpSize + lane;
      if ((k < tiles.k) & (j < tiles.n)) {
        acc_t gi = acc_t(0);
        if (loaded.w[k] != acc_t(0)) {
          TokenTerms<acc_t> o;
          token_at<acc_t, PER_TOKEN, PATH>(params, g, c, loaded, k, o);
          gi = gb * o.grad;
        }
        grad[base + j] = static_cast<scalar_t>(gi);
      }
    }
  }
}

// The cells of a launch (the band's planner, for the band of a loss that has one).
// The kernels' divergence path: kTable for a band that reads a table (KL), kClosed for every other clip.
DivPath loss_path(const LossParams& params) {
  return (params.clip_kind == ClipKind::kBand && reads_table(params.band.divergence)) ? DivPath::kTable
                                                                                      : DivPath::kClosed;
}

template <typename acc_t>
CellsPlan plan_loss_cells(const LossParams& params, const void* kernel_shared, size_t static_bytes, int device,
                          cudaStream_t stream) {
  return plan_cells<acc_t>(params.band, params.per_token_delta, params.clip_kind == ClipKind::kBand, kernel_shared,
                           static_bytes, device, stream);
}

template <typename scalar_t, int CELLS, bool WEIGHTED, DivPath PATH>
int launch_tokens(const LossParams& params, const CellsPlan& plan, const LossInputs<scalar_t>& in, const Tiles& tiles,
                  at::Tensor& tile_sums, at::Tensor& block_counts, int device, cudaStream_t stream) {
  const auto kernel = loss_tokens_kernel<scalar_t, CELLS, WEIGHTED, PATH>;
  const size_t smem = CELLS == kCellsShared ? plan.smem : 0;
  const int64_t needed = (tiles.count() + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int blocks =
      static_cast<int>(std::min<int64_t>(needed, resident_blocks((const void*)kernel, kThreads, smem, device)));
  block_counts = at::empty({blocks, kNumCounts}, tile_sums.options());
  kernel<<<blocks, kThreads, smem, stream>>>(
      params, device_grid_consts<at::opmath_type<scalar_t>>(params.band), plan.src, plan.n_cells, in, tiles,
      reinterpret_cast<double2*>(tile_sums.data_ptr<double>()), block_counts.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return blocks;
}

template <typename scalar_t, int CELLS>
int launch_tokens_mask(const LossParams& params, const CellsPlan& plan, const LossInputs<scalar_t>& in,
                       const Tiles& tiles, at::Tensor& tile_sums, at::Tensor& block_counts, int device,
                       cudaStream_t stream) {
  // Shared cells exist for a table-read band only: no closed-form kernel is instantiated for them.
  const bool table = CELLS == kCellsShared || loss_path(params) == DivPath::kTable;
  constexpr DivPath kOther = CELLS == kCellsShared ? DivPath::kTable : DivPath::kClosed;
  if (params.mask_kind == MaskKind::kFloat) {
    return table ? launch_tokens<scalar_t, CELLS, true, DivPath::kTable>(params, plan, in, tiles, tile_sums,
                                                                         block_counts, device, stream)
                 : launch_tokens<scalar_t, CELLS, true, kOther>(params, plan, in, tiles, tile_sums, block_counts,
                                                                device, stream);
  }
  return table ? launch_tokens<scalar_t, CELLS, false, DivPath::kTable>(params, plan, in, tiles, tile_sums,
                                                                        block_counts, device, stream)
               : launch_tokens<scalar_t, CELLS, false, kOther>(params, plan, in, tiles, tile_sums, block_counts, device,
                                                               stream);
}

// The forward on the device (loss_fwd_entry, loss_host.h, has checked the inputs and taken the device guard).
std::tuple<at::Tensor, at::Tensor, at::Tensor> loss_forward(const LossTensors& inputs, const LossParams& params) {
  check_table_offsets("policy_loss", params.band.table);
  const at::Tensor& lp = inputs.lp;
  const int device = lp.get_device();
  const Tiles tiles = make_tiles(lp.size(0), lp.size(1));
  LossOutputs out = empty_loss_outputs(lp);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  at::Tensor tile_sums = at::empty({2 * tiles.count()}, lp.options().dtype(at::kDouble));
  at::Tensor block_counts;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "policy_loss_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const LossInputs<scalar_t> in = loss_inputs<scalar_t>(inputs, 0);
    int blocks = 0;
    if (tiles.count() > 0) {
      const size_t static_bytes = sizeof(double) * kWarpsPerBlock * kNumCounts;
      const void* shared_kernel = params.mask_kind == MaskKind::kFloat
                                      ? (const void*)loss_tokens_kernel<scalar_t, kCellsShared, true, DivPath::kTable>
                                      : (const void*)loss_tokens_kernel<scalar_t, kCellsShared, false, DivPath::kTable>;
      const CellsPlan plan = plan_loss_cells<acc_t>(params, shared_kernel, static_bytes, device, stream);
      if (plan.mode == kCellsShared) {
        blocks = launch_tokens_mask<scalar_t, kCellsShared>(params, plan, in, tiles, tile_sums, block_counts, device,
                                                            stream);
      } else if (plan.mode == kCellsGlobal) {
        blocks = launch_tokens_mask<scalar_t, kCellsGlobal>(params, plan, in, tiles, tile_sums, block_counts, device,
                                                            stream);
      } else {
        blocks =
            launch_tokens_mask<scalar_t, kCellsNone>(params, plan, in, tiles, tile_sums, block_counts, device, stream);
      }
    } else {
      block_counts = at::empty({0}, tile_sums.options());
    }
    // One tile per row: the tile sums are the row sums; otherwise one grid-wide pass forms them (so that the
    // single-block finish reads 16 bytes per row, not per tile).
    const double2* row_sums = reinterpret_cast<const double2*>(tile_sums.data_ptr<double>());
    at::Tensor rows_buf;
    if (tiles.per_row > 1 && tiles.rows > 0) {
      rows_buf = at::empty({2 * tiles.rows}, tile_sums.options());
      const int row_blocks = static_cast<int>(std::min<int64_t>(
          (tiles.rows + kThreads - 1) / kThreads, resident_blocks((const void*)loss_rows_kernel, kThreads, 0, device)));
      loss_rows_kernel<<<row_blocks, kThreads, 0, stream>>>(tiles, row_sums,
                                                            reinterpret_cast<double2*>(rows_buf.data_ptr<double>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      row_sums = reinterpret_cast<const double2*>(rows_buf.data_ptr<double>());
    }
    loss_finish_kernel<scalar_t><<<1, kFinishThreads, 0, stream>>>(
        params.agg, tiles.rows, row_sums, block_counts.data_ptr<double>(), blocks, out.loss.data_ptr<scalar_t>(),
        out.metrics.data_ptr<scalar_t>(), out.row_scale.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out.loss, out.metrics, out.row_scale};
}

template <typename scalar_t, int CELLS, DivPath PATH>
void launch_grad_path(const LossParams& params, const CellsPlan& plan, const LossInputs<scalar_t>& in,
                      const Tiles& tiles, const at::Tensor& g, const at::Tensor& scale, at::Tensor& grad, int device,
                      cudaStream_t stream) {
  const auto kernel = loss_grad_kernel<scalar_t, CELLS, PATH>;
  const size_t smem = CELLS == kCellsShared ? plan.smem : 0;
  const int64_t needed = (tiles.count() + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int blocks =
      static_cast<int>(std::min<int64_t>(needed, resident_blocks((const void*)kernel, kThreads, smem, device)));
  kernel<<<blocks, kThreads, smem, stream>>>(params, device_grid_consts<at::opmath_type<scalar_t>>(params.band),
                                             plan.src, plan.n_cells, in, tiles, g.data_ptr<double>(),
                                             scale.data_ptr<double>(), grad.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int CELLS>
void launch_grad(const LossParams& params, const CellsPlan& plan, const LossInputs<scalar_t>& in, const Tiles& tiles,
                 const at::Tensor& g, const at::Tensor& scale, at::Tensor& grad, int device, cudaStream_t stream) {
  // Shared cells exist for a table-read band only: no closed-form kernel is instantiated for them.
  constexpr DivPath kOther = CELLS == kCellsShared ? DivPath::kTable : DivPath::kClosed;
  if (CELLS == kCellsShared || loss_path(params) == DivPath::kTable) {
    launch_grad_path<scalar_t, CELLS, DivPath::kTable>(params, plan, in, tiles, g, scale, grad, device, stream);
  } else {
    launch_grad_path<scalar_t, CELLS, kOther>(params, plan, in, tiles, g, scale, grad, device, stream);
  }
}

// The backward on the device (after loss_bwd_entry's checks, under its device guard).
at::Tensor loss_backward(const at::Tensor& grad_loss, const at::Tensor& row_scale, const LossTensors& inputs,
                         const LossParams& params) {
  check_table_offsets("policy_loss", params.band.table);
  const at::Tensor& lp = inputs.lp;
  const at::Tensor g = grad_loss.reshape({1}).to(at::kDouble);  // read on the device: no synchronisation
  const at::Tensor scale = row_scale.contiguous();
  const int device = lp.get_device();
  const Tiles tiles = make_tiles(lp.size(0), lp.size(1));
  at::Tensor grad = at::empty(lp.sizes(), lp.options());  // dense row-major: the layout the kernel writes
  if (tiles.count() == 0 || lp.numel() == 0) return grad;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lp.scalar_type(), "policy_loss_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const LossInputs<scalar_t> in = loss_inputs<scalar_t>(inputs, 0);
    const CellsPlan plan = plan_loss_cells<acc_t>(
        params, (const void*)loss_grad_kernel<scalar_t, kCellsShared, DivPath::kTable>, 0, device, stream);
    if (plan.mode == kCellsShared) {
      launch_grad<scalar_t, kCellsShared>(params, plan, in, tiles, g, scale, grad, device, stream);
    } else if (plan.mode == kCellsGlobal) {
      launch_grad<scalar_t, kCellsGlobal>(params, plan, in, tiles, g, scale, grad, device, stream);
    } else {
      launch_grad<scalar_t, kCellsNone>(params, plan, in, tiles, g, scale, grad, device, stream);
    }
  });
  return grad;
}

// The CUDA backend of loss_fwd_entry / loss_bwd_entry (loss_host.h).
struct CudaLoss {
  static c10::cuda::CUDAGuard device_guard(const at::Tensor& lp) { return c10::cuda::CUDAGuard(lp.device()); }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const LossTensors& inputs, const LossOpArgs&,
                                                                LossParams params) {
    return loss_forward(inputs, params);
  }
  static at::Tensor backward(const at::Tensor& grad_loss, const at::Tensor& row_scale, const LossTensors& inputs,
                             const LossOpArgs&, LossParams params) {
    return loss_backward(grad_loss, row_scale, inputs, params);
  }
};

}  // namespace
}  // namespace bandpo

TORCH_LIBRARY_IMPL(bandpo_lut, CUDA, m) {
  m.impl("policy_loss_fwd", &bandpo::loss_fwd_entry<bandpo::CudaLoss>);
  m.impl("policy_loss_bwd", &bandpo::loss_bwd_entry<bandpo::CudaLoss>);
}
