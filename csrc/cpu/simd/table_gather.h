// The table reads of the CPU band loops (the one part the compiler will not vectorise), for elements whose cell
// indices and fractions are already computed: per element, the cubics of its t cell (scalar δ: cubics_from_cells, for
// the blocked loops' cell_cubics where the CPU has AVX2+FMA, checked at run time; cubics_from_pairs for the fused
// AVX2 kernel's cells in p's bits) or its (t, s) cell of the per-token δ spline (patches_scalar, the 4x4 B-spline
// patches, in the blocked loops of the baseline ISA; token_cubics_avx2 in the fused kernels, from the t-cubic table:
// per t cell and s column, the cubic in t's fraction of both planes, one 256-bit run).
#pragma once

#include <cstdint>

#include "bandpo_math.h"
#include "cpu/simd/cache_lines.h"

#include "macros.h"  // BANDPO_HAVE_X86_GATHER

#if defined(BANDPO_HAVE_X86_GATHER)
#include <immintrin.h>
#endif

namespace bandpo {

// A per-token δ KL read as the fused kernels see it: the t-cubic table (make_token_cubics); the t axis as axis_cell
// computes it in float; the δ range as delta_valid and delta_in_range see it; and the s axis as TokenSAxis.
struct TokenGrid {
  const float* cubics;
  int ncol;                         // s columns: ns + 2
  float t_lo, t_hi, t_step, t_inv;  // t axis: first and last node, step, 1/step
  int t_last;                       // last cell: nt - 2
  TokenSAxis s;
  float valid_min, valid_max;  // delta_valid
  bool max_inclusive;
  float delta_min, delta_max;  // delta_in_range
};

// The t-cubic table of a per-token δ KL table: for t cell i (nt - 1 of them) and s column j (ns + 2), 8 floats at
// 8·(i·ncol + j): the power-basis coefficients a0..a3 of q_up's column j on that cell, Σ_k a_k·u^k = Σ_a w_a(u)·c(i +
// a, j) with w the cubic B-spline weights at the t fraction u, then κ's. An element of cell (i, js) reads columns
// js..js+3 as one 128-byte run (two or three cache lines where the B-spline patch's four rows take four to eight),
// needs no t weights, and its s weights combine the four runs before one cubic in u per plane (token_cubics_avx2).
// Formed from the stored float coefficients in double and rounded once: a0 ≈ the value, within 0.5 ulp; a1..a3 its
// differences.
inline LineAlignedFloats make_token_cubics(const TableView& tb) {
  const std::int64_t ncol = tb.ns + 2, plane = static_cast<std::int64_t>(tb.nt + 2) * ncol, cells = tb.nt - 1;
  LineAlignedFloats out(8 * static_cast<std::size_t>(cells * ncol));
  for (std::int64_t i = 0; i < cells; ++i) {
    for (std::int64_t j = 0; j < ncol; ++j) {
      for (int b = 0; b < 2; ++b) {
        double c[4];
        for (int a = 0; a < 4; ++a) c[a] = tb.coef[b * plane + (i + a) * ncol + j];
        float* d = &out[8 * static_cast<std::size_t>(i * ncol + j) + 4 * static_cast<std::size_t>(b)];
        d[0] = static_cast<float>((c[0] + 4.0 * c[1] + c[2]) / 6.0);
        d[1] = static_cast<float>((c[2] - c[0]) / 2.0);
        d[2] = static_cast<float>((c[0] - 2.0 * c[1] + c[2]) / 2.0);
        d[3] = static_cast<float>((3.0 * (c[1] - c[2]) + c[3] - c[0]) / 6.0);
      }
    }
  }
  return out;
}

// The TokenGrid of a band whose `token_cubics` are attached (band_cpu.cpp attach_tables).
inline TokenGrid token_grid(const BandParams& band) {
  const TableView& tb = band.table;
  TokenGrid g;
  g.cubics = band.token_cubics;
  g.ncol = tb.ns + 2;
  g.t_lo = static_cast<float>(tb.t_min);
  g.t_hi = static_cast<float>(tb.t_min + (tb.nt - 1) * tb.t_step);
  g.t_step = static_cast<float>(tb.t_step);
  g.t_inv = static_cast<float>(1.0 / tb.t_step);
  g.t_last = tb.nt - 2;
  g.s = band.s_axis;
  g.valid_min = static_cast<float>(tb.valid_min);
  g.valid_max = static_cast<float>(tb.valid_max);
  g.max_inclusive = tb.delta_max_inclusive;
  g.delta_min = static_cast<float>(tb.delta_min);
  g.delta_max = static_cast<float>(tb.delta_max);
  return g;
}

// q[i], kap[i] from the per-cell power-basis cubics cells[8·it[i] ...] at fraction ut[i].
inline void cell_cubics_scalar(const float* __restrict cells, const int* __restrict it, const float* __restrict ut,
                               float* __restrict q, float* __restrict kap, int i0, int m) {
  for (int i = i0; i < m; ++i) {
    const float* cf = cells + 8 * it[i];
    const float u = ut[i];
    q[i] = cf[0] + u * (cf[1] + u * (cf[2] + u * cf[3]));
    kap[i] = cf[4] + u * (cf[5] + u * (cf[6] + u * cf[7]));
  }
}

// q[i], kap[i] from the 4x4 patches at cells (it[i], js[i]) with fractions (ut[i], us[i]).
inline void patches_scalar(const TableView& tb, const int* __restrict it, const float* __restrict ut,
                           const int* __restrict js, const float* __restrict us, float* __restrict q,
                           float* __restrict kap, int i0, int m) {
  for (int i = i0; i < m; ++i) spline2d_cells<float>(tb, it[i], ut[i], js[i], us[i], q[i], kap[i]);
}

#if defined(BANDPO_HAVE_X86_GATHER)
// An 8x8 transpose of float rows: on return r[j] holds element j of every input row (r[j][k] = old r[k][j]).
__attribute__((target("avx2,fma"), always_inline)) inline void transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Four registers of 8 floats, each holding two elements' 4-vectors (element e in the low 128 bits, element e + 4 in
// the high ones), transposed within the 128-bit lanes: on return x[j] holds component j of elements 0..3 in its low
// lane and of elements 4..7 in its high lane, i.e. of the 8 elements in order. Only in-lane shuffles: an 8x8
// transpose of whole rows needs 8 lane-crossing permutes (vperm2f128: 8 µops each on AMD Zen 1, the one shuffle
// port on Intel), which loading the rows as 128-bit halves beside each other avoids (lane_pair).
__attribute__((target("avx2,fma"), always_inline)) inline void transpose4x4_lanes(__m256 x[4]) {
  const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
  const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
  x[0] = _mm256_shuffle_ps(t0, t2, 0x44);
  x[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  x[2] = _mm256_shuffle_ps(t1, t3, 0x44);
  x[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

// The 4 floats at lo and the 4 at hi as one register [lo | hi]: a load and an insert from memory (no shuffle port
// on Intel; 2 µops on AMD Zen 1).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 lane_pair(const float* lo, const float* hi) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}

// The two cell cubics of 8 elements whose 8-coefficient rows ([q0..q3, κ0..κ3]) start at a[0..7], at fractions u:
// the rows read as 128-bit halves in lane pairs and transposed in lanes, then q = c0 + u·(c1 + u·(c2 + u·c3)) and
// κ alike. Shared by the blocked loops (cell_cubics_avx2) and the fused AVX2 kernel (simd_avx2.h).
__attribute__((target("avx2,fma"), always_inline)) inline void cubics_from_cells(const float* const a[8], __m256 u,
                                                                                 __m256& q, __m256& kap) {
  __m256 c[4], k[4];
  for (int e = 0; e < 4; ++e) {
    c[e] = lane_pair(a[e], a[e + 4]);
    k[e] = lane_pair(a[e] + 4, a[e + 4] + 4);
  }
  transpose4x4_lanes(c);  // c[j] = q coefficient j of the 8 elements
  transpose4x4_lanes(k);
  q = _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, c[3], c[2]), c[1]), c[0]);
  kap = _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, k[3], k[2]), k[1]), k[0]);
}

// cubics_from_cells for rows with the two cubics' coefficients interleaved ([q0 κ0 q1 κ1 q2 κ2 q3 κ3]: the AVX2
// kernel's cells in p's bits, bit_cells.h): each coefficient pair (q_j, κ_j) is one 64-bit element, so one 64-bit
// unpack gives four elements' pairs (elements 0, 1, 4, 5 or 2, 3, 6, 7), both cubics are evaluated at once on
// [u u] pairs, and two shuffles split q and κ back into element order. 12 in-lane shuffles for 8 elements against
// the two 4x4 transposes' 16 (on AMD Zen 1 the read's limit: ~4% off the clip); each lane's multiply-adds are
// cubics_from_cells', so the same bits.
//
// cubics_from_pair_halves is the evaluation from the rows' halves side by side: lo[e] = [row e's first 4 floats | row
// e + 4's], hi[e] their last 4.
__attribute__((target("avx2,fma"), always_inline)) inline void cubics_from_pair_halves(const __m256d lo[4],
                                                                                       const __m256d hi[4], __m256 u,
                                                                                       __m256& q, __m256& kap) {
  const __m256 ua = _mm256_unpacklo_ps(u, u), ub = _mm256_unpackhi_ps(u, u);
  const __m256 c0a = _mm256_castpd_ps(_mm256_unpacklo_pd(lo[0], lo[1]));
  const __m256 c1a = _mm256_castpd_ps(_mm256_unpackhi_pd(lo[0], lo[1]));
  const __m256 c2a = _mm256_castpd_ps(_mm256_unpacklo_pd(hi[0], hi[1]));
  const __m256 c3a = _mm256_castpd_ps(_mm256_unpackhi_pd(hi[0], hi[1]));
  const __m256 c0b = _mm256_castpd_ps(_mm256_unpacklo_pd(lo[2], lo[3]));
  const __m256 c1b = _mm256_castpd_ps(_mm256_unpackhi_pd(lo[2], lo[3]));
  const __m256 c2b = _mm256_castpd_ps(_mm256_unpacklo_pd(hi[2], hi[3]));
  const __m256 c3b = _mm256_castpd_ps(_mm256_unpackhi_pd(hi[2], hi[3]));
  const __m256 ra = _mm256_fmadd_ps(ua, _mm256_fmadd_ps(ua, _mm256_fmadd_ps(ua, c3a, c2a), c1a), c0a);
  const __m256 rb = _mm256_fmadd_ps(ub, _mm256_fmadd_ps(ub, _mm256_fmadd_ps(ub, c3b, c2b), c1b), c0b);
  q = _mm256_shuffle_ps(ra, rb, _MM_SHUFFLE(2, 0, 2, 0));
  kap = _mm256_shuffle_ps(ra, rb, _MM_SHUFFLE(3, 1, 3, 1));
}

__attribute__((target("avx2,fma"), always_inline)) inline void cubics_from_pairs(const float* const a[8], __m256 u,
                                                                                 __m256& q, __m256& kap) {
  __m256d lo[4], hi[4];
  for (int e = 0; e < 4; ++e) {
    lo[e] = _mm256_castps_pd(lane_pair(a[e], a[e + 4]));
    hi[e] = _mm256_castps_pd(lane_pair(a[e] + 4, a[e + 4] + 4));
  }
  cubics_from_pair_halves(lo, hi, u, q, kap);
}

__attribute__((target("avx2,fma"))) inline void cell_cubics_avx2(const float* __restrict cells,
                                                                 const int* __restrict it, const float* __restrict ut,
                                                                 float* __restrict q, float* __restrict kap, int m) {
  int i = 0;
  for (; i + 8 <= m; i += 8) {
    const float* a[8];
    for (int e = 0; e < 8; ++e) a[e] = cells + 8 * it[i + e];
    __m256 qv, kv;
    cubics_from_cells(a, _mm256_loadu_ps(ut + i), qv, kv);
    _mm256_storeu_ps(q + i, qv);
    _mm256_storeu_ps(kap + i, kv);
  }
  cell_cubics_scalar(cells, it, ut, q, kap, i, m);
}

// The per-token δ read of the fused KL kernels (kl_simd_body.inc: the AVX2 type's V::read_token_cubics; the AVX-512
// type's takes the same sums 16 elements at a time), from the t-cubic table (TokenGrid): for each
// element, the four 8-float runs of its s columns js..js+3 (idx[i] = 8·(it·ncol + js)) combined by its s weights, then
// the two cubics in its t fraction ut[i], 8 elements at a time (their combined runs transposed, one element per lane).
// Elements [0, m), m a multiple of 8: every buffer must hold values there (the kernel fills whole vectors).
// ws[0], ws[1], ws[2]: the B-spline weights of columns js, js + 2 and js + 3.
//
// Column js + 1's weight is not used: the sum is taken as run_1 + Σ_{b≠1} w_b·(run_b - run_1), equal to Σ_b w_b·run_b
// for weights that sum to 1, which the B-spline's do exactly while their float values do only to a few ulp. So the
// weights' rounding and the products' act on the differences between neighbouring columns (a few per cent of the
// value). Of run 1 the value-sized a0 (both planes) is kept out of the sums and the transpose, taken across the 8
// elements by two rows of a second transpose, and added last, to the cubic in u: one rounding of the value instead of
// two (tools/measure_accuracy.py, 10^5 points, per-token upper / lower 4.56e-7 / 2.58e-7 with a0 added per element,
// 4.26e-7 / 2.22e-7 so; ~3% of the read's time).
__attribute__((target("avx2,fma"), always_inline)) inline void token_cubics_avx2(
    const float* __restrict cubics, const std::int32_t* __restrict idx, const float* __restrict ut,
    const float* const ws[3], float* __restrict q, float* __restrict kap, int m) {
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < m; i += 8) {
    __m256 r[8], run1[8];
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) {
      const float* b = cubics + idx[i + e];
      run1[e] = _mm256_loadu_ps(b + 8);
      __m256 acc = _mm256_mul_ps(_mm256_broadcast_ss(ws[0] + i + e), _mm256_sub_ps(_mm256_loadu_ps(b), run1[e]));
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(ws[1] + i + e), _mm256_sub_ps(_mm256_loadu_ps(b + 16), run1[e]), acc);
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(ws[2] + i + e), _mm256_sub_ps(_mm256_loadu_ps(b + 24), run1[e]), acc);
      r[e] = _mm256_add_ps(acc, _mm256_blend_ps(run1[e], zero, 0x11));  // a0 of both planes kept apart
    }
    transpose8x8(r);  // r[k]: coefficient k of q_up's cubic for the 8 elements (a0: its difference), r[4 + k] κ's
    // a0 of run 1 of the 8 elements, both planes: two rows of run1's transpose
    const __m256 t0 = _mm256_unpacklo_ps(run1[0], run1[1]), t1 = _mm256_unpacklo_ps(run1[2], run1[3]);
    const __m256 t2 = _mm256_unpacklo_ps(run1[4], run1[5]), t3 = _mm256_unpacklo_ps(run1[6], run1[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t1, 0x44), s1 = _mm256_shuffle_ps(t2, t3, 0x44);
    const __m256 q0 = _mm256_permute2f128_ps(s0, s1, 0x20), k0 = _mm256_permute2f128_ps(s0, s1, 0x31);
    const __m256 u = _mm256_loadu_ps(ut + i);
    _mm256_storeu_ps(
        q + i, _mm256_add_ps(q0, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, r[3], r[2]), r[1]), r[0])));
    _mm256_storeu_ps(
        kap + i, _mm256_add_ps(k0, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, r[7], r[6]), r[5]), r[4])));
  }
}

inline bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

inline void cell_cubics(const float* cells, const int* it, const float* ut, float* q, float* kap, int m) {
#if defined(BANDPO_HAVE_X86_GATHER)
  if (cpu_has_avx2_fma()) return cell_cubics_avx2(cells, it, ut, q, kap, m);
#endif
  cell_cubics_scalar(cells, it, ut, q, kap, 0, m);
}

}  // namespace bandpo
