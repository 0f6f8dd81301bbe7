// The facts of the compiled library that Python must agree with, as one JSON object: the one way C++ facts
// reach Python (bandpo_lut._C.facts_json, read by bandpo_lut._extension.facts()). Keys:
//   build                      what the library was built with (csrc/build_info.h)
//   divergences                {name: id} of the compiled divergences (csrc/divergence.h)
//   closed_form_divergences    the names of those evaluated in closed form (they read no table, only its δ range)
//   grid_fields                the order of the ops' `grid` argument (csrc/table_grid.h)
//   loss                       the fused loss's contract (csrc/loss_element.h): option ids, count and metric
//                              sizes, the fractions' (numerator, denominator) count indices, bucket edges,
//                              thresholds
//   cpu                        the CPU's vector ISA and the kernel variant chosen for it (csrc/cpu/cpu_variant.h;
//                              "variant_error" instead when BANDPO_LUT_CPU_VARIANT asks for one it cannot run)
// tests/runtime/test_contract.py compares each with its Python owner (the divergence registry, loss_spec).
#pragma once

#include <sstream>
#include <string>

#include "build_info.h"
#include "cpu/cpu_variant.h"
#include "divergence.h"
#include "loss_element.h"
#include "table_grid.h"

namespace bandpo {
namespace detail {

// {"name": id, ...} of every id that `name_of` names, in id order.
template <typename E>
void write_option_ids(std::ostringstream& o) {
  o << "{";
  for (int id = 0; name_of(static_cast<E>(id)) != nullptr; ++id) {
    o << (id ? ", " : "") << "\"" << name_of(static_cast<E>(id)) << "\": " << id;
  }
  o << "}";
}

}  // namespace detail

inline std::string facts_json() {
  std::ostringstream o;
  o.precision(17);
  o << "{\"build\": " << bandpo_build_info_json() << ", \"divergences\": {";
  for (int id = 0; id < kNumDivergences; ++id) {
    o << (id ? ", " : "") << "\"" << info_of(static_cast<Divergence>(id)).name << "\": " << id;
  }
  o << "}, \"closed_form_divergences\": [";
  bool first = true;
  for (int id = 0; id < kNumDivergences; ++id) {
    const DivergenceInfo d = info_of(static_cast<Divergence>(id));
    if (!d.closed_form) continue;
    o << (first ? "" : ", ") << "\"" << d.name << "\"";
    first = false;
  }
  o << "], \"grid_fields\": [";
  for (int i = 0; i < kGridLen; ++i) o << (i ? ", " : "") << "\"" << kGridFieldNames[i] << "\"";
  o << "], \"loss\": {\"clip\": ";
  detail::write_option_ids<ClipKind>(o);
  o << ", \"mode\": ";
  detail::write_option_ids<LossMode>(o);
  o << ", \"agg\": ";
  detail::write_option_ids<AggKind>(o);
  o << ", \"n_counts\": " << kNumCounts << ", \"n_metrics\": " << kNumMetrics
    << ", \"log_ratio_clamp\": " << kLogRatioClamp << ", \"lowprob\": " << kLowProb << ", \"bucket_edges\": [";
  for (int k = 0; k < kNumBuckets; ++k) o << (k ? ", " : "") << bucket_edge(k);
  o << "], \"fractions\": [";
  for (int f = 0; f < kNumFractions; ++f) {
    const FractionDef d = fraction_def(f);
    o << (f ? ", " : "") << "[" << d.num << ", " << d.den << "]";
  }
  o << "]}, \"cpu\": {\"isa\": \"" << cpu_variant_name(cpu_variant_supported()) << "\", ";
  try {
    const char* variant = cpu_variant_name(cpu_variant_from_env());  // may raise: write nothing before
    o << "\"variant\": \"" << variant << "\"";
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    for (char& ch : msg)
      if (ch == '"' || ch == '\\' || ch == '\n') ch = ' ';
    o << "\"variant_error\": \"" << msg << "\"";
  }
  o << "}}";
  return o.str();
}

}  // namespace bandpo
