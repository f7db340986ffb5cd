// The GGUF tensor table: every weight tensor the forward pass reads, with its role, expected shape and the config flag that asks for it; the config check and both weight loaders read it.
// D model width, V real vocabulary, F feed-forward width, Dh head width, Dq = H*Dh, Dkv = Hkv*Dh, E experts,
// Fe one expert's feed-forward width, Fs the shared expert's (qwen2moe).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/gguf.hpp"

namespace diffrun {

struct ModelConfig;

// What a tensor is to the forward pass. Each loader maps a role to its own field, named as the role
// (reference_cpu/weights.hpp, engine/weights.cuh); a switch over the roles with no default makes the compiler
// name a role a loader forgot. Shapes below as the loaders hold them, [rows, cols] (the table's ne order is the
// reverse).
enum class TensorRole : uint8_t {
  // global
  token_embd,      // [Vt, D] embedding rows (Vt >= V)
  output_norm,     // [D] final RMSNorm weight
  output,          // [Vt, D] lm head; absent when tied to token_embd
  // per layer, in the order the forward pass reads them (the engine's arena keeps this order)
  attn_norm,       // [D]
  wq,              // [Dq, D]
  wk,              // [Dkv, D]
  wv,              // [Dkv, D]
  bq,              // [Dq]   qkv_bias
  bk,              // [Dkv]  qkv_bias
  bv,              // [Dkv]  qkv_bias
  q_norm,          // [Dh]   qk_norm
  k_norm,          // [Dh]   qk_norm
  wo,              // [D, Dq]
  attn_post_norm,  // [D]    post_norms
  ffn_norm,        // [D]
  w_gate,          // [F, D]   not moe
  w_up,            // [F, D]   not moe
  w_down,          // [D, F]   not moe
  ffn_post_norm,   // [D]    post_norms
  ffn_gate_inp,    // [E, D]   moe: the router
  ffn_gate_exps,   // [E, Fe, D] moe: every expert's gate projection (GGUF ne [D, Fe, E])
  ffn_up_exps,     // [E, Fe, D] moe
  ffn_down_exps,   // [E, D, Fe] moe (GGUF ne [Fe, D, E])
  ffn_gate_inp_shexp,  // [D]   moe_shexp (qwen2moe): the shared expert's gate, one logit per token
  ffn_gate_shexp,      // [Fs, D] moe_shexp: the shared expert's SwiGLU FFN
  ffn_up_shexp,        // [Fs, D] moe_shexp
  ffn_down_shexp,      // [D, Fs] moe_shexp
};

// A dimension of an expected shape, sized by the config.
enum class TensorDim : uint8_t { D, V, F, Dh, Dq, Dkv, E, Fe, Fs };

// A feature flag of the config (&ModelConfig::qkv_bias).
using ConfigFlag = bool ModelConfig::*;

// One row of the table.
struct TensorSpec {
  TensorRole role;
  const char* name;        // GGUF name (llama.cpp's); a per-layer one without its "blk.L." prefix
  bool per_layer = false;
  ConfigFlag when = nullptr;  // read when the config's flag `when` is `when_is`; nullptr: always
  bool when_is = true;
  int rank = 1;            // 1: a vector (norm weight, bias), 2: a matrix, 3: one matrix per expert
  TensorDim ne[3] = {};    // the expected GGUF shape, ne order (ne[0] the contiguous dimension)
  bool vocab_rows = false;  // ne[1] may exceed V (padded vocabulary rows, never read)
  std::optional<TensorRole> fallback = {};  // read in its place when the file lacks it (output: token_embd)
};

// The table, globals first, then one layer's tensors in forward order.
std::span<const TensorSpec> tensor_specs();
const TensorSpec& tensor_spec(TensorRole role);

// Read by config_from_gguf into rope_freq_factors (Llama 3.1+), not a weight: not in the table.
inline constexpr const char* kRopeFreqsTensor = "rope_freqs.weight";

// GGUF tensor names (llama.cpp's), e.g. layer_tensor(3, "attn_q.weight") == "blk.3.attn_q.weight".
std::string layer_tensor(int layer, const char* suffix);
// The GGUF name of a role's tensor (layer ignored for a global one).
std::string tensor_name(TensorRole role, int layer = -1);
// The first tensor of a layer (attn_norm), whose presence says the file holds that block.
std::string first_layer_tensor(int layer);

// One entry per weight tensor the forward pass reads for a config, with its expected GGUF dims (ne
// order): globals first, then each layer in forward order. rope_freqs.weight is read by config_from_gguf
// into rope_freq_factors and is not listed.
struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> ne;
  TensorRole role = TensorRole::token_embd;
  int layer = -1;           // -1 for a global tensor
  bool vocab_rows = false;  // may hold more rows than ne[1] = V; loaders read the first V
  // The absent tensor this one stands in for (token_embd as the lm head where output.weight is absent).
  std::optional<TensorRole> stands_in_for;

  bool matrix() const { return ne.size() >= 2; }  // a matrix, or a stack of one per expert (3-D)
};
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg);

// Checks presence, dtype support (dequant_supported) and shape of every expected tensor before any
// compute; throws ModelError naming the file and the tensor with expected and found shapes.
void validate_tensors(const GgufFile& file, const ModelConfig& cfg);

}  // namespace diffrun
