// One token of the fused policy loss, for every backend: ratio, bounds, surrogate, gradient factor and
// the metric counts. The semantics are those of bandpo_lut/reference/policy_loss.py (its docstring is
// the specification); the counts are indexed as its COUNTS tuple.
#pragma once

#include <cstdint>

#include "band_element.h"

namespace bandpo {

// The ids of the string options: their position in bandpo_lut/runtime/settings.py's CLIPS, MODES and AGGS. Every
// switch over them is exhaustive and has no `default:` (-Werror=switch). `name_of` gives the Python name (the
// facts exported to Python, csrc/facts.h) and, returning null for anything else, decides which ids the host
// accepts (option_from_id in loss_host.h): a new enumerator needs its name, or it is refused.
enum class ClipKind : int { kBand = 0, kFixed = 1, kDcpo = 2 };
enum class LossMode : int { kClip = 0, kMask = 1 };
enum class AggKind : int { kTokenMean = 0, kTokenSum = 1, kSeqMeanTokenMean = 2, kSeqMeanTokenSum = 3 };
// How the kernels read the mask (not a Python option: the host picks it from the mask's dtype).
enum class MaskKind : int { kNone = 0, kBytes = 1, kFloat = 2 };

inline const char* name_of(ClipKind k) {
  switch (k) {
    case ClipKind::kBand:
      return "band";
    case ClipKind::kFixed:
      return "fixed";
    case ClipKind::kDcpo:
      return "dcpo";
  }
  return nullptr;
}

inline const char* name_of(LossMode m) {
  switch (m) {
    case LossMode::kClip:
      return "clip";
    case LossMode::kMask:
      return "mask";
  }
  return nullptr;
}

inline const char* name_of(AggKind a) {
  switch (a) {
    case AggKind::kTokenMean:
      return "token-mean";
    case AggKind::kTokenSum:
      return "token-sum";
    case AggKind::kSeqMeanTokenMean:
      return "seq-mean-token-mean";
    case AggKind::kSeqMeanTokenSum:
      return "seq-mean-token-sum";
  }
  return nullptr;
}

// Indices into the counts vector (bandpo_lut.runtime.loss_spec.COUNTS).
enum CountIndex : int {
  kNTokens = 0,
  kNClipped,
  kNClippedUpper,
  kNClippedLower,
  kNDualClipped,
  kNLowprobPos,
  kNClippedUpperLowprob,
  kPpoKlSum,
  kBandWidthSum,
  kNBandFinite,
  kNTokensBucket0 = 10,   // 10..14: tokens with p in [0,.2), [.2,.4), [.4,.6), [.6,.8), [.8,1]
  kNClippedBucket0 = 15,  // 15..19: clipped tokens in those buckets
  kNumCounts = 20
};
constexpr int kNumBuckets = 5;

// The fractions (loss_spec.FRACTIONS, in its order): count `num` / count `den`, 0 where den is 0. The op's
// metric vector is the counts, then the fractions (loss_spec.METRICS).
constexpr int kNumFractions = 7 + kNumBuckets;
constexpr int kNumMetrics = kNumCounts + kNumFractions;
struct FractionDef {
  int num, den;
};
BANDPO_HD FractionDef fraction_def(int f) {
  switch (f) {
    case 0:
      return {kPpoKlSum, kNTokens};  // ppo_kl
    case 1:
      return {kNClipped, kNTokens};  // clip_frac
    case 2:
      return {kNClippedUpper, kNTokens};  // clip_frac_upper
    case 3:
      return {kNClippedLower, kNTokens};  // clip_frac_lower
    case 4:
      return {kNDualClipped, kNTokens};  // dual_clip_frac
    case 5:
      return {kNClippedUpperLowprob, kNLowprobPos};  // clip_frac_upper_lowprob
    case 6:
      return {kBandWidthSum, kNBandFinite};  // band_width_mean
    default:
      return {kNClippedBucket0 + (f - 7), kNTokensBucket0 + (f - 7)};  // clip_frac_pXX_YY
  }
}

// The lower edge of probability bucket k (loss_spec.BUCKETS; the last bucket includes p = 1).
BANDPO_HD double bucket_edge(int k) {
  switch (k) {
    case 0:
      return 0.0;
    case 1:
      return 0.2;
    case 2:
      return 0.4;
    case 3:
      return 0.6;
    default:
      return 0.8;
  }
}

constexpr double kLogRatioClamp = 20.0;  // loss_spec.LOG_RATIO_CLAMP
constexpr double kLowProb = 0.2;         // loss_spec.LOWPROB

struct LossParams {
  BandParams band;  // the band (clip_kind == kBand; band.log_input is true) and the max_ratio cap
  ClipKind clip_kind;
  double eps_low;  // fixed: [1 - eps_low, 1 + eps_high]; dcpo: its two constants
  double eps_high;
  double dual_clip;  // c > 1, or 0 for no dual clip
  LossMode mode;
  AggKind agg;
  MaskKind mask_kind;
  bool per_token_delta;  // a δ tensor of the inputs' shape is given
};

// Where a kernel reads its inputs: dense row-major (batch, T) arrays (CUDA: the batch; CPU: one row).
template <typename scalar_t>
struct LossInputs {
  const scalar_t* lp;
  const scalar_t* olp;
  const scalar_t* adv;
  const scalar_t* delta;  // per-token δ or null
  const void* mask;       // LossParams::mask_kind says how to read it; null without a mask
};

// A token's weight from the mask: the one decoding of the mask for every backend.
template <MaskKind MASK, typename scalar_t, typename acc_t>
BANDPO_HD acc_t mask_weight(const void* mask, int64_t i) {
  switch (MASK) {
    case MaskKind::kBytes:
      return static_cast<const uint8_t*>(mask)[i] ? acc_t(1) : acc_t(0);
    case MaskKind::kFloat:
      return static_cast<acc_t>(static_cast<const scalar_t*>(mask)[i]);
    case MaskKind::kNone:
      return acc_t(1);
  }
  return acc_t(1);
}

// The same for a mask kind known only at run time.
template <typename scalar_t, typename acc_t>
BANDPO_HD acc_t mask_weight_any(MaskKind mask_kind, const void* mask, int64_t i) {
  switch (mask_kind) {
    case MaskKind::kBytes:
      return mask_weight<MaskKind::kBytes, scalar_t, acc_t>(mask, i);
    case MaskKind::kFloat:
      return mask_weight<MaskKind::kFloat, scalar_t, acc_t>(mask, i);
    case MaskKind::kNone:
      return acc_t(1);
  }
  return acc_t(1);
}

template <typename T>
struct TokenTerms {
  T value;        // w · loss_t (0 for w == 0)
  T grad;         // w · ∂loss_t/∂log_prob_t
  T p;            // p_old
  T lo, up;       // the bounds
  T neg_d;        // old_log_prob - log_prob, clamped: the ppo_kl summand (before w)
  bool positive;  // A > 0
  bool clipped_upper, clipped_lower, dual_clipped;
};

// The bounds of the chosen clip at old log-probability olp, capped by max_ratio once (band_element caps
// the band itself). PATH kTable: the caller knows the clip is a band that reads a table (KL); kClosed: any
// other clip or a closed-form band; kAny: decided here (see DivPath).
// g: grid_consts(params.band) (the GPU kernels pass theirs, built once).
template <typename acc_t, bool PER_TOKEN, DivPath PATH = DivPath::kAny>
BANDPO_HD void clip_bounds(const LossParams& params, const GridConsts<acc_t>& g, const DeltaConsts<acc_t>& c, acc_t olp,
                           acc_t p, acc_t dtok, acc_t& lo, acc_t& up) {
  if (PATH == DivPath::kTable) {  // the band reads log-probabilities (LossParams::band.log_input is true)
    band_element<acc_t, PER_TOKEN, DivPath::kTable, ProbInput::kLogProbExp>(params.band, g, c, olp, dtok, lo, up, p);
    return;
  }
  switch (params.clip_kind) {
    case ClipKind::kBand:
      band_element<acc_t, PER_TOKEN, PATH>(params.band, g, c, olp, dtok, lo, up);
      return;
    case ClipKind::kFixed:
      lo = acc_t(1) - acc_t(params.eps_low);
      up = acc_t(1) + acc_t(params.eps_high);
      break;
    case ClipKind::kDcpo: {  // DCPO's dynamic bounds
      const acc_t a = acc_t(1) - acc_t(4) * acc_t(params.eps_low) / p;
      lo = acc_t(0.5) + acc_t(0.5) * sqrt(a > acc_t(0) ? a : acc_t(0));
      up = acc_t(0.5) + acc_t(0.5) * sqrt(acc_t(1) + acc_t(4) * acc_t(params.eps_high) / p);
      break;
    }
  }
  const acc_t cap = acc_t(params.band.max_ratio);
  up = up > cap ? cap : up;
}

template <typename acc_t, bool PER_TOKEN, DivPath PATH = DivPath::kAny>
BANDPO_HD void clip_bounds(const LossParams& params, const DeltaConsts<acc_t>& c, acc_t olp, acc_t p, acc_t dtok,
                           acc_t& lo, acc_t& up) {
  clip_bounds<acc_t, PER_TOKEN, PATH>(params, grid_consts<acc_t>(params.band), c, olp, p, dtok, lo, up);
}

// Everything about one token with weight w != 0 and bounds (lo, up) already known.
template <typename acc_t>
BANDPO_HD void token_terms(const LossParams& params, acc_t lp, acc_t olp, acc_t adv, acc_t w, acc_t p, acc_t lo,
                           acc_t up, TokenTerms<acc_t>& o) {
  const acc_t raw = lp - olp;
  const acc_t clampv = acc_t(kLogRatioClamp);
  const acc_t d = raw < -clampv ? -clampv : (raw > clampv ? clampv : raw);
  const bool in_clamp = (raw >= -clampv) & (raw <= clampv);  // torch.clamp's gradient is inclusive
  const acc_t r = exp_normal_any(d);                         // |d| <= 20: never subnormal
  const bool pos = adv > acc_t(0), neg = adv < acc_t(0);
  o.positive = pos;
  // Bitwise & and | throughout: no short-circuit branches, so that the CPU loops vectorise.
  o.clipped_upper = pos & (r > up);
  o.clipped_lower = neg & (r < lo);
  const bool has_dual = params.dual_clip > 0.0;
  const acc_t cdual = acc_t(params.dual_clip);
  o.dual_clipped = has_dual & neg & (r > cdual);
  const acc_t surrogate = -adv * r;
  acc_t per = surrogate;
  const bool clip_mode = params.mode == LossMode::kClip;  // selects, not an if-block: the CPU loops vectorise
  per = (clip_mode & o.clipped_lower) ? -adv * lo : per;
  per = (clip_mode & o.clipped_upper) ? -adv * up : per;
  per = (clip_mode & o.dual_clipped) ? -adv * cdual : per;
  const bool no_grad = o.clipped_upper | o.clipped_lower | o.dual_clipped | !in_clamp;
  // NaN bounds (a per-token δ outside the table's range) must not pass for "not clipped".
  const bool nan_bounds = (lo != lo) | (up != up);
  per = nan_bounds ? lo + up : per;
  o.value = w * per;
  o.grad = no_grad ? acc_t(0) : w * surrogate;  // ∂(-A·e^d)/∂lp = -A·r inside the clamp
  o.grad = nan_bounds ? acc_t(0) : o.grad;      // the NaN loss is a constant there: no gradient
  o.p = p;
  o.lo = lo;
  o.up = up;
  o.neg_d = -d;
}

// w where `keep` holds, else +0: a bit mask, not a select. From selects on related conditions (clipped, clipped
// upper, ...) the compiler derives branches, and a vectorised loop runs those as masked stores (slow on AMD cores).
BANDPO_HD float keep_if(bool keep, float w) {
  return bits_to_float(float_to_bits(w) & -static_cast<std::int32_t>(keep));
}
BANDPO_HD double keep_if(bool keep, double w) { return keep ? w : 0.0; }

// Where p_old lies among the counts' edges: at or above each bucket's lower edge (at[k], bucket_edge(k); NaN p: none)
// and below the low-probability threshold (NaN p: not).
struct ProbPlace {
  bool at[kNumBuckets];
  bool low;
};

template <typename acc_t>
BANDPO_HD ProbPlace prob_place(acc_t p) {
  return {{p >= acc_t(bucket_edge(0)), p >= acc_t(bucket_edge(1)), p >= acc_t(bucket_edge(2)),
           p >= acc_t(bucket_edge(3)), p >= acc_t(bucket_edge(4))},
          p < acc_t(kLowProb)};
}

// One token's contribution to each of the 20 counts, c[k * stride] (branch-free: bit masks only), with p_old's place
// given (the CPU's float32 rows decide it from the log-probability: loss_cpu.cpp LogProbEdges).
template <typename acc_t>
BANDPO_HD void count_terms(const TokenTerms<acc_t>& o, acc_t w, const ProbPlace& place, acc_t* c, int stride) {
  const bool clipped = o.clipped_upper | o.clipped_lower;
  const bool lowprob_pos = place.low & o.positive;
  const bool finite_up = (o.up - o.up) == acc_t(0);  // one comparison: x - x is NaN for ±inf and NaN
  c[kNTokens * stride] = w;
  c[kNClipped * stride] = keep_if(clipped, w);
  c[kNClippedUpper * stride] = keep_if(o.clipped_upper, w);
  c[kNClippedLower * stride] = keep_if(o.clipped_lower, w);
  c[kNDualClipped * stride] = keep_if(o.dual_clipped, w);
  c[kNLowprobPos * stride] = keep_if(lowprob_pos, w);
  c[kNClippedUpperLowprob * stride] = keep_if(lowprob_pos & o.clipped_upper, w);
  c[kPpoKlSum * stride] = keep_if(w != acc_t(0), w * o.neg_d);  // w == 0: exactly 0 even for NaN inputs
  c[kBandWidthSum * stride] = keep_if(finite_up, w * (o.up - o.lo));
  c[kNBandFinite * stride] = keep_if(finite_up, w);
  // Buckets [0,.2), [.2,.4), [.4,.6), [.6,.8), [.8, 1], written out (no inner loop: the CPU loops around
  // this stay vectorisable). NaN p is in none.
  const bool e0 = place.at[0], e1 = place.at[1], e2 = place.at[2], e3 = place.at[3], e4 = place.at[4];
  const bool in0 = e0 & !e1, in1 = e1 & !e2, in2 = e2 & !e3, in3 = e3 & !e4, in4 = e4;  // (no bool array:
  c[(kNTokensBucket0 + 0) * stride] = keep_if(in0, w);                                  //  it would sit in memory)
  c[(kNTokensBucket0 + 1) * stride] = keep_if(in1, w);
  c[(kNTokensBucket0 + 2) * stride] = keep_if(in2, w);
  c[(kNTokensBucket0 + 3) * stride] = keep_if(in3, w);
  c[(kNTokensBucket0 + 4) * stride] = keep_if(in4, w);
  c[(kNClippedBucket0 + 0) * stride] = keep_if(in0 & clipped, w);
  c[(kNClippedBucket0 + 1) * stride] = keep_if(in1 & clipped, w);
  c[(kNClippedBucket0 + 2) * stride] = keep_if(in2 & clipped, w);
  c[(kNClippedBucket0 + 3) * stride] = keep_if(in3 & clipped, w);
  c[(kNClippedBucket0 + 4) * stride] = keep_if(in4 & clipped, w);
}

// The same with p_old's place from o.p.
template <typename acc_t>
BANDPO_HD void count_terms(const TokenTerms<acc_t>& o, acc_t w, acc_t* c, int stride) {
  count_terms<acc_t>(o, w, prob_place<acc_t>(o.p), c, stride);
}

// Add one token's contributions to the counts (sum_t: the accumulator type).
template <typename acc_t, typename sum_t>
BANDPO_HD void add_counts(const TokenTerms<acc_t>& o, acc_t w, sum_t* counts) {
  acc_t c[kNumCounts];
  count_terms<acc_t>(o, w, c, 1);
  for (int k = 0; k < kNumCounts; ++k) counts[k] += static_cast<sum_t>(c[k]);
}

// ---- the finish: aggregation, metrics and the backward's per-row scale, from fixed-order sums ----------
// Everything after the token loop, for every backend. The sums are float64 and are added in a fixed order
// (so the results are bit-identical run to run).
struct LossTotals {
  double s;         // Σ_b S_b, S_b = Σ_t w·loss on row b
  double w;         // Σ_b W_b, W_b = Σ_t w
  double row_mean;  // Σ_b S_b / W_b over rows with W_b != 0
  double n_rows;    // rows with W_b > 0
  double counts[kNumCounts];
};

BANDPO_HD void add_row(LossTotals& totals, double s_b, double w_b) {
  totals.s += s_b;
  totals.w += w_b;
  totals.row_mean += (w_b != 0.0) ? s_b / w_b : 0.0;
  totals.n_rows += (w_b > 0.0) ? 1.0 : 0.0;
}

// The aggregated loss (as loss_spec specifies: 0, never NaN, for an empty mask).
BANDPO_HD double aggregate_loss(AggKind agg, const LossTotals& totals) {
  switch (agg) {
    case AggKind::kTokenMean:
      return totals.w != 0.0 ? totals.s / totals.w : 0.0;
    case AggKind::kTokenSum:
      return totals.s;
    case AggKind::kSeqMeanTokenMean:
      return totals.n_rows != 0.0 ? totals.row_mean / totals.n_rows : 0.0;
    case AggKind::kSeqMeanTokenSum:
      return totals.n_rows != 0.0 ? totals.s / totals.n_rows : 0.0;
  }
  return 0.0 / 0.0;  // not an AggKind (ids are checked on the host)
}

// ∂loss/∂S_b: the backward multiplies each token's w·∂loss_t/∂log_prob_t by it.
BANDPO_HD double row_scale(AggKind agg, const LossTotals& totals, double w_b) {
  switch (agg) {
    case AggKind::kTokenMean:
      return totals.w != 0.0 ? 1.0 / totals.w : 0.0;
    case AggKind::kTokenSum:
      return 1.0;
    case AggKind::kSeqMeanTokenMean:
      return (w_b != 0.0 && totals.n_rows != 0.0) ? 1.0 / (w_b * totals.n_rows) : 0.0;
    case AggKind::kSeqMeanTokenSum:
      return totals.n_rows != 0.0 ? 1.0 / totals.n_rows : 0.0;
  }
  return 0.0 / 0.0;  // not an AggKind (ids are checked on the host)
}

// The metric vector: the counts rounded to out_t, then each fraction as the quotient of two rounded counts
// in out_t's arithmetic (what dividing the 0-dim count tensors gives).
template <typename out_t>
BANDPO_HD void write_metrics(const LossTotals& totals, out_t* metrics) {
  using op_t = decltype(out_t(0) + 0.0f);  // float for half types
  for (int k = 0; k < kNumCounts; ++k) metrics[k] = static_cast<out_t>(totals.counts[k]);
  for (int f = 0; f < kNumFractions; ++f) {
    const FractionDef d = fraction_def(f);
    const op_t num = static_cast<op_t>(metrics[d.num]), den = static_cast<op_t>(metrics[d.den]);
    metrics[kNumCounts + f] = static_cast<out_t>(den != op_t(0) ? num / den : op_t(0));
  }
}

}  // namespace bandpo
