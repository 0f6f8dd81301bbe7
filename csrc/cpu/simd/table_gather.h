// The table reads of the CPU band loops (the one part the compiler will not vectorise), for elements whose cell
// indices and fractions are already computed: per element, the cubics of its t cell (scalar δ: cubics_from_cells, for
// the blocked loops' cell_cubics where the CPU has AVX2+FMA, checked at run time; cubics_from_pairs for the fused
// AVX2 kernel's cells in p's bits) or
// the 4x4 B-spline patches of its (t, s) cell (per-token δ: patches_scalar in the blocked loops of the baseline ISA;
// in the fused kernels, from the pair table whose patch rows are 256-bit runs, pair_patches_avx2 for AVX-512 and
// pair_patches_lanes_avx2 for AVX2).
#pragma once

#include <cstdint>
#include <vector>

#include "bandpo_math.h"

#include "macros.h"  // BANDPO_HAVE_X86_GATHER

#if defined(BANDPO_HAVE_X86_GATHER)
#include <immintrin.h>
#endif

namespace bandpo {

// A per-token δ KL read as the fused kernels see it: the table with its two planes interleaved, so that
// pairs[i·row + 2j] = q_up coefficient (i, j) and the next float is κ's (make_pair_table); the t axis as axis_cell
// computes it in float; the δ range as delta_valid and delta_in_range see it; and the s axis as TokenSAxis.
struct PairGrid {
  const float* pairs;
  int row;                          // floats per t row: 2·(ns + 2)
  float t_lo, t_hi, t_step, t_inv;  // t axis: first and last node, step, 1/step
  int t_last;                       // last cell: nt - 2
  TokenSAxis s;
  float valid_min, valid_max;  // delta_valid
  bool max_inclusive;
  float delta_min, delta_max;  // delta_in_range
};

inline std::vector<float> make_pair_table(const TableView& tb) {
  const std::int64_t ncol = tb.ns + 2, plane = static_cast<std::int64_t>(tb.nt + 2) * ncol;
  std::vector<float> pairs(2 * static_cast<size_t>(plane));
  for (std::int64_t k = 0; k < plane; ++k) {
    pairs[2 * k] = tb.coef[k];
    pairs[2 * k + 1] = tb.coef[plane + k];
  }
  return pairs;
}

// The PairGrid of a band whose `pairs` are attached (band_cpu.cpp attach_tables).
inline PairGrid pair_grid(const BandParams& band) {
  const TableView& tb = band.table;
  PairGrid g;
  g.pairs = band.pairs;
  g.row = 2 * (tb.ns + 2);
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

// The last step of both patch reads for a group of 8 elements at i: r[2b] = their q row sums at s offset b, r[2b + 1]
// their κ ones, each element in its lane; the s weights applied across them and the coefficients (1, 1) added.
__attribute__((target("avx2,fma"), always_inline)) inline void store_patch_sums(const __m256 r[8], __m256 q_base,
                                                                                __m256 k_base, const float* const ws[4],
                                                                                int i, float* __restrict q,
                                                                                float* __restrict kap) {
  const __m256 w0 = _mm256_loadu_ps(ws[0] + i), w1 = _mm256_loadu_ps(ws[1] + i);
  const __m256 w2 = _mm256_loadu_ps(ws[2] + i), w3 = _mm256_loadu_ps(ws[3] + i);
  __m256 qv = _mm256_mul_ps(w0, r[0]), kv = _mm256_mul_ps(w0, r[1]);
  qv = _mm256_fmadd_ps(w1, r[2], qv);
  kv = _mm256_fmadd_ps(w1, r[3], kv);
  qv = _mm256_fmadd_ps(w2, r[4], qv);
  kv = _mm256_fmadd_ps(w2, r[5], kv);
  _mm256_storeu_ps(q + i, _mm256_add_ps(q_base, _mm256_fmadd_ps(w3, r[6], qv)));
  _mm256_storeu_ps(kap + i, _mm256_add_ps(k_base, _mm256_fmadd_ps(w3, r[7], kv)));
}

// The per-token δ table read of the fused KL kernels (kl_simd_body.inc), from the pair table (PairGrid): an
// element's two 4x4 patches are four 256-bit rows (the 4 coefficients of a patch row in both planes, interleaved),
// which its t weights combine; the row sums of 8 elements are transposed and their s weights applied across the
// elements. Elements [0, m), m a multiple of 8: every buffer must hold values there (the kernel fills whole vectors).
// idx[i]: element i's first pair, it·row + 2·js; wt[a][i], ws[b][i]: its B-spline weights along t and s.
//
// The sum is taken of the differences from the patch's coefficient (1, 1) and that coefficient added last:
// Σ w_a·w_b·c_ab = c_11 + Σ w_a·w_b·(c_ab - c_11), the products w_a·w_b summing to 1 (the kernels pass t weights 6
// times the B-spline's and s weights 1/6 of theirs: kl_simd_body.inc bspline_weights6_v). In float the weights'
// rounding (their products sum to 1 only to a few ulp) and the sixteen roundings of the sum then act on differences
// of a few per cent of the value rather than on the value: the bound's float error falls from ~4e-7 to ~1e-7
// relative.
// The coefficient (1, 1) is taken from row 1's register (one permute), not loaded twice more: an iteration's loads
// (~90 for 8 elements when it was loaded, ~74 now) fill the load queue, so fewer loads let more of the next iteration
// issue (AMD EPYC, through the op, random p and δ: ~4% less time; replacing the 32 weight broadcasts by in-register
// permutes as well cost 6%: the shuffle pipes are the other limit). For the same reason a row-pair table (rows i and
// i + 1 interleaved: ~3.5 cache lines per patch instead of ~5.5) was slower, 5.0-5.3 ns per element against 4.5-4.9:
// its row sums need a horizontal step per element (docs/performance.md, "Per-token δ").
__attribute__((target("avx2,fma"), always_inline)) inline void pair_patches_avx2(
    const float* __restrict pairs, int row, const int* __restrict idx, const float* const wt[4],
    const float* const ws[4], float* __restrict q, float* __restrict kap, int m) {
  for (int i = 0; i < m; i += 8) {
    __m256 r[8];
    __m256d c11s[8];  // each element's pair (1, 1), in every 64-bit lane: [q k q k q k q k]
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) {
      const float* b = pairs + idx[i + e];
      const __m256 row1 = _mm256_loadu_ps(b + row);
      c11s[e] = _mm256_permute4x64_pd(_mm256_castps_pd(row1), 0x55);  // the pair at floats 2, 3 of row 1
      const __m256 c11 = _mm256_castpd_ps(c11s[e]);
      __m256 acc = _mm256_mul_ps(_mm256_broadcast_ss(wt[0] + i + e), _mm256_sub_ps(_mm256_loadu_ps(b), c11));
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(wt[1] + i + e), _mm256_sub_ps(row1, c11), acc);
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(wt[2] + i + e), _mm256_sub_ps(_mm256_loadu_ps(b + 2 * row), c11), acc);
      r[e] = _mm256_fmadd_ps(_mm256_broadcast_ss(wt[3] + i + e), _mm256_sub_ps(_mm256_loadu_ps(b + 3 * row), c11), acc);
    }
    transpose8x8(r);  // r[2b]: the q row sums at s offset b of the 8 elements, r[2b + 1]: the κ ones
    // The base pairs as [q0 k0 .. q3 k3], [q4 k4 .. q7 k7], then split into q and κ in element order.
    const __m256 p0 = _mm256_castpd_ps(
        _mm256_blend_pd(_mm256_blend_pd(c11s[0], c11s[1], 0x2), _mm256_blend_pd(c11s[2], c11s[3], 0x8), 0xC));
    const __m256 p1 = _mm256_castpd_ps(
        _mm256_blend_pd(_mm256_blend_pd(c11s[4], c11s[5], 0x2), _mm256_blend_pd(c11s[6], c11s[7], 0x8), 0xC));
    const __m256 q_base = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(p0, p1, 0x88)), 0xD8));  // [q0 q1 q4 q5 | q2 q3 q6 q7]
    const __m256 k_base =
        _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(p0, p1, 0xDD)), 0xD8));
    store_patch_sums(r, q_base, k_base, ws, i, q, kap);
  }
}

// One pair of pair_patches_lanes_avx2: elements e = E and E + 4 of the group at idx, whose t weights are lanes E and
// E + 4 of wt_v. lo = their row sums at s offsets 0-1 ([q0 κ0 q1 κ1], element E in the low lane, E + 4 in the high),
// hi at 2-3, base = [q κ q κ] of their coefficients (1, 1).
template <int E>
__attribute__((target("avx2,fma"), always_inline)) inline void pair_row_sums_lanes(const float* __restrict pairs,
                                                                                   int row, const int* __restrict idx,
                                                                                   const __m256 wt_v[4], __m256& lo,
                                                                                   __m256& hi, __m256& base) {
  const float* b0 = pairs + idx[E];
  const float* b1 = pairs + idx[E + 4];
  const __m256 lo1 = lane_pair(b0 + row, b1 + row);
  base = _mm256_permute_ps(lo1, 0xEE);              // the pair at floats 2, 3 of row 1, twice in each lane
  __m256 w = _mm256_permute_ps(wt_v[0], 0x55 * E);  // element E's weight in the low lane, E + 4's in the high
  __m256 acc_lo = _mm256_mul_ps(w, _mm256_sub_ps(lane_pair(b0, b1), base));
  __m256 acc_hi = _mm256_mul_ps(w, _mm256_sub_ps(lane_pair(b0 + 4, b1 + 4), base));
  w = _mm256_permute_ps(wt_v[1], 0x55 * E);
  acc_lo = _mm256_fmadd_ps(w, _mm256_sub_ps(lo1, base), acc_lo);
  acc_hi = _mm256_fmadd_ps(w, _mm256_sub_ps(lane_pair(b0 + row + 4, b1 + row + 4), base), acc_hi);
  w = _mm256_permute_ps(wt_v[2], 0x55 * E);
  acc_lo = _mm256_fmadd_ps(w, _mm256_sub_ps(lane_pair(b0 + 2 * row, b1 + 2 * row), base), acc_lo);
  acc_hi = _mm256_fmadd_ps(w, _mm256_sub_ps(lane_pair(b0 + 2 * row + 4, b1 + 2 * row + 4), base), acc_hi);
  w = _mm256_permute_ps(wt_v[3], 0x55 * E);
  lo = _mm256_fmadd_ps(w, _mm256_sub_ps(lane_pair(b0 + 3 * row, b1 + 3 * row), base), acc_lo);
  hi = _mm256_fmadd_ps(w, _mm256_sub_ps(lane_pair(b0 + 3 * row + 4, b1 + 3 * row + 4), base), acc_hi);
}

// pair_patches_avx2 with every shuffle inside 128-bit lanes, for CPUs whose lane-crossing permutes are slow (AMD
// Zen 1 splits a 256-bit operation in two and runs vperm2f128 as 8 µops, vpermpd as 3; Intel runs both on its one
// shuffle port): the fused AVX2 kernel's read. The same sums in the same order, so the same bits. Elements e and
// e + 4 of a group of 8 share registers: each patch row is read as two 128-bit halves (s offsets 0-1 and 2-3, both
// planes), element e's beside element e + 4's (lane_pair), and the t weights of the two are taken from the group's
// weight vector by an in-lane permute instead of two broadcasts; the row sums then need only in-lane transposes.
__attribute__((target("avx2,fma"), always_inline)) inline void pair_patches_lanes_avx2(
    const float* __restrict pairs, int row, const int* __restrict idx, const float* const wt[4],
    const float* const ws[4], float* __restrict q, float* __restrict kap, int m) {
  for (int i = 0; i < m; i += 8) {
    const __m256 wt_v[4] = {_mm256_loadu_ps(wt[0] + i), _mm256_loadu_ps(wt[1] + i), _mm256_loadu_ps(wt[2] + i),
                            _mm256_loadu_ps(wt[3] + i)};
    __m256 r[8], base[4];  // r[e]: pair e's row sums at s offsets 0-1, r[4 + e] at 2-3
    pair_row_sums_lanes<0>(pairs, row, idx + i, wt_v, r[0], r[4], base[0]);
    pair_row_sums_lanes<1>(pairs, row, idx + i, wt_v, r[1], r[5], base[1]);
    pair_row_sums_lanes<2>(pairs, row, idx + i, wt_v, r[2], r[6], base[2]);
    pair_row_sums_lanes<3>(pairs, row, idx + i, wt_v, r[3], r[7], base[3]);
    // Transposed in lanes: r[0] = the 8 elements' q row sums at s offset 0, r[1] their κ ones, r[2], r[3] the same
    // at s offset 1; r[4..7] at 2 and 3 (store_patch_sums' order). The bases alike, into q and κ.
    transpose4x4_lanes(r);
    transpose4x4_lanes(r + 4);
    const __m256 c0 = _mm256_unpacklo_ps(base[0], base[1]), c1 = _mm256_unpacklo_ps(base[2], base[3]);
    store_patch_sums(r, _mm256_shuffle_ps(c0, c1, 0x44), _mm256_shuffle_ps(c0, c1, 0xEE), ws, i, q, kap);
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
