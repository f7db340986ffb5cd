// One checkpoint's comparison result, shared by the comparator, the verdict and the reports.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "diff/metrics.hpp"
#include "diff/tolerances.hpp"

namespace diffrun::diff {

enum class CheckpointStatus { pass, fail, shape_mismatch, only_engine, only_reference };
const char* checkpoint_status_name(CheckpointStatus s);

// A checkpoint's fit to f16 storage: every engine value representable in f16, and the largest
// |a - b| in halves of the f16 spacing at the reference value (<= 1: what rounding the reference to
// f16 gives). The verdict's rule f16_storage reads it.
struct F16Fit {
  bool engine_exact = false;
  double max_half_ulps = 0.0;
};

// Isolation replay: the same checkpoint compared when the engine's op got the reference's inputs.
struct LocalError {
  CheckpointStatus status = CheckpointStatus::pass;  // against the same tolerance rule
  double rel_l2 = 0.0;                               // NaN when not compared (a shape mismatch)
  std::optional<F16Fit> f16_fit;                     // the isolated result's, when it failed
  bool failed() const { return status == CheckpointStatus::fail || status == CheckpointStatus::shape_mismatch; }
};

// A checkpoint merged from rank dumps (dump/shards.hpp): each rank's share of a failure (diff/shards.hpp).
struct RankShare {
  int rank = 0;
  std::string path;                // the rank's dump
  int64_t from = 0, to = 0;        // the slice it holds along RankBlame::split, [from, to); 0, 0: the whole
  double rel_l2 = 0.0;             // its slice against the reference's same slice; NaN where not measured
  bool failed = false;             // its slice fails the checkpoint's bounds
  bool copy_differs = false;       // the copies of its slice disagree and its copy is to blame (it fails alone,
                                   // or no copy does)
};
struct RankBlame {
  std::string split;  // the layout letter the ranks split along; "" replicated
  bool partial = false;
  std::vector<RankShare> ranks;
  std::vector<int> blamed;  // the ranks whose slice fails (or whose copy differs), in rank order
  std::string note;         // what cannot be told from this checkpoint (partial sums)
};

// What the routing verdict (diff/routing.hpp) reads of an MoE checkpoint, kept when it is compared so
// that no values need be held: ffn_moe_topk's ids on both sides ([T, K], -1 where a value is not a
// whole number), ffn_moe_logits' reference values ([T, E]) and the router error bound per token, and for
// every kind laid out per slot ([T, K, ...]: ffn_moe_topk, the weights, gate, up, swiglu, down) the
// sums of (a - b)^2 and b^2 and the largest |a - b| of each (token, slot), so that the slots of a
// routing flip can be left out of its comparison.
struct RoutingRows {
  int64_t rows = 0, width = 0;
  std::vector<int32_t> ids_engine, ids_reference;
  std::vector<float> logits_reference;
  std::vector<double> error;
  std::vector<double> slot_err2, slot_ref2, slot_max_abs;  // [T, K]
};

struct CheckpointResult {
  int step = 0;
  std::string name;  // "Qcur-3"
  std::string base;  // "Qcur"
  int layer = -1;
  int order = 0;
  std::string layout;
  std::vector<int64_t> shape_engine, shape_reference;
  int64_t row_offset = 0;  // first row compared along the row dimension (a side holding its last rows only)
  int64_t positions = 0;   // the KV length after the step (its tokens and every earlier step's)
  std::string native_engine, native_reference;  // each side's native dtype ("f16", "f32", ...; "" unknown)
  CheckpointStatus status = CheckpointStatus::pass;
  std::optional<TensorMetrics> metrics;  // absent unless both sides exist with the same shape
  std::vector<BoundCheck> checks;
  std::string rule_match;  // the pattern of the rule applied ("" for the default rule)
  std::string rule_reason;
  // The rel L2 bounds' scaling at this step: long context (ToleranceSet::length_scale) times long reduction
  // (ToleranceSet::reduction_scale).
  double bound_scale = 1.0;
  std::optional<LocalError> local;  // set by add_isolation when the isolated run recorded it
  // A failing checkpoint whose layout has dims of equal size, read with two of them swapped, matching
  // the reference far better (rel_l2 under a tenth of the as-stored one): the dims it looks like
  // ("T,H,S") and that reading's rel_l2. Empty when none does (compare_checkpoint).
  std::string layout_suspect;
  double layout_suspect_rel_l2 = 0.0;
  std::optional<F16Fit> f16_fit;  // failing and finite only (compare_checkpoint)
  std::optional<RankBlame> ranks;  // a failing checkpoint merged from rank dumps (diff/shards.hpp)
  std::optional<RoutingRows> routing;  // ffn_moe_logits and the per-slot kinds, when compared and finite
  // Slots left out of the comparison as those of a routing flip by drift (excuse_routing_flip): the
  // metrics and checks are then over the other slots.
  int64_t routing_excused = 0;

  bool failed() const { return status == CheckpointStatus::fail || status == CheckpointStatus::shape_mismatch; }
  bool compared() const { return metrics.has_value(); }
};

}  // namespace diffrun::diff
