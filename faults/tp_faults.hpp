// The tensor-parallel fault catalog: bugs of a TP engine's sharding and communication, injected into diffrun's own
// (--tp N --inject tp_...), each found by `compare` of the rank dumps at its checkpoint and step with its rank
// named. They live beside the one-GPU catalog (faults/faults.hpp), not in it: the CPU reference has no ranks, and
// the one-GPU engine none of these code paths.
//
// Each is resolved by the tensor-parallel engine (engine/tp_engine.cu) into what one rank, or every rank, does:
// its weights cut from another slice, an all-reduce skipped or run twice, or a one-GPU fault of the catalog on the
// last rank alone (its positions, its cache rows).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace diffrun {

enum class TpFault {
  wq_shard_offset,         // the last rank's Wq|bq rows are rank 0's heads (the wrong shard offset)
  attn_allreduce_skipped,  // no all-reduce after the attention output projection: each rank adds its partial sum
  ffn_allreduce_twice,     // the all-reduce after the FFN's down projection runs twice (N times the sum)
  kv_head_wrong_rank,      // Hkv < N: the last rank loads the next KV head's Wk|Wv rows (the wrong group)
  rope_position_offset,    // the last rank's fused decode RoPE rotates at n_past + 1 (rope_fused_position_off)
  stale_kv_row,            // the last rank writes its decode K/V rows at row 0 and reads row n_past stale
};

struct TpFaultInfo {
  TpFault fault;
  const char* name;         // "tp_attn_allreduce_skipped"
  const char* first_shows;  // the checkpoint (layer 0) where compare first finds it
  int step;                 // the step where it first shows
  const char* ranks;        // the ranks compare names
  const char* what;
};

const std::vector<TpFaultInfo>& tp_fault_catalog();
const TpFaultInfo& tp_fault_info(TpFault f);
// The catalog entry named `name`, or none.
std::optional<TpFault> find_tp_fault(std::string_view name);
// Why fault f does not apply to `cfg` at `world` ranks ("" when it does).
std::string tp_fault_refusal(TpFault f, const ModelConfig& cfg, int world);

// An --inject list split into the tensor-parallel faults (names starting "tp_", each checked against the catalog:
// InputError naming an unknown one) and the rest, returned as they were ("a,b").
std::vector<TpFault> take_tp_faults(const std::string& inject, std::string* rest);

}  // namespace diffrun
