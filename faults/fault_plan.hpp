// The fault plan: the injected faults (faults/faults.hpp) resolved once, when a backend is constructed, into
// what each one changes, sorted by where it acts. Both backends build theirs with plan_faults, so both inject a
// fault the same way; their forward passes then read op after op, with no fault condition but a few control-flow
// hooks. D model width, H/Hkv heads, Dh head width, V real vocabulary, Vp padded vocabulary, Vt table rows.
//
// Where each fault lives:
// - config edits (FaultPlan::config, "the model said something else"): rope_theta_10000, rope_local_theta_global,
//   rms_eps_1e5, attn_scale_missing, sliding_window_ignored, rope_pairing_swapped;
// - weight edits (WeightEdits, made by each backend's constructor in one place: reference_cpu/faults/fault_weights,
//   engine/faults/fault_state): dequant_scale_offset (at load), embd_transposed, qkv_bias_missing,
//   attn_out_transposed, ffn_down_transposed, weight_row_nan, rms_norm_weight_twice, moe_expert_gate_up_swapped;
// - op arguments (OpArgs, the struct the forward passes to its ops): rms_norm_off_by_one, rms_eps_outside_sqrt,
//   post_norm_skipped (RmsNormFlaws), causal_mask_missing, softmax_f16_overflow (AttentionVariant),
//   gqa_head_modulo, rope_cache_unrotated, swiglu_gate_up_swapped, embd_scale_missing, lm_head_padded_vocab,
//   argmax_ties_highest, the MoE routing flaws (MoeRoutingFlaws), moe_shared_expert_gate_skipped;
// - the production path (FusedPathFaults): swiglu_fused_gate_up_swapped, rope_fused_position_off,
//   embd_norm_fused_no_weight, graph_position_frozen. The engine hands each to its fused kernel or captured graph
//   at construction (a weight, a position); the CPU reference, which has no fused kernels, takes them on its
//   one-token steps (FaultPlan::one_token, and its frozen RoPE position);
// - control flow (ControlFlow, one-line hooks in the forwards): kv_cache_pos0, kv_cache_not_read,
//   residual_skipped.
#pragma once

#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/op_variants.hpp"

namespace diffrun {

// The weights a backend edits at construction, before any step.
struct WeightEdits {
  bool dequant_scale_offset = false;   // legacy block formats decoded from dequant_fault_bytes (done at load)
  bool embd_transposed = false;        // token_embd [Vt, D] replaced by its memory read as [D, Vt] and transposed
                                       // (a wrong leading dimension); the lm head keeps the real table
  bool qkv_bias_missing = false;       // the q/k/v biases dropped
  bool attn_out_transposed = false;    // W_o replaced by its memory read with the wrong leading dimension
  bool ffn_down_transposed = false;    // W_down likewise
  bool weight_row_nan = false;         // row kFaultNanWeightRow of blk.0.attn_q.weight set to NaN
  bool rms_norm_weight_twice = false;  // every RMSNorm weight squared: norm(x)·w·w
  bool expert_gate_up_swapped = false; // expert kFaultSwappedExpert's ffn_gate_exps and ffn_up_exps swapped, every layer
};

// The arguments the forward passes to its ops; the defaults are production's.
struct OpArgs {
  RmsNormFlaws norm;            // every RMSNorm (rms_norm_off_by_one, rms_eps_outside_sqrt)
  RmsNormFlaws first_norm;      // layer 0's attn_norm, the one embedding_rms_norm fuses: norm's, and on the
                                // reference's one-token steps unweighted under embd_norm_fused_no_weight
  RmsNormFlaws attn_post_norm;  // gemma3's norm of the attention output: norm's, skipped under post_norm_skipped
  AttentionVariant attention;   // causal_mask_missing, softmax_f16_overflow
  bool gqa_head_modulo = false;       // attention reads the K/V cache expanded to H heads the wrong way round
  bool rope_cache_unrotated = false;  // the cache write stores K as it was before RoPE
  int rope_position_offset = 0;       // q and k rotate at n_past + this (the reference's rope_fused_position_off)
  bool act_swapped = false;           // the gated activation takes (up, gate): silu(up)·gate
  double embd_scale = 1;              // the factor of the embedding rows where the model scales them: sqrt(D),
                                      // or 1 under embd_scale_missing
  int logit_columns = 0;              // the logits' row width: V, or Vp under lm_head_padded_vocab (the lm
                                      // head writes V columns of each row, the rest hold stale bytes)
  ArgmaxTies argmax_ties = ArgmaxTies::lowest;  // argmax_ties_highest
  MoeRoutingFlaws moe_routing;        // moe_softmax_over_topk, moe_weights_not_renormalised, moe_expert_id_off_by_one
  bool shexp_gate_skipped = false;    // moe_shared_expert_gate_skipped: the shared expert's output not gated
};

// The production-path faults (fault_in_production_path_only): what the engine's fused one-token kernels and its
// captured decode graph get wrong.
struct FusedPathFaults {
  bool gate_up_swapped = false;       // swiglu_fused_gate_up_swapped: Wgate|Wup stored as Wup|Wgate, so
                                      // matmul_gate_up_swiglu computes silu(up)·gate (the GEMMs' outputs are put back)
  int rope_position_offset = 0;       // rope_fused_position_off: matmul_qkv_rope rotates at n_past + 1
  bool embd_norm_unweighted = false;  // embd_norm_fused_no_weight: embedding_rms_norm handed ones for the weight
  bool graph_position_frozen = false; // graph_position_frozen: the captured graph's RoPE reads the position it was
                                      // captured at (the reference: the first one-token step's)
};

// The faults that live in the forwards' control flow, each a one-line hook there.
struct ControlFlow {
  bool kv_cache_pos0 = false;      // the step's K/V written at cache row 0 instead of n_past
  bool kv_cache_not_read = false;  // attention over the step's own K/V, not the cache
  bool residual_skipped = false;   // ffn_inp = attn_out
};

struct FaultPlan {
  ModelConfig config;  // the model's config with the config edits: what the forward reads (Backend::config()
                       // stays the model's)
  WeightEdits weights;
  OpArgs ops;          // every step's ops
  OpArgs one_token;    // a one-token step's ops where no fused kernel runs (the CPU reference): ops with the
                       // production-path faults the engine's fused kernels show at such steps
  FusedPathFaults fused;
  ControlFlow hooks;
};

// Resolves `faults` for a model with config `cfg` (the faults must apply: FaultSet::check_applicable).
FaultPlan plan_faults(const FaultSet& faults, const ModelConfig& cfg);

}  // namespace diffrun
