// The checkpoint vocabulary: names, execution order within a step, layouts, which architectures emit which.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace diffrun {

// What a backend computed a checkpoint in (stored values are always float32, or int32 for ids).
enum class NativeDType { f16, bf16, f32, f64, i32 };
const char* native_dtype_name(NativeDType d);

// One kind of checkpoint. Per-layer kinds are named "<base>-<layer>" ("Qcur-3").
// Layouts name every dimension of the stored array, one letter group per dimension: per-head
// tensors are 3-D ("T,H,Dh", "T,Hkv,Dh", "S,Hkv,Dh") so a diff can report (token, head, dim).
// Letters: T tokens of the step, S positions attended (KV cache length after the step), D n_embd,
// H n_head, Hkv n_head_kv, Dh head_dim, F n_ff, V n_vocab, E n_expert, K n_expert_used, Fe n_ff_exp.
//
// `inputs` is the kind's dataflow: the checkpoints its operands are, comma-separated. A name is the
// same layer's checkpoint for a per-layer kind; "@prev" is the previous layer's (the stream before the
// layers, inp_scaled or embd, at layer 0) and "@last" the last layer's. "A|B": A where A was recorded,
// else B. "?A": A where A was recorded, else no operand (ffn_out's shared expert, qwen2moe only).
//
// `needs` is the config feature a kind exists for (KindNeeds); kinds with none exist for every config.
// `read_back`: a later op reads this tensor, so an isolation replay replaces it; false for a tensor only
// recorded (kq_soft_max: attention computes its output from Qrope and the cache, not from it).
enum class KindNeeds : uint8_t {
  none,
  qk_norm,     // ModelConfig::qk_norm: qwen3, gemma3
  embd_scale,  // ModelConfig::embd_scale: gemma3
  post_norms,  // ModelConfig::post_norms: gemma3
  ffn_silu,    // ModelConfig::ffn_act == silu: llama, qwen2, qwen3
  ffn_gelu,    // ModelConfig::ffn_act == gelu_tanh: gemma3
  dense_ffn,   // !ModelConfig::moe: the dense FFN's projections
  dense_silu,  // ffn_silu and dense: ffn_swiglu
  dense_gelu,  // ffn_gelu and dense: ffn_geglu
  moe,         // ModelConfig::moe: qwen3moe, qwen2moe, llama with experts (Mixtral)
  moe_norm,    // moe and not moe_shexp: the renormalised top-k weights (not qwen2moe: llama.cpp's norm_w false)
  moe_shexp,   // ModelConfig::moe_shexp: qwen2moe's shared expert
  ffn_out,     // a dense FFN's down projection, or qwen2moe's sum of the experts and the shared expert
};

struct CheckpointKind {
  const char* base;    // "Qcur"
  bool per_layer;
  const char* layout;  // dimension letters of the stored array, e.g. "T,H,Dh" or "H,T,S"
  const char* what;    // one line for help and reports
  const char* inputs;  // dataflow inputs, e.g. "Qrope,cache_k|Krope"; "" for none
  KindNeeds needs = KindNeeds::none;
  bool read_back = true;
};

// Every kind, in execution order within a step (per-layer kinds in their order inside a layer).
const std::vector<CheckpointKind>& checkpoint_kinds();
const CheckpointKind* find_checkpoint_kind(std::string_view base);  // nullptr if unknown
bool kind_applies(const CheckpointKind& k, const ModelConfig& cfg);  // whether the config has k.needs
std::vector<Arch> kind_archs(const CheckpointKind& k);  // the architectures that emit this kind

// The direct dataflow inputs of checkpoint `base` at `layer` (-1 outside layers) in a model of
// n_layer layers, as the kind's `inputs` name them, each alternative resolved by `recorded`.
std::vector<std::string> checkpoint_inputs(std::string_view base, int layer, int n_layer,
                                           const std::function<bool(const std::string&)>& recorded);

// Per-layer kinds that apply to this config (the stride of `order` from one layer to the next).
int checkpoints_per_layer(const ModelConfig& cfg);

// "T,Hkv,Dh" -> {"T", "Hkv", "Dh"}.
std::vector<std::string> layout_dims(std::string_view layout);
// "T,H*Dh" -> {{"T"}, {"H", "Dh"}}: each dimension's letters, one stored as the product of several split at '*'
// (a foreign dump's flat layout); "" -> {}.
std::vector<std::vector<std::string>> layout_factors(std::string_view layout);

// The shape a step stores for this kind: n_tokens = T, n_kv = S (positions in the cache after it).
std::vector<int64_t> checkpoint_shape(const ModelConfig& cfg, const CheckpointKind& k, int64_t n_tokens,
                                      int64_t n_kv);

// The vocabulary as JSON ({"kinds": [{base, per_layer, layout, what, archs}, ...]}), for
// `diffrun vocab --json` and the Python mirror's test.
std::string vocabulary_json();

std::string checkpoint_name(std::string_view base, int layer);  // layer < 0: base alone

struct ParsedCheckpointName {
  std::string base;
  int layer;  // -1 outside layers
};
ParsedCheckpointName parse_checkpoint_name(std::string_view name);

// One expert id as ffn_moe_topk-<layer> holds it (ids stored as values): a whole number in 0..n_expert-1, else
// InputError naming the checkpoint. Both backends read their ids back this way (an isolation replay's are the
// reference's).
int32_t checked_expert_id(double value, int n_expert, int layer);

// Canonical execution index of a checkpoint within a step for this config (the dump's `order`):
// its index in checkpoint_names(cfg). Throws InputError for a name this config does not emit.
int checkpoint_order(const ModelConfig& cfg, std::string_view base, int layer);

// Every checkpoint name a full step records for this config, in execution order.
std::vector<std::string> checkpoint_names(const ModelConfig& cfg);

// The checkpoint holding a step's input token ids (int32 [T]); every dump records it.
inline constexpr std::string_view kTokensCheckpoint = "tokens";
// The checkpoint holding a step's logits ([T, V]; the last row is what a step returns).
inline constexpr std::string_view kLogitsCheckpoint = "result_output";

// Attention's probabilities ([H, T, S]: causal, rows cut by --softmax-rows) and its output before the output
// projection ([T, H, Dh]), the kinds whose patterns the diff reads by head (diff/pattern.cpp) and whose rows a dump may
// cut (dump/rows.hpp).
inline constexpr std::string_view kAttentionProbsKind = "kq_soft_max";
inline constexpr std::string_view kAttentionOutKind = "kqv_out";

// A mixture of experts' routing, as the kinds of the table name it: the router's logits ([T, E]), the K experts chosen
// per token (ids stored as values, [T, K]) and their weights as selected and renormalised. The routing verdict
// (diff/routing.hpp) and the routing follow-up read them by these names.
inline constexpr std::string_view kRouterLogitsKind = "ffn_moe_logits";
inline constexpr std::string_view kExpertIdsKind = "ffn_moe_topk";
inline constexpr std::string_view kExpertWeightsKind = "ffn_moe_weights";
inline constexpr std::string_view kExpertWeightsNormKind = "ffn_moe_weights_norm";

// The reduction a kind's rounding error grows with (tolerance presets scale their bounds by it on models
// wider than their calibration): over D (the projections out of the residual stream, the RMSNorms' sums of
// squares, and what carries a q/k/v or gate/up error on unchanged: the router and each expert's gate, up and
// swiglu too), over n_head·head_dim (attn_out), over F (ffn_out), over one expert's Fe (ffn_moe_down and
// ffn_moe_out, the sum of the weighted downs), the larger of attn_width and F (the residual sums ffn_inp
// and l_out), or none (tokens, the embedding).
enum class KindReduction { none, n_embd, attn_width, ffn, expert_ffn, residual };
KindReduction kind_reduction(std::string_view base);

// `--checkpoints 'attn_*,result_*'`: comma-separated globs (* and ?) over full names; empty = all.
class CheckpointFilter {
 public:
  CheckpointFilter() = default;  // matches everything
  explicit CheckpointFilter(std::string_view spec);  // throws InputError on an empty pattern
  bool matches(std::string_view name) const;
  // What a dump writer records under this filter: the matching checkpoints, and always `tokens`.
  bool records(std::string_view name) const { return name == kTokensCheckpoint || matches(name); }
  bool all() const { return patterns_.empty(); }
  const std::string& spec() const { return spec_; }

 private:
  std::string spec_;
  std::vector<std::string> patterns_;
};

bool glob_match(std::string_view pattern, std::string_view text);

}  // namespace diffrun
