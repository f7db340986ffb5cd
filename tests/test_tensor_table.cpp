// The tensor table (model/tensor_table.hpp) and the architecture names (model/config_names.cpp): one row per role, each architecture's tensors and shapes, the tied lm head's fallback.
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "model/config.hpp"
#include "model/tensor_table.hpp"

namespace diffrun {
namespace {

// Sizes that differ from each other, so a shape names its dimensions unambiguously.
ModelConfig config_of(Arch arch, bool tied) {
  ModelConfig c;
  c.arch = arch;
  set_arch_features(c);
  c.n_layer = 2;
  c.n_embd = 16;    // D
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 6;   // Dh; Dq 24, Dkv 12
  c.n_ff = 40;      // F
  c.n_vocab = 50;   // V
  c.tied_output = tied;
  return c;
}

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

Shapes shapes_of(const std::vector<ExpectedTensor>& ts) {
  Shapes s;
  for (const ExpectedTensor& t : ts) s.emplace_back(t.name, t.ne);
  return s;
}

TEST(TensorTable, OneRowPerRoleInRoleOrder) {
  std::set<std::string> names;
  size_t i = 0;
  for (const TensorSpec& s : tensor_specs()) {
    EXPECT_EQ(static_cast<size_t>(s.role), i++);
    EXPECT_EQ(&tensor_spec(s.role), &s);
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    EXPECT_TRUE(s.rank == 1 || s.rank == 2 || (s.rank == 3 && std::string_view(s.name).find("_exps") != std::string_view::npos))
        << s.name;  // 3: one matrix per expert
  }
  EXPECT_EQ(tensor_name(TensorRole::wq, 3), "blk.3.attn_q.weight");
  EXPECT_EQ(tensor_name(TensorRole::output), "output.weight");
  EXPECT_EQ(first_layer_tensor(7), "blk.7.attn_norm.weight");
  EXPECT_EQ(tensor_spec(TensorRole::output).fallback, TensorRole::token_embd);
}

// Each architecture's tensors, names and GGUF shapes, written out: llama's nine per layer, qwen2's biases,
// qwen3's q/k norms, gemma3's q/k norms and post norms, in the forward pass's order.
TEST(TensorTable, EachArchitecturesTensors) {
  const Shapes globals = {{"token_embd.weight", {16, 50}}, {"output_norm.weight", {16}}, {"output.weight", {16, 50}}};
  auto layer = [](int l, bool bias, bool norms, bool post) {
    auto n = [&](const char* s) { return "blk." + std::to_string(l) + "." + s; };
    Shapes s = {{n("attn_norm.weight"), {16}}, {n("attn_q.weight"), {16, 24}}, {n("attn_k.weight"), {16, 12}},
                {n("attn_v.weight"), {16, 12}}};
    if (bias) s.insert(s.end(), {{n("attn_q.bias"), {24}}, {n("attn_k.bias"), {12}}, {n("attn_v.bias"), {12}}});
    if (norms) s.insert(s.end(), {{n("attn_q_norm.weight"), {6}}, {n("attn_k_norm.weight"), {6}}});
    s.push_back({n("attn_output.weight"), {24, 16}});
    if (post) s.push_back({n("post_attention_norm.weight"), {16}});
    s.insert(s.end(), {{n("ffn_norm.weight"), {16}}, {n("ffn_gate.weight"), {16, 40}}, {n("ffn_up.weight"), {16, 40}},
                       {n("ffn_down.weight"), {40, 16}}});
    if (post) s.push_back({n("post_ffw_norm.weight"), {16}});
    return s;
  };
  const struct {
    Arch arch;
    bool bias, norms, post;
  } archs[] = {{Arch::llama, false, false, false},
               {Arch::qwen2, true, false, false},
               {Arch::qwen3, false, true, false},
               {Arch::gemma3, false, true, true}};
  for (const auto& a : archs) {
    SCOPED_TRACE(arch_name(a.arch));
    Shapes want = globals;
    for (int l = 0; l < 2; ++l) {
      const Shapes s = layer(l, a.bias, a.norms, a.post);
      want.insert(want.end(), s.begin(), s.end());
    }
    const std::vector<ExpectedTensor> got = expected_tensors(config_of(a.arch, false));
    EXPECT_EQ(shapes_of(got), want);
    for (const ExpectedTensor& t : got) {
      EXPECT_EQ(t.name, tensor_name(t.role, t.layer));
      EXPECT_EQ(t.vocab_rows, t.role == TensorRole::token_embd || t.role == TensorRole::output) << t.name;
      EXPECT_FALSE(t.stands_in_for) << t.name;
    }
  }
}

// qwen2moe: qwen2's biases, the router and expert stacks in place of the dense FFN, then the shared expert's gate
// vector [D] and its FFN of width Fs (n_ff_shexp), as llama.cpp's qwen2moe loads them.
TEST(TensorTable, Qwen2MoeAddsTheSharedExpert) {
  ModelConfig c = config_of(Arch::qwen2moe, false);
  c.n_expert = 4, c.n_expert_used = 2, c.n_ff_exp = 8, c.n_ff_shexp = 12;
  ASSERT_TRUE(c.moe && c.moe_shexp && c.qkv_bias);
  Shapes after_norm;
  bool seen = false;
  for (const ExpectedTensor& t : expected_tensors(c)) {
    if (t.layer != 0) continue;
    if (t.name == "blk.0.ffn_norm.weight") seen = true;
    else if (seen) after_norm.emplace_back(t.name, t.ne);
  }
  const Shapes want = {{"blk.0.ffn_gate_inp.weight", {16, 4}},       {"blk.0.ffn_gate_exps.weight", {16, 8, 4}},
                       {"blk.0.ffn_up_exps.weight", {16, 8, 4}},      {"blk.0.ffn_down_exps.weight", {8, 16, 4}},
                       {"blk.0.ffn_gate_inp_shexp.weight", {16}},     {"blk.0.ffn_gate_shexp.weight", {16, 12}},
                       {"blk.0.ffn_up_shexp.weight", {16, 12}},       {"blk.0.ffn_down_shexp.weight", {12, 16}}};
  EXPECT_EQ(after_norm, want);
  int biases = 0;
  for (const ExpectedTensor& t : expected_tensors(c)) biases += t.name.ends_with(".bias");
  EXPECT_EQ(biases, 3 * 2);
}

TEST(TensorTable, TiedOutputReadsTokenEmbd) {
  const std::vector<ExpectedTensor> ts = expected_tensors(config_of(Arch::llama, true));
  for (const ExpectedTensor& t : ts) {
    EXPECT_NE(t.role, TensorRole::output);
    EXPECT_EQ(t.stands_in_for.has_value(), t.role == TensorRole::token_embd) << t.name;
  }
  EXPECT_EQ(ts.front().stands_in_for, TensorRole::output);
}

TEST(ArchNames, OneListEveryWay) {
  EXPECT_EQ(arch_names(), "llama, qwen2, qwen3, gemma3, qwen3moe, qwen2moe");
  for (Arch a : all_archs()) EXPECT_EQ(arch_from_name(arch_name(a)), a);
  EXPECT_EQ(arch_from_name("gemma2"), std::nullopt);
  EXPECT_EQ(arch_from_name(""), std::nullopt);
}

}  // namespace
}  // namespace diffrun
