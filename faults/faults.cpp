// The fault catalog: names, descriptions, expected first checkpoints, applicability, parsing, shared fault parameters.
#include "faults/faults.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "checkpoints/vocabulary.hpp"
#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

const std::vector<FaultInfo> kCatalog = {
    {Fault::embd_transposed, "embd_transposed",
     "token_embd (GGUF [n_embd, n_vocab], ne[0] fastest) read as [D, V]: embd[t, i] = table[i * V + id]", "embd", 0,
     "all", "embd differs at once; nothing before it can (verdict rule embedding)",
     "embd"},
    {Fault::qkv_bias_missing, "qkv_bias_missing", "q/k/v projections computed without their biases", "Qcur-0", 0,
     "models with q/k/v biases (qwen2)", "Qcur-0 is the first projection; Kcur-0 and Vcur-0 follow",
     "Qcur,Kcur,Vcur"},
    {Fault::rope_pairing_swapped, "rope_pairing_swapped",
     "RoPE pairs (2i, 2i+1) where the model pairs (i, i+Dh/2), and the reverse", "Qrope-0", 0, "all",
     "needs T >= 2: position 0 is a rotation by 0, so the prompt's first token is unchanged",
     "Qrope,Krope,cache_k"},
    {Fault::rope_theta_10000, "rope_theta_10000", "RoPE base 10000 instead of the model's rope_theta", "Qrope-0", 0,
     "models whose rope_theta is not 10000 (not the tiny llama)",
     "needs T >= 2 (position 0 rotates by 0 at any base)",
     "Qrope,Krope,cache_k"},
    {Fault::gqa_head_modulo, "gqa_head_modulo", "query head h reads KV head h % Hkv instead of h / (H / Hkv)",
     "kq_soft_max-0", 0, "models with H > Hkv > 1",
     "the scores already read the wrong K head, before kqv_out-0 reads the wrong V head; needs T >= 2 "
     "(one key has probability 1 whatever it is); kqv_out-0 when kq_soft_max is not recorded",
     "kq_soft_max,kqv_out"},
    {Fault::kv_cache_not_read, "kv_cache_not_read",
     "attention over the step's own K/V instead of the cache: a decode step sees only the current token",
     "kq_soft_max-0", 1, "all",
     "step 0 is unchanged (the prefill's own tokens are the whole cache); at step 1 the probabilities are "
     "[H, 1, 1] against [H, 1, S]: a shape mismatch; kqv_out-0 when kq_soft_max is not recorded",
     "kq_soft_max,kqv_out"},
    {Fault::kv_cache_pos0, "kv_cache_pos0", "the step's K/V rows written at cache row 0 instead of row n_past",
     "cache_k-0", 1, "all",
     "step 0 writes rows 0..T-1 as it should; at step 1 row 0 is overwritten and row n_past is never written",
     "cache_k,cache_v"},
    {Fault::causal_mask_missing, "causal_mask_missing", "prefill without the causal mask: every token attends to all T",
     "kq_soft_max-0", 0, "all", "needs T >= 2; decode steps are unaffected (one query, every key is in its past)",
     "kq_soft_max,kqv_out"},
    {Fault::attn_scale_missing, "attn_scale_missing", "attention scores q·k without the 1/sqrt(Dh) scale",
     "kq_soft_max-0", 0, "all", "needs T >= 2 (the first token's single score has probability 1 at any scale)",
     "kq_soft_max,kqv_out"},
    {Fault::rms_norm_weight_twice, "rms_norm_weight_twice", "every RMSNorm multiplies by its weight twice",
     "attn_norm-0", 0, "all", "the first RMSNorm is attn_norm-0",
     "attn_norm,Qnorm,Knorm,attn_post_norm,ffn_norm,ffn_post_norm,result_norm"},
    {Fault::rms_eps_1e5, "rms_eps_1e5", "RMSNorm epsilon 1e-5 instead of the model's rms_eps", "attn_norm-0", 0,
     "models whose rms_eps is not 1e-5 (qwen2, qwen3; not llama)",
     "subtle: the relative change is about (1e-5 - eps) / (2 mean(x^2)), largest on rows of small mean square "
     "(the embeddings). Tiny qwen2/qwen3: attn_norm-0 rel_l2 about 1e-4, 5x the f32_vs_f64 bound (2e-5), caught; "
     "200x under the f16 presets' 0.02, so an f16 engine's run passes it",
     "attn_norm,Qnorm,Knorm,attn_post_norm,ffn_norm,ffn_post_norm,result_norm"},
    {Fault::swiglu_gate_up_swapped, "swiglu_gate_up_swapped", "SwiGLU computes silu(up) · gate (GeGLU: gelu(up) · gate)",
     "ffn_swiglu-0", 0, "all", "ffn_gate-0 and ffn_up-0 themselves are right; ffn_geglu-0 on gemma3",
     "ffn_swiglu,ffn_geglu"},
    {Fault::attn_out_transposed, "attn_out_transposed",
     "attention output projection with W_o read with the wrong leading dimension (GEMM transpose flag flipped)",
     "attn_out-0", 0, "all",
     "a true transpose when W_o is square (H·Dh == D, as in every supported fixture); otherwise the same memory "
     "read with rows H·Dh long instead of D, still in bounds",
     "attn_out"},
    {Fault::ffn_down_transposed, "ffn_down_transposed",
     "FFN down projection with W_down [D, F] read as if its rows were D long (the wrong leading dimension)",
     "ffn_out-0", 0, "all", "W_down is not square: the classic wrong-lda read, in bounds",
     "ffn_out"},
    {Fault::residual_skipped, "residual_skipped", "ffn_inp = attn_out: the residual add after attention skipped",
     "ffn_inp-0", 0, "all", "attn_out-0 is right; ffn_inp-0 has lost the residual stream",
     "ffn_inp"},
    {Fault::lm_head_padded_vocab, "lm_head_padded_vocab",
     "logits over a vocabulary padded to a multiple of 128 whose extra rows are never written; argmax over all of them",
     "result_output", 0, "all",
     "result_output is recorded over the padded width: a shape mismatch [T, Vp] vs [T, V]; the stale rows "
     "(0x7f bytes) win the argmax, so every step's token is id V, past the vocabulary (token agreement)",
     "result_output"},
    {Fault::dequant_scale_offset, "dequant_scale_offset",
     "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks decoded with the f16 scale d read from bytes 2..3 instead of 0..1",
     "first checkpoint reading such a tensor", 0, "models with a tensor in Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0",
     "embd when token_embd is in one of these formats; Q4_1/Q5_1 then use the min as the scale, Q4_0/Q8_0 two "
     "quant bytes (which may decode to Inf/NaN: the nonfinite rule)",
     "embd,inp_scaled,attn_norm,Qcur,Kcur,Vcur,Qnorm,Knorm,attn_out,attn_post_norm,ffn_norm,ffn_gate,ffn_up,ffn_out,"
     "ffn_post_norm,result_norm,result_output"},
    {Fault::rms_norm_off_by_one, "rms_norm_off_by_one",
     "every RMSNorm's sum of squares stops one element short (misses x[D-1]) and is still divided by D",
     "attn_norm-0", 0, "all",
     "subtle: each row's scale grows by about x[D-1]^2 / (2 sum(x^2)), 1/(2D) on average: tiny fixtures' "
     "attn_norm-0 (D 256) about 2e-3 rel_l2, 100x the f32_vs_f64 bound. Under the f16 presets' 0.02, an f16 engine "
     "against the f32 reference shows it late or not at all (qwen3's Qnorm over Dh 32 moves 2.5e-2 and shows "
     "there): it needs a reference of the engine's precision and tighter bounds",
     "attn_norm,Qnorm,Knorm,attn_post_norm,ffn_norm,ffn_post_norm,result_norm"},
    {Fault::rms_eps_outside_sqrt, "rms_eps_outside_sqrt",
     "every RMSNorm scales by 1 / (sqrt(mean(x^2)) + eps) instead of 1 / sqrt(mean(x^2) + eps)",
     "attn_norm-0", 0, "all",
     "subtle: the scale moves by about eps / sqrt(mean(x^2)) - eps / (2 mean(x^2)), largest on rows of small "
     "mean square (the embeddings). Tiny llama (eps 1e-5): attn_norm-0 7e-5 rel_l2; tiny qwen2/qwen3 (eps 1e-6): 7e-6. "
     "f32_vs_f64 catches both at attn_norm-0, whose bound is one norm's rounding (2.5e-6: layer 0 reads exact "
     "embeddings). "
     "Missed by the f16 presets",
     "attn_norm,Qnorm,Knorm,attn_post_norm,ffn_norm,ffn_post_norm,result_norm"},
    {Fault::rope_cache_unrotated, "rope_cache_unrotated",
     "the fused RoPE + KV cache write stores each K row as it was before RoPE; Krope and V are right",
     "cache_k-0", 0, "all",
     "needs T >= 2 (position 0 rotates by 0, so the first row is right); the attention then reads unrotated "
     "keys. Isolation must test the fused write itself: a replaced Krope is not written to the cache again",
     "cache_k"},
    {Fault::softmax_f16_overflow, "softmax_f16_overflow",
     "attention weights e = f16(exp(q·k)) without the row max subtracted, raised to 1/sqrt(Dh) and normalised: "
     "exp overflows f16 once a raw score q·k passes 11.09",
     "kq_soft_max-0", 0, "all",
     "needs a raw score q·k above ln(65520) = 11.09 in layer 0's prefill (the tiny fixtures reach 13 to 76; "
     "trained models far more): that row is Inf / Inf = NaN; other rows differ by f16 rounding only",
     "kq_soft_max,kqv_out"},
    {Fault::weight_row_nan, "weight_row_nan",
     "row 0 of blk.0.attn_q.weight is NaN, as a corrupted or never-written weight row",
     "Qcur-0", 0, "all",
     "Qcur-0 holds NaN in feature 0 (head 0, dim 0) of every token; attn_norm-0 before it is finite",
     "Qcur"},
    {Fault::embd_scale_missing, "embd_scale_missing",
     "the embedding rows not multiplied by sqrt(D) (gemma3's inp_scaled)", "inp_scaled", 0,
     "models that scale their embeddings (gemma3)",
     "embd is right, inp_scaled is sqrt(D) too small; the norms after it hide most of it downstream",
     "inp_scaled"},
    {Fault::post_norm_skipped, "post_norm_skipped",
     "the RMSNorm of the attention output before its residual add skipped: attn_post_norm = attn_out",
     "attn_post_norm-0", 0, "models with post-attention norms (gemma3)",
     "attn_out-0 is right; attn_post_norm-0 is the raw projection",
     "attn_post_norm"},
    {Fault::sliding_window_ignored, "sliding_window_ignored",
     "local (sliding-window) layers attend to every earlier position, as global layers do", "kq_soft_max-0", 0,
     "models with sliding-window layers (gemma3)",
     "needs a prompt longer than the window (the tiny gemma3's is 8 positions, the real model's 512); "
     "kqv_out-0 when kq_soft_max is not recorded",
     "kq_soft_max,kqv_out"},
    {Fault::rope_local_theta_global, "rope_local_theta_global",
     "local (sliding-window) layers rotate with the global rope_theta instead of their own base", "Qrope-0", 0,
     "models whose local layers have their own RoPE base (gemma3: 10000 against 1e6)",
     "needs T >= 2 (position 0 rotates by 0 at any base); the first local layer's Qrope, here layer 0",
     "Qrope,Krope,cache_k"},
    {Fault::swiglu_fused_gate_up_swapped, "swiglu_fused_gate_up_swapped",
     "Wgate|Wup concatenated as Wup|Wgate at load, so the fused gate|up GEMV of one-token steps "
     "(matmul_gate_up_swiglu) computes silu(up) · gate; the prefill's GEMM writes each part where it belongs",
     "ffn_swiglu-0", 1, "SwiGLU models whose ffn_gate and ffn_up share a format (not gemma3's GeGLU)",
     "only one-token steps run the fused kernel: the prefill is right, the first decode step's ffn_swiglu-0 is "
     "wrong while its ffn_gate-0 and ffn_up-0 are right. The f32 engine keeps Q4_K/Q5_K/Q6_K gate|up unfused, "
     "where the fault does nothing. Isolation replay runs the unfused twins and cannot show it",
     "ffn_swiglu"},
    {Fault::rope_fused_position_off, "rope_fused_position_off",
     "the RoPE fused into the qkv GEMV of one-token steps (matmul_qkv_rope) rotates q and k at position "
     "n_past + 1; the cache row written is right",
     "Qrope-0", 1, "models without q/k norms (their decode fuses the RoPE into the qkv GEMV)",
     "only one-token steps run the fused kernel: the prefill is right, the first decode step's Qcur-0 is right "
     "and Qrope-0 is not. Isolation replay runs the unfused twins and cannot show it",
     "Qrope,Krope,cache_k"},
    {Fault::embd_norm_fused_no_weight, "embd_norm_fused_no_weight",
     "the embedding gather fused with layer 0's RMSNorm (embedding_rms_norm, one-token steps) normalises "
     "without the attn_norm weight",
     "attn_norm-0", 1, "models with a dense token_embd (F32, F16, BF16) and no embedding scale",
     "only one-token steps run the fused kernel: the prefill is right, the first decode step's embd is right "
     "and attn_norm-0 is not. Isolation replay runs the unfused twins and cannot show it",
     "attn_norm"},
    {Fault::graph_position_frozen, "graph_position_frozen",
     "the captured decode graph's RoPE reads the position the first decode step had when it was captured, "
     "not the current one from device memory",
     "Qrope-0", 2, "all",
     "the first decode step (the capture) is right; every later replay rotates q and k at that step's position, "
     "so step 2's Qrope-0 is the first wrong checkpoint. Steps launched one by one (the prefill, "
     "DIFFRUN_CUDA_GRAPHS=0, isolation replay) are right",
     "Qrope,Krope,cache_k"},
    {Fault::argmax_ties_highest, "argmax_ties_highest",
     "the greedy argmax (matmul_argmax and argmax on the GPU) breaks exact ties toward the higher token id, "
     "not the lower one",
     "result_output", 0, "models whose logits tie exactly: lm head rows 0 and 1 equal (tiny-llama-tiedrows)",
     "the logits are right; the engine's own token (the dump's argmax) is not its logits' argmax, an exact tie "
     "with a lower id passed over (rule argmax). Real logits tie rarely, so it needs a model made to tie",
     "result_output"},
    {Fault::moe_softmax_over_topk, "moe_softmax_over_topk",
     "routing weights from a softmax over the K selected logits instead of the probabilities of all E experts",
     "ffn_moe_weights-0", 0, "mixture-of-experts models (qwen3moe, Mixtral)",
     "ffn_moe_probs-0 and ffn_moe_topk-0 are right; the weights already sum to 1, so under renormalisation "
     "ffn_moe_weights_norm-0 and everything after it are right again: only a model without renormalisation "
     "would change its output",
     "ffn_moe_weights,ffn_moe_weights_norm"},
    {Fault::moe_weights_not_renormalised, "moe_weights_not_renormalised",
     "the K routing weights used as they are, not divided by their sum as the model asks",
     "ffn_moe_weights_norm-0", 0, "mixture-of-experts models (qwen3moe, Mixtral)",
     "ffn_moe_weights-0 is right; the normalised weights are the unnormalised ones, each expert's output "
     "scaled by the share of probability the K experts hold",
     "ffn_moe_weights_norm"},
    {Fault::moe_expert_id_off_by_one, "moe_expert_id_off_by_one",
     "expert id + 1 (mod E) selected in place of each chosen expert, its probability taken as the weight",
     "ffn_moe_topk-0", 0, "mixture-of-experts models (qwen3moe, Mixtral)",
     "ffn_moe_probs-0 is right; every selected id is one higher (E-1 becomes 0)",
     "ffn_moe_topk,ffn_moe_weights,ffn_moe_weights_norm"},
    {Fault::moe_expert_gate_up_swapped, "moe_expert_gate_up_swapped",
     "expert 0's ffn_gate_exps and ffn_up_exps matrices swapped in every layer, as a converter writing one "
     "expert's slices in the wrong order would leave them",
     "ffn_moe_gate-0", 0, "mixture-of-experts models (qwen3moe, Mixtral)",
     "the routing is right; in the slots that select expert 0, ffn_moe_gate-0 holds the up projection and "
     "ffn_moe_up-0 the gate, the other slots are right. It shows at the first step whose tokens select expert 0 "
     "in layer 0: step 0 for the tests' prompts",
     "ffn_moe_gate,ffn_moe_up"},
    {Fault::moe_shared_expert_gate_skipped, "moe_shared_expert_gate_skipped",
     "qwen2moe's shared expert added to the routed experts' sum without its gate, sigmoid(ffn_gate_inp_shexp · x)",
     "ffn_shexp_out-0", 0, "mixture-of-experts models with a shared expert (qwen2moe)",
     "the routing, ffn_moe_out-0, ffn_shexp_gate-0 and ffn_shexp-0 are right; ffn_shexp_out-0 is ffn_shexp-0 "
     "itself, each token's row too large by 1 / its gate",
     "ffn_shexp_out"},
};

// The checkpoint first computed from a tensor of the table (wq of layer 3, blk.3.attn_q.weight -> "Qcur-3").
std::string checkpoint_of_tensor(const ExpectedTensor& e) {
  using R = TensorRole;
  const char* base = "";
  switch (e.role) {
    case R::token_embd: base = "embd"; break;
    case R::output_norm: base = "result_norm"; break;
    case R::output: base = "result_output"; break;
    case R::attn_norm: base = "attn_norm"; break;
    case R::wq: case R::bq: base = "Qcur"; break;
    case R::wk: case R::bk: base = "Kcur"; break;
    case R::wv: case R::bv: base = "Vcur"; break;
    case R::q_norm: base = "Qnorm"; break;
    case R::k_norm: base = "Knorm"; break;
    case R::wo: base = "attn_out"; break;
    case R::attn_post_norm: base = "attn_post_norm"; break;
    case R::ffn_norm: base = "ffn_norm"; break;
    case R::w_gate: base = "ffn_gate"; break;
    case R::w_up: base = "ffn_up"; break;
    case R::w_down: base = "ffn_out"; break;
    case R::ffn_post_norm: base = "ffn_post_norm"; break;
    case R::ffn_gate_inp: base = "ffn_moe_logits"; break;
    case R::ffn_gate_exps: base = "ffn_moe_gate"; break;
    case R::ffn_up_exps: base = "ffn_moe_up"; break;
    case R::ffn_down_exps: base = "ffn_moe_down"; break;
    case R::ffn_gate_inp_shexp: base = "ffn_shexp_gate_inp"; break;
    case R::ffn_gate_shexp: case R::ffn_up_shexp: case R::ffn_down_shexp: base = "ffn_shexp"; break;
  }
  return checkpoint_name(base, e.layer);
}

// The first checkpoint (in execution order) computed from a tensor in a legacy block format; "" if none.
std::string first_legacy_checkpoint(const ModelConfig& cfg, const GgufFile& file) {
  std::string best;
  int best_order = 0;
  for (const ExpectedTensor& e : expected_tensors(cfg)) {
    const TensorInfo* t = file.find_tensor(e.name);
    if (!t || !dequant_fault_format(t->type)) continue;
    const std::string cp = checkpoint_of_tensor(e);
    const ParsedCheckpointName p = parse_checkpoint_name(cp);
    const int order = checkpoint_order(cfg, p.base, p.layer);
    if (best.empty() || order < best_order) {
      best = cp;
      best_order = order;
    }
  }
  return best;
}

// GGUF stores rope_theta and rms_eps as f32: 1e-5 arrives as 9.99999975e-06.
bool same_f32(double a, double b) { return static_cast<float>(a) == static_cast<float>(b); }

// The first layer whose RoPE base is not `theta` (gemma3's local layers have their own), or -1.
int first_layer_theta_not(const ModelConfig& cfg, double theta) {
  for (int l = 0; l < cfg.n_layer; ++l)
    if (!same_f32(cfg.layer_rope_theta(l), theta)) return l;
  return -1;
}

// The first sliding-window layer, or -1.
int first_local_layer(const ModelConfig& cfg) {
  for (int l = 0; l < cfg.n_layer; ++l)
    if (cfg.layer_is_swa(l)) return l;
  return -1;
}

}  // namespace

const std::vector<FaultInfo>& fault_catalog() { return kCatalog; }

const FaultInfo& fault_info(Fault f) { return kCatalog.at(static_cast<size_t>(f)); }

bool fault_in_production_path_only(Fault f) {
  return f == Fault::swiglu_fused_gate_up_swapped || f == Fault::rope_fused_position_off ||
         f == Fault::embd_norm_fused_no_weight || f == Fault::graph_position_frozen;
}

std::string fault_not_applicable(Fault f, const ModelConfig& cfg, const GgufFile* file) {
  switch (f) {
    case Fault::moe_weights_not_renormalised:
      if (cfg.moe && !cfg.expert_weights_norm) return "the model does not renormalise its expert weights";
      return cfg.moe ? "" : "the model has no experts";
    case Fault::moe_shared_expert_gate_skipped:
      return cfg.moe_shexp ? "" : "the model has no shared expert";
    case Fault::moe_softmax_over_topk:
    case Fault::moe_expert_id_off_by_one:
    case Fault::moe_expert_gate_up_swapped:
      return cfg.moe ? "" : "the model has no experts";
    case Fault::swiglu_gate_up_swapped:
    case Fault::ffn_down_transposed:
      return cfg.moe ? "the model's FFN is routed to experts: it has no dense ffn_gate/ffn_up/ffn_down" : "";
    case Fault::qkv_bias_missing:
      return cfg.qkv_bias ? "" : "the model has no q/k/v biases";
    case Fault::rope_theta_10000:
      return first_layer_theta_not(cfg, kFaultRopeTheta) < 0 ? "the model's rope_theta is already 10000" : "";
    case Fault::embd_scale_missing:
      return cfg.embd_scale ? "" : "the model does not scale its embeddings";
    case Fault::post_norm_skipped:
      return cfg.post_norms ? "" : "the model has no post-attention norm";
    case Fault::sliding_window_ignored:
      return first_local_layer(cfg) >= 0 ? "" : "the model has no sliding-window layer";
    case Fault::rope_local_theta_global:
      if (first_local_layer(cfg) < 0) return "the model has no sliding-window layer";
      return same_f32(cfg.rope_theta_swa, cfg.rope_theta) ? "the local layers' RoPE base is the global one" : "";
    case Fault::gqa_head_modulo:
      if (cfg.n_head_kv == 1) return "the model has one KV head: every mapping reads head 0";
      if (cfg.n_head_kv == cfg.n_head) return "the model has as many KV heads as query heads: h % H == h / 1";
      return "";
    case Fault::rms_eps_1e5:
      return same_f32(cfg.rms_eps, kFaultRmsEps) ? "the model's rms_eps is already 1e-5" : "";
    case Fault::swiglu_fused_gate_up_swapped: {
      if (cfg.moe) return "the model's FFN is routed to experts: it has no dense ffn_gate/ffn_up to fuse";
      if (cfg.ffn_act == FfnAct::gelu_tanh) return "the model's FFN is GeGLU, which no kernel fuses into the GEMV";
      if (!file) return "which tensor formats the model has is not known here";
      const TensorInfo* g = file->find_tensor("blk.0.ffn_gate.weight");
      const TensorInfo* u = file->find_tensor("blk.0.ffn_up.weight");
      if (!g || !u || g->type != u->type) return "ffn_gate and ffn_up are in different formats: never fused";
      return "";
    }
    case Fault::rope_fused_position_off:
      return cfg.qk_norm ? "the model normalises q and k before RoPE, which keeps the RoPE out of the qkv GEMV" : "";
    case Fault::embd_norm_fused_no_weight: {
      if (cfg.embd_scale) return "the model scales its embeddings, which keeps the gather out of the norm";
      if (cfg.n_embd > kFusedEmbeddingNormMaxWidth)
        return fmt::format("rows of {} are wider than the {} the fused embedding norm takes: the gather and the norm "
                           "run as two kernels",
                           cfg.n_embd, kFusedEmbeddingNormMaxWidth);
      if (!file) return "which tensor formats the model has is not known here";
      const TensorInfo* t = file->find_tensor("token_embd.weight");
      if (!t || (t->type != GgmlType::F32 && t->type != GgmlType::F16 && t->type != GgmlType::BF16))
        return "token_embd is quantized: the fused embedding norm takes dense tables only";
      return "";
    }
    case Fault::argmax_ties_highest: {
      if (!file) return "whether the model's logits tie is not known here";
      const TensorInfo* head = file->find_tensor("output.weight");
      if (!head) head = file->find_tensor("token_embd.weight");
      const std::span<const std::byte> rows = head ? file->tensor_data(*head) : std::span<const std::byte>();
      const size_t row = head && head->type == GgmlType::F32 && head->ne.size() == 2 ? head->ne[0] * 4 : 0;
      if (row == 0 || rows.size() < 2 * row || !std::equal(rows.begin(), rows.begin() + row, rows.begin() + row))
        return "its logits never tie exactly (an F32 lm head whose rows 0 and 1 are equal makes them tie)";
      return "";
    }
    case Fault::dequant_scale_offset:
      if (!file) return "which tensor formats the model has is not known here";
      return first_legacy_checkpoint(cfg, *file).empty() ? "the model has no tensor in Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0"
                                                         : "";
    default:
      return "";
  }
}

std::string fault_dormant(Fault f, const ModelConfig& cfg, const GgufFile* file, std::string_view engine_precision) {
  if (f != Fault::swiglu_fused_gate_up_swapped || engine_precision != "f32" || !file) return "";
  if (!fault_not_applicable(f, cfg, file).empty()) return "";
  const GgmlType t = file->tensor("blk.0.ffn_gate.weight").type;
  if (!gemv_super_block(t)) return "";
  return fmt::format("the f32 engine runs {} ffn_gate|ffn_up unfused (the SIMT GEMV), so matmul_gate_up_swiglu never "
                     "runs there; the f16 engine fuses it",
                     ggml_type_name(t));
}

std::string expected_checkpoint(Fault f, const ModelConfig& cfg, const GgufFile* file) {
  const std::string why = fault_not_applicable(f, cfg, file);
  if (!why.empty()) throw InputError(fmt::format("fault {} does not apply: {}", fault_info(f).name, why));
  if (f == Fault::dequant_scale_offset) return first_legacy_checkpoint(cfg, *file);
  // Where the architecture moves the first change: the first layer whose base is not 10000 (gemma3's
  // first global one), the first local layer, GeGLU in place of SwiGLU.
  if (f == Fault::rope_theta_10000) return checkpoint_name("Qrope", first_layer_theta_not(cfg, kFaultRopeTheta));
  if (f == Fault::rope_local_theta_global) return checkpoint_name("Qrope", first_local_layer(cfg));
  if (f == Fault::sliding_window_ignored) return checkpoint_name("kq_soft_max", first_local_layer(cfg));
  if (f == Fault::swiglu_gate_up_swapped && cfg.ffn_act == FfnAct::gelu_tanh) return "ffn_geglu-0";
  return fault_info(f).checkpoint;
}

FaultSet::FaultSet(std::initializer_list<Fault> faults) {
  for (Fault f : faults) add(f);
}

std::vector<Fault> FaultSet::list() const {
  std::vector<Fault> out;
  for (int i = 0; i < kFaultCount; ++i) {
    if (bits_.test(static_cast<size_t>(i))) out.push_back(static_cast<Fault>(i));
  }
  return out;
}

std::string FaultSet::names() const {
  std::string out;
  for (Fault f : list()) {
    if (!out.empty()) out += ',';
    out += fault_info(f).name;
  }
  return out;
}

void FaultSet::check_applicable(const ModelConfig& cfg, const GgufFile* file) const {
  for (Fault f : list()) {
    const std::string why = fault_not_applicable(f, cfg, file);
    if (!why.empty()) {
      throw InputError(fmt::format("--inject {}: the fault does not apply to this {} model: {}", fault_info(f).name,
                                   arch_name(cfg.arch), why));
    }
  }
}

std::vector<std::string> fault_list(std::string_view csv) {
  std::vector<std::string> out;
  if (csv.find_first_not_of(" \t,") == std::string_view::npos) return out;  // "" or only separators: no fault
  size_t pos = 0;
  while (pos <= csv.size()) {
    size_t end = csv.find(',', pos);
    if (end == std::string_view::npos) end = csv.size();
    std::string_view item = csv.substr(pos, end - pos);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
    pos = end + 1;
    if (item.empty()) throw InputError(fmt::format("--inject '{}': an empty fault name", csv));
    out.emplace_back(item);
  }
  return out;
}

FaultSet parse_faults(std::string_view csv) {
  FaultSet set;
  for (const std::string& item : fault_list(csv)) {
    auto it = std::find_if(kCatalog.begin(), kCatalog.end(), [&](const FaultInfo& f) { return item == f.name; });
    if (it == kCatalog.end()) {
      std::string names;
      for (const FaultInfo& f : kCatalog) {
        if (!names.empty()) names += ", ";
        names += f.name;
      }
      throw InputError(fmt::format("--inject: unknown fault '{}'; the catalog (diffrun faults): {}", item, names));
    }
    set.add(it->id);
  }
  return set;
}

std::string fault_table() {
  std::string out = fmt::format("{:<24} {:<16} {:>4}  {}\n", "fault", "first shows at", "step", "what");
  for (const FaultInfo& f : kCatalog) {
    const bool named = f.id != Fault::dequant_scale_offset;
    out += fmt::format("{:<24} {:<16} {:>4}  {}\n", f.name, named ? f.checkpoint : "(see below)", f.step, f.what);
    if (!named) out += fmt::format("{:<24} {}\n", "", std::string("first shows at: ") + f.checkpoint);
    out += fmt::format("{:<24} applies to: {}\n", "", f.applies);
    out += fmt::format("{:<24} {}\n", "", f.shows);
  }
  return out;
}

int fault_padded_vocab(int n_vocab) { return (n_vocab / 128 + 1) * 128; }

bool dequant_fault_format(GgmlType t) {
  return t == GgmlType::Q4_0 || t == GgmlType::Q4_1 || t == GgmlType::Q5_0 || t == GgmlType::Q5_1 ||
         t == GgmlType::Q8_0;
}

std::vector<std::byte> dequant_fault_bytes(GgmlType t, std::span<const std::byte> raw) {
  if (!dequant_fault_format(t)) {
    throw InputError(fmt::format("dequant_scale_offset: {} is not one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0", ggml_type_name(t)));
  }
  const size_t block = static_cast<size_t>(ggml_block_bytes(t));
  std::vector<std::byte> out(raw.begin(), raw.end());
  for (size_t b = 0; b + block <= out.size(); b += block) {
    out[b] = raw[b + 2];
    out[b + 1] = raw[b + 3];
  }
  return out;
}

}  // namespace diffrun
