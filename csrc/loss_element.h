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
  const bool in_clamp = (raw >= -clampv) && (raw <= clampv);   // torch.clamp's gradient is inclusive
  const acc_t r = exp_any(d);
  const bool pos = adv > acc_t(0), neg = adv < acc_t(0);
  o.positive = pos;
  o.clipped_upper = pos && (r > up);
  o.clipped_lower = neg && (r < lo);
  const bool has_dual = L.dual_clip > 0.0;
  const acc_t cdual = acc_t(L.dual_clip);
  o.dual_clipped = has_dual && neg && (r > cdual);
  const acc_t surrogate = -adv * r;
  acc_t per = surrogate;
  if (L.mode == kModeClip) {
    per = o.clipped_lower ? -adv * lo : per;
    per = o.clipped_upper ? -adv * up : per;
    per = o.dual_clipped ? -adv * cdual : per;
  }
  const bool no_grad = o.clipped_upper || o.clipped_lower || o.dual_clipped || !in_clamp;
  // NaN bounds (a per-token δ outside the table's range) must not pass for "not clipped".
  const bool nan_bounds = (lo != lo) || (up != up);
  per = nan_bounds ? lo + up : per;
  o.value = w * per;
  o.grad = no_grad ? acc_t(0) : w * surrogate;   // ∂(-A·e^d)/∂lp = -A·r inside the clamp
  o.grad = nan_bounds ? acc_t(0) : o.grad;       // the NaN loss is a constant there: no gradient
  o.p = p;
  o.lo = lo;
  o.up = up;
  o.neg_d = -d;
}

// Add one token's contributions to the 20 counts (sum_t: the accumulator type).
template <typename acc_t, typename sum_t>
BANDPO_HD void add_counts(const TokenTerms<acc_t>& o, acc_t w, sum_t* counts) {
  const bool clipped = o.clipped_upper || o.clipped_lower;
  const bool lowprob_pos = (o.p < acc_t(kLowProb)) && o.positive;
  counts[kNTokens] += w;
  if (lowprob_pos) counts[kNLowprobPos] += w;
  if (lowprob_pos && o.clipped_upper) counts[kNClippedUpperLowprob] += w;
  if (clipped) counts[kNClipped] += w;
  if (o.clipped_upper) counts[kNClippedUpper] += w;
  if (o.clipped_lower) counts[kNClippedLower] += w;
  if (o.dual_clipped) counts[kNDualClipped] += w;
  counts[kPpoKlSum] += w * o.neg_d;
  const acc_t inf = acc_t(1) / acc_t(0);
  const bool finite_up = (o.up == o.up) && (o.up < inf) && (o.up > -inf);
  if (finite_up) {
    counts[kBandWidthSum] += w * (o.up - o.lo);
    counts[kNBandFinite] += w;
  }
  const acc_t edges[4] = {acc_t(0.2), acc_t(0.4), acc_t(0.6), acc_t(0.8)};
  int bucket = -1;
  if (o.p >= acc_t(0)) {
    bucket = 0;
    for (int k = 0; k < 4; ++k) bucket += (o.p >= edges[k]) ? 1 : 0;
  }
  if (bucket >= 0) {
    counts[kNTokensBucket0 + bucket] += w;
    if (clipped) counts[kNClippedBucket0 + bucket] += w;
  }
}

}  // namespace bandpo
