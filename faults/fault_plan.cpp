// The fault plan: each injected fault turned into a config edit, a weight edit, an op argument, a production-path
// fault or a control-flow hook, once per backend.
#include "faults/fault_plan.hpp"

#include <cmath>
#include <limits>

namespace diffrun {

FaultPlan plan_faults(const FaultSet& faults, const ModelConfig& cfg) {
  auto has = [&](Fault f) { return faults.has(f); };
  FaultPlan p;

  // Config edits: what the forward reads of the model.
  ModelConfig& c = p.config;
  c = cfg;
  if (has(Fault::rope_local_theta_global)) c.rope_theta_swa = c.rope_theta;  // local layers on the global base
  if (has(Fault::rope_theta_10000)) c.rope_theta = c.rope_theta_swa = kFaultRopeTheta;  // every layer
  if (has(Fault::rope_pairing_swapped))
    c.rope_type = c.rope_type == RopeType::neox ? RopeType::norm : RopeType::neox;
  if (has(Fault::rms_eps_1e5)) c.rms_eps = kFaultRmsEps;
  if (has(Fault::attn_scale_missing)) c.attn_scale = 1.0;  // scores q·k unscaled
  // Local layers keep their RoPE base (layer_is_swa) and see every earlier position: a window wider than any
  // context (each attention op takes the keys from max(0, n - window), 0 for this one, as for window 0).
  if (has(Fault::sliding_window_ignored)) c.sliding_window = std::numeric_limits<int>::max();

  // Weight edits.
  WeightEdits& w = p.weights;
  w.dequant_scale_offset = has(Fault::dequant_scale_offset);
  w.embd_transposed = has(Fault::embd_transposed);
  w.qkv_bias_missing = has(Fault::qkv_bias_missing);
  w.attn_out_transposed = has(Fault::attn_out_transposed);
  w.ffn_down_transposed = has(Fault::ffn_down_transposed);
  w.weight_row_nan = has(Fault::weight_row_nan);
  w.rms_norm_weight_twice = has(Fault::rms_norm_weight_twice);
  w.expert_gate_up_swapped = has(Fault::moe_expert_gate_up_swapped);

  // Op arguments.
  OpArgs& o = p.ops;
  o.norm.off_by_one = has(Fault::rms_norm_off_by_one);
  o.norm.eps_outside_sqrt = has(Fault::rms_eps_outside_sqrt);
  o.first_norm = o.norm;
  o.attn_post_norm = o.norm;
  o.attn_post_norm.skipped = has(Fault::post_norm_skipped);
  o.attention.causal = !has(Fault::causal_mask_missing);
  o.attention.f16_exp = has(Fault::softmax_f16_overflow);
  o.gqa_head_modulo = has(Fault::gqa_head_modulo);
  o.rope_cache_unrotated = has(Fault::rope_cache_unrotated);
  o.act_swapped = has(Fault::swiglu_gate_up_swapped);
  o.embd_scale = has(Fault::embd_scale_missing) ? 1.0 : std::sqrt(static_cast<double>(cfg.n_embd));
  o.logit_columns = has(Fault::lm_head_padded_vocab) ? fault_padded_vocab(cfg.n_vocab) : cfg.n_vocab;
  o.argmax_ties = has(Fault::argmax_ties_highest) ? ArgmaxTies::highest : ArgmaxTies::lowest;
  o.moe_routing.softmax_over_topk = has(Fault::moe_softmax_over_topk);
  o.moe_routing.not_renormalised = has(Fault::moe_weights_not_renormalised);
  o.moe_routing.id_off_by_one = has(Fault::moe_expert_id_off_by_one);
  o.shexp_gate_skipped = has(Fault::moe_shared_expert_gate_skipped);

  // The production path, and its twin on the reference's one-token steps.
  FusedPathFaults& f = p.fused;
  f.gate_up_swapped = has(Fault::swiglu_fused_gate_up_swapped);
  f.rope_position_offset = has(Fault::rope_fused_position_off) ? 1 : 0;
  f.embd_norm_unweighted = has(Fault::embd_norm_fused_no_weight);
  f.graph_position_frozen = has(Fault::graph_position_frozen);
  p.one_token = o;
  p.one_token.act_swapped = o.act_swapped || f.gate_up_swapped;
  p.one_token.rope_position_offset = f.rope_position_offset;
  p.one_token.first_norm.unweighted = f.embd_norm_unweighted;

  // Control flow.
  p.hooks.kv_cache_pos0 = has(Fault::kv_cache_pos0);
  p.hooks.kv_cache_not_read = has(Fault::kv_cache_not_read);
  p.hooks.residual_skipped = has(Fault::residual_skipped);
  return p;
}

}  // namespace diffrun
