// Checkpoints merged from a tensor-parallel engine's rank dumps (dump/shards.hpp): the ranks holding one slice
// must agree, and a failing checkpoint names the ranks whose slice is wrong.
//
// Decisions:
// - Ranks holding the same slice (a replicated checkpoint: every rank; KV heads copied where n_head_kv < world_size)
//   must hold the same bits: an all-reduce gives every rank the same sum. A copy that differs fails the checkpoint
//   (check "replicas") and blames that rank, whatever the reference says.
// - A failing split checkpoint is judged rank by rank: each rank's slice of the merged tensor against the same slice
//   of the reference, by the checkpoint's own rule and bound scale. A replicated one: each rank's copy.
// - Partial sums cannot be told apart by rank from the sum alone (any split of the error into N parts adds up to it),
//   so the report says so and names no rank; the column-parallel input of the same layer (kqv_out for attn_out,
//   ffn_swiglu for ffn_out) shows which rank's inputs were wrong.
#pragma once

#include <span>

#include "diff/metrics.hpp"
#include "diff/result.hpp"
#include "diff/tolerances.hpp"
#include "dump/dump.hpp"

namespace diffrun::diff {

// `r` compared the merged checkpoint `engine` (engine.shards not empty) of `reader`: `a` its merged values, `b` the
// reference's, as compared. Checks the copies of each slice, and where `r` fails sets r.ranks.
void judge_ranks(CheckpointResult& r, const DatasetInfo& engine, const DumpReader& reader, std::span<const float> a,
                 std::span<const float> b, const ToleranceSet& tolerances, const DimSizes& dims);

// "rank 1 (H 2..3)", "ranks 0, 2 (Hkv 0..0)": the blamed ranks and their slices, for reports; "" when none.
std::string blamed_ranks_text(const RankBlame& blame);

}  // namespace diffrun::diff
