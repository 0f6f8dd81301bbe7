// The table reads of the CPU band loops (the one part the compiler will not vectorise): per element, the
// cubics of its t cell (scalar δ) or the 4x4 B-spline patch of its (t, s) cell (per-token δ), for blocks of
// elements whose cell indices and fractions are already computed.
//
// On x86-64 with AVX2+FMA (checked at run time) the reads use whole-row loads: the 8 coefficients of a
// cell are one 256-bit load, transposed 8 elements at a time; a patch row is one 128-bit load. Elsewhere
// the same arithmetic runs as scalar code. The result is the same polynomial, evaluated in float.
#pragma once

#include <cstdint>

#include "bandpo_math.h"

#include "macros.h"  // BANDPO_HAVE_X86_GATHER

#if defined(BANDPO_HAVE_X86_GATHER)
#include <immintrin.h>
#endif

namespace bandpo {

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

// The two cell cubics of 8 elements from their cells' 8-coefficient rows r0..r7 (row k = element k's
// [q0..q3, κ0..κ3]): an 8x8 transpose, then q = c0 + u·(c1 + u·(c2 + u·c3)) and κ alike. Shared by the blocked
// loops (cell_cubics_avx2) and the fused AVX2 kernel (simd_avx2.h).
__attribute__((target("avx2,fma"), always_inline)) inline void cubics_from_rows(__m256 r0, __m256 r1, __m256 r2,
                                                                                __m256 r3, __m256 r4, __m256 r5,
                                                                                __m256 r6, __m256 r7, __m256 u,
                                                                                __m256& q, __m256& kap) {
  __m256 c[8] = {r0, r1, r2, r3, r4, r5, r6, r7};
  transpose8x8(c);  // c[j] = coefficient j of the 8 elements
  q = _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, c[3], c[2]), c[1]), c[0]);
  kap = _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, _mm256_fmadd_ps(u, c[7], c[6]), c[5]), c[4]);
}

__attribute__((target("avx2,fma"))) inline void cell_cubics_avx2(const float* __restrict cells,
                                                                 const int* __restrict it, const float* __restrict ut,
                                                                 float* __restrict q, float* __restrict kap, int m) {
  int i = 0;
  for (; i + 8 <= m; i += 8) {
    __m256 r0 = _mm256_loadu_ps(cells + 8 * it[i + 0]), r1 = _mm256_loadu_ps(cells + 8 * it[i + 1]);
    __m256 r2 = _mm256_loadu_ps(cells + 8 * it[i + 2]), r3 = _mm256_loadu_ps(cells + 8 * it[i + 3]);
    __m256 r4 = _mm256_loadu_ps(cells + 8 * it[i + 4]), r5 = _mm256_loadu_ps(cells + 8 * it[i + 5]);
    __m256 r6 = _mm256_loadu_ps(cells + 8 * it[i + 6]), r7 = _mm256_loadu_ps(cells + 8 * it[i + 7]);
    const __m256 u = _mm256_loadu_ps(ut + i);
    __m256 qv, kv;
    cubics_from_rows(r0, r1, r2, r3, r4, r5, r6, r7, u, qv, kv);
    _mm256_storeu_ps(q + i, qv);
    _mm256_storeu_ps(kap + i, kv);
  }
  cell_cubics_scalar(cells, it, ut, q, kap, i, m);
}

__attribute__((target("avx2,fma"))) inline void patches_avx2(const TableView& tb, const int* __restrict it,
                                                             const float* __restrict ut, const int* __restrict js,
                                                             const float* __restrict us, float* __restrict q,
                                                             float* __restrict kap, int m) {
  const int ncol = tb.ns + 2;
  const std::int64_t plane = static_cast<std::int64_t>(tb.nt + 2) * ncol;
  for (int i = 0; i < m; ++i) {
    float wt[4], ws[4];
    bspline_weights<float>(ut[i], wt);
    bspline_weights<float>(us[i], ws);
    const __m128 wsv = _mm_loadu_ps(ws);
    const float* base = tb.coef + static_cast<std::int64_t>(it[i]) * ncol + js[i];
    // Σ_a wt[a]·row_a for both planes, then the dot product with the s weights.
    __m128 aq = _mm_mul_ps(_mm_set1_ps(wt[0]), _mm_loadu_ps(base));
    __m128 ak = _mm_mul_ps(_mm_set1_ps(wt[0]), _mm_loadu_ps(base + plane));
    for (int a = 1; a < 4; ++a) {
      aq = _mm_fmadd_ps(_mm_set1_ps(wt[a]), _mm_loadu_ps(base + a * ncol), aq);
      ak = _mm_fmadd_ps(_mm_set1_ps(wt[a]), _mm_loadu_ps(base + plane + a * ncol), ak);
    }
    aq = _mm_mul_ps(aq, wsv);
    ak = _mm_mul_ps(ak, wsv);
    const __m128 h = _mm_hadd_ps(aq, ak);  // [q01, q23, k01, k23]
    const __m128 h2 = _mm_hadd_ps(h, h);   // [q, k, q, k]
    q[i] = _mm_cvtss_f32(h2);
    kap[i] = _mm_cvtss_f32(_mm_shuffle_ps(h2, h2, 0x55));
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

inline void patches(const TableView& tb, const int* it, const float* ut, const int* js, const float* us, float* q,
                    float* kap, int m) {
#if defined(BANDPO_HAVE_X86_GATHER)
  if (cpu_has_avx2_fma()) return patches_avx2(tb, it, ut, js, us, q, kap, m);
#endif
  patches_scalar(tb, it, ut, js, us, q, kap, 0, m);
}

}  // namespace bandpo
