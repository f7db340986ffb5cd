// The routing verdict of a mixture of experts: where the two sides chose other experts, and whether the
// router's error explains it.
//
// Decisions:
// - A (token, layer) is flipped when its ffn_moe_topk rows differ as sets of expert ids; one whose sets
//   are equal but ordered otherwise is reordered (its slots, and every [T, K, ...] checkpoint, are
//   permuted). Both are judged alike.
// - The margin is the reference's K-th minus (K+1)-th router logit (ffn_moe_logits) at that token: how
//   close the choice was. The gap is what the engine's choice had to cross: the largest reference
//   logit difference l_i - l_j over the pairs the two sides rank in opposite order (i above j on the
//   reference, j above i on the engine; outside the top K counts as one rank below it). A swap of the
//   K-th and (K+1)-th expert crosses the margin itself; a choice further down crosses more.
// - The router error at a token is the larger of the engine's observed error there (the largest
//   |a - b| over its logits row) and the largest element error the tolerance rule of ffn_moe_logits
//   admits on that row (its max_abs, else its row or tensor rel L2 bound times the row's norm, as
//   scaled for the step): the size the preset declares for this pair's precision error. An ordering
//   of two experts changes when their logits' difference moves by more than the gap, which two
//   element errors of size e do when |gap| <= 2e: such a flip is drift ("drift (routing flip)"). A flip
//   with a larger gap is local: the selection, not the logits (an expert id off by one, a softmax over
//   the wrong set). So is one whose gap is below -2e: the reference's own logits order the pair the
//   engine's way, so its choice contradicts its router (a flawed reference), which no drift explains.
//   Where the engine's logits were not compared, the flip is undetermined.
// - Wrong routing weights with the same experts are no flip: ffn_moe_weights fails on its own and the
//   ordinary rules call it local.
// - A flip by drift is no failure (excuse_routing_flip): the slots of the other experts are left out of
//   the per-slot checkpoints, and a failure downstream gets the verdict drift (routing flip). The report
//   lists every flip first (the terminal's ROUTING block, the JSON's "routing").
// - The evidence is kept by compare_checkpoint (RoutingRows on the results of ffn_moe_topk and
//   ffn_moe_logits), so the streaming comparison and compare_dumps judge alike with no values kept.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "diff/result.hpp"

namespace diffrun::diff {

enum class FlipKind { drift, local, undetermined };
const char* flip_kind_name(FlipKind k);

// One (token, layer) whose selected experts differ.
struct RoutingFlip {
  int step = 0;
  int layer = -1;
  int64_t token = 0;                      // the row of the step's ffn_moe_topk
  std::vector<int32_t> reference, engine; // the K ids, most probable first
  int overlap = 0;                        // |reference ∩ engine|
  bool reordered = false;                 // the same set in another order
  double margin = std::nan("");           // reference's K-th minus (K+1)-th logit (NaN: logits not compared)
  double gap = std::nan("");              // the largest reference logit difference the engine crossed
  double router_error = std::nan("");     // the router error bound at this token
  FlipKind kind = FlipKind::undetermined;
};

// The routing of one (step, layer): its tokens and those that flipped.
struct RoutingLayer {
  int step = 0;
  int layer = -1;
  int64_t tokens = 0;
  int64_t k = 0;
  int64_t overlap_sum = 0;  // sum over tokens of |reference ∩ engine|
  std::vector<RoutingFlip> flips;
};

// Over every compared ffn_moe_topk of a comparison.
struct RoutingSummary {
  std::vector<RoutingLayer> layers;  // step order, then layer order; only those compared
  int64_t token_layers = 0;          // (token, layer) pairs compared
  int64_t flipped = 0;    // another set of experts
  int64_t reordered = 0;  // the same set in another order
  int64_t drift = 0, local = 0, undetermined = 0;  // of the flipped and reordered
  // Drift flips the reference followed: the job ran the pair again with the reference taking the engine's
  // experts at these (step, layer, token)s (reference_cpu/reference.hpp ForcedRouting), so their ffn_moe_topk
  // rows now agree and what comes after them compares the same experts' outputs. From the job, with the first
  // run's evidence (margin, gap, router error); from a dump, the reference's fact routing_followed (the engine's
  // ids alone, the rest unknown).
  std::vector<RoutingFlip> followed;
  int64_t differing() const { return flipped + reordered; }
  double flip_rate() const { return token_layers ? static_cast<double>(flipped) / token_layers : 0.0; }
  double topk_overlap() const;       // mean |reference ∩ engine| / K over (token, layer)
  bool empty() const { return layers.empty() && followed.empty(); }
};

// The fact routing_followed of a reference ("step 0 layer 1 token 8: 1,0; step ...", as reference_cpu writes it) as
// flips of kind drift holding the engine's ids; nullopt when it does not read so.
std::optional<std::vector<RoutingFlip>> parse_routing_followed(std::string_view fact);

// The evidence compare_checkpoint keeps for kind `base` of layout `layout` (ffn_moe_logits [T, E], or a
// kind laid out per slot, [T, K, ...], ffn_moe_topk among them) from the values compared and the checks
// it made against its rule; nullopt for any other kind.
std::optional<RoutingRows> routing_rows(std::string_view base, std::string_view layout, std::span<const float> a,
                                        std::span<const float> b, std::span<const int64_t> shape,
                                        const std::vector<BoundCheck>& checks);

// A flip by drift is no failure. Where every token of a layer whose experts differ is a drift flip, a
// failing checkpoint of that layer laid out per slot ([T, K, ...]) is judged again over the slots whose
// expert is the same on both sides (a flipped token's other slots, and a reordered token's, are left
// out): its rel L2, row rel L2, NMSE and max |a - b| recomputed from RoutingRows, its rule's bounds
// checked again; it passes when they all do (routing_excused: the slots left out). Downstream of the
// slots (ffn_moe_out, l_out, later layers and steps) nothing is left out: the other experts' output is
// judged by the tolerance, and a failure there is called drift (routing flip) by the verdict. `find`
// gives a result of the same step by name (null when absent). Returns true when `r` was excused.
bool excuse_routing_flip(CheckpointResult& r, const std::function<const CheckpointResult*(const std::string&)>& find,
                         const ToleranceSet& tolerances);

// The routing of one ffn_moe_topk result, judged with the same step and layer's ffn_moe_logits result
// (null when not compared).
RoutingLayer analyse_routing(const CheckpointResult& topk, const CheckpointResult* logits);

// Every compared ffn_moe_topk of `results`.
RoutingSummary summarise_routing(const std::vector<CheckpointResult>& results);

}  // namespace diffrun::diff
