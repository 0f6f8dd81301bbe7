// The AVX2+FMA vector type of the fused KL kernel (csrc/cpu/simd/kl_simd_body.inc): 8 float lanes, masks as lanes of
// all ones, and the scalar-δ table read from cells in p's float bits (bit_cells.h: 8 coefficients per cell, the two
// cubics' interleaved, read as two 128-bit halves and unpacked as 64-bit pairs within 128-bit lanes; AVX2 has no
// permute wide enough for the wide cells, and its gathers are slower).
// Compiled only under `#pragma GCC target("avx2,fma")` (csrc/cpu/simd/kl_simd.h).
#pragma once

#include "cpu/simd/simd_common.h"

namespace bandpo {
namespace avx2 {

struct V {
  static constexpr int kLanes = 8;
  using F = __m256;
  using M = __m256;
  struct Tail {
    __m256i lanes;  // maskload/maskstore lanes (the sign bit of each)
    bool full;
  };
  struct Consts {
    F invc, logc;  // the 8-entry log table (simd_common.h)
  };
  struct Tables {  // the cells in p's bits (bit_cells.h) and their geometry
    const float* cells;
    int side_cells;
    std::int32_t base;
    float x_lo, x_cell;
  };
  struct Grid {
    __m256i base, last_cell, side_cells;
    F x_lo, x_cell;
  };

  BANDPO_SIMD_INLINE static F set1(float v) { return _mm256_set1_ps(v); }
  BANDPO_SIMD_INLINE static F add(F a, F b) { return _mm256_add_ps(a, b); }
  BANDPO_SIMD_INLINE static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  BANDPO_SIMD_INLINE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  BANDPO_SIMD_INLINE static F div(F a, F b) { return _mm256_div_ps(a, b); }
  BANDPO_SIMD_INLINE static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  BANDPO_SIMD_INLINE static F min(F a, F b) { return _mm256_min_ps(a, b); }  // b where either is NaN
  BANDPO_SIMD_INLINE static F max(F a, F b) { return _mm256_max_ps(a, b); }
  BANDPO_SIMD_INLINE static F trunc(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
  BANDPO_SIMD_INLINE static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  // max and min of the bits as signed integers (simd_common.h: for clamp_bits)
  BANDPO_SIMD_INLINE static F imax(F a, F b) {
    return _mm256_castsi256_ps(_mm256_max_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
  }
  BANDPO_SIMD_INLINE static F imin(F a, F b) {
    return _mm256_castsi256_ps(_mm256_min_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
  }
  BANDPO_SIMD_INLINE static M lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  BANDPO_SIMD_INLINE static M le(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  BANDPO_SIMD_INLINE static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  BANDPO_SIMD_INLINE static M eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  BANDPO_SIMD_INLINE static M unord(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
  BANDPO_SIMD_INLINE static M mand(M a, M b) { return _mm256_and_ps(a, b); }
  BANDPO_SIMD_INLINE static M mor(M a, M b) { return _mm256_or_ps(a, b); }
  BANDPO_SIMD_INLINE static M mandnot(M a, M b) { return _mm256_andnot_ps(a, b); }  // ~a & b
  BANDPO_SIMD_INLINE static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  BANDPO_SIMD_INLINE static F blend(M m, F a, F b) { return _mm256_blendv_ps(a, b, m); }  // b where m
  BANDPO_SIMD_INLINE static Tail tail(int64_t left) {
    const int k = left >= kLanes ? kLanes : static_cast<int>(left);
    return {_mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), k == kLanes};
  }
  BANDPO_SIMD_INLINE static F load(const float* p, const Tail& m) {
    return m.full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m.lanes);
  }
  BANDPO_SIMD_INLINE static void store(float* p, const Tail& m, F v) {
    if (m.full) {
      _mm256_storeu_ps(p, v);
    } else {
      _mm256_maskstore_ps(p, m.lanes, v);
    }
  }

  // v (whole numbers in int range) as int32, stored to p (8 ints)
  BANDPO_SIMD_INLINE static void store_int(std::int32_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_cvttps_epi32(v));
  }

  BANDPO_SIMD_INLINE static Consts consts() {
    const LogTableT<3>& lt = log_table_t<3>();
    return {_mm256_loadu_ps(lt.invc), _mm256_loadu_ps(lt.logc)};
  }
  BANDPO_SIMD_INLINE static Grid grid(const Tables& tb) {
    return {_mm256_set1_epi32(tb.base), _mm256_set1_epi32(tb.side_cells - 1), _mm256_set1_epi32(tb.side_cells),
            set1(tb.x_lo), set1(tb.x_cell)};
  }
  // The lanes of a signed x (prob_pass) that the cells do not cover, for the tails' pass: below x_lo on the side
  // p > 1/2; on the side p <= 1/2, the part of x_lo's cell below x_lo, and below the smallest normal float (0, and
  // NaN never: its compares are false). below: p -> 0, above: p -> 1.
  BANDPO_SIMD_INLINE static void tail_lanes(const Grid& g, F x, M& below, M& above) {
    const F a = abs(x);
    const M small = lt(a, g.x_lo), upper_side = sign_set(x);
    above = mand(upper_side, small);
    below = mandnot(upper_side, mand(small, mor(le(g.x_cell, a), lt(a, set1(kFloatMinNormal)))));
  }
  // The lanes whose sign bit is set, as a mask.
  BANDPO_SIMD_INLINE static M sign_set(F x) {
    return _mm256_castsi256_ps(_mm256_srai_epi32(_mm256_castps_si256(x), 31));
  }

  // log x as in the AVX-512 type, with an 8-entry table (|r| <= 1/16) and a degree-6 series (truncation < 6e-10).
  BANDPO_SIMD_INLINE static F log(F x, const Consts& k) {
    F e, logc, r;
    log_reduce(x, k, e, logc, r);
    const F y0 = fmadd(e, set1(kLn2Hi), logc);
    F y = add(y0, fmadd(mul(r, r), log_series(r), fmadd(e, set1(kLn2Lo), r)));
    // 0, subnormals and negatives -> -inf, +inf -> +inf, NaN -> NaN (see the AVX-512 type)
    const M special = _mm256_or_ps(_mm256_cmp_ps(x, set1(kFloatMinNormal), _CMP_NGE_UQ),
                                   _mm256_cmp_ps(x, set1(kFloatMax), _CMP_GT_OQ));
    if (!any(special)) return y;
    y = blend(lt(x, set1(kFloatMinNormal)), y, set1(-kInf));
    y = blend(gt(x, set1(kFloatMax)), y, set1(kInf));
    return blend(unord(x, x), y, x);
  }

  // x = z·2^e as log() splits it: e (a whole number, as a float), the table's log c and r = z/c - 1.
  BANDPO_SIMD_INLINE static void log_reduce(F x, const Consts& k, F& e, F& logc, F& r) {
    const __m256i ix = _mm256_castps_si256(x);
    const __m256i tmp = _mm256_sub_epi32(ix, _mm256_set1_epi32(kLogOff));
    const __m256i idx = _mm256_srli_epi32(tmp, 20);  // the permute reads the low 3 bits
    e = _mm256_cvtepi32_ps(_mm256_srai_epi32(tmp, 23));
    const F z = _mm256_castsi256_ps(_mm256_sub_epi32(ix, _mm256_and_si256(tmp, _mm256_set1_epi32(kExponentMask))));
    r = _mm256_fmsub_ps(z, _mm256_permutevar8x32_ps(k.invc, idx), set1(1.0f));
    logc = _mm256_permutevar8x32_ps(k.logc, idx);
  }
  // (log1p(r) - r)/r², to r^6
  BANDPO_SIMD_INLINE static F log_series(F r) {
    F s = fmadd(r, set1(-1.0f / 6.0f), set1(0.2f));
    s = fmadd(r, s, set1(-0.25f));
    s = fmadd(r, s, set1(1.0f / 3.0f));
    return fmadd(r, s, set1(-0.5f));
  }
  // log x = e·ln 2 + log z, the two parts unrounded against each other (for positive normal x only): e, and log z
  // (|log z| < 0.36) to about 1e-8 absolute.
  BANDPO_SIMD_INLINE static F log_parts(F x, const Consts& k, F& e) {
    F logc, r;
    log_reduce(x, k, e, logc, r);
    return add(logc, fmadd(mul(r, r), log_series(r), r));
  }

  // e^x for x <= 88 (NaN stays NaN, below -104 gives 0), the exponential of the lower bound's exponent L (lower_pass):
  // exp_reduce's shorter form (ln 2 as one float, a degree-6 polynomial), then, as the AVX-512 type's exp does, 2^n
  // added to the exponent field where the result is 2^-126 or more (n >= -125), and below that the result assembled
  // from its bits (y = e^r·2^(n+149), exact and below 2^24; the float with the bits round(y)): no floating-point
  // instruction produces or reads a subnormal, and no multiplication is spent on the scaling.
  BANDPO_SIMD_INLINE static F exp(F x) {
    F xs[1] = {x};
    exp_group(xs);
    return xs[0];
  }
  // exp of K vectors in place, their steps interleaved: one exp is a chain of ~15 dependent instructions, and on
  // cores with a small out-of-order window (AMD Zen 1: ~1.6 ns per element alone against ~1.2 four at a time) one
  // chain at a time runs at its latency. Every lane's operations are exp's: the same bits.
  static constexpr int kExpGroup = 4;
  template <int K>
  BANDPO_SIMD_INLINE static void exp_group(F (&x)[K]) {
    F n[K], r[K], poly[K];
    __m256i ni[K];
    exp_reduce</*PROB=*/false>(x, n, ni, r, poly);
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) x[j] = exp_scale(n[j], ni[j], fmadd(r[j], poly[j], set1(1.0f)));
  }
  // e^x, and expm1(x) for x <= 2^-9 (as the AVX-512 type's exp_expm1).
  BANDPO_SIMD_INLINE static F exp_expm1(F x, F& em1) {
    F xs[1] = {x}, em1s[1];
    exp_expm1_group(xs, em1s);
    em1 = em1s[0];
    return xs[0];
  }
  // exp_expm1 of K vectors in place (e^x into x), interleaved as exp_group.
  // A subnormal e^x (x < -87.3: a probability below 2^-126) is rare among log-probabilities: where no lane of the K
  // vectors has one, exp_scale's normal sum alone (the lanes' bits unchanged; ~8 instructions fewer per vector).
  template <int K>
  BANDPO_SIMD_INLINE static void exp_expm1_group(F (&x)[K], F (&em1)[K]) {
    F n[K], r[K], poly[K];
    __m256i ni[K];
    exp_reduce</*PROB=*/true>(x, n, ni, r, poly);
    M tiny = lt(n[0], set1(-125.5f));
#pragma GCC unroll 8
    for (int j = 1; j < K; ++j) tiny = mor(tiny, lt(n[j], set1(-125.5f)));
    const bool any_tiny = any(tiny);
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) {
      const __m256i nc = _mm256_max_epi32(ni[j], _mm256_set1_epi32(-30));  // below 2^-30: -1
      const F two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(nc, _mm256_set1_epi32(127)), 23));
      em1[j] = fmadd(two_n, mul(r[j], poly[j]), sub(two_n, set1(1.0f)));
      const F s = fmadd(r[j], poly[j], set1(1.0f));
      x[j] = any_tiny ? exp_scale(n[j], ni[j], s) : exp_scale_normal(ni[j], s);
    }
  }
  // For K vectors, step by step across them: x = n·ln 2 + r (x held in [-104, 88], NaN kept), n as an integer
  // (NaN: 0x80000000), and poly with e^r = 1 + r·poly.
  // PROB (a probability from its logarithm, exp_expm1_group: its error is every bound's): ln 2 in two parts and the
  // series to r^7. Otherwise (e^L, the lower bound: exp_group) two multiply-adds fewer per vector, where the kernel is
  // bound by throughput (AMD Zen 1: 4% of the clip from p): ln 2 as one float, whose error puts n·1.9e-9 into r, a
  // relative error of e^L below 2.8e-9·|L| (the lower bound's bar is 3e-7·(1 + |L|)), and a minimax polynomial of
  // degree 6 (max relative error on |r| <= 0.35 in float32 arithmetic: 7.2e-8, the series' 6.2e-8).
  template <bool PROB, int K>
  BANDPO_SIMD_INLINE static void exp_reduce(F (&x)[K], F (&n)[K], __m256i (&ni)[K], F (&r)[K], F (&poly)[K]) {
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) {
      x[j] = min(set1(88.0f), max(set1(-104.0f), x[j]));  // NaN passes (second operands)
      n[j] = _mm256_round_ps(mul(x[j], set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) {
      ni[j] = _mm256_cvtps_epi32(n[j]);
      r[j] = PROB ? _mm256_fnmadd_ps(n[j], set1(kLn2Lo), _mm256_fnmadd_ps(n[j], set1(kLn2Hi), x[j]))
                  : _mm256_fnmadd_ps(n[j], set1(kLn2), x[j]);
    }
    // poly by Horner's rule from the highest coefficient (c[0] the constant term)
    constexpr int kTop = PROB ? 6 : 5;
    constexpr const float* c = PROB ? kExpSeries : kExpMinimax;
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) poly[j] = fmadd(r[j], set1(c[kTop]), set1(c[kTop - 1]));
#pragma GCC unroll 8
    for (int d = kTop - 2; d >= 0; --d) {
#pragma GCC unroll 8
      for (int j = 0; j < K; ++j) poly[j] = fmadd(r[j], poly[j], set1(c[d]));
    }
  }
  // s·2^n (s = e^r in [0.70, 1.42], n in [-150, 127]) without a subnormal operand or result on the way (see exp
  // above): n added to s's exponent field, exact where the result is normal (elsewhere the integer sum wraps, in
  // lanes the select drops; NaN n: 0x80000000 << 23 = 0 keeps s's NaN); for the others s·2^(n+149) with n held at
  // -126 or below, a normal float in every lane (AVX2 has no way to keep a conversion from flagging an operand): n is
  // -150 or more wherever the select keeps it (x >= -104), and NaN n's lane takes the normal sum.
  BANDPO_SIMD_INLINE static F exp_scale_normal(__m256i ni, F s) {
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(s), _mm256_slli_epi32(ni, 23)));
  }
  BANDPO_SIMD_INLINE static F exp_scale(F n, __m256i ni, F s) {
    const F normal = exp_scale_normal(ni, s);
    const __m256i ns = _mm256_min_epi32(ni, _mm256_set1_epi32(-126));
    const F y = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_castps_si256(s), _mm256_slli_epi32(_mm256_add_epi32(ns, _mm256_set1_epi32(149)), 23)));
    const F tiny = _mm256_castsi256_ps(_mm256_cvtps_epi32(y));  // to nearest even (MXCSR's default)
    return blend(lt(n, set1(-125.5f)), normal, tiny);
  }

  // The table read runs as two passes over a block (kl_simd_body.inc, kl_run): the cells' row offsets and fractions,
  // then the rows. In one pass each vector's chain (the cell, eight moves of offsets to general registers, the row
  // loads, the transpose, the cubics, then the bounds' division) outlasts what the out-of-order window overlaps on
  // smaller cores (AMD Zen 1: 2.4 ns per element for the read alone against 0.6 + 1.1 as two passes).
  static constexpr bool kIndexPass = true;
  // The scalar-δ cells are in p's bits (bit_cells.h): the first pass gives x = min(p, 1 - p) signed by its side
  // (kl_simd_body.inc prob_pass), not t.
  static constexpr bool kBitCells = true;

  // The cell of each lane's signed x (negative: p > 1/2), clamped into its side's cells (x below the first cell, 0
  // and NaN read a cell the tails or the NaN overwrite): off[0..7] = the cells' row offsets in floats, u[0..7] = the
  // fractions, the mantissa bits below the cell's (exact).
  BANDPO_SIMD_INLINE static void table_index(const Grid& g, F x, std::int32_t* off, float* u) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    __m256i cell = _mm256_sub_epi32(_mm256_srli_epi32(mag, BitGrid::kShift), g.base);
    cell = _mm256_min_epi32(_mm256_max_epi32(cell, _mm256_setzero_si256()), g.last_cell);
    cell = _mm256_add_epi32(cell, _mm256_and_si256(_mm256_srai_epi32(bits, 31), g.side_cells));
    const __m256i low = _mm256_and_si256(mag, _mm256_set1_epi32((1 << BitGrid::kShift) - 1));
    _mm256_storeu_ps(u, mul(_mm256_cvtepi32_ps(low), set1(1.0f / (1 << BitGrid::kShift))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(off), _mm256_slli_epi32(cell, 3));
  }
  // q_up and κ from the cells table_index chose: the cell cubics read as rows of interleaved pairs
  // (cubics_from_pairs).
  BANDPO_SIMD_INLINE static void table_rows(const Tables& tb, const std::int32_t* off, F u, F& q, F& kappa) {
    rows_at(tb.cells, off, u, q, kappa);
  }
  // The two interleaved cubics of the 8 rows at cells + off[0..7], at fractions u (cubics_from_pairs, table_gather.h).
  BANDPO_SIMD_INLINE static void rows_at(const float* cells, const std::int32_t* off, F u, F& a, F& b) {
    const float* const r[8] = {cells + off[0], cells + off[1], cells + off[2], cells + off[3],
                               cells + off[4], cells + off[5], cells + off[6], cells + off[7]};
    cubics_from_pairs(r, u, a, b);
  }

  // Per-token δ from the patches in the bits of p and δ (bit_patches.h), read by kl_simd_body.inc kl_token_bits_run_w:
  // where they lie (the GPU's layout, no tail cells, then the tail patches) and the table's δ range.
  struct PatchTables {
    const float* patches;
    int side_cells, d_cells;
    std::int32_t first_key, d_first_key;
    float x_lo;
  };
  struct PatchGrid {
    __m256i first_key, last_cell, side_cells, d_first_key, d_last, d_cells, tail_cell, x_lo_bits;
    F x_lo;
  };
  BANDPO_SIMD_INLINE static PatchGrid patch_grid(const PatchTables& tb) {
    PatchGrid g;
    g.first_key = _mm256_set1_epi32(tb.first_key);
    g.last_cell = _mm256_set1_epi32(tb.side_cells - 1);
    g.side_cells = _mm256_set1_epi32(tb.side_cells);
    g.d_first_key = _mm256_set1_epi32(tb.d_first_key);
    g.d_last = _mm256_set1_epi32(tb.d_cells - 1);
    g.d_cells = _mm256_set1_epi32(tb.d_cells);
    g.tail_cell = _mm256_set1_epi32(2 * tb.side_cells);  // the tail patches' row
    g.x_lo_bits = _mm256_castps_si256(set1(tb.x_lo));
    g.x_lo = set1(tb.x_lo);
    return g;
  }
  // Each lane's patch (kl_bit_cells.h kl_bits_token_delta's, from the signed x of prob_pass and a δ already on the
  // table's range): off = its first float, u and gd the fractions of x and δ in their cells (exact). x below x_lo
  // (0 included; the tails' lanes) reads its δ cell's tail patch (bit_patches.h: δ's constants for the tails), NaN a
  // patch whose values the NaN replaces.
  BANDPO_SIMD_INLINE static void patch_index(const PatchGrid& g, F x, F d, std::int32_t* off, float* u, float* gd) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i low_mask = _mm256_set1_epi32((1 << BitGrid::kShift) - 1);
    const F frac = set1(1.0f / (1 << BitGrid::kShift));
    __m256i cell = _mm256_sub_epi32(_mm256_srli_epi32(mag, BitGrid::kShift), g.first_key);
    cell = _mm256_min_epi32(_mm256_max_epi32(cell, _mm256_setzero_si256()), g.last_cell);
    cell = _mm256_add_epi32(cell, _mm256_and_si256(_mm256_srai_epi32(bits, 31), g.side_cells));
    cell = _mm256_blendv_epi8(cell, g.tail_cell, _mm256_cmpgt_epi32(g.x_lo_bits, mag));  // |x| < x_lo, on the bits
    const __m256i db = _mm256_castps_si256(d);
    __m256i kd = _mm256_sub_epi32(_mm256_srli_epi32(db, BitGrid::kShift), g.d_first_key);
    kd = _mm256_min_epi32(_mm256_max_epi32(kd, _mm256_setzero_si256()), g.d_last);
    _mm256_storeu_ps(u, mul(_mm256_cvtepi32_ps(_mm256_and_si256(mag, low_mask)), frac));
    _mm256_storeu_ps(gd, mul(_mm256_cvtepi32_ps(_mm256_and_si256(db, low_mask)), frac));
    const __m256i patch = _mm256_add_epi32(_mm256_mullo_epi32(cell, g.d_cells), kd);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(off), _mm256_slli_epi32(patch, 5));  // kPatchValues floats each
  }
  // Ask for 8 elements' patches (two cache lines each) ahead of their patch_cubics: a block's reads are then in
  // flight together rather than as far as the out-of-order window reaches.
  BANDPO_SIMD_INLINE static void prefetch_patches(const float* patches, const std::int32_t* off) {
    for (int e = 0; e < 8; ++e) {
      const char* a = reinterpret_cast<const char*>(patches + off[e]);
      _mm_prefetch(a, _MM_HINT_T0);
      _mm_prefetch(a + 64, _MM_HINT_T0);
    }
  }
  // q_up and κ of 8 elements from their patches (patch_index's off and δ fractions gd) at x's fractions u: the powers
  // of δ's fraction summed over the patch rows (bit_patches.h's layout) into each element's cell row, held as the
  // 128-bit halves cubics_from_pair_halves takes (elements e and e + 4 side by side, each with its own fraction), so
  // that the rows never go through memory.
  BANDPO_SIMD_INLINE static void patch_cubics(const float* patches, const std::int32_t* off, const float* gd, F u, F& q,
                                              F& kappa) {
    __m256d lo[4], hi[4];
    for (int e = 0; e < 4; ++e) {
      const float* a = patches + off[e];
      const float* b = patches + off[e + 4];
      const F g = _mm256_set_m128(_mm_broadcast_ss(gd + e + 4), _mm_broadcast_ss(gd + e));
      for (int h = 0; h < 2; ++h) {
        const int c = 4 * h;
        F acc = fmadd(g, lane_pair(a + 24 + c, b + 24 + c), lane_pair(a + 16 + c, b + 16 + c));
        acc = fmadd(g, acc, lane_pair(a + 8 + c, b + 8 + c));
        (h == 0 ? lo : hi)[e] = _mm256_castps_pd(fmadd(g, acc, lane_pair(a + c, b + c)));
      }
    }
    cubics_from_pair_halves(lo, hi, u, q, kappa);
  }

  BANDPO_SIMD_INLINE static void read_token_cubics(const float* cubics, const std::int32_t* idx, const float* ut,
                                                   const float* const ws[3], float* q, float* kappa, int m) {
    token_cubics_avx2(cubics, idx, ut, ws, q, kappa, m);
  }
};

}  // namespace avx2
}  // namespace bandpo
