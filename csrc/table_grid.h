// The table's grid as it crosses from Python to the ops (the `float[] grid` argument): its fields, in order.
// Python packs the list by these names, read from bandpo_lut._C's facts (csrc/facts.h,
// bandpo_lut/runtime/table_cache.py), so the order is written here only; the length follows from the list.
#pragma once

namespace bandpo {

enum GridField : int {
  kTMin,  // first t = logit(p) node; nodes t_min + i·t_step (t_step a power of two)
  kTStep,
  kSMin,  // first s = log(δ) node
  kSStep,
  kDeltaMin,  // the table's δ range
  kDeltaMax,
  kDeltaMaxInclusive,  // 1: δ_max belongs to the range, 0: it does not (tv: δ < 1)
  kGridLen
};

constexpr const char* kGridFieldNames[kGridLen] = {
    "t_min", "t_step", "s_min", "s_step", "delta_min", "delta_max", "delta_max_inclusive"};

}  // namespace bandpo
