// The Megatron tensor-parallel layout as data (docs/dump-format.md, "Shards"): which slice of the model each of N
// ranks holds, and what each checkpoint of a rank is (split along a layout letter, partial sums, or replicated).
// The CUDA engine's --tp N reads it to cut its weights and record its rank dumps; the examples' Python engine
// writes the same table (examples/tp_numpy_engine).
//
// Decisions:
// - Column parallel: Wq|bq by query head, Wk|Wv|bk|bv by KV head, Wgate|Wup by channel. Row parallel: Wo and
//   Wdown on their input (the same head and channel slices), each followed by an all-reduce (sum). Where
//   Hkv < N, rank r holds KV head r·Hkv/N (floored), copied on N/Hkv ranks.
// - Embedding, norms and the lm head are replicated (every rank holds them whole, and computes the whole
//   logits): the lm head is one matrix of D·V, small next to the layers at the sizes TP is for, and a replicated
//   head needs no gather before the argmax.
// - Heads split evenly (H and Hkv multiples of N, or N a multiple of Hkv): attention needs whole heads and the
//   same GQA group on every rank. F splits in units of `f_unit` channels (the down projection's quantization
//   block, so that its rows cut on block boundaries), as evenly as the units allow: F = 11008 = 43·256 gives
//   5376 and 5632 at N = 2.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace diffrun {

// What one rank holds: query heads [h0, h1), KV heads [kv0, kv1), FFN channels [f0, f1).
struct TpSlice {
  int rank = 0, world = 1;
  int h0 = 0, h1 = 0, kv0 = 0, kv1 = 0;
  int64_t f0 = 0, f1 = 0;
};

// Why `cfg` cannot be split over `world` ranks with FFN units of f_unit channels, or "" when it can.
std::string tp_refusal(const ModelConfig& cfg, int world, int64_t f_unit);
// Rank `rank`'s slice (tp_refusal must have returned "").
TpSlice tp_slice(const ModelConfig& cfg, int rank, int world, int64_t f_unit);
// The config one rank's forward reads: cfg with H, Hkv and F the slice's.
ModelConfig tp_local_config(const ModelConfig& cfg, const TpSlice& s);

// How a rank's checkpoint relates to the whole: split along layout letter `split` from `offset` (extent along
// it), partial sums awaiting the all-reduce, or neither (replicated).
struct ShardSpec {
  std::string split;
  int64_t offset = 0, extent = 0;
  bool partial = false;
};
// The checkpoint `name` (vocabulary name, "-L" suffix or not) of rank s in the Megatron layout: attn_out and
// ffn_out partial (recorded before their all-reduce); a layout with H, Hkv or F split along it; else replicated.
ShardSpec megatron_shard(std::string_view name, const TpSlice& s);

// The merge of one checkpoint's rank pieces (docs/dump-format.md, "Shards"), the one rule of every place that
// merges them (dump/shards.cpp for rank dumps, the TP engine for its merged recording):
// - place_shard: a rank's piece (its slice along dimension `dim` of the whole shape, from `offset`; every other
//   dimension whole) copied into `whole`. Copies of one slice on several ranks: the caller places the lowest
//   rank's last.
// - add_partials: the ranks' partial sums added in float64 in rank order, rounded to float32 once.
void place_shard(std::span<float> whole, std::span<const int64_t> whole_shape, int dim, int64_t offset,
                 std::span<const float> piece);
// place_shard's inverse: elements [from, to) of dimension `dim` of a row-major tensor of `shape` (every other
// dimension whole). Also how a rank's slice of a merged checkpoint is cut out (diff/shards.cpp) and a step's token
// row and cache positions out of a pass of several (StepBatch).
std::vector<float> take_slice(std::span<const float> v, std::span<const int64_t> shape, int dim, int64_t from,
                              int64_t to);
std::vector<float> add_partials(const std::vector<std::span<const float>>& ranks);

}  // namespace diffrun
