// Tests of the checkpoint vocabulary: order, names per architecture, layouts, shapes, filter globs, errors.
#include <cmath>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

namespace diffrun {
namespace {

ModelConfig tiny(Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.n_layer = 3;
  c.n_embd = 8;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 2;
  c.n_ff = 12;
  c.n_vocab = 17;
  c.n_ctx = 64;
  set_arch_features(c);
  return c;
}

const std::vector<std::string> kLlamaLayer = {
    "attn_norm", "Qcur", "Kcur", "Vcur", "Qrope", "Krope", "cache_k", "cache_v", "kq_soft_max", "kqv_out",
    "attn_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"};

TEST(Vocabulary, LlamaNamesInExecutionOrder) {
  const ModelConfig c = tiny(Arch::llama);
  std::vector<std::string> expected = {"tokens", "embd"};
  for (int l = 0; l < c.n_layer; ++l)
    for (const auto& b : kLlamaLayer) expected.push_back(b + "-" + std::to_string(l));
  expected.push_back("result_norm");
  expected.push_back("result_output");
  EXPECT_EQ(checkpoint_names(c), expected);
  EXPECT_EQ(checkpoint_names(tiny(Arch::qwen2)), expected);
  EXPECT_EQ(checkpoints_per_layer(c), 18);
}

TEST(Vocabulary, Qwen3AddsQnormKnormBeforeRope) {
  const ModelConfig c = tiny(Arch::qwen3);
  const auto names = checkpoint_names(c);
  ASSERT_EQ(names.size(), 2u + 3u * 20u + 2u);
  EXPECT_EQ(checkpoints_per_layer(c), 20);
  const std::vector<std::string> layer0(names.begin() + 2, names.begin() + 22);
  const std::vector<std::string> expected = {
      "attn_norm-0", "Qcur-0", "Kcur-0", "Vcur-0", "Qnorm-0", "Knorm-0", "Qrope-0", "Krope-0", "cache_k-0",
      "cache_v-0", "kq_soft_max-0", "kqv_out-0", "attn_out-0", "ffn_inp-0", "ffn_norm-0", "ffn_gate-0",
      "ffn_up-0", "ffn_swiglu-0", "ffn_out-0", "l_out-0"};
  EXPECT_EQ(layer0, expected);
  EXPECT_EQ(names[22], "attn_norm-1");
}

// Gemma 3 as llama.cpp's gemma3 graph: inp_scaled after embd, q/k norms, a norm after attention and
// after the FFN, GeGLU in place of SwiGLU.
TEST(Vocabulary, Gemma3AddsScaledEmbeddingPostNormsAndGeglu) {
  const ModelConfig c = tiny(Arch::gemma3);
  const auto names = checkpoint_names(c);
  EXPECT_EQ(checkpoints_per_layer(c), 22);
  ASSERT_EQ(names.size(), 3u + 3u * 22u + 2u);
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + 3),
            (std::vector<std::string>{"tokens", "embd", "inp_scaled"}));
  const std::vector<std::string> layer0(names.begin() + 3, names.begin() + 25);
  const std::vector<std::string> expected = {
      "attn_norm-0", "Qcur-0", "Kcur-0", "Vcur-0", "Qnorm-0", "Knorm-0", "Qrope-0", "Krope-0", "cache_k-0",
      "cache_v-0", "kq_soft_max-0", "kqv_out-0", "attn_out-0", "attn_post_norm-0", "ffn_inp-0", "ffn_norm-0",
      "ffn_gate-0", "ffn_up-0", "ffn_geglu-0", "ffn_out-0", "ffn_post_norm-0", "l_out-0"};
  EXPECT_EQ(layer0, expected);
  EXPECT_EQ(names.back(), "result_output");
  EXPECT_THROW(checkpoint_order(c, "ffn_swiglu", 0), InputError);
  EXPECT_THROW(checkpoint_order(tiny(Arch::llama), "inp_scaled", -1), InputError);
  // The dataflow: the first layer reads inp_scaled, ffn_inp the post-normed attention, l_out the post-normed FFN.
  const auto all = [](const std::string&) { return true; };
  EXPECT_EQ(checkpoint_inputs("attn_norm", 0, 3, all), std::vector<std::string>{"inp_scaled"});
  EXPECT_EQ(checkpoint_inputs("ffn_inp", 1, 3, all), (std::vector<std::string>{"attn_post_norm-1", "l_out-0"}));
  const auto gemma = [](const std::string& n) { return n.find("ffn_shexp") == std::string::npos; };
  EXPECT_EQ(checkpoint_inputs("ffn_out", 1, 3, gemma), std::vector<std::string>{"ffn_geglu-1"});
  const auto llama = [](const std::string& n) { return n.find("post_norm") == std::string::npos &&
                                                       n.find("geglu") == std::string::npos && n != "inp_scaled" &&
                                                       n.find("shexp") == std::string::npos; };
  EXPECT_EQ(checkpoint_inputs("attn_norm", 0, 3, llama), std::vector<std::string>{"embd"});
  EXPECT_EQ(checkpoint_inputs("ffn_out", 1, 3, llama), std::vector<std::string>{"ffn_swiglu-1"});
  EXPECT_EQ(checkpoint_inputs("l_out", 2, 3, llama), (std::vector<std::string>{"ffn_out-2", "ffn_inp-2"}));
}

// A mixture of experts (qwen3moe, or llama with experts): the routing kinds in place of the dense FFN's, in
// build_moe_ffn's order, and the dataflow from ffn_norm through the routing to l_out.
TEST(Vocabulary, MoeReplacesTheDenseFfnWithTheRouting) {
  for (Arch a : {Arch::qwen3moe, Arch::llama}) {
    ModelConfig c = tiny(a);
    c.n_expert = 8, c.n_expert_used = 2, c.n_ff_exp = 16, c.moe = true;
    std::vector<std::string> after_norm;
    bool seen = false;
    for (const std::string& n : checkpoint_names(c)) {
      if (n == "ffn_norm-0") seen = true;
      else if (seen && n.ends_with("-0")) after_norm.push_back(n);
    }
    const std::vector<std::string> expected = {
        "ffn_moe_logits-0", "ffn_moe_probs-0", "ffn_moe_topk-0", "ffn_moe_weights-0", "ffn_moe_weights_norm-0",
        "ffn_moe_gate-0", "ffn_moe_up-0", "ffn_moe_swiglu-0", "ffn_moe_down-0", "ffn_moe_out-0", "l_out-0"};
    EXPECT_EQ(after_norm, expected) << arch_name(a);
    EXPECT_THROW(checkpoint_order(c, "ffn_gate", 0), InputError);
    EXPECT_EQ(checkpoint_shape(c, *find_checkpoint_kind("ffn_moe_down"), 5, 5), (std::vector<int64_t>{5, 2, c.n_embd}));
    EXPECT_EQ(checkpoint_shape(c, *find_checkpoint_kind("ffn_moe_probs"), 5, 5), (std::vector<int64_t>{5, 8}));
    EXPECT_EQ(checkpoint_shape(c, *find_checkpoint_kind("ffn_moe_gate"), 5, 5), (std::vector<int64_t>{5, 2, 16}));
  }
  EXPECT_THROW(checkpoint_order(tiny(Arch::llama), "ffn_moe_topk", 0), InputError);  // a dense llama
  const auto moe = [](const std::string& n) { return n.find("ffn_out") == std::string::npos && n.find("post_norm") == std::string::npos; };
  EXPECT_EQ(checkpoint_inputs("l_out", 1, 2, moe), (std::vector<std::string>{"ffn_moe_out-1", "ffn_inp-1"}));
  EXPECT_EQ(checkpoint_inputs("ffn_moe_out", 1, 2, moe),
            (std::vector<std::string>{"ffn_moe_down-1", "ffn_moe_weights_norm-1"}));
  EXPECT_EQ(checkpoint_inputs("ffn_moe_logits", 0, 2, moe), std::vector<std::string>{"ffn_norm-0"});
}

// qwen2moe: the routing without renormalised weights (llama.cpp's norm_w false), then the shared expert (its gate
// logit, the sigmoid, its FFN, the gated output) and ffn_out, the sum of both, as llama.cpp's qwen2moe graph.
TEST(Vocabulary, Qwen2MoeAddsTheSharedExpertAfterTheRouting) {
  ModelConfig c = tiny(Arch::qwen2moe);
  c.n_expert = 8, c.n_expert_used = 2, c.n_ff_exp = 16, c.n_ff_shexp = 24;
  ASSERT_TRUE(c.moe && c.moe_shexp && c.qkv_bias && !c.expert_weights_norm);
  std::vector<std::string> after_norm;
  bool seen = false;
  for (const std::string& n : checkpoint_names(c)) {
    if (n == "ffn_norm-0") seen = true;
    else if (seen && n.ends_with("-0")) after_norm.push_back(n);
  }
  const std::vector<std::string> expected = {
      "ffn_moe_logits-0", "ffn_moe_probs-0", "ffn_moe_topk-0", "ffn_moe_weights-0", "ffn_moe_gate-0",
      "ffn_moe_up-0", "ffn_moe_swiglu-0", "ffn_moe_down-0", "ffn_moe_out-0", "ffn_shexp_gate_inp-0",
      "ffn_shexp_gate-0", "ffn_shexp-0", "ffn_shexp_out-0", "ffn_out-0", "l_out-0"};
  EXPECT_EQ(after_norm, expected);
  EXPECT_THROW(checkpoint_order(c, "ffn_moe_weights_norm", 0), InputError);
  EXPECT_THROW(checkpoint_order(tiny(Arch::qwen3moe), "ffn_shexp", 0), InputError);
  EXPECT_THROW(checkpoint_order(tiny(Arch::qwen3moe), "ffn_out", 0), InputError);
  EXPECT_EQ(checkpoint_shape(c, *find_checkpoint_kind("ffn_shexp_gate"), 5, 5), (std::vector<int64_t>{5}));
  EXPECT_EQ(checkpoint_shape(c, *find_checkpoint_kind("ffn_shexp"), 5, 5), (std::vector<int64_t>{5, c.n_embd}));
  const auto recorded = [](const std::string& n) { return n.find("weights_norm") == std::string::npos &&
                                                          n.find("swiglu") == std::string::npos &&
                                                          n.find("geglu") == std::string::npos &&
                                                          n.find("post_norm") == std::string::npos; };
  EXPECT_EQ(checkpoint_inputs("ffn_moe_out", 1, 2, recorded),
            (std::vector<std::string>{"ffn_moe_down-1", "ffn_moe_weights-1"}));
  EXPECT_EQ(checkpoint_inputs("ffn_shexp_out", 1, 2, recorded),
            (std::vector<std::string>{"ffn_shexp-1", "ffn_shexp_gate-1"}));
  EXPECT_EQ(checkpoint_inputs("ffn_out", 1, 2, recorded),
            (std::vector<std::string>{"ffn_moe_out-1", "ffn_shexp_out-1"}));
  EXPECT_EQ(checkpoint_inputs("l_out", 1, 2, recorded), (std::vector<std::string>{"ffn_out-1", "ffn_inp-1"}));
}

TEST(Vocabulary, OrderIsIndexInTheFullList) {
  for (Arch a : all_archs()) {
    const ModelConfig c = tiny(a);
    const auto names = checkpoint_names(c);
    for (size_t i = 0; i < names.size(); ++i) {
      const auto p = parse_checkpoint_name(names[i]);
      EXPECT_EQ(checkpoint_order(c, p.base, p.layer), static_cast<int>(i)) << names[i];
    }
  }
  const ModelConfig c = tiny(Arch::llama);
  EXPECT_EQ(checkpoint_order(c, "tokens", -1), 0);
  EXPECT_EQ(checkpoint_order(c, "embd", -1), 1);
  EXPECT_EQ(checkpoint_order(c, "attn_norm", 1), 2 + 18);
  EXPECT_EQ(checkpoint_order(c, "result_output", -1), 2 + 3 * 18 + 1);
}

TEST(Vocabulary, OrderRejectsNamesTheConfigDoesNotEmit) {
  const ModelConfig c = tiny(Arch::llama);
  EXPECT_THROW(checkpoint_order(c, "Qnorm", 0), InputError);       // qwen3 only
  EXPECT_THROW(checkpoint_order(c, "bogus", -1), InputError);      // unknown
  EXPECT_THROW(checkpoint_order(c, "Qcur", 3), InputError);        // layer out of range
  EXPECT_THROW(checkpoint_order(c, "Qcur", -1), InputError);       // per-layer without a layer
  EXPECT_THROW(checkpoint_order(c, "result_norm", 0), InputError); // not per-layer
  try {
    checkpoint_order(c, "Qcur", 7);
    FAIL() << "no throw";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("Qcur-7"), std::string::npos) << e.what();
  }
}

TEST(Vocabulary, Layouts) {
  auto layout = [](const char* b) { return std::string(find_checkpoint_kind(b)->layout); };
  EXPECT_EQ(layout("tokens"), "T");
  for (const char* b : {"embd", "attn_norm", "attn_out", "ffn_inp", "ffn_norm", "ffn_out", "l_out", "result_norm"})
    EXPECT_EQ(layout(b), "T,D") << b;
  for (const char* b : {"Qcur", "Qnorm", "Qrope", "kqv_out"}) EXPECT_EQ(layout(b), "T,H,Dh") << b;
  for (const char* b : {"Kcur", "Knorm", "Krope", "Vcur"}) EXPECT_EQ(layout(b), "T,Hkv,Dh") << b;
  for (const char* b : {"cache_k", "cache_v"}) EXPECT_EQ(layout(b), "S,Hkv,Dh") << b;
  EXPECT_EQ(layout("kq_soft_max"), "H,T,S");
  for (const char* b : {"ffn_gate", "ffn_up", "ffn_swiglu"}) EXPECT_EQ(layout(b), "T,F") << b;
  EXPECT_EQ(layout("result_output"), "T,V");
  EXPECT_EQ(find_checkpoint_kind("nope"), nullptr);
  EXPECT_EQ(layout_dims("S,Hkv,Dh"), (std::vector<std::string>{"S", "Hkv", "Dh"}));
  EXPECT_EQ(layout_dims("T"), (std::vector<std::string>{"T"}));
  using Factors = std::vector<std::vector<std::string>>;
  EXPECT_EQ(layout_factors("T,H*Dh"), (Factors{{"T"}, {"H", "Dh"}}));
  EXPECT_EQ(layout_factors("S,Hkv,Dh"), (Factors{{"S"}, {"Hkv"}, {"Dh"}}));
  EXPECT_EQ(layout_factors(""), Factors{});
}

TEST(Vocabulary, Shapes) {
  const ModelConfig c = tiny(Arch::qwen3);
  auto shape = [&](const char* b) { return checkpoint_shape(c, *find_checkpoint_kind(b), 5, 9); };
  EXPECT_EQ(shape("tokens"), (std::vector<int64_t>{5}));
  EXPECT_EQ(shape("embd"), (std::vector<int64_t>{5, 8}));
  EXPECT_EQ(shape("Qnorm"), (std::vector<int64_t>{5, 4, 2}));
  EXPECT_EQ(shape("Krope"), (std::vector<int64_t>{5, 2, 2}));
  EXPECT_EQ(shape("cache_v"), (std::vector<int64_t>{9, 2, 2}));
  EXPECT_EQ(shape("kq_soft_max"), (std::vector<int64_t>{4, 5, 9}));
  EXPECT_EQ(shape("ffn_up"), (std::vector<int64_t>{5, 12}));
  EXPECT_EQ(shape("result_output"), (std::vector<int64_t>{5, 17}));
}

TEST(Vocabulary, NamesParseAndFormat) {
  EXPECT_EQ(checkpoint_name("Qcur", 3), "Qcur-3");
  EXPECT_EQ(checkpoint_name("embd", -1), "embd");
  auto p = parse_checkpoint_name("kq_soft_max-12");
  EXPECT_EQ(p.base, "kq_soft_max");
  EXPECT_EQ(p.layer, 12);
  p = parse_checkpoint_name("result_output");
  EXPECT_EQ(p.base, "result_output");
  EXPECT_EQ(p.layer, -1);
  p = parse_checkpoint_name("Qcur-x");
  EXPECT_EQ(p.base, "Qcur-x");
  EXPECT_EQ(p.layer, -1);
  p = parse_checkpoint_name("Qcur-");
  EXPECT_EQ(p.layer, -1);
}

TEST(Vocabulary, ArchsAndJson) {
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("Knorm")), (std::vector<Arch>{Arch::qwen3, Arch::gemma3, Arch::qwen3moe}));
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("Kcur")).size(), 6u);
  // llama emits the routing kinds only with experts (Mixtral), which kind_archs' default config has not.
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("ffn_moe_topk")), (std::vector<Arch>{Arch::qwen3moe, Arch::qwen2moe}));
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("ffn_moe_weights_norm")), std::vector<Arch>{Arch::qwen3moe});
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("ffn_shexp_out")), std::vector<Arch>{Arch::qwen2moe});
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("ffn_out")),
            (std::vector<Arch>{Arch::llama, Arch::qwen2, Arch::qwen3, Arch::gemma3, Arch::qwen2moe}));
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("ffn_swiglu")), (std::vector<Arch>{Arch::llama, Arch::qwen2, Arch::qwen3}));
  EXPECT_EQ(kind_archs(*find_checkpoint_kind("ffn_geglu")), std::vector<Arch>{Arch::gemma3});
  const auto doc = nlohmann::json::parse(vocabulary_json());
  ASSERT_EQ(doc["kinds"].size(), checkpoint_kinds().size());
  EXPECT_EQ(doc["kinds"][0]["base"], "tokens");
  EXPECT_EQ(doc["kinds"][7]["base"], "Qnorm");
  EXPECT_EQ(doc["kinds"][7]["archs"], nlohmann::json::array({"qwen3", "gemma3", "qwen3moe"}));
  EXPECT_EQ(doc["kinds"][4]["layout"], "T,H,Dh");
  EXPECT_EQ(doc["kinds"][4]["per_layer"], true);
}

// Every dataflow input names a kind of the vocabulary that runs before it (or the previous/last
// layer's), and the lists resolve per layer with their alternatives.
TEST(Vocabulary, DataflowInputsNameEarlierKinds) {
  const auto& kinds = checkpoint_kinds();
  for (size_t i = 0; i < kinds.size(); ++i) {
    std::string_view list = kinds[i].inputs;
    while (!list.empty()) {
      const size_t end = std::min(list.find_first_of(",|"), list.size());
      std::string_view name = list.substr(0, end);
      list.remove_prefix(std::min(end + 1, list.size()));
      if (name.starts_with('?')) name.remove_prefix(1);  // an operand only where recorded
      const bool other_layer = name.find('@') != std::string_view::npos;
      name = name.substr(0, name.find('@'));
      const CheckpointKind* k = find_checkpoint_kind(name);
      ASSERT_NE(k, nullptr) << kinds[i].base << " names an unknown input '" << name << "'";
      if (!other_layer) {
        EXPECT_LT(k - kinds.data(), static_cast<ptrdiff_t>(i)) << kinds[i].base << " <- " << name;
      }
    }
  }
  // What a llama dump records: every kind but gemma3's.
  const auto all = [](const std::string& n) {
    return n.find("post_norm") == std::string::npos && n.find("geglu") == std::string::npos && n != "inp_scaled";
  };
  const auto no_cache = [&](const std::string& n) { return all(n) && n.rfind("cache_", 0) != 0; };
  using V = std::vector<std::string>;
  EXPECT_EQ(checkpoint_inputs("kqv_out", 2, 4, all), (V{"kq_soft_max-2", "cache_v-2"}));
  EXPECT_EQ(checkpoint_inputs("kqv_out", 2, 4, no_cache), (V{"kq_soft_max-2", "Vcur-2"}));
  EXPECT_EQ(checkpoint_inputs("ffn_inp", 3, 4, all), (V{"attn_out-3", "l_out-2"}));
  EXPECT_EQ(checkpoint_inputs("attn_norm", 0, 4, all), V{"embd"});
  EXPECT_EQ(checkpoint_inputs("result_norm", -1, 4, all), V{"l_out-3"});
  EXPECT_EQ(checkpoint_inputs("result_norm", -1, 0, all), V{"embd"});
  EXPECT_TRUE(checkpoint_inputs("tokens", -1, 4, all).empty());
  EXPECT_TRUE(checkpoint_inputs("not_a_kind", 0, 4, all).empty());
}

TEST(Filter, GlobsOverFullNames) {
  const CheckpointFilter f("attn_*,result_*");
  EXPECT_TRUE(f.matches("attn_norm-0"));
  EXPECT_TRUE(f.matches("attn_out-11"));
  EXPECT_TRUE(f.matches("result_output"));
  EXPECT_FALSE(f.matches("ffn_out-0"));
  EXPECT_FALSE(f.matches("kq_soft_max-0"));
  EXPECT_FALSE(f.all());

  const CheckpointFilter layer0("*-0");
  EXPECT_TRUE(layer0.matches("Qcur-0"));
  EXPECT_FALSE(layer0.matches("Qcur-10"));
  EXPECT_FALSE(layer0.matches("embd"));

  const CheckpointFilter q("?cur-1?, l_out-*");
  EXPECT_TRUE(q.matches("Kcur-12"));
  EXPECT_FALSE(q.matches("Kcur-1"));
  EXPECT_TRUE(q.matches("l_out-3"));
  EXPECT_EQ(q.spec(), "?cur-1?, l_out-*");
}

TEST(Filter, DefaultAndEmptySpecMatchEverything) {
  EXPECT_TRUE(CheckpointFilter().all());
  EXPECT_TRUE(CheckpointFilter().matches("anything"));
  EXPECT_TRUE(CheckpointFilter("").all());
}

TEST(Filter, EmptyPatternIsAnInputError) {
  EXPECT_THROW(CheckpointFilter("attn_*,"), InputError);
  EXPECT_THROW(CheckpointFilter(",attn_*"), InputError);
  EXPECT_THROW(CheckpointFilter("a,,b"), InputError);
  EXPECT_THROW(CheckpointFilter(" "), InputError);
  try {
    CheckpointFilter("attn_*,,x");
    FAIL() << "no throw";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("attn_*,,x"), std::string::npos) << e.what();
  }
}

TEST(Glob, Matcher) {
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("", ""));
  EXPECT_FALSE(glob_match("", "a"));
  EXPECT_TRUE(glob_match("a*b*c", "aXXbYYc"));
  EXPECT_FALSE(glob_match("a*b*c", "aXXbYY"));
  EXPECT_TRUE(glob_match("*-1", "Qcur-1"));
  EXPECT_FALSE(glob_match("*-1", "Qcur-11x"));
  EXPECT_TRUE(glob_match("**a", "bba"));
  EXPECT_FALSE(glob_match("?", ""));
  EXPECT_TRUE(glob_match("Qcur-?", "Qcur-3"));
  EXPECT_FALSE(glob_match("qcur-3", "Qcur-3"));  // case-sensitive, like the names
}

TEST(NativeDType, Names) {
  EXPECT_STREQ(native_dtype_name(NativeDType::f16), "f16");
  EXPECT_STREQ(native_dtype_name(NativeDType::bf16), "bf16");
  EXPECT_STREQ(native_dtype_name(NativeDType::f32), "f32");
  EXPECT_STREQ(native_dtype_name(NativeDType::f64), "f64");
  EXPECT_STREQ(native_dtype_name(NativeDType::i32), "i32");
}

// The expert ids both backends read back from ffn_moe_topk (an isolation replay's are the reference's): whole numbers
// within the experts, else an InputError naming the checkpoint and the value.
TEST(Vocabulary, CheckedExpertIdNamesTheCheckpoint) {
  EXPECT_EQ(checked_expert_id(3.0, 8, 2), 3);
  EXPECT_EQ(checked_expert_id(0.0, 8, 0), 0);
  for (double bad : {2.5, -1.0, 8.0, std::nan("")}) {
    try {
      checked_expert_id(bad, 8, 2);
      ADD_FAILURE() << bad << " was taken as an expert id";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("ffn_moe_topk-2 holds"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not an expert id in 0..7"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace diffrun
