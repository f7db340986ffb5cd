// Tests of name maps: rule parsing and its errors, {L} and glob patterns, repeats, archs, facts, the built-in maps.
#include <gtest/gtest.h>

#include <string>

#include "checkpoints/name_map.hpp"
#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

namespace diffrun {
namespace {

std::string mapped(const NameMap& m, std::string_view raw, int count, Arch arch = Arch::qwen2,
                   const std::map<std::string, std::string>& facts = {}) {
  auto [base, k] = split_occurrence(raw);
  auto r = m.map(base, k, count, arch, facts);
  if (!r) return "(none)";
  return r->drop ? "(drop)" : r->name;
}

TEST(NameMap, SplitOccurrence) {
  EXPECT_EQ(split_occurrence("Qcur-0#3"), std::make_pair(std::string("Qcur-0"), 3));
  EXPECT_EQ(split_occurrence("Qcur-0"), std::make_pair(std::string("Qcur-0"), 1));
  EXPECT_EQ(split_occurrence("Qcur-0#1"), std::make_pair(std::string("Qcur-0#1"), 1));  // k >= 2 only
  EXPECT_EQ(split_occurrence("a#b"), std::make_pair(std::string("a#b"), 1));
  EXPECT_EQ(split_occurrence("#2"), std::make_pair(std::string("#2"), 1));
}

TEST(NameMap, LayersRepeatsArchsFactsGlobs) {
  const NameMap m = NameMap::parse(R"json({"rules": [
      {"match": "Qcur-{L}", "occurrence": "last", "to": "Qrope-{L}"},
      {"match": "Qcur-{L}", "occurrence": "last-1", "to": "Qcur-{L}"},
      {"match": "Qcur-{L}", "drop": true},
      {"match": "x.{L}.y", "archs": ["llama"], "to": "l_out-{L}"},
      {"match": "v{L}", "when": {"flash_attn": "on"}, "to": "cache_v-{L}"},
      {"match": "v{L}", "to": "cache_k-{L}"},
      {"match": "ffn_out-{L}", "occurrence": 1, "to": "ffn_out-{L}"},
      {"match": "* (view)", "drop": true}]})json",
                                   "test");
  EXPECT_EQ(mapped(m, "Qcur-12#4", 4), "Qrope-12");
  EXPECT_EQ(mapped(m, "Qcur-12#3", 4), "Qcur-12");
  EXPECT_EQ(mapped(m, "Qcur-12#2", 4), "(drop)");
  EXPECT_EQ(mapped(m, "Qcur-12", 4), "(drop)");
  EXPECT_EQ(mapped(m, "Qcur-3", 1), "Qrope-3");
  EXPECT_EQ(mapped(m, "Qcur-x", 1), "(none)");
  EXPECT_EQ(mapped(m, "Qcur-", 1), "(none)");
  EXPECT_EQ(mapped(m, "x.7.y", 1, Arch::llama), "l_out-7");
  EXPECT_EQ(mapped(m, "x.7.y", 1, Arch::qwen3), "(none)");
  EXPECT_EQ(mapped(m, "v2", 1, Arch::qwen2, {{"flash_attn", "on"}}), "cache_v-2");
  EXPECT_EQ(mapped(m, "v2", 1, Arch::qwen2, {{"flash_attn", "off"}}), "cache_k-2");
  EXPECT_EQ(mapped(m, "ffn_out-1", 2), "ffn_out-1");
  EXPECT_EQ(mapped(m, "ffn_out-1#2", 2), "(none)");
  EXPECT_EQ(mapped(m, "k-0 (view)", 1), "(drop)");
}

TEST(NameMap, BadMapsNameTheRule) {
  auto message = [](std::string_view json) {
    try {
      NameMap::parse(json, "m.json");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("{").find("m.json: not valid JSON"), std::string::npos);
  EXPECT_NE(message(R"({"rule": []})").find("\"rules\" array"), std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "typo": 1}]})").find("rule 1: unknown key \"typo\""),
            std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a"}]})").find("exactly one of"), std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b"}, {"match": "a", "to": "b", "drop": true}]})")
                .find("rule 2 (\"a\")"),
            std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b-{L}"}]})").find("\"match\" has none"), std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "occurrence": "first"}]})").find("occurrence"),
            std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "archs": ["gpt2"]}]})").find("unknown arch \"gpt2\""),
            std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a*{L}", "to": "b"}]})").find("glob"), std::string::npos);
  EXPECT_THROW(NameMap::load("no-such-map"), InputError);
}

// Hostile maps: out-of-range occurrences, repeated keys, unknown crop letters, a huge key, a huge file.
TEST(NameMap, HostileMapsAreRefusedClearly) {
  auto message = [](const std::string& json) {
    try {
      NameMap::parse(json, "m.json");
    } catch (const InputError& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not an InputError: ") + e.what();
    }
    return std::string("no error");
  };
  const std::string big = R"({"rules": [{"match": "a", "to": "b", "occurrence": "99999999999"}]})";
  EXPECT_NE(message(big).find("occurrence \"99999999999\" is not k >= 1"), std::string::npos) << message(big);
  const std::string huge_int = R"({"rules": [{"match": "a", "to": "b", "occurrence": 1099511627776}]})";
  EXPECT_NE(message(huge_int).find("occurrence 1099511627776 is not k >= 1"), std::string::npos) << message(huge_int);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "occurrence": 0}]})").find("occurrence 0"), std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "occurrence": "last-99999999999"}]})").find("occurrence"),
            std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "to": "c"}]})").find("the key \"to\" is given twice"),
            std::string::npos);
  EXPECT_NE(message(R"({"rules": [], "rules": []})").find("\"rules\" is given twice"), std::string::npos);
  EXPECT_NE(message(R"({"rules": [{"match": "a", "to": "b", "crop": ["Q"]}]})").find("crop letter \"Q\""),
            std::string::npos);
  const std::string key(5 << 20 >> 4, 'k');  // 320 kB
  const std::string long_key = message(R"({"rules": [{"match": "a", "to": "b", ")" + key + R"(": 1}]})");
  EXPECT_NE(long_key.find("unknown key"), std::string::npos);
  EXPECT_LT(long_key.size(), 400u) << long_key.substr(0, 400);
  const std::string oversized = "{\"rules\": [], \"description\": \"" + std::string(2 << 20, 'x') + "\"}";
  EXPECT_NE(message(oversized).find("more than the 1 MiB"), std::string::npos);
  // A valid occurrence still selects its repeat.
  const NameMap m = NameMap::parse(R"({"rules": [{"match": "a", "to": "b", "occurrence": 2}]})", "m.json");
  EXPECT_EQ(mapped(m, "a#2", 2), "b");
  EXPECT_EQ(mapped(m, "a", 2), "(none)");
}

// Every target of the built-in maps is a vocabulary name for some layer.
TEST(NameMap, BuiltinMapsTargetTheVocabulary) {
  const auto names = NameMap::builtin_names();
  ASSERT_EQ(names, (std::vector<std::string>{"hf", "llamacpp"}));
  for (const auto& n : names) {
    const NameMap m = NameMap::load(n);
    EXPECT_GT(m.rules().size(), 10u) << n;
    for (const auto& r : m.rules()) {
      if (r.drop) continue;
      std::string to = r.to;
      if (auto at = to.find("{L}"); at != std::string::npos) to = to.substr(0, at) + "0" + to.substr(at + 3);
      const ParsedCheckpointName p = parse_checkpoint_name(to);
      EXPECT_NE(find_checkpoint_kind(p.base), nullptr) << n << ": " << r.match << " -> " << r.to;
      EXPECT_FALSE(r.why.empty()) << n << ": " << r.match;
    }
  }
  const NameMap llamacpp = NameMap::load("llamacpp");
  EXPECT_EQ(mapped(llamacpp, "Qcur-0#3", 3, Arch::llama), "Qrope-0");
  EXPECT_EQ(mapped(llamacpp, "Qcur-0#2", 3, Arch::llama), "Qcur-0");
  EXPECT_EQ(mapped(llamacpp, "norm-4#2", 2), "(drop)");
  EXPECT_EQ(mapped(llamacpp, "cache_v_l3", 1), "cache_v-3");
  EXPECT_EQ(mapped(llamacpp, "cache_v_l3 (view)", 1), "cache_v-3");
  EXPECT_EQ(llamacpp.map("cache_v_l3 (view)", 1, 1, Arch::qwen2)->rule->layout, "Dh,Hkv,S");
  EXPECT_EQ(mapped(llamacpp, "cache_k_l3 (view)#2", 2), "(drop)");
  EXPECT_EQ(mapped(llamacpp, "Qcur-0 (view) (permuted)", 1), "(drop)");
  EXPECT_EQ(mapped(llamacpp, "node_65", 1), "(drop)");
  EXPECT_TRUE(llamacpp.map("cache_v_l3", 1, 1, Arch::qwen2)->rule->transpose);
  EXPECT_FALSE(llamacpp.map("cache_v_l3", 1, 1, Arch::qwen2, {{"flash_attn", "on"}})->rule->transpose);
  EXPECT_EQ(mapped(NameMap::load("hf"), "model.layers.11.self_attn.q_proj", 1, Arch::qwen2), "Qcur-11");
  EXPECT_EQ(mapped(NameMap::load("hf"), "model.layers.11.self_attn.q_proj", 1, Arch::llama), "(drop)");
}

// The hf map's mixtures of experts: transformers 4 and 5 module names per architecture, each MoE kind from one
// module only (two datasets of a step mapped to one name are an error), per-expert modules dropped.
TEST(NameMap, HfMixturesOfExperts) {
  const NameMap hf = NameMap::load("hf");
  for (Arch a : {Arch::qwen3moe, Arch::qwen2moe, Arch::llama}) {
    EXPECT_EQ(mapped(hf, "model.layers.3.mlp.gate", 1, a), "ffn_moe_logits-3") << arch_name(a);
    EXPECT_EQ(mapped(hf, "model.layers.3.mlp.experts.act_fn", 1, a), "(drop)") << arch_name(a);
    EXPECT_EQ(mapped(hf, "model.layers.3.mlp.experts.5.down_proj", 1, a), "(drop)") << arch_name(a);
    EXPECT_EQ(mapped(hf, "model.layers.3.post_attention_layernorm", 1, a), "ffn_norm-3") << arch_name(a);
  }
  EXPECT_EQ(mapped(hf, "model.layers.1.self_attn.q_proj", 1, Arch::qwen3moe), "Qcur-1");
  EXPECT_EQ(mapped(hf, "model.layers.1.self_attn.k_proj", 1, Arch::qwen2moe), "Kcur-1");
  // qwen3moe: the block's output in both versions; transformers 5's experts module holds the same sum
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp", 1, Arch::qwen3moe), "ffn_moe_out-0");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.experts", 1, Arch::qwen3moe), "(drop)");
  // qwen2moe: the block adds the gated shared expert to the experts' sum
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp", 1, Arch::qwen2moe), "ffn_out-0");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.experts", 1, Arch::qwen2moe), "ffn_moe_out-0");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.shared_expert", 1, Arch::qwen2moe), "ffn_shexp-0");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.shared_expert_gate", 1, Arch::qwen2moe), "ffn_shexp_gate_inp-0");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.shared_expert.down_proj", 1, Arch::qwen2moe), "(drop)");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.shared_expert.gate_proj", 1, Arch::qwen2moe), "(drop)");
  // Mixtral (llama with experts): transformers 5's mlp.experts, transformers 4's block_sparse_moe; a dense llama's
  // mlp stays dropped
  EXPECT_EQ(mapped(hf, "model.layers.2.mlp.experts", 1, Arch::llama), "ffn_moe_out-2");
  EXPECT_EQ(mapped(hf, "model.layers.2.mlp", 1, Arch::llama), "(drop)");
  EXPECT_EQ(mapped(hf, "model.layers.2.block_sparse_moe", 1, Arch::llama), "ffn_moe_out-2");
  EXPECT_EQ(mapped(hf, "model.layers.2.block_sparse_moe.gate", 1, Arch::llama), "ffn_moe_logits-2");
  EXPECT_EQ(mapped(hf, "model.layers.2.block_sparse_moe.experts.1.w1", 1, Arch::llama), "(drop)");
  EXPECT_EQ(mapped(hf, "model.layers.2.self_attn.q_proj", 1, Arch::llama), "(drop)");
  // the dense models are unchanged
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp", 1, Arch::qwen3), "(drop)");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.down_proj", 1, Arch::qwen3), "ffn_out-0");
  EXPECT_EQ(mapped(hf, "model.layers.0.mlp.gate", 1, Arch::qwen2), "(none)");
}

}  // namespace
}  // namespace diffrun
