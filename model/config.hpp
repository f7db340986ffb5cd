// ModelConfig per architecture, read from GGUF metadata, and the tensor table every backend needs.
#pragma once

#include <string>
#include <vector>

#include "model/gguf.hpp"

namespace diffrun {

enum class Arch { llama, qwen2, qwen3 };
enum class RopeType { norm, neox };  // NORM pairs (2i, 2i+1): llama. NEOX pairs (i, i+Dh/2): qwen2/qwen3.

const char* arch_name(Arch a);
const char* rope_type_name(RopeType r);

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
  double rms_eps = 1e-5;
  bool tied_output = false;  // no output.weight: token_embd.weight is the lm head
  bool qkv_bias = false;     // qwen2
  bool qk_norm = false;      // qwen3: attn_q_norm / attn_k_norm of shape [Dh]
};

// Throws ModelError listing the supported architectures for an unknown general.architecture.
ModelConfig config_from_gguf(const GgufFile& file);

// GGUF tensor names (llama.cpp's), e.g. layer_tensor(3, "attn_q.weight") == "blk.3.attn_q.weight".
std::string layer_tensor(int layer, const char* suffix);

// One entry per tensor the forward pass reads, with its expected GGUF dims (ne order).
struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> ne;
};
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg);

// Checks presence, dtype support (dequant_supported) and shape of every expected tensor before any
// compute; throws ModelError naming the tensor with expected and found shapes.
void validate_tensors(const GgufFile& file, const ModelConfig& cfg);

// A one-paragraph description of the config for `diffrun inspect` and logs.
std::string describe(const ModelConfig& cfg);

}  // namespace diffrun
