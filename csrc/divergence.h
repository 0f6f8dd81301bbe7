// The compiled divergences: the one list that every kernel dispatches on.
//
// Python's registry (bandpo_lut/tables/divergences.py, `compiled_id`) must agree with it: the list reaches Python in
// bandpo_lut._C's facts (csrc/facts.h) and tests/runtime/test_contract.py compares the two. Adding a divergence here
// means an enumerator, its traits specialisation below (else nothing compiles), a case in every `switch` over
// Divergence (the build passes -Werror=switch: a missing case is a compile error; the switches have no
// `default:`), and its math in bandpo_math.h. Whether the kernels read its table is `reads_table`, never a
// comparison with kKL.
#pragma once

#include "fast_math.h"  // BANDPO_HD

namespace bandpo {

enum class Divergence : int { kKL = 0, kTV = 1, kChi2 = 2, kHellinger = 3 };

// What the kernels need to know of a divergence.
//   name         the registry name (bandpo_lut.tables.divergences)
//   closed_form  bounds from a closed form, exact to rounding (csrc/bandpo_math.h closed_form_bounds);
//                otherwise read from the table (q_up and κ = -p·ln(r_lo)/δ, see bandpo_math.h)
template <Divergence D>
struct DivergenceTraits;
template <>
struct DivergenceTraits<Divergence::kKL> {
  static constexpr const char* name = "kl";
  static constexpr bool closed_form = false;
};
template <>
struct DivergenceTraits<Divergence::kTV> {
  static constexpr const char* name = "tv";
  static constexpr bool closed_form = true;
};
template <>
struct DivergenceTraits<Divergence::kChi2> {
  static constexpr const char* name = "chi2";
  static constexpr bool closed_form = true;
};
template <>
struct DivergenceTraits<Divergence::kHellinger> {
  static constexpr const char* name = "hellinger";
  static constexpr bool closed_form = true;
};

struct DivergenceInfo {
  const char* name;
  int id;
  bool closed_form;
};

template <Divergence D>
constexpr DivergenceInfo divergence_info() {
  return {DivergenceTraits<D>::name, static_cast<int>(D), DivergenceTraits<D>::closed_form};
}

// A divergence's facts, from its traits (exhaustive: a new enumerator without a case does not compile).
constexpr DivergenceInfo info_of(Divergence d) {
  switch (d) {
    case Divergence::kKL:
      return divergence_info<Divergence::kKL>();
    case Divergence::kTV:
      return divergence_info<Divergence::kTV>();
    case Divergence::kChi2:
      return divergence_info<Divergence::kChi2>();
    case Divergence::kHellinger:
      return divergence_info<Divergence::kHellinger>();
  }
  return {nullptr, -1, false};  // not an enumerator (ids from Python are checked on the host first)
}

// How many divergences are compiled; ids are 0 .. kNumDivergences - 1 (checked below, so that this count and
// the enumerators cannot disagree).
constexpr int kNumDivergences = 4;

// Whether the kernels read `d`'s coefficient table; otherwise a closed form, which takes only the δ range from
// the grid and an empty (2, 0, 0) placeholder table. On the device too (no string in sight: only the trait).
BANDPO_HD constexpr bool reads_table(Divergence d) {
  switch (d) {
    case Divergence::kKL:
      return !DivergenceTraits<Divergence::kKL>::closed_form;
    case Divergence::kTV:
      return !DivergenceTraits<Divergence::kTV>::closed_form;
    case Divergence::kChi2:
      return !DivergenceTraits<Divergence::kChi2>::closed_form;
    case Divergence::kHellinger:
      return !DivergenceTraits<Divergence::kHellinger>::closed_form;
  }
  return false;
}

namespace detail {
constexpr bool ids_are_dense() {
  for (int i = 0; i < kNumDivergences; ++i)
    if (info_of(static_cast<Divergence>(i)).id != i) return false;
  return info_of(static_cast<Divergence>(kNumDivergences)).id == -1;
}
// The table-read path of the kernels (kl_* in bandpo_math.h: q_up and κ = -p·ln(r_lo)/δ) is KL's: a second
// table-read divergence needs its own lower-value reader first.
constexpr bool only_kl_reads_a_table() {
  for (int i = 0; i < kNumDivergences; ++i) {
    const auto d = static_cast<Divergence>(i);
    if (reads_table(d) != (d == Divergence::kKL)) return false;
  }
  return true;
}
}  // namespace detail
static_assert(detail::ids_are_dense(), "Divergence ids must be 0 .. kNumDivergences - 1");
static_assert(detail::only_kl_reads_a_table(), "the kernels' table path (kl_* in bandpo_math.h) is KL's only");

}  // namespace bandpo
