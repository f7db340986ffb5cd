// Names of the architectures and RoPE types and the flags each architecture implies, alone in a file so the C API's vocabulary checks link without the GGUF reader.
#include "model/config.hpp"

#include <cmath>

namespace diffrun {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
    case Arch::qwen3: return "qwen3";
    case Arch::gemma3: return "gemma3";
  }
  return "unknown";
}

const char* rope_type_name(RopeType r) { return r == RopeType::norm ? "norm" : "neox"; }

const std::vector<Arch>& all_archs() {
  static const std::vector<Arch> archs = {Arch::llama, Arch::qwen2, Arch::qwen3, Arch::gemma3};
  return archs;
}

double ModelConfig::attention_scale() const { return attn_scale > 0 ? attn_scale : 1.0 / std::sqrt(double(head_dim)); }

void set_arch_features(ModelConfig& c) {
  c.rope_type = c.arch == Arch::llama ? RopeType::norm : RopeType::neox;
  c.qkv_bias = c.arch == Arch::qwen2;
  c.qk_norm = c.arch == Arch::qwen3 || c.arch == Arch::gemma3;
  c.embd_scale = c.post_norms = c.arch == Arch::gemma3;
  c.ffn_act = c.arch == Arch::gemma3 ? FfnAct::gelu_tanh : FfnAct::silu;
}

}  // namespace diffrun
