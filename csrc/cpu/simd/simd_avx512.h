// The AVX-512 vector type of the fused KL kernel (csrc/cpu/simd/kl_simd_body.inc): 16 float lanes, mask registers,
// and the table read from the 32 wide cells (csrc/cpu/simd/wide_cells.h), one two-register permute (vpermt2ps) per
// coefficient. Compiled only under `#pragma GCC target` for AVX-512 (csrc/cpu/simd/kl_simd.h).
#pragma once

#include "cpu/simd/simd_common.h"

namespace bandpo {
namespace avx512 {

struct V {
  static constexpr int kLanes = 16;
  using F = __m512;
  using M = __mmask16;
  using Tail = __mmask16;
  struct Consts {
    F invc, logc;  // the 16-entry log table (simd_common.h)
  };
  struct Grid {
    F t_min, t_max, width, inv_width, last_cell;
  };
  using Tables = WideCells;

  BANDPO_SIMD_INLINE static F set1(float v) { return _mm512_set1_ps(v); }
  BANDPO_SIMD_INLINE static F add(F a, F b) { return _mm512_add_ps(a, b); }
  BANDPO_SIMD_INLINE static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  BANDPO_SIMD_INLINE static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  BANDPO_SIMD_INLINE static F div(F a, F b) { return _mm512_div_ps(a, b); }
  BANDPO_SIMD_INLINE static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  BANDPO_SIMD_INLINE static F min(F a, F b) { return _mm512_min_ps(a, b); }  // b where either is NaN
  BANDPO_SIMD_INLINE static F max(F a, F b) { return _mm512_max_ps(a, b); }
  BANDPO_SIMD_INLINE static F trunc(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
  BANDPO_SIMD_INLINE static F abs(F a) { return _mm512_abs_ps(a); }
  // max and min of the bits as signed integers (simd_common.h: for clamp_bits)
  BANDPO_SIMD_INLINE static F imax(F a, F b) {
    return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  BANDPO_SIMD_INLINE static F imin(F a, F b) {
    return _mm512_castsi512_ps(_mm512_min_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  BANDPO_SIMD_INLINE static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  BANDPO_SIMD_INLINE static M le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  BANDPO_SIMD_INLINE static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  BANDPO_SIMD_INLINE static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  BANDPO_SIMD_INLINE static M unord(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  BANDPO_SIMD_INLINE static M mand(M a, M b) { return a & b; }
  BANDPO_SIMD_INLINE static M mor(M a, M b) { return a | b; }
  BANDPO_SIMD_INLINE static M mandnot(M a, M b) { return static_cast<M>(~a & b); }
  BANDPO_SIMD_INLINE static bool any(M m) { return m != 0; }
  BANDPO_SIMD_INLINE static F blend(M m, F a, F b) { return _mm512_mask_blend_ps(m, a, b); }  // b where m
  BANDPO_SIMD_INLINE static Tail tail(int64_t left) {
    return left >= kLanes ? static_cast<Tail>(0xffff) : static_cast<Tail>((1u << left) - 1u);
  }
  BANDPO_SIMD_INLINE static F load(const float* p, Tail m) { return _mm512_maskz_loadu_ps(m, p); }
  BANDPO_SIMD_INLINE static void store(float* p, Tail m, F v) { _mm512_mask_storeu_ps(p, m, v); }

  // v (whole numbers in int range) as int32, stored to p (16 ints)
  BANDPO_SIMD_INLINE static void store_int(std::int32_t* p, F v) { _mm512_storeu_si512(p, _mm512_cvttps_epi32(v)); }

  BANDPO_SIMD_INLINE static Consts consts() {
    const LogTableT<4>& lt = log_table_t<4>();
    return {_mm512_loadu_ps(lt.invc), _mm512_loadu_ps(lt.logc)};
  }
  BANDPO_SIMD_INLINE static Grid grid(const Tables& w) {
    return {set1(w.t_min), set1(w.t_max), set1(w.width), set1(w.inv_width),
            set1(static_cast<float>(WideCells::kCells - 1))};
  }

  // log x: x = z·2^e with z in [kLogOff, 2·kLogOff) from the bits, z·(1/c) - 1 = r with |r| <= 1/32 for the
  // table entry c of z's top 4 mantissa bits, log1p(r) by a degree-5 series (truncation < 2e-10). Absolute
  // error ~1e-8 plus the result's rounding; log(0) = -inf, log(+inf) = +inf, NaN stays NaN (fixed below).
  BANDPO_SIMD_INLINE static F log(F x, const Consts& k) {
    F e, logc, r;
    log_reduce(x, k, e, logc, r);
    return fix_log_specials(x, log_combine(e, logc, r));
  }
  // x = z·2^e as log() splits it: e (a whole number, as a float), the table's log c and r = z/c - 1.
  BANDPO_SIMD_INLINE static void log_reduce(F x, const Consts& k, F& e, F& logc, F& r) {
    const __m512i ix = _mm512_castps_si512(x);
    const __m512i tmp = _mm512_sub_epi32(ix, _mm512_set1_epi32(kLogOff));
    const __m512i idx = _mm512_srli_epi32(tmp, 19);  // the permute reads the low 4 bits
    e = _mm512_cvtepi32_ps(_mm512_srai_epi32(tmp, 23));
    const F z = _mm512_castsi512_ps(_mm512_sub_epi32(ix, _mm512_and_si512(tmp, _mm512_set1_epi32(kExponentMask))));
    r = _mm512_fmsub_ps(z, _mm512_permutexvar_ps(idx, k.invc), set1(1.0f));
    logc = _mm512_permutexvar_ps(idx, k.logc);
  }
  // log x = e·ln 2 + log z, the two parts unrounded against each other (for positive normal x only): e, and log z
  // (|log z| < 0.36) to about 1e-8 absolute.
  BANDPO_SIMD_INLINE static F log_parts(F x, const Consts& k, F& e) {
    F logc, r;
    log_reduce(x, k, e, logc, r);
    return add(logc, fmadd(mul(r, r), log_series(r), r));
  }
  BANDPO_SIMD_INLINE static F log_combine(F e, F logc, F r) {
    const F y0 = fmadd(e, set1(kLn2Hi), logc);
    return add(y0, fmadd(mul(r, r), log_series(r), fmadd(e, set1(kLn2Lo), r)));
  }
  // (log1p(r) - r)/r², to r^5
  BANDPO_SIMD_INLINE static F log_series(F r) {
    F s = fmadd(r, set1(0.2f), set1(-0.25f));
    s = fmadd(r, s, set1(1.0f / 3.0f));
    return fmadd(r, s, set1(-0.5f));
  }
  // 0, subnormals and negatives -> -inf (a t far beyond the grid either way; negative arguments come only from
  // inputs already marked NaN), +inf -> +inf, NaN -> NaN.
  BANDPO_SIMD_INLINE static F fix_log_specials(F x, F y) {
    if (!any(_mm512_fpclass_ps_mask(x, 0xff))) return y;  // every class but a positive normal: one instruction
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(kFloatMinNormal), _CMP_LT_OQ), y, set1(-kInf));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(kFloatMax), _CMP_GT_OQ), y, set1(kInf));
    return _mm512_mask_blend_ps(unord(x, x), y, x);
  }

  // e^x for x <= 88 (the lower bound's e^L): e^r by exp_reduce's shorter form, times 2^n by adding n to the exponent
  // field where the result is 2^-126 or more (n >= -125), and below that assembled from its bits as exp_f32 does (no
  // floating-point instruction produces or reads a subnormal): y = e^r·2^(n+149) is exact and below 2^24, and the
  // float with the bits round(y) is the correctly rounded result. Below -104 the result is 0; NaN stays NaN.
  // The scaling is integer arithmetic, not vscalefps: on AMD Zen 4 vscalefps runs at half the FMA's rate on the FMA
  // pipes, which the kernel's passes load most, while integer adds run beside them (tools/cpu_ports.py).
  BANDPO_SIMD_INLINE static F exp(F x) {
    F n, r, poly;
    __m512i shift;
    exp_reduce</*PROB=*/false>(x, n, shift, r, poly);
    return exp_scale(n, shift, fmadd(r, poly, set1(1.0f)));
  }
  // exp and exp_expm1 of K vectors (kl_simd_body.inc): one at a time; the AVX2 type says why it interleaves them.
  static constexpr int kExpGroup = 1;
  template <int K>
  BANDPO_SIMD_INLINE static void exp_group(F (&x)[K]) {
    for (int j = 0; j < K; ++j) x[j] = exp(x[j]);
  }
  template <int K>
  BANDPO_SIMD_INLINE static void exp_expm1_group(F (&x)[K], F (&em1)[K]) {
    for (int j = 0; j < K; ++j) x[j] = exp_expm1(x[j], em1[j]);
  }
  // e^x, and expm1(x) for x <= 2^-9 (the log-probabilities prob_terms_v reads; n <= 0 there): from the same
  // reduction, e^x - 1 = 2^n·(e^r - 1) + (2^n - 1) with e^r - 1 = r·poly, one rounding of a sum whose terms do not
  // cancel (|2^n·(e^r - 1)| <= 0.41·2^n against 1 - 2^n >= 1/2 for n < 0; the series itself for n = 0).
  BANDPO_SIMD_INLINE static F exp_expm1(F x, F& em1) {
    F n, r, poly;
    __m512i shift;
    exp_reduce</*PROB=*/true>(x, n, shift, r, poly);
    // 2^max(n, -30) from its bits (below 2^-30, e^x - 1 rounds to -1); NaN n: any scale (r·poly is NaN)
    const __m512i held = _mm512_max_epi32(shift, _mm512_set1_epi32(-30 << 23));
    const F two_n = _mm512_castsi512_ps(_mm512_add_epi32(held, _mm512_set1_epi32(127 << 23)));
    em1 = fmadd(two_n, mul(r, poly), sub(two_n, set1(1.0f)));
    return exp_scale(n, shift, fmadd(r, poly, set1(1.0f)));
  }
  // x = n·ln 2 + r (x held in [-104, 88], NaN kept), n·2^23 as an integer (the exponent field's increment), and
  // poly with e^r = 1 + r·poly. PROB (a probability from its logarithm, exp_expm1: its error is every bound's): ln 2
  // in two parts and the series to r^7. Otherwise (e^L, the lower bound: exp) the AVX2 type's shorter form, two
  // FMA-pipe instructions fewer per vector: ln 2 as one float (n·1.9e-9 into r: a relative error of e^L below
  // 2.8e-9·|L|, under the lower bound's bar of 3e-7·(1 + |L|)) and the degree-6 minimax polynomial kExpMinimax.
  template <bool PROB>
  BANDPO_SIMD_INLINE static void exp_reduce(F& x, F& n, __m512i& shift, F& r, F& poly) {
    x = min(set1(88.0f), max(set1(-104.0f), x));  // NaN passes (second operands)
    n = _mm512_roundscale_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    shift = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);  // NaN: 0x80000000 << 23 = 0
    r = PROB ? _mm512_fnmadd_ps(n, set1(kLn2Lo), _mm512_fnmadd_ps(n, set1(kLn2Hi), x))
             : _mm512_fnmadd_ps(n, set1(kLn2), x);
    // poly by Horner's rule from the highest coefficient (c[0] the constant term)
    constexpr int kTop = PROB ? 6 : 5;
    constexpr const float* c = PROB ? kExpSeries : kExpMinimax;
    poly = fmadd(r, set1(c[kTop]), set1(c[kTop - 1]));
#pragma GCC unroll 8
    for (int d = kTop - 2; d >= 0; --d) poly = fmadd(r, poly, set1(c[d]));
  }
  // s·2^n (s = e^r in [0.70, 1.42], n in [-150, 127]) without a subnormal operand or result on the way (see exp
  // above): n added to s's exponent field, exact where the result is normal; 149 more, and the bits rounded from
  // that float, where it is not (the sums wrap modulo 2^32 only in lanes the other branch takes).
  BANDPO_SIMD_INLINE static F exp_scale(F n, __m512i shift, F s) {
    const __m512i normal = _mm512_add_epi32(_mm512_castps_si512(s), shift);
    const F y = _mm512_castsi512_ps(_mm512_add_epi32(normal, _mm512_set1_epi32(149 << 23)));
    const F tiny = _mm512_castsi512_ps(_mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return blend(lt(n, set1(-125.5f)), _mm512_castsi512_ps(normal), tiny);  // NaN n: normal (s is NaN)
  }
  // The table read is a chain of register permutes and FMAs, no loads: one pass (kl_simd_body.inc, kl_run).
  static constexpr bool kIndexPass = false;
  static constexpr bool kBitCells = false;  // the wide cells are in t

  // q_up and κ at t (clamped onto the grid; NaN goes to its first node): cell c = floor((t - t_min)/width),
  // offset v = t - (t_min + c·width), exact for the shipped grid; then the degree-6 polynomials in v.
  BANDPO_SIMD_INLINE static void read_table(const Tables& w, const Grid& g, F t, F& q, F& kappa) {
    const F tc = min(max(t, g.t_min), g.t_max);
    const F cell =
        min(_mm512_roundscale_ps(mul(sub(tc, g.t_min), g.inv_width), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
            g.last_cell);
    const F v = sub(tc, fmadd(cell, g.width, g.t_min));
    const __m512i idx = _mm512_cvttps_epi32(cell);
    constexpr int D = WideCells::kDegree;
    q = _mm512_permutex2var_ps(_mm512_load_ps(&w.q[D][0]), idx, _mm512_load_ps(&w.q[D][16]));
    kappa = _mm512_permutex2var_ps(_mm512_load_ps(&w.kappa[D][0]), idx, _mm512_load_ps(&w.kappa[D][16]));
    for (int j = D - 1; j >= 0; --j) {
      q = fmadd(q, v, _mm512_permutex2var_ps(_mm512_load_ps(&w.q[j][0]), idx, _mm512_load_ps(&w.q[j][16])));
      kappa =
          fmadd(kappa, v, _mm512_permutex2var_ps(_mm512_load_ps(&w.kappa[j][0]), idx, _mm512_load_ps(&w.kappa[j][16])));
    }
  }

  // The 128-bit blocks [a0, b0 | a2, b2] and [a1, b1 | a3, b3] of two registers: vperm2f128's 0x20 and 0x31 in each
  // 256-bit half (AVX-512 has no per-half form), by two-register permutes.
  BANDPO_SIMD_INLINE static F blocks_even(F a, F b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27), b);
  }
  BANDPO_SIMD_INLINE static F blocks_odd(F a, F b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31), b);
  }
  // table_gather.h's transpose8x8 in each 256-bit half: on return r[j]'s low half holds element j of every input
  // row's low half, its high half the same of the high halves.
  BANDPO_SIMD_INLINE static void transpose8x8_halves(F r[8]) {
    const F t0 = _mm512_unpacklo_ps(r[0], r[1]), t1 = _mm512_unpackhi_ps(r[0], r[1]);
    const F t2 = _mm512_unpacklo_ps(r[2], r[3]), t3 = _mm512_unpackhi_ps(r[2], r[3]);
    const F t4 = _mm512_unpacklo_ps(r[4], r[5]), t5 = _mm512_unpackhi_ps(r[4], r[5]);
    const F t6 = _mm512_unpacklo_ps(r[6], r[7]), t7 = _mm512_unpackhi_ps(r[6], r[7]);
    const F s0 = _mm512_shuffle_ps(t0, t2, 0x44), s1 = _mm512_shuffle_ps(t0, t2, 0xEE);
    const F s2 = _mm512_shuffle_ps(t1, t3, 0x44), s3 = _mm512_shuffle_ps(t1, t3, 0xEE);
    const F s4 = _mm512_shuffle_ps(t4, t6, 0x44), s5 = _mm512_shuffle_ps(t4, t6, 0xEE);
    const F s6 = _mm512_shuffle_ps(t5, t7, 0x44), s7 = _mm512_shuffle_ps(t5, t7, 0xEE);
    r[0] = blocks_even(s0, s4);
    r[4] = blocks_odd(s0, s4);
    r[1] = blocks_even(s1, s5);
    r[5] = blocks_odd(s1, s5);
    r[2] = blocks_even(s2, s6);
    r[6] = blocks_odd(s2, s6);
    r[3] = blocks_even(s3, s7);
    r[7] = blocks_odd(s3, s7);
  }

  // The per-token δ read from the t-cubic table: table_gather.h's token_cubics_avx2 (its sums, in the same order: the
  // same bits) for 16 elements at a time, element e's runs in a register's low half and element e + 8's in its high
  // half; each element's s weights taken from the 16-lane weight vectors by a permute, its a0 lanes left out of the
  // sums by a masked add, the two halves' 8x8 transposes by in-lane shuffles and two-register permutes, and the cubics
  // in u for 16 elements at once. Half the instructions of the 256-bit read; on an AMD Zen 4, which runs a 512-bit
  // operation as two 256-bit halves, the per-token clip took 3.75-3.99 ns per element against 3.88-4.36 with δ
  // uniform in [0.01, 0.1] and 3.99-4.20 against 4.34-4.59 with δ log-uniform over the table (its reads wait on L2:
  // fewer instructions keep more of them in flight), 3.56-3.71 against 3.39-3.50 with every read from L1.
  BANDPO_SIMD_INLINE static void read_token_cubics(const float* __restrict cubics, const std::int32_t* __restrict idx,
                                                   const float* __restrict ut, const float* const ws[3],
                                                   float* __restrict q, float* __restrict kap, int m) {
    const auto pair = [](const float* a, const float* b) BANDPO_SIMD_LAMBDA {
      return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                                 _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
    };
    for (int i = 0; i < m; i += 16) {
      const F w0 = _mm512_loadu_ps(ws[0] + i), w2 = _mm512_loadu_ps(ws[1] + i), w3 = _mm512_loadu_ps(ws[2] + i);
      F r[8], a0_pairs[4];  // run 1's rows unpacked in pairs, toward its a0 lanes' transpose
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {
        const float* a = cubics + idx[i + e];
        const float* b = cubics + idx[i + e + 8];
        const __m512i sel =
            _mm512_set_epi32(e + 8, e + 8, e + 8, e + 8, e + 8, e + 8, e + 8, e + 8, e, e, e, e, e, e, e, e);
        const F run1 = pair(a + 8, b + 8);
        F acc = mul(_mm512_permutexvar_ps(sel, w0), sub(pair(a, b), run1));
        acc = fmadd(_mm512_permutexvar_ps(sel, w2), sub(pair(a + 16, b + 16), run1), acc);
        acc = fmadd(_mm512_permutexvar_ps(sel, w3), sub(pair(a + 24, b + 24), run1), acc);
        r[e] = _mm512_mask_add_ps(acc, 0xEEEE, acc, run1);
        if (e & 1)
          a0_pairs[e / 2] = _mm512_unpacklo_ps(a0_pairs[e / 2], run1);
        else
          a0_pairs[e / 2] = run1;
      }
      transpose8x8_halves(r);  // r[k]: coefficient k of q_up's cubic (a0: its difference) for the 16, r[4 + k] κ's
      const F b0 = _mm512_shuffle_ps(a0_pairs[0], a0_pairs[1], 0x44);
      const F b1 = _mm512_shuffle_ps(a0_pairs[2], a0_pairs[3], 0x44);
      const F q0 = blocks_even(b0, b1), k0 = blocks_odd(b0, b1);
      const F u = _mm512_loadu_ps(ut + i);
      _mm512_storeu_ps(q + i, add(q0, fmadd(u, fmadd(u, fmadd(u, r[3], r[2]), r[1]), r[0])));
      _mm512_storeu_ps(kap + i, add(k0, fmadd(u, fmadd(u, fmadd(u, r[7], r[6]), r[5]), r[4])));
    }
  }
};

}  // namespace avx512
}  // namespace bandpo
