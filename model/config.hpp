// ModelConfig per architecture, read from GGUF metadata (the tensor table every backend needs: model/tensor_table.hpp).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/gguf.hpp"
#include "model/tensor_table.hpp"  // the tensor table of a config: expected_tensors, validate_tensors

namespace diffrun {

enum class Arch { llama, qwen2, qwen3, gemma3, qwen3moe, qwen2moe };
enum class RopeType { norm, neox };  // NORM pairs (2i, 2i+1): llama. NEOX pairs (i, i+Dh/2): qwen2/qwen3/gemma3.
enum class FfnAct { silu, gelu_tanh };  // gated FFN: silu(gate)·up (SwiGLU) or gelu_tanh(gate)·up (GeGLU, gemma3)

// The architectures' names (GGUF general.architecture, a dump's `arch`), defined once in
// model/config_names.cpp.
const char* arch_name(Arch a);
std::optional<Arch> arch_from_name(std::string_view name);  // nullopt: not an architecture diffrun runs
std::string arch_names(const char* separator = ", ");        // "llama, qwen2, qwen3, gemma3, qwen3moe, qwen2moe"
const char* rope_type_name(RopeType r);
const std::vector<Arch>& all_archs();  // every supported architecture, in the order errors list them

struct ModelConfig {
  Arch arch = Arch::llama;
  int n_layer = 0;
  int n_embd = 0;       // D
  int n_head = 0;       // H
  int n_head_kv = 0;    // Hkv
  int head_dim = 0;     // Dh
  int n_ff = 0;         // F
  int n_vocab = 0;      // V: the real vocabulary (token list length), never padded rows
  int n_ctx = 0;        // context length the model was trained for
  double rope_theta = 10000.0;
  RopeType rope_type = RopeType::norm;
  // Per rotary pair i in [0, Dh/2): its frequency is divided by rope_freq_factors[i] (Llama 3.1+'s
  // rope_freqs.weight, times the linear rope.scaling.factor); empty: no scaling.
  std::vector<float> rope_freq_factors;
  double rms_eps = 1e-5;
  bool tied_output = false;  // no output.weight: token_embd.weight is the lm head
  bool qkv_bias = false;     // qwen2
  bool qk_norm = false;      // qwen3, gemma3: attn_q_norm / attn_k_norm of shape [Dh]
  bool embd_scale = false;   // gemma3: the embedding row times sqrt(D) (checkpoint inp_scaled)
  bool post_norms = false;   // gemma3: RMSNorm of the attention and FFN outputs before their residual adds
  FfnAct ffn_act = FfnAct::silu;
  // Mixture of experts (qwen3moe; llama with expert_count > 0, Mixtral): every layer's FFN is routed. Per token the
  // router's softmax over all E experts picks the K most probable (ties: the lower id), their probabilities are
  // renormalised to sum 1 (expert_weights_norm; llama.cpp does so for both), and the output is the weighted sum of
  // those K experts' SwiGLU FFNs of width Fe. llama.cpp's build_moe_ffn.
  bool moe = false;          // n_expert > 0
  int n_expert = 0;          // E: experts per layer (expert_count)
  int n_expert_used = 0;     // K: experts each token uses (expert_used_count)
  int n_ff_exp = 0;          // Fe: one expert's FFN width (qwen3moe: expert_feed_forward_length; llama: n_ff)
  bool expert_weights_norm = true;  // the K weights divided by their sum (not qwen2moe: llama.cpp passes norm_w false)
  // qwen2moe's shared expert, beside the routed ones: a dense SwiGLU FFN of width n_ff_shexp over the same normed
  // input, times sigmoid(ffn_gate_inp_shexp · x), added to the experts' weighted sum (llama.cpp's qwen2moe graph).
  bool moe_shexp = false;
  int n_ff_shexp = 0;        // Fs: the shared expert's width (expert_shared_feed_forward_length; n_ff where absent)
  int sliding_window = 0;            // positions a local layer attends (query included); 0: no local layers
  std::vector<uint8_t> swa_layers;   // [n_layer] 1 where the layer is local (sliding window); empty: none
  double rope_theta_swa = 10000.0;   // RoPE base of local layers
  double attn_scale = 0;             // multiplies q·k; 0 means 1/sqrt(Dh)
  double final_logit_softcap = 0;    // logits = c·tanh(logits/c) when > 0
  // Metadata read but not applied because llama.cpp does not apply it either (e.g. a llama file's
  // attention.sliding_window), one sentence each; describe() lists them and the CLI prints them on stderr.
  std::vector<std::string> notes;

  bool layer_is_swa(int l) const { return sliding_window > 0 && l < int(swa_layers.size()) && swa_layers[l]; }
  // The window of layer l in positions, 0 for a global layer (every earlier position).
  int layer_window(int l) const { return layer_is_swa(l) ? sliding_window : 0; }
  double layer_rope_theta(int l) const { return layer_is_swa(l) ? rope_theta_swa : rope_theta; }
  double attention_scale() const;
};

// The structural flags an architecture implies (rope type, biases, q/k norms, post-norms, embedding
// scale, FFN activation), set from cfg.arch; metadata-derived numbers are left alone. Readers of a dump
// call it after reading `arch`.
void set_arch_features(ModelConfig& cfg);

// Throws ModelError listing the supported architectures for an unknown general.architecture.
ModelConfig config_from_gguf(const GgufFile& file);

// A one-paragraph description of the config for `diffrun inspect` and logs.
std::string describe(const ModelConfig& cfg);

}  // namespace diffrun
