// The scalar-δ cell cubics on the GPU, collapsed once per (device, table, δ, precision) and cached, and the cells in
// p's bits fitted from them (kl_bit_cells.h), cached the same way; the shared-memory check; the resident grid size
// (cached per launch configuration). See kernel_common.cuh.
//
// Tables live for the whole process (the table store never frees them), so the coefficient pointer (with the
// table's geometry, against an address reused by another table) is a stable key. Cached arrays are never freed either:
// a δ schedule adds one small entry (8 values per t cell) per distinct δ, and past kMaxEntries entries further δ values
// are collapsed per call instead (correct, one extra small launch each).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "cuda/kernel_common.cuh"

namespace bandpo {
namespace {

constexpr size_t kMaxEntries = 4096;

template <typename acc_t>
__global__ void collapse_kernel(TableView tb, int js, double w0, double w1, double w2, double w3, acc_t* out) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= tb.nt - 1) return;
  const double ws[4] = {w0, w1, w2, w3};
  double c8[kCellValues];
  collapse_cell(tb, k, js, ws, c8);
  for (int j = 0; j < kCellValues; ++j) out[kCellValues * k + j] = static_cast<acc_t>(c8[j]);
}

void launch_collapse(const BandParams& band, bool as_double, void* out, cudaStream_t stream) {
  const int cells = band.table.nt - 1;
  const int threads = 128, blocks = (cells + threads - 1) / threads;
  const double* w = band.delta_ws;
  if (as_double) {
    collapse_kernel<double>
        <<<blocks, threads, 0, stream>>>(band.table, band.delta_js, w[0], w[1], w[2], w[3], static_cast<double*>(out));
  } else {
    collapse_kernel<float>
        <<<blocks, threads, 0, stream>>>(band.table, band.delta_js, w[0], w[1], w[2], w[3], static_cast<float*>(out));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The cells in p's bits (kl_bit_cells.h), one thread per cell, from the collapsed spline in double; a cell whose fit
// misses kBitCellsTolerance (a damaged or unusually coarse table) gets NaN, so that its elements' bounds are NaN
// rather than silently off.
__global__ void fit_bits_kernel(TableView tb, const double* cell_d, DeltaConsts<double> dc, BitGrid g, float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * g.side_cells) return;
  float cubics[kCellValues];
  const double err = fit_bit_cell(tb, cell_d, dc, g, c, cubics);
  const bool ok = err <= kBitCellsTolerance;
  for (int j = 0; j < kCellValues; ++j) out[kCellValues * c + j] = ok ? cubics[j] : __int_as_float(0x7fc00000);
}

void launch_fit_bits(const BandParams& band, const BitGrid& g, float* out, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto cell_d = at::empty({static_cast<int64_t>(band.table.nt - 1) * kCellValues},
                                at::TensorOptions().device(at::kCUDA, device).dtype(at::kDouble));
  launch_collapse(band, /*as_double=*/true, cell_d.data_ptr(), stream);
  const int cells = 2 * g.side_cells;
  const int threads = 128, blocks = (cells + threads - 1) / threads;
  fit_bits_kernel<<<blocks, threads, 0, stream>>>(band.table, cell_d.data_ptr<double>(),
                                                  delta_consts<double>(band.delta), g, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // cell_d goes back to the caching allocator here: its blocks are reused only by work queued after this on `stream`.
}

// The per-token patches (kl_bit_cells.h fit_bit_patch), one thread per (p cell, δ cell); NaN where a fit misses, as
// for the scalar cells.
__global__ void fit_patches_kernel(TableView tb, BitGrid g, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 2 * g.side_cells * g.d_cells) return;
  float patch[kPatchValues];
  const double err = fit_bit_patch(tb, g, i / g.d_cells, i % g.d_cells, patch);
  const bool ok = err <= kBitCellsTolerance;
  for (int j = 0; j < kPatchValues; ++j) out[kPatchValues * i + j] = ok ? patch[j] : __int_as_float(0x7fc00000);
}

void launch_fit_patches(const BandParams& band, const BitGrid& g, float* out, cudaStream_t stream) {
  const int n = 2 * g.side_cells * g.d_cells;
  const int threads = 128, blocks = (n + threads - 1) / threads;
  fit_patches_kernel<<<blocks, threads, 0, stream>>>(band.table, g, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct Entry {
  at::Tensor cells;       // the device array (owned for the life of the process)
  cudaEvent_t ready;      // recorded after the collapse kernel
  cudaStream_t stream;    // where it was computed
  bool complete = false;  // the event is known to have completed: no wait needed anywhere
};

// What an entry holds: the cells in t (float or double), the cells in p's bits (float) or the per-token patches.
enum class CellsKind : int { kTFloat = 0, kTDouble = 1, kBits = 2, kBitPatches = 3 };

// (table coefficients, device, δ, kind, the table's geometry: nt, ns, t_min, t_step, s_min, s_step). The
// geometry guards against a table freed and another allocated at its address (then the cached cells
// are another table's, of another length).
using Key = std::tuple<const float*, int, double, int, int, int, double, double, double, double>;

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

namespace {

// The one cache of both kinds: `values` elements of `dtype`, computed by `fill(out)` on `stream` (see cached_cells in
// kernel_common.cuh for the rules on streams and capture).
template <typename Fill>
const void* cached_array(const BandParams& band, CellsKind kind, int64_t values, at::ScalarType dtype,
                         cudaStream_t stream, at::Tensor& scratch, const Fill& fill) {
  static std::mutex mu;
  static std::map<Key, Entry> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto options = at::TensorOptions().device(at::kCUDA, device).dtype(dtype);
  const bool in_capture = capturing(stream);
  std::lock_guard<std::mutex> lock(mu);
  const TableView& tb = band.table;
  const Key key{tb.coef,   device,   band.delta, static_cast<int>(kind), tb.nt, tb.ns, tb.t_min,
                tb.t_step, tb.s_min, tb.s_step};
  auto it = cache.find(key);
  if (it != cache.end()) {
    Entry& e = it->second;
    if (e.complete) return e.cells.data_ptr();
    if (!in_capture) {
      const cudaError_t q = cudaEventQuery(e.ready);  // non-blocking
      if (q == cudaSuccess) {
        e.complete = true;
      } else if (q == cudaErrorNotReady) {
        (void)cudaGetLastError();  // clear the not-ready status
        if (e.stream != stream) C10_CUDA_CHECK(cudaStreamWaitEvent(stream, e.ready, 0));
      } else {
        C10_CUDA_CHECK(q);
      }
      return e.cells.data_ptr();
    }
    // In a capture, an entry that may still be in flight elsewhere is not used (waiting on an event recorded
    // outside the capture is not allowed): fall through to a per-call computation.
  }
  if (in_capture || cache.size() >= kMaxEntries) {
    scratch = at::empty({values}, options);
    fill(scratch.data_ptr());
    return scratch.data_ptr();
  }
  Entry e;
  e.cells = at::empty({values}, options);
  fill(e.cells.data_ptr());
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e.ready, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(e.ready, stream));
  e.stream = stream;
  const void* ptr = e.cells.data_ptr();
  cache.emplace(key, std::move(e));
  return ptr;
}

}  // namespace

const void* cached_cells(const BandParams& band, bool as_double, cudaStream_t stream, at::Tensor& scratch) {
  const int64_t values = static_cast<int64_t>(band.table.nt - 1) * kCellValues;
  return cached_array(band, as_double ? CellsKind::kTDouble : CellsKind::kTFloat, values,
                      as_double ? at::kDouble : at::kFloat, stream, scratch,
                      [&](void* out) { launch_collapse(band, as_double, out, stream); });
}

const void* cached_bit_cells(const BandParams& band, const BitGrid& grid, cudaStream_t stream, at::Tensor& scratch) {
  const int64_t values = int64_t{2} * grid.side_cells * kCellValues;
  return cached_array(band, CellsKind::kBits, values, at::kFloat, stream, scratch,
                      [&](void* out) { launch_fit_bits(band, grid, static_cast<float*>(out), stream); });
}

const void* cached_bit_patches(const BandParams& band, const BitGrid& grid, cudaStream_t stream, at::Tensor& scratch) {
  BandParams any_delta = band;  // one array per table: the key's δ is fixed
  any_delta.delta = 0.0;
  const int64_t values = int64_t{2} * grid.side_cells * grid.d_cells * kPatchValues;
  return cached_array(any_delta, CellsKind::kBitPatches, values, at::kFloat, stream, scratch,
                      [&](void* out) { launch_fit_patches(band, grid, static_cast<float*>(out), stream); });
}

size_t shared_cells_bytes(const void* kernel, size_t cells_bytes, size_t static_bytes, int device) {
  constexpr size_t kDefault = 48 * 1024;  // usable without opting in, on every architecture
  if (cells_bytes + static_bytes <= kDefault) return cells_bytes;
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (cells_bytes + static_bytes > static_cast<size_t>(optin)) return 0;
  // The kernel is allowed the most it can ever take (the opt-in less its own static use), not this call's bytes:
  // one value from every caller, so a thread planning a smaller table cannot lower the limit under another
  // thread's launch of a larger one.
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const int most = optin - static_cast<int>(attr.sharedSizeBytes);
  if (cells_bytes > static_cast<size_t>(most)) return 0;
  if (attr.maxDynamicSharedSizeBytes < most) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  }
  return cells_bytes;
}

int resident_blocks(const void* kernel, int threads, size_t smem, int device) {
  // A pure function of its arguments for the life of the process (a kernel's resources and a device's
  // multiprocessors do not change), asked at every launch: computed once per (device, kernel, threads, smem) and
  // thread and kept in a thread_local map, so the hot path takes no lock and makes no CUDA call (the occupancy
  // query walks the kernel's attributes: microseconds per launch). Each thread that launches fills its own copy;
  // the few launch configurations of this library keep it small.
  struct Key {
    int device;
    const void* kernel;
    int threads;
    size_t smem;
    bool operator==(const Key& o) const {
      return device == o.device && kernel == o.kernel && threads == o.threads && smem == o.smem;
    }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      size_t h = std::hash<const void*>()(k.kernel);
      h ^= std::hash<size_t>()(k.smem) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
      h ^= std::hash<int64_t>()((static_cast<int64_t>(k.device) << 32) | static_cast<uint32_t>(k.threads)) +
           0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
      return h;
    }
  };
  thread_local std::unordered_map<Key, int, Hash> resident;
  const Key key{device, kernel, threads, smem};
  const auto it = resident.find(key);
  if (it != resident.end()) return it->second;
  int n_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, device));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int blocks = (per_sm > 0 ? per_sm : 1) * (n_sm > 0 ? n_sm : 1);
  resident.emplace(key, blocks);
  return blocks;
}

}  // namespace bandpo
