// What the CUDA kernels of the band (band_cuda.cu) and of the fused loss (loss_cuda.cu) share:
//  * the scalar-δ cell cubics: collapsed once per (device, table, δ, precision) by a small kernel and cached
//    (cells_cuda.cu); the element kernels only read them;
//  * the one device prologue that stages them in shared memory, and the one host check of shared memory;
//  * the resident-sized grid.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "band_element.h"

namespace bandpo {

// Where a kernel finds the scalar-δ KL cell cubics (a template argument of the element kernels).
enum CellsMode : int {
  kCellsNone = 0,       // a per-token δ: no cells (the full 2-D spline per element)
  kCellsShared = 1,     // scalar δ, KL: staged in dynamic shared memory by the prologue (the fast path)
  kCellsGlobal = 2,     // scalar δ: read from the cached device array through the read-only cache (KL tables
                        // too large for shared memory), or none at all (closed-form divergences: null)
  kCellsBits = 3,       // scalar δ, KL, float arithmetic: the cells in p's bits (kl_bit_cells.h), staged in shared
                        // memory as kCellsShared's (no logit on the grid: the band kernels' fast path)
  kCellsBitsToken = 4,  // per-token δ, KL, float arithmetic: the patches in the bits of p and δ (fit_bit_patch),
                        // read from the cached device array through the read-only cache
};

// Whether a cells mode means a per-token δ (band_element's PER_TOKEN).
constexpr bool per_token_mode(int mode) { return mode == kCellsNone || mode == kCellsBitsToken; }

// Whether a cells mode reads the cells in p's bits (band_element's BITS).
constexpr bool bits_mode(int mode) { return mode == kCellsBits || mode == kCellsBitsToken; }

constexpr int kCellValues = 8;  // per t cell: the q_up and κ cubics, a0..a3 each

// The cached device array of cell cubics for BandParams' table and scalar δ, in double (as_double) or float,
// laid out [nt - 1][8]. Computed by one small kernel on `stream` the first time, without host
// synchronisation; streams other than the one that computed it wait on its event until it has completed.
// During CUDA-graph capture an entry that is not known complete is not used and none is created: the cells
// are collapsed into `scratch` (allocated from the capture's pool), so the graph holds its own collapse
// kernel and never depends on work outside it.
const void* cached_cells(const BandParams& band, bool as_double, cudaStream_t stream, at::Tensor& scratch);

// The same for the cells in p's bits of `grid` (bit_grid_for with no tail cells), float, [2·side_cells][8]: fitted on
// the device from the collapsed cells (fit_bit_cell), cached and captured as cached_cells' are.
const void* cached_bit_cells(const BandParams& band, const BitGrid& grid, cudaStream_t stream, at::Tensor& scratch);

// The per-token patches of `grid`, float, [2·side_cells][d_cells][kPatchValues] (fit_bit_patch): one array per
// (device, table), whatever the δ; cached and captured as cached_cells' are.
const void* cached_bit_patches(const BandParams& band, const BitGrid& grid, cudaStream_t stream, at::Tensor& scratch);

// Dynamic shared memory for `cells_bytes` of cells in `kernel` (which also uses `static_bytes`): the bytes
// to request, opting the kernel in above the 48 KB default where the device allows, or 0 when they do not
// fit (use kCellsGlobal). The one place where shared memory is checked.
size_t shared_cells_bytes(const void* kernel, size_t cells_bytes, size_t static_bytes, int device);

// The element kernels address the table (a per-token δ's tensor-product patch, bandpo_math.h spline2d_cells) with
// 32-bit offsets: every CUDA entry point refuses a table of 2^31 floats or more (shipped tables hold well under 2^20).
inline void check_table_offsets(const char* op, const TableView& tb) {
  const int64_t entries = int64_t{2} * (tb.nt + 2) * (tb.ns + 2);
  TORCH_CHECK(entries <= std::numeric_limits<int32_t>::max(), op, ": the table has ", entries,
              " entries; the CUDA kernels address at most 2^31 - 1");
}

// grid_consts(band) as device code computes it, for the element kernels (band and loss) to take as an argument: built
// there, its values would be converted from BandParams' double fields again for every element (nvcc rematerialises
// them). The one expression that could round differently on the host is an axis' last node x0 + (n - 1)·step: nvcc
// contracts it into one fused multiply-add (fma.rn.f64 in the PTX), so it is taken by std::fma here; the rest are
// conversions and a quotient, correctly rounded on both sides.
template <typename acc_t>
GridConsts<acc_t> device_grid_consts(const BandParams& band) {
  const TableView& tb = band.table;
  GridConsts<acc_t> g = grid_consts<acc_t>(band);
  g.t.hi = static_cast<acc_t>(std::fma(static_cast<double>(tb.nt - 1), tb.t_step, tb.t_min));
  g.s.hi = static_cast<acc_t>(std::fma(static_cast<double>(tb.ns - 1), tb.s_step, tb.s_min));
  return g;
}

// Blocks of `threads` that are resident at once on the device for `kernel` with `smem` dynamic bytes
// (grid-stride kernels launch no more than this: one wave).
int resident_blocks(const void* kernel, int threads, size_t smem, int device);

// The device prologue of every element kernel: with kCellsShared, copy the cached cells into shared memory
// (16-byte loads) and return the shared copy; otherwise return `src` (kCellsGlobal) or null. The pointer is
// assigned once, unconditionally per mode, so that the compiler knows the address space (LDS.128 reads).
template <int MODE, typename acc_t>
__device__ __forceinline__ const acc_t* cells_prologue(const acc_t* src, int n_cells, unsigned char* smem_raw) {
  if constexpr (MODE == kCellsShared || MODE == kCellsBits) {
    acc_t* cells = reinterpret_cast<acc_t*>(smem_raw);
    const int n16 = n_cells * kCellValues * static_cast<int>(sizeof(acc_t)) / 16;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(smem_raw);
    for (int i = threadIdx.x; i < n16; i += blockDim.x) d4[i] = __ldg(s4 + i);
    __syncthreads();
    return cells;
  } else if constexpr (MODE == kCellsGlobal || MODE == kCellsBitsToken) {
    return src;
  } else {
    return nullptr;
  }
}

// Point BandParams at the cells for acc_t (float inputs read cell_f, double inputs cell_d).
template <typename acc_t>
__device__ __forceinline__ void set_cells(BandParams& band, const acc_t* cells) {
  if constexpr (std::is_same<acc_t, double>::value) {
    band.cell_d = cells;
  } else {
    band.cell_f = cells;
  }
}

// The cells a launch needs (host): mode and source for a scalar-δ KL band, kCellsNone otherwise.
struct CellsPlan {
  int mode;         // CellsMode
  const void* src;  // device array [n_cells][8] of acc_t, or null
  int n_cells;
  size_t smem;         // dynamic shared memory to request
  at::Tensor scratch;  // keeps a capture-time collapse alive until the launch is enqueued
  BitGrid grid;        // kCellsBits: where the cells lie (the launch puts it into BandParams::bit_grid)
};

// The one planner of every launch (band and loss): shared memory for a scalar-δ band of a table-read divergence
// when the cells fit beside the kernel's `static_bytes`, else global; none for a per-token δ; a null global
// source when the band reads no table or does not apply (the loss's baseline clips). bits (float arithmetic only):
// the cells in p's bits where the table's grid allows them, for a scalar δ where they fit in shared memory
// (kCellsBits, `kernel_shared` being that kernel; else the cells in t through the read-only cache, kCellsGlobal), for
// a per-token δ the patches in the bits of p and δ (kCellsBitsToken; else the table itself, kCellsNone).
template <typename acc_t>
CellsPlan plan_cells(const BandParams& band, bool per_token, bool band_applies, const void* kernel_shared,
                     size_t static_bytes, int device, cudaStream_t stream, bool bits = false) {
  static_assert(std::is_same<acc_t, float>::value || std::is_same<acc_t, double>::value, "float or double cells");
  CellsPlan plan{per_token ? kCellsNone : kCellsGlobal, nullptr, band.table.nt - 1, 0, at::Tensor(), BitGrid{}};
  if (!band_applies || !reads_table(band.divergence)) return plan;
  if (per_token) {
    BitGrid grid{};
    if (bits && std::is_same<acc_t, float>::value && bit_patch_grid(band.table, grid)) {
      plan.src = cached_bit_patches(band, grid, stream, plan.scratch);
      plan.mode = kCellsBitsToken;
      plan.grid = grid;
    }
    return plan;
  }
  if (bits && std::is_same<acc_t, float>::value) {
    BitGrid grid{};
    if (bit_grid_for(band.table, /*tail_cells=*/false, grid)) {
      const int n = 2 * grid.side_cells;
      const size_t smem = shared_cells_bytes(kernel_shared, sizeof(float) * kCellValues * n, static_bytes, device);
      if (smem > 0) {
        plan.src = cached_bit_cells(band, grid, stream, plan.scratch);
        plan.mode = kCellsBits;
        plan.n_cells = n;
        plan.smem = smem;
        plan.grid = grid;
        return plan;
      }
    }
    plan.src = cached_cells(band, /*as_double=*/false, stream, plan.scratch);
    return plan;
  }
  plan.src = cached_cells(band, std::is_same<acc_t, double>::value, stream, plan.scratch);
  plan.smem = shared_cells_bytes(kernel_shared, sizeof(acc_t) * kCellValues * plan.n_cells, static_bytes, device);
  plan.mode = plan.smem > 0 ? kCellsShared : kCellsGlobal;
  return plan;
}

}  // namespace bandpo
