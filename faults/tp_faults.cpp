#include "faults/tp_faults.hpp"

#include "faults/faults.hpp"
#include "model/error.hpp"

namespace diffrun {

const std::vector<TpFaultInfo>& tp_fault_catalog() {
  static const std::vector<TpFaultInfo> catalog = {
      {TpFault::wq_shard_offset, "tp_wq_shard_offset", "Qcur-0", 0, "the last",
       "the last rank's Wq (and bq) rows cut at rank 0's shard offset: it computes rank 0's query heads as its own"},
      {TpFault::attn_allreduce_skipped, "tp_attn_allreduce_skipped", "ffn_inp-0", 0, "every",
       "no all-reduce after the attention output projection: each rank adds its own partial sum to the residual "
       "(gemma3: attn_post_norm-0 first)"},
      {TpFault::ffn_allreduce_twice, "tp_ffn_allreduce_twice", "l_out-0", 0, "every",
       "the all-reduce after the FFN's down projection runs twice: the residual gets N times the FFN output "
       "(not gemma3, whose post-FFN norm undoes the scale)"},
      {TpFault::kv_head_wrong_rank, "tp_kv_head_wrong_rank", "Kcur-0", 0, "the last",
       "where KV heads are copied (Hkv < N), the last rank loads the next KV head's Wk|Wv rows: its query heads "
       "attend with another group's keys and values"},
      {TpFault::rope_position_offset, "tp_rope_position_offset", "Qrope-0", 1, "the last",
       "the last rank's decode steps rotate q and k at n_past + 1 (the catalog's rope_fused_position_off on that "
       "rank alone); models with q/k norms run no fused RoPE, so it does not apply there"},
      {TpFault::stale_kv_row, "tp_stale_kv_row", "cache_k-0", 1, "the last",
       "the last rank writes its decode K/V rows at cache row 0 (the catalog's kv_cache_pos0 on that rank alone): "
       "its attention reads row n_past, never written"},
  };
  return catalog;
}

const TpFaultInfo& tp_fault_info(TpFault f) {
  for (const TpFaultInfo& i : tp_fault_catalog())
    if (i.fault == f) return i;
  throw Error("tp_fault_info: a fault outside the catalog");
}

std::optional<TpFault> find_tp_fault(std::string_view name) {
  for (const TpFaultInfo& i : tp_fault_catalog())
    if (name == i.name) return i.fault;
  return std::nullopt;
}

std::string tp_fault_refusal(TpFault f, const ModelConfig& cfg, int world) {
  if (world < 2) return "it needs --tp 2 or more";
  switch (f) {
    case TpFault::ffn_allreduce_twice:
      if (cfg.post_norms) return "the model's post-FFN norm undoes the scale (gemma3)";
      return "";
    case TpFault::kv_head_wrong_rank:
      if (cfg.n_head_kv >= world || cfg.n_head_kv < 2)
        return "it needs KV heads copied onto ranks and another head to take (2 <= Hkv < N); the model has " +
               std::to_string(cfg.n_head_kv) + " at --tp " + std::to_string(world);
      return "";
    case TpFault::rope_position_offset:
      if (cfg.qk_norm) return "models with q/k norms run no fused RoPE (qwen3, gemma3)";
      return "";
    default:
      return "";
  }
}

std::vector<TpFault> take_tp_faults(const std::string& inject, std::string* rest) {
  std::vector<TpFault> out;
  rest->clear();
  for (const std::string& name : fault_list(inject)) {
    if (name.rfind("tp_", 0) == 0) {
      const std::optional<TpFault> f = find_tp_fault(name);
      if (!f) {
        std::string names;
        for (const TpFaultInfo& i : tp_fault_catalog()) names += std::string(names.empty() ? "" : ", ") + i.name;
        throw InputError("--inject: unknown tensor-parallel fault '" + name + "' (the catalog: " + names + ")");
      }
      out.push_back(*f);
    } else {
      *rest += (rest->empty() ? "" : ",") + name;
    }
  }
  return out;
}

}  // namespace diffrun
