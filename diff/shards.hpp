// Checkpoints merged from a tensor-parallel engine's rank dumps (dump/shards.hpp): the ranks holding one slice
// must agree, and a failing checkpoint names the ranks whose slice is wrong.
//
// Decisions:
// - Ranks holding the same slice (a replicated checkpoint: every rank; KV heads copied where n_head_kv < world_size)
//   must hold the same bits: an all-reduce gives every rank the same sum. Copies that disagree fail the checkpoint
//   (check "replicas"), whatever the reference says.
// - A failing checkpoint is judged rank by rank: each rank's own piece (its slice, or its copy of a replicated
//   checkpoint) against the same slice of the reference, by the checkpoint's own rule and bound scale. The merged
//   tensor presents one copy of a slice several ranks hold, so it cannot tell which copy is wrong.
// - Of copies that disagree, the ranks whose piece fails alone are blamed; where none fails alone (copies that
//   differ within the bounds), each rank of the slice is, as no rank's copy is more right than another's.
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

// `r` compared the merged checkpoint `engine` (engine.shards not empty) of `reader` with the reference's values `b`
// (as compared: the rows from r.row_offset). Checks the copies of each slice, and where `r` fails sets r.ranks.
void judge_ranks(CheckpointResult& r, const DatasetInfo& engine, const DumpReader& reader, std::span<const float> b,
                 const ToleranceSet& tolerances, const DimSizes& dims);

// "rank 1 (H 2..3)", "ranks 0, 2 (Hkv 0..0)": the blamed ranks and their slices, for reports; "" when none.
std::string blamed_ranks_text(const RankBlame& blame);

}  // namespace diffrun::diff
