// The verdict on the first divergence: a local bug (the error jumps at this op) or accumulated drift.
//
// Each checkpoint kind has dataflow inputs (its operands' checkpoints, as the checkpoint vocabulary
// names them: CheckpointKind::inputs, see dataflow_inputs); diff/ knows no architecture. The
// rules run in order and the first that decides wins; the report prints the rule and its numbers:
//   shape         shapes differ                                         -> local
//   replicas      ranks holding copies of one slice (rank dumps) disagree -> local (diff/shards.hpp)
//   layout        an equal-sized pair of the layout's dims read swapped matches the reference far
//                 better (CheckpointResult::layout_suspect)                -> undetermined: label it
//   f16_storage   every engine value is an f16 value and |a - b| <= half an f16 spacing of the
//                 reference value everywhere (on the replay's values where isolation ran; 1/8 more
//                 where inputs carry error), the reference not storing it in f16 -> drift (precision)
//   isolation     (isolation replay ran) this op on the reference's inputs fails its tolerance
//                 -> local; passes it -> drift (the error came in through its inputs)
//   nonfinite     non-finite values appear here, inputs are finite      -> local
//   routing       ffn_moe_topk chose other experts (diff/routing.hpp): a flip across a gap of the
//                 reference's router logits larger than twice the router error -> local; every flip
//                 within it -> drift (routing flip, rule routing_flip); a flip whose router logits
//                 were not compared -> undetermined
//   (after embedding)
//   routing_flip  downstream of a drift flip (an earlier step's, or this step's before this checkpoint)
//                 -> drift (routing flip): the other experts' output carries on, not a bug here
//   storage       the engine stores this tensor narrower than the reference (native dtype f16 or
//                 bf16 against f32/f64) and rel_l2 <= u + jump_factor x its inputs' max, u the
//                 unit roundoff of that storage (f16 2^-11, bf16 2^-8): what rounding the stored
//                 tensor once explains -> drift (precision)
//   embedding     embd reads identical token ids, it has no float input -> local
//   jump          rel_l2 > jump_factor x max rel_l2 of its inputs       -> local; but when a direct
//                 dataflow input was not recorded (unrecorded_inputs), the error may come from that
//                 unrecorded op as well -> undetermined ("local or upstream", rule unrecorded_input)
//   smooth_growth the same kind's rel_l2 rose over the layers before it, never by more than
//                 jump_factor from one layer to the next                -> drift
//   no_jump       rel_l2 <= jump_factor x its inputs' (no growth series) -> drift
//   otherwise     no input recorded                                     -> undetermined
// Only isolation (its replay replaced every input: add_isolation), shape, storage and embedding
// decide without the inputs; nonfinite's "local" then names the unrecorded inputs (the first NaN/Inf
// of the recorded stretch).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "diff/result.hpp"
#include "diff/routing.hpp"

namespace diffrun::diff {

enum class VerdictKind { none, local, drift, undetermined };
const char* verdict_kind_name(VerdictKind k);

struct VerdictInput {
  std::string name;
  double rel_l2;
};

struct LayerError {
  int layer;
  double rel_l2;
};

struct Verdict {
  VerdictKind kind = VerdictKind::none;
  std::string rule;         // "jump", "smooth_growth", ...; empty for none
  std::string explanation;  // one line with the numbers
  std::vector<VerdictInput> inputs;  // the failing checkpoint's inputs, as compared in its step
  double ratio = 0.0;                // rel_l2 / max input rel_l2 (inf when the inputs are exact)
  std::vector<LayerError> growth;    // the same kind's rel_l2 by layer up to the failing one
  bool precision = false;            // drift explained by the engine's declared storage precision (rule storage)
  bool routing_flip = false;         // drift: other experts chosen across a margin within the router's error
  std::vector<RoutingFlip> flips;    // rule routing/routing_flip: the failing layer's flipped tokens
  // Direct dataflow inputs of the op (the vocabulary's, a kind no op reads back standing for its own)
  // that the step does not hold compared: "cache_k-0 or Krope-0" for an operand with alternatives.
  std::vector<std::string> unrecorded_inputs;
};

// Names of the checkpoints a checkpoint is computed from, for a model of n_layer layers: the
// vocabulary's checkpoint_inputs, where an input that was not recorded is replaced by its own inputs.
// `recorded` says whether a name exists in the step (to choose Qnorm over Qcur, cache_k over
// Krope). embd (from token ids) has none.
std::vector<std::string> dataflow_inputs(std::string_view base, int layer, int n_layer,
                                         const std::function<bool(const std::string&)>& recorded);

// The direct dataflow inputs of checkpoint `base` at `layer` that `recorded` says were not recorded,
// each named with its alternatives ("cache_k-0 or Krope-0"); a kind no later op reads back
// (kq_soft_max, CheckpointKind::read_back) stands for its own inputs.
std::vector<std::string> unrecorded_inputs(std::string_view base, int layer, int n_layer,
                                           const std::function<bool(const std::string&)>& recorded);

// `results` as produced by the comparator; `failing` indexes the first failing one.
Verdict decide_verdict(const std::vector<CheckpointResult>& results, size_t failing, int n_layer,
                       double jump_factor);

}  // namespace diffrun::diff
