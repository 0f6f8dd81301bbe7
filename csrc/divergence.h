// The compiled divergences: the one list that every kernel dispatches on.
//
// Python's registry (bandpo_lut/divergences.py, `compiled_id`) must agree with it: bandpo_lut._C exposes
// this list as `divergences` and tests/test_contract.py compares the two. Adding a divergence here means
// a traits specialisation below (else nothing compiles), a case in every `switch` over Divergence (the
// build passes -Werror=switch: a missing case is a compile error), and its math in bandpo_math.h.
#pragma once

namespace bandpo {

enum Divergence : int { kKL = 0, kTV = 1, kChi2 = 2, kHellinger = 3 };

// What the kernels need to know of a divergence.
//   name         the registry name (bandpo_lut.divergences)
//   closed_form  bounds from a closed form in double precision (csrc/bandpo_math.h closed_form_bounds);
//                otherwise read from the table (q_up and κ = -p·ln(r_lo)/δ, see bandpo_math.h)
template <int D>
struct DivergenceTraits;
template <>
struct DivergenceTraits<kKL> {
  static constexpr const char* name = "kl";
  static constexpr bool closed_form = false;
};
template <>
struct DivergenceTraits<kTV> {
  static constexpr const char* name = "tv";
  static constexpr bool closed_form = true;
};
template <>
struct DivergenceTraits<kChi2> {
  static constexpr const char* name = "chi2";
  static constexpr bool closed_form = true;
};
template <>
struct DivergenceTraits<kHellinger> {
  static constexpr const char* name = "hellinger";
  static constexpr bool closed_form = true;
};

struct DivergenceInfo {
  const char* name;
  int id;
  bool closed_form;
};

template <int D>
constexpr DivergenceInfo divergence_info() {
  return {DivergenceTraits<D>::name, D, DivergenceTraits<D>::closed_form};
}

// Every compiled divergence, in id order (the host checks ids against it before any kernel runs).
constexpr DivergenceInfo kDivergences[] = {divergence_info<kKL>(), divergence_info<kTV>(), divergence_info<kChi2>(),
                                           divergence_info<kHellinger>()};
constexpr int kNumDivergences = sizeof(kDivergences) / sizeof(kDivergences[0]);

}  // namespace bandpo
