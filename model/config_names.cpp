// The architectures (their names and the flags each implies) and the RoPE type names: the one C++ definition, alone in a file so the C API's vocabulary checks link without the GGUF reader.
// python/diffrun/dump_schema.json lists the same architectures with the same features under `archs`;
// tests/test_dump_schema.cpp checks the two against each other.
#include "model/config.hpp"

#include <cmath>

namespace diffrun {

namespace {

// One row per architecture, in the order errors list them: its general.architecture name and the
// structural flags set_arch_features gives it.
struct ArchSpec {
  Arch arch;
  const char* name;
  RopeType rope_type;
  bool qkv_bias, qk_norm, embd_scale, post_norms;
  FfnAct ffn_act;
  bool moe;  // always routed (llama is routed only where expert_count > 0: Mixtral)
  bool moe_shexp;  // a shared expert beside the routed ones, and the top-k weights not renormalised (qwen2moe)
};

constexpr ArchSpec kArchs[] = {
    // arch, name, rope, qkv_bias, qk_norm, embd_scale, post_norms, ffn_act, moe, moe_shexp
    {Arch::llama, "llama", RopeType::norm, false, false, false, false, FfnAct::silu, false, false},
    {Arch::qwen2, "qwen2", RopeType::neox, true, false, false, false, FfnAct::silu, false, false},
    {Arch::qwen3, "qwen3", RopeType::neox, false, true, false, false, FfnAct::silu, false, false},
    {Arch::gemma3, "gemma3", RopeType::neox, false, true, true, true, FfnAct::gelu_tanh, false, false},
    {Arch::qwen3moe, "qwen3moe", RopeType::neox, false, true, false, false, FfnAct::silu, true, false},
    {Arch::qwen2moe, "qwen2moe", RopeType::neox, true, false, false, false, FfnAct::silu, true, true},
};

const ArchSpec* find_spec(Arch a) {
  for (const ArchSpec& s : kArchs)
    if (s.arch == a) return &s;
  return nullptr;
}

}  // namespace

const char* arch_name(Arch a) {
  const ArchSpec* s = find_spec(a);
  return s ? s->name : "unknown";
}

std::optional<Arch> arch_from_name(std::string_view name) {
  for (const ArchSpec& s : kArchs)
    if (name == s.name) return s.arch;
  return std::nullopt;
}

std::string arch_names(const char* separator) {
  std::string out;
  for (const ArchSpec& s : kArchs) out += (out.empty() ? "" : separator) + std::string(s.name);
  return out;
}

const char* rope_type_name(RopeType r) { return r == RopeType::norm ? "norm" : "neox"; }

const std::vector<Arch>& all_archs() {
  static const std::vector<Arch> archs = [] {
    std::vector<Arch> v;
    for (const ArchSpec& s : kArchs) v.push_back(s.arch);
    return v;
  }();
  return archs;
}

double ModelConfig::attention_scale() const { return attn_scale > 0 ? attn_scale : 1.0 / std::sqrt(double(head_dim)); }

void set_arch_features(ModelConfig& c) {
  const ArchSpec* s = find_spec(c.arch);
  if (!s) return;
  c.rope_type = s->rope_type;
  c.qkv_bias = s->qkv_bias;
  c.qk_norm = s->qk_norm;
  c.embd_scale = s->embd_scale;
  c.post_norms = s->post_norms;
  c.ffn_act = s->ffn_act;
  c.moe = s->moe || c.n_expert > 0;
  c.moe_shexp = s->moe_shexp;
  c.expert_weights_norm = !s->moe_shexp;
}

}  // namespace diffrun
