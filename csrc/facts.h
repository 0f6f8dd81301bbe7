// The facts of the compiled library that Python must agree with, as one JSON object: the one way C++ facts
// reach Python (bandpo_lut._C.facts_json, read by bandpo_lut.runtime._extension.facts()). Keys:
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
//
// Built with string appends and std::to_chars only, never an iostream: this runs inside PyInit__C, and a GCC that
// links libstdc++ statically into _C.so (the GPU image's /opt/gcc) gives the library a second copy of
// the locale/iostream machinery whose first ostream write segfaulted at import. Numbers are written shortest
// round-trip (std::to_chars without a precision), so Python reads back the very double. tests/runtime/test_contract.py
// checks that this code references no iostream or locale symbol.
#pragma once

#include <charconv>
#include <string>
#include <system_error>

#include "build_info.h"
#include "cpu/cpu_variant.h"
#include "divergence.h"
#include "loss_element.h"
#include "table_grid.h"

namespace bandpo {
namespace detail {

// A number as JSON text: integers exactly, doubles shortest round-trip ("20", "0.2", "1e-05"). The buffer
// holds any int or double (at most 24 characters).
template <typename T>
void append_number(std::string& o, T x) {
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), x);
  o.append(buf, r.ec == std::errc() ? r.ptr : buf);
}

inline void append_quoted(std::string& o, const char* s) {
  o += '"';
  o += s;
  o += '"';
}

// {"name": id, ...} of every id that `name_of` names, in id order.
template <typename E>
void write_option_ids(std::string& o) {
  o += '{';
  for (int id = 0; name_of(static_cast<E>(id)) != nullptr; ++id) {
    if (id) o += ", ";
    append_quoted(o, name_of(static_cast<E>(id)));
    o += ": ";
    append_number(o, id);
  }
  o += '}';
}

}  // namespace detail

inline std::string facts_json() {
  using detail::append_number;
  using detail::append_quoted;
  std::string o;
  o += "{\"build\": ";
  o += bandpo_build_info_json();
  o += ", \"divergences\": {";
  for (int id = 0; id < kNumDivergences; ++id) {
    if (id) o += ", ";
    append_quoted(o, info_of(static_cast<Divergence>(id)).name);
    o += ": ";
    append_number(o, id);
  }
  o += "}, \"closed_form_divergences\": [";
  bool first = true;
  for (int id = 0; id < kNumDivergences; ++id) {
    const DivergenceInfo d = info_of(static_cast<Divergence>(id));
    if (!d.closed_form) continue;
    if (!first) o += ", ";
    append_quoted(o, d.name);
    first = false;
  }
  o += "], \"grid_fields\": [";
  for (int i = 0; i < kGridLen; ++i) {
    if (i) o += ", ";
    append_quoted(o, kGridFieldNames[i]);
  }
  o += "], \"loss\": {\"clip\": ";
  detail::write_option_ids<ClipKind>(o);
  o += ", \"mode\": ";
  detail::write_option_ids<LossMode>(o);
  o += ", \"agg\": ";
  detail::write_option_ids<AggKind>(o);
  o += ", \"n_counts\": ";
  append_number(o, static_cast<int>(kNumCounts));
  o += ", \"n_metrics\": ";
  append_number(o, static_cast<int>(kNumMetrics));
  o += ", \"log_ratio_clamp\": ";
  append_number(o, kLogRatioClamp);
  o += ", \"lowprob\": ";
  append_number(o, kLowProb);
  o += ", \"bucket_edges\": [";
  for (int k = 0; k < kNumBuckets; ++k) {
    if (k) o += ", ";
    append_number(o, bucket_edge(k));
  }
  o += "], \"fractions\": [";
  for (int f = 0; f < kNumFractions; ++f) {
    const FractionDef d = fraction_def(f);
    if (f) o += ", ";
    o += '[';
    append_number(o, d.num);
    o += ", ";
    append_number(o, d.den);
    o += ']';
  }
  o += "]}, \"cpu\": {\"isa\": ";
  append_quoted(o, cpu_variant_name(cpu_variant_supported()));
  o += ", ";
  const CpuVariantChoice& choice = cpu_variant_choice();  // the kernels' choice, made here at import
  if (choice.variant >= 0) {
    o += "\"variant\": ";
    append_quoted(o, cpu_variant_name(static_cast<CpuVariant>(choice.variant)));
  } else {
    std::string msg = choice.error;
    for (char& ch : msg)
      if (ch == '"' || ch == '\\' || ch == '\n') ch = ' ';
    o += "\"variant_error\": ";
    append_quoted(o, msg.c_str());
  }
  o += "}}";
  return o;
}

}  // namespace bandpo
