// One token of the fused policy loss, for every backend: ratio, bounds, surrogate, gradient factor and
// the metric counts. The semantics are those of bandpo_lut/reference/policy_loss.py (its docstring is
// the specification); the counts are indexed as its COUNTS tuple.
#pragma once

#include "band_element.h"

namespace bandpo {

enum ClipKind : int { kClipBand = 0, kClipFixed = 1, kClipDcpo = 2 };
enum LossMode : int { kModeClip = 0, kModeMask = 1 };
enum MaskKind : int { kMaskNone = 0, kMaskBytes = 1, kMaskFloat = 2 };

// Indices into the counts vector (bandpo_lut.reference.policy_loss.COUNTS).
enum CountIndex : int {
  kNTokens = 0, kNClipped, kNClippedUpper, kNClippedLower, kNDualClipped, kNLowprobPos,
  kNClippedUpperLowprob, kPpoKlSum, kBandWidthSum, kNBandFinite,
  kNTokensBucket0 = 10,    // 10..14: tokens with p in [0,.2), [.2,.4), [.4,.6), [.6,.8), [.8,1]
  kNClippedBucket0 = 15,   // 15..19: clipped tokens in those buckets
  kNumCounts = 20
};

struct LossParams {
  BandParams band;       // the band (clip_kind == kClipBand); band.log_input is true (old log-probs)
  int clip_kind;         // ClipKind
  double eps_low;        // fixed: [1 - eps_low, 1 + eps_high]; dcpo: its two constants
  double eps_high;
  double max_ratio;      // cap of every upper bound (+inf: none)
  double dual_clip;      // c > 1, or 0 for no dual clip
  int mode;              // LossMode
  int mask_kind;         // MaskKind
  bool per_token_delta;  // a δ tensor of the inputs' shape is given
};

constexpr double kLogRatioClamp = 20.0;
constexpr double kLowProb = 0.2;

template <typename T>
struct TokenTerms {
  T value;       // w · loss_t (0 for w == 0)
  T grad;        // w · ∂loss_t/∂log_prob_t
  T p;           // p_old
  T lo, up;      // the bounds
  T neg_d;       // old_log_prob - log_prob, clamped: the ppo_kl summand (before w)
  bool positive;  // A > 0
  bool clipped_upper, clipped_lower, dual_clipped;
};

// The bounds of the chosen clip at old log-probability olp.
template <typename acc_t, bool TOKEN>
BANDPO_HD void clip_bounds(const LossParams& L, const DeltaConsts<acc_t>& c, acc_t olp, acc_t p, acc_t dtok,
                           acc_t& lo, acc_t& up) {
  if (L.clip_kind == kClipBand) {
    band_element<acc_t, TOKEN>(L.band, c, olp, dtok, lo, up);
  } else if (L.clip_kind == kClipFixed) {
    lo = acc_t(1) - acc_t(L.eps_low);
    up = acc_t(1) + acc_t(L.eps_high);
  } else {  // DCPO's dynamic bounds
    const acc_t a = acc_t(1) - acc_t(4) * acc_t(L.eps_low) / p;
    lo = acc_t(0.5) + acc_t(0.5) * sqrt(a > acc_t(0) ? a : acc_t(0));
    up = acc_t(0.5) + acc_t(0.5) * sqrt(acc_t(1) + acc_t(4) * acc_t(L.eps_high) / p);
  }
  const acc_t cap = acc_t(L.max_ratio);
  up = up > cap ? cap : up;
}

// Everything about one token with weight w != 0 and bounds (lo, up) already known.
template <typename acc_t>
BANDPO_HD void token_terms(const LossParams& L, acc_t lp, acc_t olp, acc_t adv, acc_t w, acc_t p, acc_t lo,
                           acc_t up, TokenTerms<acc_t>& o) {
  const acc_t raw = lp - olp;
  const acc_t clampv = acc_t(kLogRatioClamp);
  const acc_t d = raw < -clampv ? -clampv : (raw > clampv ? clampv : raw);
  const bool in_clamp = (raw >= -clampv) & (raw <= clampv);   // torch.clamp's gradient is inclusive
  const acc_t r = exp_normal_any(d);   // |d| <= 20: never subnormal
  const bool pos = adv > acc_t(0), neg = adv < acc_t(0);
  o.positive = pos;
  // Bitwise & and | throughout: no short-circuit branches, so that the CPU loops vectorise.
  o.clipped_upper = pos & (r > up);
  o.clipped_lower = neg & (r < lo);
  const bool has_dual = L.dual_clip > 0.0;
  const acc_t cdual = acc_t(L.dual_clip);
  o.dual_clipped = has_dual & neg & (r > cdual);
  const acc_t surrogate = -adv * r;
  acc_t per = surrogate;
  const bool clip_mode = L.mode == kModeClip;   // selects, not an if-block: the CPU loops vectorise
  per = (clip_mode & o.clipped_lower) ? -adv * lo : per;
  per = (clip_mode & o.clipped_upper) ? -adv * up : per;
  per = (clip_mode & o.dual_clipped) ? -adv * cdual : per;
  const bool no_grad = o.clipped_upper | o.clipped_lower | o.dual_clipped | !in_clamp;
  // NaN bounds (a per-token δ outside the table's range) must not pass for "not clipped".
  const bool nan_bounds = (lo != lo) | (up != up);
  per = nan_bounds ? lo + up : per;
  o.value = w * per;
  o.grad = no_grad ? acc_t(0) : w * surrogate;   // ∂(-A·e^d)/∂lp = -A·r inside the clamp
  o.grad = nan_bounds ? acc_t(0) : o.grad;       // the NaN loss is a constant there: no gradient
  o.p = p;
  o.lo = lo;
  o.up = up;
  o.neg_d = -d;
}

// One token's contribution to each of the 20 counts, c[k * stride] (branch-free: selects only).
template <typename acc_t>
BANDPO_HD void count_terms(const TokenTerms<acc_t>& o, acc_t w, acc_t* c, int stride) {
  const acc_t zero = acc_t(0);
  const bool clipped = o.clipped_upper | o.clipped_lower;
  const bool lowprob_pos = (o.p < acc_t(kLowProb)) & o.positive;
  const acc_t inf = acc_t(1) / acc_t(0);
  const bool finite_up = (o.up == o.up) & (o.up < inf) & (o.up > -inf);
  c[kNTokens * stride] = w;
  c[kNClipped * stride] = clipped ? w : zero;
  c[kNClippedUpper * stride] = o.clipped_upper ? w : zero;
  c[kNClippedLower * stride] = o.clipped_lower ? w : zero;
  c[kNDualClipped * stride] = o.dual_clipped ? w : zero;
  c[kNLowprobPos * stride] = lowprob_pos ? w : zero;
  c[kNClippedUpperLowprob * stride] = (lowprob_pos & o.clipped_upper) ? w : zero;
  c[kPpoKlSum * stride] = (w != zero) ? w * o.neg_d : zero;   // w == 0: exactly 0 even for NaN inputs
  c[kBandWidthSum * stride] = finite_up ? w * (o.up - o.lo) : zero;
  c[kNBandFinite * stride] = finite_up ? w : zero;
  // Buckets [0,.2), [.2,.4), [.4,.6), [.6,.8), [.8, 1], written out (no inner loop: the CPU loops around
  // this stay vectorisable). NaN p is in none.
  const bool e0 = o.p >= acc_t(0), e1 = o.p >= acc_t(0.2), e2 = o.p >= acc_t(0.4), e3 = o.p >= acc_t(0.6),
             e4 = o.p >= acc_t(0.8);
  const bool in0 = e0 & !e1, in1 = e1 & !e2, in2 = e2 & !e3, in3 = e3 & !e4, in4 = e4;   // (no bool array:
  c[(kNTokensBucket0 + 0) * stride] = in0 ? w : zero;                            //  it would sit in memory)
  c[(kNTokensBucket0 + 1) * stride] = in1 ? w : zero;
  c[(kNTokensBucket0 + 2) * stride] = in2 ? w : zero;
  c[(kNTokensBucket0 + 3) * stride] = in3 ? w : zero;
  c[(kNTokensBucket0 + 4) * stride] = in4 ? w : zero;
  c[(kNClippedBucket0 + 0) * stride] = (in0 & clipped) ? w : zero;
  c[(kNClippedBucket0 + 1) * stride] = (in1 & clipped) ? w : zero;
  c[(kNClippedBucket0 + 2) * stride] = (in2 & clipped) ? w : zero;
  c[(kNClippedBucket0 + 3) * stride] = (in3 & clipped) ? w : zero;
  c[(kNClippedBucket0 + 4) * stride] = (in4 & clipped) ? w : zero;
}

// Add one token's contributions to the counts (sum_t: the accumulator type).
template <typename acc_t, typename sum_t>
BANDPO_HD void add_counts(const TokenTerms<acc_t>& o, acc_t w, sum_t* counts) {
  acc_t c[kNumCounts];
  count_terms<acc_t>(o, w, c, 1);
  for (int k = 0; k < kNumCounts; ++k) counts[k] += static_cast<sum_t>(c[k]);
}

}  // namespace bandpo
