// Tolerance rules as data: a JSON file of name-pattern rules with metric bounds, and the presets.
//
// File format:
//   {
//     "preset": "f32_vs_f64",                 // optional name
//     "description": "one paragraph",         // optional
//     "rules": [                              // first rule whose pattern matches a checkpoint wins
//       {"match": "kq_soft_max-*", "max_rel_l2": 1e-5, "atol": 1e-7, "rtol": 1e-4,
//        "max_fail_frac": 0.001, "reason": "one line: why this bound"}
//     ],
//     "default": {"max_rel_l2": 1e-5, "reason": "..."}   // required; used when no rule matches
//   }
// Keys of a rule: match (glob with * and ?, over full names such as "Qcur-3"; not in "default"),
// reason, atol, rtol (element tolerance for fail_frac, worst element and min_rtol),
// rel_l2_per_position (the rel L2 bounds grow by it times the step's KV length), and the bounds
// max_abs, max_mean_abs, max_rel_l2, max_nmse, min_cosine, min_sqnr_db, max_fail_frac,
// max_row_rel_l2 (the worst token row's rel L2, or the worst cache row's for cache_k/cache_v),
// max_head_rel_l2 (the worst head's, for per-head layouts; ignored where there are no heads), and
// for logits (result_output) min_top1, min_top5, max_kl (KL(ref||engine), largest over tokens).
// A bug confined to one row or head hides in the tensor-wide rel L2 (diluted by the other rows);
// the row and head bounds catch it.
// Every rule (the default too) needs at least one bound. Any other key, a duplicate key, a bad
// pattern, a bad number or nesting deeper than 32 levels is an InputError naming the file and line.
// load_tolerances reads only a regular file of at most 16 MiB (a FIFO or a device is refused unopened).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "diff/metrics.hpp"

namespace diffrun::diff {

struct ToleranceRule {
  std::string match;  // empty for the default rule
  std::string reason;
  ElementTolerance element;
  std::optional<double> max_abs, max_mean_abs, max_rel_l2, max_nmse, min_cosine, min_sqnr_db,
      max_fail_frac, max_row_rel_l2, max_head_rel_l2, min_top1, min_top5, max_kl;
  // Not a bound: max_rel_l2, max_row_rel_l2 and max_head_rel_l2 grow by this times the positions
  // the step reaches (its KV length), for errors that grow with the position (f32 RoPE angles).
  std::optional<double> rel_l2_per_position;
  int line = 0;  // where the rule starts in its file
};

// One bound checked against one metric.
struct BoundCheck {
  std::string metric;  // "rel_l2"
  std::string bound;   // "max_rel_l2"
  double value;
  double limit;
  bool pass;
};

struct ToleranceSet {
  std::string source;  // file path, or "preset:<name>"
  std::string preset;
  std::string description;
  std::vector<ToleranceRule> rules;
  ToleranceRule default_rule;
  // The longest context (KV length) the bounds were calibrated on. Beyond it every rel L2 bound
  // (max_rel_l2, max_row_rel_l2, max_head_rel_l2) is scaled by sqrt(positions / calibrated_positions)
  // and max_kl by its square: rounding in sums over the context grows like the square root of its
  // length, and the worst of more rows is larger. Absent: no scaling.
  std::optional<int64_t> calibrated_positions;
  // The reduction lengths the bounds were calibrated at (key "calibrated_reduction": {"n_embd", "n_ff",
  // "attn_width", "exponent"}). A matmul output's rel L2 bounds are scaled by (K / K_cal)^exponent where its
  // reduction K is longer: Qcur, Kcur, Vcur, ffn_gate, ffn_up and result_output reduce over n_embd, attn_out
  // over n_head·head_dim (attn_width), ffn_out over n_ff. Accumulation-order error grows with the length
  // summed; a bound taken on a 576-wide model would call a clean 4,096-wide one's GEMMs local.
  struct Reduction {
    int64_t n_embd = 0, n_ff = 0, attn_width = 0;
    double exponent = 1.0;
  };
  std::optional<Reduction> calibrated_reduction;

  const ToleranceRule& rule_for(std::string_view checkpoint) const;
  // The factor the rel L2 bounds are scaled by at a step reaching `positions` (1 within calibration).
  double length_scale(int64_t positions) const;
  // The factor the rel L2 bounds of checkpoint kind `base` are scaled by on a model of these dimension sizes
  // (D, F, H, Dh; 1 within calibration, and for kinds that are not a matmul's output).
  double reduction_scale(std::string_view base, const DimSizes& dims) const;
};

// Throws InputError "<source>:<line>: ..." for anything wrong in the text.
ToleranceSet parse_tolerances(std::string_view text, const std::string& source);
// Throws InputError naming the file when it cannot be read.
ToleranceSet load_tolerances(const std::string& path);

// Committed presets (fixtures/tolerances/<name>.json, embedded at build time).
std::vector<std::string> preset_names();
ToleranceSet preset_tolerances(std::string_view name);  // throws InputError listing the presets
// "f32_vs_f64" for engine f32 and reference f64.
std::string preset_name(std::string_view engine_precision, std::string_view reference_precision);

// Every bound of `rule` against `m`. A NaN or Inf on either side (the same on both included) gives
// one failing "nonfinite" check (value: the number of non-finite elements on both sides) and nothing
// else: the metrics are undefined there. `positions`: the KV length after the step (the rel L2
// bounds grow by rule.rel_l2_per_position times it). `length_scale` (ToleranceSet::length_scale)
// multiplies the grown rel L2 bounds, and max_kl by its square.
std::vector<BoundCheck> check_bounds(const TensorMetrics& m, const ToleranceRule& rule, int64_t positions = 0,
                                     double length_scale = 1.0);

}  // namespace diffrun::diff
