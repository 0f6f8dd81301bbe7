// CPU implementations of bandpo_lut::bounds and bandpo_lut::clip.
//
// TensorIterator handles broadcasting, strides and the parallel split (at::parallel_for underneath). Contiguous
// float32 runs (and every other run, gathered block by block into float32 buffers) go to f32_contiguous: KL with a
// scalar δ to the fused SIMD kernel (csrc/cpu/simd/kl_simd.h; AVX-512 or AVX2), everything else to branch-free blocked
// loops that GCC vectorises, compiled for x86-64-v4, x86-64-v3 and the baseline ISA. The variant is chosen at run
// time by the one CPU dispatcher (csrc/cpu/cpu_variant.h). float64 runs the same per-element code in a plain
// strided loop, one implementation for every variant (compiled for the baseline ISA).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "band_element.h"
#include "band_host.h"
#include "cpu/band_cpu.h"
#include "cpu/cpu_variant.h"
#include "cpu/simd/kl_simd.h"
#include "cpu/simd/closed_form_cpu.h"
#include "cpu/simd/table_gather.h"

namespace bandpo {

// ---- what is computed once per table (and δ), cached -------------------------------------------------------
// The key holds, besides the table's address, values that tell tables apart: a table tensor freed and another
// allocated at the same address (a temporary `table.cpu()` copy per call does this) must not get the first one's
// derived arrays, of another length (read out of bounds: NaN and garbage bounds). At most `bound` entries: tables
// are few and δ rarely changes; the memory is bounded anyway. One cache per result type and call site.
template <typename T, std::size_t N, typename Make>
std::shared_ptr<const T> cached_per_table(const float* coef, const double (&values)[N], std::size_t bound, Make make) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const T>> cache;
  std::string key(sizeof(void*) + sizeof(values), '\0');
  std::memcpy(&key[0], &coef, sizeof(void*));
  std::memcpy(&key[sizeof(void*)], values, sizeof(values));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  std::shared_ptr<const T> made = make();
  if (cache.size() >= bound) cache.clear();
  cache.emplace(key, made);
  return made;
}

// Scalar δ: the cell cubics, keyed by the table's geometry and δ.
std::shared_ptr<const CellPolys> cell_polys(const BandParams& band) {
  const TableView& tb = band.table;
  const double geometry[] = {
      static_cast<double>(tb.nt), static_cast<double>(tb.ns), tb.t_min, tb.t_step, tb.s_min, tb.s_step, band.delta};
  return cached_per_table<CellPolys>(tb.coef, geometry, 256, [&band] {
    auto polys = std::make_shared<CellPolys>();
    const int cells = band.table.nt - 1;
    polys->d.resize(8 * static_cast<size_t>(cells));
    polys->f.resize(polys->d.size());
    for (int k = 0; k < cells; ++k) {
      collapse_cell(band.table, k, band.delta_js, band.delta_ws, &polys->d[8 * static_cast<size_t>(k)]);
    }
    for (size_t i = 0; i < polys->d.size(); ++i) polys->f[i] = static_cast<float>(polys->d[i]);
    auto wide = std::make_unique<WideCells>();
    if (fit_wide_cells(band.table, polys->d.data(), *wide)) polys->wide = std::move(wide);
    auto bits = std::make_unique<BitCells>();
    if (fit_bit_cells(band.table, polys->d.data(), band.delta, *bits)) polys->bits = std::move(bits);
    return std::shared_ptr<const CellPolys>(std::move(polys));
  });
}

// Per-token δ: the t-cubic table, keyed by the geometry and a sample of the coefficients (it is computed from them, so
// a table of the same geometry at the same address must differ in the key: table_key).
constexpr int kKeySample = 16;
struct TableKey {
  double values[6 + kKeySample];
};
TableKey table_key(const TableView& tb) {
  const std::int64_t count = 2 * static_cast<std::int64_t>(tb.nt + 2) * (tb.ns + 2);  // the table's floats
  TableKey key{{static_cast<double>(tb.nt), static_cast<double>(tb.ns), tb.t_min, tb.t_step, tb.s_min, tb.s_step}};
  for (int i = 0; i < kKeySample; ++i) key.values[6 + i] = tb.coef[(count - 1) * i / (kKeySample - 1)];
  return key;
}

std::shared_ptr<const LineAlignedFloats> token_cubic_table(const TableView& tb) {
  return cached_per_table<LineAlignedFloats>(tb.coef, table_key(tb).values, 16, [&tb] {
    return std::make_shared<const LineAlignedFloats>(make_token_cubics(tb));
  });
}

// Per-token δ, the AVX2 kernel: the patches in the bits of p and δ, keyed as the t-cubic table; null where the table
// does not allow them or a fit misses (bit_patches.h). Fitted across the threads (the shipped table: ~1e5 patches,
// about a second of one core), once per table and process.
std::shared_ptr<const BitPatches> bit_patches(const TableView& tb) {
  return cached_per_table<BitPatches>(tb.coef, table_key(tb).values, 4, [&tb]() -> std::shared_ptr<const BitPatches> {
    auto made = std::make_shared<BitPatches>();
    if (!bit_patch_grid(tb, made->grid)) return nullptr;
    const BitGrid& g = made->grid;
    const std::int64_t n = 2 * static_cast<std::int64_t>(g.side_cells) * g.d_cells;
    made->patches.resize(static_cast<std::size_t>(n + g.d_cells) * kPatchValues);  // and the tail patches
    std::vector<double> worst(static_cast<std::size_t>(at::get_num_threads()) + 1, 0.0);
    at::parallel_for(0, n, 256, [&](std::int64_t begin, std::int64_t end) {
      const double e = fit_bit_patches_range(tb, g, begin, end, made->patches.data());
      double& w = worst[static_cast<std::size_t>(at::get_thread_num())];
      if (!(e <= w)) w = e;  // NaN sticks
    });
    worst.push_back(fit_tail_patches(g, made->patches.data() + n * kPatchValues));
    for (const double e : worst) {
      if (!(e <= made->fit_error)) made->fit_error = e;
    }
    if (!(made->fit_error <= kBitCellsTolerance)) return nullptr;
    return made;
  });
}

CpuTables attach_tables(BandParams& band, bool per_token) {
  CpuTables keep;
  if (!reads_table(band.divergence)) return keep;
  if (per_token) {
    // The fused kernels form an index into the t-cubic table (8·(it·ncol + js)) in float: exact below 2^24 (the
    // shipped table: 4.1e5 floats). A larger user table keeps the baseline loops, whose indices are 64-bit.
    const double floats = 8.0 * (band.table.nt - 1) * (band.table.ns + 2);
    if (floats < 16777216.0) {
      keep.token_cubics = token_cubic_table(band.table);
      band.token_cubics = keep.token_cubics->data();
#if defined(BANDPO_HAVE_KL_SIMD)
      if (cpu_variant() == CpuVariant::kAvx2) {  // the one kernel that reads them (beside the token grid's δ range)
        keep.patches = bit_patches(band.table);
        band.token_bits = keep.patches.get();
      }
#endif
    }
  } else {
    keep.cells = cell_polys(band);
    band.cell_f = keep.cells->f.data();
    band.cell_d = keep.cells->d.data();
    band.wide = keep.cells->wide.get();
    band.bits = keep.cells->bits.get();
    if (band.bits != nullptr) band.bit_grid = band.bits->grid;
  }
  return keep;
}

// ---- the vectorisable float32 loops (contiguous runs) ----------------------------------------------------
// Blocks of kBlock elements in passes, so that the transcendental passes vectorise (the compiler will not
// vectorise the table gathers, so they get a short scalar pass of their own):
//   1. p, 1 - p, t = logit p, and per-token δ terms  (vector)
//   2. cell lookup and the cubics                     (scalar: the gathers)
//   3. tails, the exp of the lower bound, cap, clamp  (vector)
// Closed forms need no table and run in one vector pass of their own (cpu/simd/closed_form_cpu.h).
namespace {

// Pass 3 of a per-token-δ block; TAILS: whether the block has elements beyond the grid in t. dd: the block's
// δ moved onto the table's range, ok: whether the δ given was in range.
template <bool CLIP, bool TAILS>
BANDPO_INLINE void kl_finish_token_block(const FastRun& run, int64_t start, int m, const float* p,
                                         const float* one_minus_p, const float* t, const float* q, const float* kap,
                                         const float* dd, const int* ok, float cap) {
  const TableView tb = run.band->table;
  const float nan = bits_to_float(0x7fc00000);
  for (int i = 0; i < m; ++i) {
    const float d = dd[i];
    const DeltaConsts<float> c = TAILS ? delta_consts<float>(d) : DeltaConsts<float>{d, 1.0f, 0.0f, 0.0f};
    float l, u;
    kl_finish<float>(p[i], one_minus_p[i], t[i], q[i], kap[i], c, tb, l, u);
    store<CLIP>(run, start + i, ok[i] ? l : nan, ok[i] ? u : nan, cap);
  }
}

template <bool LOG, bool CLIP, bool PER_TOKEN>
BANDPO_INLINE void kl_f32_run(const FastRun& run) {
  const BandParams& band = *run.band;
  const float cap = static_cast<float>(band.max_ratio);
  const TableView tb = band.table;
  const DeltaConsts<float> c0 = *run.c;
  const float* __restrict cells = band.cell_f;
  const float* __restrict x = run.x;
  const float* __restrict dl = run.delta;
  const AxisConsts<float> s_axis = axis_consts<float>(tb.s_min, tb.s_step, tb.ns);
  alignas(64) float p[kBlock], one_minus_p[kBlock], t[kBlock], q[kBlock], kap[kBlock], ut[kBlock], us[kBlock];
  alignas(64) float dd[kBlock];
  alignas(64) int it[kBlock], js[kBlock], ok[kBlock];
  for (int64_t start = 0; start < run.n; start += kBlock) {
    const int m = static_cast<int>(run.n - start < kBlock ? run.n - start : kBlock);
    for (int i = 0; i < m; ++i) prob_terms_t<LOG, float>(x[start + i], p[i], one_minus_p[i], t[i]);
    // Cell indices in a vector pass of their own: fused with the gathers below, the loop runs 10x slower.
    for (int i = 0; i < m; ++i) it[i] = axis_cell<float>(t[i], tb.t_min, tb.t_step, tb.nt, ut[i]);
    if (PER_TOKEN) {
      for (int i = 0; i < m; ++i) {
        ok[i] = delta_valid<float>(tb, dl[start + i]);
        dd[i] = delta_in_range<float>(tb, dl[start + i]);
      }
      for (int i = 0; i < m; ++i) js[i] = token_s_cell<float>(s_axis, band.s_axis, dd[i], us[i]);
      patches_scalar(tb, it, ut, js, us, q, kap, 0, m);
    } else {
      cell_cubics(cells, it, ut, q, kap, m);
    }
    if (PER_TOKEN) {
      // Per-token δ: its tail constants (an expm1 and a log each) matter only beyond the grid in t; a
      // block with no such element skips them (kl_finish's selects then never pick the tail values).
      const float tmin = static_cast<float>(tb.t_min), tmax = static_cast<float>(tb.t_min + (tb.nt - 1) * tb.t_step);
      int any_tail = 0;
      for (int i = 0; i < m; ++i) any_tail |= int(!((t[i] >= tmin) & (t[i] <= tmax)));
      if (any_tail) {
        kl_finish_token_block<CLIP, true>(run, start, m, p, one_minus_p, t, q, kap, dd, ok, cap);
      } else {
        kl_finish_token_block<CLIP, false>(run, start, m, p, one_minus_p, t, q, kap, dd, ok, cap);
      }
    } else {
      for (int i = 0; i < m; ++i) {
        float l, u;
        kl_finish<float>(p[i], one_minus_p[i], t[i], q[i], kap[i], c0, tb, l, u);
        store<CLIP>(run, start + i, l, u, cap);
      }
    }
  }
}

template <bool LOG, bool CLIP, bool PER_TOKEN>
BANDPO_INLINE void f32_run_div(const FastRun& run) {
  switch (run.band->divergence) {  // exhaustive (-Werror=switch); ids checked on the host
    case Divergence::kKL:
      kl_f32_run<LOG, CLIP, PER_TOKEN>(run);
      break;
    case Divergence::kTV:
      closed_f32_run<Divergence::kTV, LOG, CLIP, PER_TOKEN>(run);
      break;
    case Divergence::kChi2:
      closed_f32_run<Divergence::kChi2, LOG, CLIP, PER_TOKEN>(run);
      break;
    case Divergence::kHellinger:
      closed_f32_run<Divergence::kHellinger, LOG, CLIP, PER_TOKEN>(run);
      break;
  }
}

// Every combination of the flags, one fully specialised, inlined loop each.
BANDPO_INLINE void f32_contiguous_loops(const FastRun& run, bool log_input, bool clip, bool token) {
  const int combo = (log_input ? 4 : 0) | (clip ? 2 : 0) | (token ? 1 : 0);
  switch (combo) {
    case 0:
      f32_run_div<false, false, false>(run);
      break;
    case 1:
      f32_run_div<false, false, true>(run);
      break;
    case 2:
      f32_run_div<false, true, false>(run);
      break;
    case 3:
      f32_run_div<false, true, true>(run);
      break;
    case 4:
      f32_run_div<true, false, false>(run);
      break;
    case 5:
      f32_run_div<true, false, true>(run);
      break;
    case 6:
      f32_run_div<true, true, false>(run);
      break;
    default:
      f32_run_div<true, true, true>(run);
      break;
  }
}

#if defined(BANDPO_HAVE_KL_SIMD)
// The cells in p's bits and their geometry, for the AVX2 kernel.
avx2::V::Tables bit_cells(const BandParams& band) {
  const BitCells& b = *band.bits;
  return {b.cells.data(), b.grid.side_cells, b.grid.first_key, b.grid.x_lo, b.grid.x_cell};
}

// The per-token patches in the bits of p and δ and their geometry, for the AVX2 kernel.
avx2::V::PatchTables bit_patch_tables(const BandParams& band) {
  const BitPatches& b = *band.token_bits;
  return {b.patches.data(), b.grid.side_cells, b.grid.d_cells, b.grid.first_key, b.grid.d_first_key, b.grid.x_lo};
}
#endif

// One variant's code for a run: KL with a scalar δ goes to the variant's intrinsics kernel where it has one
// (AVX-512: when the wide-cell fit exists; AVX2: when the cells in p's bits fit), everything else to the blocked loops,
// compiled for the variant's ISA (BANDPO_CPU_VARIANTS).
template <CpuVariant V>
BANDPO_INLINE void f32_contiguous_body(const FastRun& run, bool log_input, bool clip, bool token) {
#if defined(BANDPO_HAVE_KL_SIMD)
  const bool kl = run.band->divergence == Divergence::kKL;
  if constexpr (V == CpuVariant::kAvx512) {
    if (kl && !token && run.band->wide != nullptr) return avx512::kl_scalar(run, *run.band->wide, log_input, clip);
    if (kl && token && run.band->token_cubics != nullptr) {
      return avx512::kl_token(run, token_grid(*run.band), log_input, clip);
    }
  }
  if constexpr (V == CpuVariant::kAvx2) {
    if (kl && !token && run.band->bits != nullptr) return avx2::kl_scalar(run, bit_cells(*run.band), log_input, clip);
    if (kl && token && run.band->token_bits != nullptr && run.band->token_cubics != nullptr) {
      return avx2::kl_token_bits<avx2::V>(run, token_grid(*run.band), bit_patch_tables(*run.band), log_input, clip);
    }
    if (kl && token && run.band->token_cubics != nullptr) {
      return avx2::kl_token(run, token_grid(*run.band), log_input, clip);
    }
  }
#endif
  f32_contiguous_loops(run, log_input, clip, token);
}

BANDPO_CPU_VARIANTS(void, f32_contiguous, (const FastRun& run, bool log_input, bool clip, bool token),
                    f32_contiguous_body, (run, log_input, clip, token))

}  // namespace

void f32_contiguous(const FastRun& run, bool log_input, bool clip, bool token) {
  pick(f32_contiguous_variants)(run, log_input, clip, token);
}

namespace {

// ---- the element loops over the iterator ----------------------------------------------------------------
// Operand order in the iterator: outputs first, then [ratio,] prob[, delta].
//
// float32, float16 and bfloat16 all run the vectorised float32 loop: contiguous float32 runs in place, every
// other run (strided, broadcast, transposed, or a 16-bit dtype) is gathered block by block into float32
// buffers, run through the same loop and scattered back. So a token gets the same bits whatever the layout
// of its batch (and a 16-bit result is the float32 one, rounded). float64 runs the scalar element code.
template <typename scalar_t>
BANDPO_INLINE float load_as_float(const char* base, int64_t stride, int64_t i) {
  return static_cast<float>(*reinterpret_cast<const scalar_t*>(base + i * stride));
}

template <typename scalar_t>
BANDPO_INLINE void store_from_float(char* base, int64_t stride, int64_t i, float v) {
  *reinterpret_cast<scalar_t*>(base + i * stride) = static_cast<scalar_t>(v);
}

template <typename scalar_t, bool CLIP>
void run_f32_blocks(char** data, const int64_t* strides, int64_t n, const BandParams& band, const DeltaConsts<float>& c,
                    bool per_token) {
  const int in0 = CLIP ? 1 : 2;         // first input operand
  const int ip = CLIP ? in0 + 1 : in0;  // the probability
  alignas(64) float x[kBlock], d[kBlock], r[kBlock], o0[kBlock], o1[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int m = static_cast<int>(n - start < kBlock ? n - start : kBlock);
    for (int i = 0; i < m; ++i) x[i] = load_as_float<scalar_t>(data[ip], strides[ip], start + i);
    if (per_token) {
      for (int i = 0; i < m; ++i) d[i] = load_as_float<scalar_t>(data[ip + 1], strides[ip + 1], start + i);
    }
    if (CLIP) {
      for (int i = 0; i < m; ++i) r[i] = load_as_float<scalar_t>(data[in0], strides[in0], start + i);
    }
    const FastRun run{&band,
                      &c,
                      x,
                      per_token ? d : nullptr,
                      CLIP ? r : nullptr,
                      CLIP ? nullptr : o0,
                      CLIP ? nullptr : o1,
                      CLIP ? o0 : nullptr,
                      m};
    f32_contiguous(run, band.log_input, CLIP, per_token);
    for (int i = 0; i < m; ++i) store_from_float<scalar_t>(data[0], strides[0], start + i, o0[i]);
    if (!CLIP) {
      for (int i = 0; i < m; ++i) store_from_float<scalar_t>(data[1], strides[1], start + i, o1[i]);
    }
  }
}

template <typename scalar_t, bool CLIP>
void run_band(at::TensorIterator& iter, const BandParams& band, bool per_token) {
  using acc_t = at::opmath_type<scalar_t>;
  const DeltaConsts<acc_t> c = delta_consts<acc_t>(static_cast<acc_t>(band.delta));
  const int n_out = CLIP ? 1 : 2;
  iter.for_each([&](char** data, const int64_t* strides, int64_t n) {
    const int in0 = n_out;  // first input operand
    const int ip = CLIP ? in0 + 1 : in0;
    if constexpr (std::is_same<acc_t, float>::value) {
      bool contiguous = std::is_same<scalar_t, float>::value;
      for (int k = 0; k < iter.ntensors(); ++k) contiguous = contiguous && strides[k] == sizeof(scalar_t);
      if (contiguous) {
        const FastRun run{&band,
                          &c,
                          reinterpret_cast<const float*>(data[ip]),
                          per_token ? reinterpret_cast<const float*>(data[ip + 1]) : nullptr,
                          CLIP ? reinterpret_cast<const float*>(data[in0]) : nullptr,
                          CLIP ? nullptr : reinterpret_cast<float*>(data[0]),
                          CLIP ? nullptr : reinterpret_cast<float*>(data[1]),
                          CLIP ? reinterpret_cast<float*>(data[0]) : nullptr,
                          n};
        f32_contiguous(run, band.log_input, CLIP, per_token);
      } else {
        run_f32_blocks<scalar_t, CLIP>(data, strides, n, band, c, per_token);
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const acc_t x = static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(data[ip] + i * strides[ip]));
      const acc_t d = per_token
                          ? static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(data[ip + 1] + i * strides[ip + 1]))
                          : c.delta;
      acc_t l, u;
      if (per_token) {
        band_element<acc_t, true>(band, c, x, d, l, u);
      } else {
        band_element<acc_t, false>(band, c, x, d, l, u);
      }
      if (CLIP) {
        const acc_t r = static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(data[in0] + i * strides[in0]));
        *reinterpret_cast<scalar_t*>(data[0] + i * strides[0]) =
            static_cast<scalar_t>(clamp_like_torch<acc_t>(r, l, u));
      } else {
        *reinterpret_cast<scalar_t*>(data[0] + i * strides[0]) = static_cast<scalar_t>(l);
        *reinterpret_cast<scalar_t*>(data[1] + i * strides[1]) = static_cast<scalar_t>(u);
      }
    }
  });
}

BandParams params_with_tables(const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence, bool log_input,
                              const DeltaArg& delta, double max_ratio, CpuTables& keep) {
  BandParams band = make_params(table, grid, divergence, log_input, delta, max_ratio);
  keep = attach_tables(band, delta.per_token_mode());
  return band;
}

std::tuple<at::Tensor, at::Tensor> bounds_cpu(const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                                              double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid,
                                              int64_t divergence, bool log_input, double max_ratio) {
  cpu_variant();  // an invalid BANDPO_LUT_CPU_VARIANT raises here, on the calling thread, for every dtype
  const DeltaArg d = resolve_delta("bounds", delta, delta_scalar, grid, prob);
  BandIter it = make_band_iter("bounds", nullptr, prob, d.per_token, table, grid, divergence, max_ratio);
  CpuTables keep;
  const BandParams band = params_with_tables(table, grid, divergence, log_input, d, max_ratio, keep);
  if (d.all_nan) {
    it.lo.fill_(std::numeric_limits<double>::quiet_NaN());
    it.up.fill_(std::numeric_limits<double>::quiet_NaN());
    return {it.lo, it.up};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, prob.scalar_type(), "bandpo_lut::bounds",
                                  [&] { run_band<scalar_t, false>(it.iter, band, d.per_token_mode()); });
  return {it.lo, it.up};
}

at::Tensor clip_cpu(const at::Tensor& ratio, const at::Tensor& prob, const c10::optional<at::Tensor>& delta,
                    double delta_scalar, const at::Tensor& table, c10::ArrayRef<double> grid, int64_t divergence,
                    bool log_input, double max_ratio) {
  cpu_variant();  // an invalid BANDPO_LUT_CPU_VARIANT raises here, on the calling thread, for every dtype
  const DeltaArg d = resolve_delta("clip", delta, delta_scalar, grid, prob);
  BandIter it = make_band_iter("clip", &ratio, prob, d.per_token, table, grid, divergence, max_ratio);
  CpuTables keep;
  const BandParams band = params_with_tables(table, grid, divergence, log_input, d, max_ratio, keep);
  if (d.all_nan) {
    // clamp with NaN bounds is NaN (torch.clamp's rule), whatever the ratio
    it.out.fill_(std::numeric_limits<double>::quiet_NaN());
    return it.out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, prob.scalar_type(), "bandpo_lut::clip",
                                  [&] { run_band<scalar_t, true>(it.iter, band, d.per_token_mode()); });
  return it.out;
}

}  // namespace
}  // namespace bandpo

TORCH_LIBRARY_IMPL(bandpo_lut, CPU, m) {
  m.impl("bounds", &bandpo::bounds_cpu);
  m.impl("clip", &bandpo::clip_cpu);
}
