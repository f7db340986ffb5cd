// ModelConfig and tensor validation: SmolLM2 and the fixtures as written by other tools, crafted metadata for errors.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "tests/gguf_builder.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;
using test::GgufBuilder;

std::set<std::string> names_of(const std::vector<ExpectedTensor>& ts) {
  std::set<std::string> s;
  for (const auto& t : ts) s.insert(t.name);
  return s;
}

std::set<std::string> names_of(const GgufFile& f) {
  std::set<std::string> s;
  for (const auto& t : f.tensors()) s.insert(t.name);
  return s;
}

TEST(ConfigReal, SmolLM2) {
  const std::string model = test::smollm2_path();
  if (!fs::exists(model)) GTEST_SKIP() << "SmolLM2 not fetched (" << model << "); run scripts/fetch_models";
  auto f = GgufFile::open(model);
  const ModelConfig c = config_from_gguf(*f);
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_EQ(c.n_layer, 30);
  EXPECT_EQ(c.n_embd, 576);
  EXPECT_EQ(c.n_head, 9);
  EXPECT_EQ(c.n_head_kv, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.n_ff, 1536);
  EXPECT_EQ(c.n_vocab, 49152);
  EXPECT_EQ(c.n_ctx, 8192);
  EXPECT_EQ(c.rope_theta, 100000.0);
  EXPECT_EQ(c.rms_eps, static_cast<double>(1e-5f));
  EXPECT_EQ(c.rope_type, RopeType::norm);
  EXPECT_TRUE(c.tied_output);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_NO_THROW(validate_tensors(*f, c));
  // The forward pass reads exactly the tensors the file has.
  EXPECT_EQ(names_of(expected_tensors(c)), names_of(*f));
  const std::string d = describe(c);
  for (const char* part : {"llama", "30 layers", "576", "49152", "norm", "tied"})
    EXPECT_NE(d.find(part), std::string::npos) << part << " not in: " << d;
}

// Gemma 3 270M as llama.cpp reads it: 18 layers, layers 5, 11 and 17 global (the default pattern of 6),
// local layers on RoPE base 10000 with a window of 512, q·k scaled by 1/sqrt(key_length = 256), no
// softcap in the metadata, tied output, and the post-norm tensors present.
TEST(ConfigReal, Gemma3) {
  const std::string model = test::gemma3_path();
  if (!fs::exists(model)) GTEST_SKIP() << "Gemma 3 270M not fetched (" << model << "); run scripts/fetch_models gemma3";
  auto f = GgufFile::open(model);
  const ModelConfig c = config_from_gguf(*f);
  EXPECT_EQ(c.arch, Arch::gemma3);
  EXPECT_EQ(c.n_layer, 18);
  EXPECT_EQ(c.n_embd, 640);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.n_head_kv, 1);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_ff, 2048);
  EXPECT_EQ(c.n_vocab, 262144);
  EXPECT_EQ(c.rope_type, RopeType::neox);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_theta_swa, 10000.0);
  EXPECT_EQ(c.sliding_window, 512);
  for (int l = 0; l < 18; ++l) EXPECT_EQ(c.layer_is_swa(l), l % 6 != 5) << "layer " << l;
  EXPECT_DOUBLE_EQ(c.attention_scale(), 1.0 / 16.0);
  EXPECT_EQ(c.final_logit_softcap, 0.0);
  EXPECT_TRUE(c.tied_output && c.qk_norm && c.post_norms && c.embd_scale);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.ffn_act, FfnAct::gelu_tanh);
  EXPECT_NO_THROW(validate_tensors(*f, c));
  EXPECT_EQ(names_of(expected_tensors(c)), names_of(*f));
}

TEST(ConfigReal, EveryFixture) {
  const std::string dir = test::fixture_path("");
  std::vector<fs::path> files;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".gguf" && e.path().filename().string().rfind("tiny-", 0) == 0)
        files.push_back(e.path());
  if (files.empty()) GTEST_SKIP() << "no tiny-*.gguf fixtures in " << dir << " (ctest fixture tiny_models)";
  std::sort(files.begin(), files.end());
  int seen[3] = {0, 0, 0};
  for (const auto& p : files) {
    SCOPED_TRACE(p.string());
    const std::string name = p.filename().string();
    auto f = GgufFile::open(p.string());
    const ModelConfig c = config_from_gguf(*f);
    ASSERT_NO_THROW(validate_tensors(*f, c));
    std::set<std::string> in_file = names_of(*f);
    // rope_freqs.weight (tiny-llama3rope) is read into the config, not among the weights.
    EXPECT_EQ(in_file.erase("rope_freqs.weight") == 1, name.find("llama3rope") != std::string::npos);
    EXPECT_EQ(c.rope_freq_factors.size(), name.find("llama3rope") != std::string::npos ? 32u : 0u);
    EXPECT_EQ(names_of(expected_tensors(c)), in_file);
    EXPECT_EQ(c.n_vocab, static_cast<int>(f->get_string_array("tokenizer.ggml.tokens").size()));
    EXPECT_EQ(c.n_embd, 256);
    EXPECT_EQ(c.n_ff, 512);
    EXPECT_EQ(c.n_layer, name.rfind("tiny-gemma3", 0) == 0 ? 6 : 2);
    EXPECT_EQ(c.n_head % c.n_head_kv, 0);
    EXPECT_EQ(c.notes.empty(), name.rfind("tiny-mistral", 0) != 0);
    if (name.rfind("tiny-gemma3", 0) == 0) {
      // scripts/fixturegen/models.py EXTRA: window 8 on layers 0-4 (layer 5 global), softcap 30.
      EXPECT_EQ(c.arch, Arch::gemma3);
      EXPECT_EQ(c.rope_type, RopeType::neox);
      EXPECT_TRUE(c.qk_norm && c.post_norms && c.embd_scale);
      EXPECT_EQ(c.ffn_act, FfnAct::gelu_tanh);
      EXPECT_EQ(c.head_dim, 128);
      EXPECT_EQ(c.sliding_window, 8);
      EXPECT_EQ(c.swa_layers, (std::vector<uint8_t>{1, 1, 1, 1, 1, 0}));
      EXPECT_EQ(c.layer_window(4), 8);
      EXPECT_EQ(c.layer_window(5), 0);
      EXPECT_EQ(c.layer_rope_theta(0), 10000.0);
      EXPECT_EQ(c.layer_rope_theta(5), 1e6);
      EXPECT_DOUBLE_EQ(c.attention_scale(), 1.0 / std::sqrt(128.0));
      EXPECT_DOUBLE_EQ(c.final_logit_softcap, 30.0);
    } else if (name.rfind("tiny-mistral", 0) == 0) {
      // llama with llama.attention.sliding_window = 8: read, not applied (llama.cpp's llama attends every
      // earlier position), and said.
      EXPECT_EQ(c.arch, Arch::llama);
      EXPECT_EQ(c.sliding_window, 0);
      EXPECT_TRUE(c.swa_layers.empty());
      EXPECT_EQ(c.layer_window(0), 0);
      ASSERT_EQ(c.notes.size(), 1u);
      EXPECT_EQ(c.notes[0].rfind("llama.attention.sliding_window = 8 is not applied", 0), 0u) << c.notes[0];
      EXPECT_NE(describe(c).find("note: " + c.notes[0]), std::string::npos) << describe(c);
    } else if (name.rfind("tiny-qwen3moe", 0) == 0) {
      // scripts/fixturegen/models.py MOE: 8 experts of width 128, 2 per token, renormalised.
      EXPECT_EQ(c.arch, Arch::qwen3moe);
      EXPECT_TRUE(c.moe && c.qk_norm && c.expert_weights_norm);
      EXPECT_EQ(c.n_expert, 8);
      EXPECT_EQ(c.n_expert_used, 2);
      EXPECT_EQ(c.n_ff_exp, 128);
      EXPECT_NE(describe(c).find("8 experts (E) of width 128 (Fe), 2 used per token (K)"), std::string::npos);
    } else if (name.rfind("tiny-qwen2moe", 0) == 0) {
      // scripts/fixturegen/models.py MOE: qwen2's biases, 8 experts of width 128, 2 per token, not renormalised,
      // and a shared expert of width 384 (expert_shared_feed_forward_length).
      EXPECT_EQ(c.arch, Arch::qwen2moe);
      EXPECT_TRUE(c.moe && c.moe_shexp && c.qkv_bias && !c.qk_norm && !c.expert_weights_norm && !c.tied_output);
      EXPECT_EQ(c.rope_type, RopeType::neox);
      EXPECT_EQ(c.n_expert, 8);
      EXPECT_EQ(c.n_expert_used, 2);
      EXPECT_EQ(c.n_ff_exp, 128);
      EXPECT_EQ(c.n_ff_shexp, 384);
      EXPECT_NE(describe(c).find("a shared expert of width 384 gated by a sigmoid"), std::string::npos);
    } else if (name.rfind("tiny-mixtral", 0) == 0) {
      // llama with llama.expert_count 4: the experts are feed_forward_length wide.
      EXPECT_EQ(c.arch, Arch::llama);
      EXPECT_TRUE(c.moe && !c.qk_norm);
      EXPECT_EQ(c.n_expert, 4);
      EXPECT_EQ(c.n_expert_used, 2);
      EXPECT_EQ(c.n_ff_exp, c.n_ff);
    } else if (name.rfind("tiny-llama", 0) == 0) {
      ++seen[0];
      EXPECT_EQ(c.arch, Arch::llama);
      EXPECT_FALSE(c.moe);
      EXPECT_EQ(c.rope_type, RopeType::norm);
      EXPECT_EQ(c.tied_output, name.find("-tied-") != std::string::npos);
      EXPECT_LT(c.n_head_kv, c.n_head) << "tiny llama has GQA";
    } else if (name.rfind("tiny-qwen2", 0) == 0) {
      ++seen[1];
      EXPECT_EQ(c.arch, Arch::qwen2);
      EXPECT_EQ(c.rope_type, RopeType::neox);
      EXPECT_TRUE(c.qkv_bias);
      EXPECT_FALSE(c.qk_norm);
    } else if (name.rfind("tiny-qwen3", 0) == 0) {
      ++seen[2];
      EXPECT_EQ(c.arch, Arch::qwen3);
      EXPECT_FALSE(c.moe);
      EXPECT_EQ(c.rope_type, RopeType::neox);
      EXPECT_TRUE(c.qk_norm);
      EXPECT_FALSE(c.qkv_bias);
    }
  }
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
}

// ---- crafted models: D 8, H 2, Hkv 1, Dh 4, F 16, V 5, one layer, F32 zeros ----

struct Tensor {
  std::string name;
  std::vector<uint64_t> ne;
  uint32_t type = 0;  // F32
};

struct Spec {
  std::string arch = "llama";
  std::vector<std::pair<std::string, uint32_t>> ints;
  std::vector<std::pair<std::string, float>> floats;
  std::vector<std::pair<std::string, std::string>> strings;
  int n_vocab = 5;
  std::vector<Tensor> tensors;
};

Spec llama_spec() {
  Spec s;
  s.ints = {{"block_count", 1}, {"embedding_length", 8}, {"feed_forward_length", 16}, {"attention.head_count", 2},
            {"attention.head_count_kv", 1}, {"context_length", 64}};
  s.floats = {{"attention.layer_norm_rms_epsilon", 1e-6f}, {"rope.freq_base", 5e5f}};
  s.tensors = {{"token_embd.weight", {8, 5}},       {"output_norm.weight", {8}},
               {"output.weight", {8, 5}},           {"blk.0.attn_norm.weight", {8}},
               {"blk.0.attn_q.weight", {8, 8}},     {"blk.0.attn_k.weight", {8, 4}},
               {"blk.0.attn_v.weight", {8, 4}},     {"blk.0.attn_output.weight", {8, 8}},
               {"blk.0.ffn_norm.weight", {8}},      {"blk.0.ffn_gate.weight", {8, 16}},
               {"blk.0.ffn_up.weight", {8, 16}},    {"blk.0.ffn_down.weight", {16, 8}}};
  return s;
}

uint64_t tensor_bytes(const Tensor& t) {
  uint64_t n = 1;
  for (uint64_t d : t.ne) n *= d;
  return t.type == 0 ? n * 4 : (n / ggml_block_elements(static_cast<GgmlType>(t.type))) *
                                   ggml_block_bytes(static_cast<GgmlType>(t.type));
}

std::string write_spec(const Spec& s, const std::string& path) {
  GgufBuilder b;
  const size_t n_kv = 2 + s.ints.size() + s.floats.size() + s.strings.size();
  b.header(s.tensors.size(), n_kv);
  b.kv_string("general.architecture", s.arch);
  for (const auto& [k, v] : s.ints) b.kv_u32(s.arch + "." + k, v);
  for (const auto& [k, v] : s.floats) b.kv_f32(s.arch + "." + k, v);
  for (const auto& [k, v] : s.strings) b.kv_string(s.arch + "." + k, v);
  std::vector<std::string> tokens;
  for (int i = 0; i < s.n_vocab; ++i) tokens.push_back(std::string(1, static_cast<char>('a' + i % 26)) + std::to_string(i));
  b.kv_string_array("tokenizer.ggml.tokens", tokens);
  uint64_t offset = 0;
  for (const Tensor& t : s.tensors) {
    b.tensor_info(t.name, t.ne, t.type, offset);
    offset += (tensor_bytes(t) + 31) / 32 * 32;
  }
  b.pad_to(32).zeros(offset);
  return b.write(path);
}

class ConfigCrafted : public ::testing::Test {
 protected:
  test::ScratchDir scratch{"config"};
  int n = 0;
  std::unique_ptr<GgufFile> open(const Spec& s) {
    return GgufFile::open(write_spec(s, scratch.path + "/m" + std::to_string(n++) + ".gguf"));
  }
  // The ModelError message of config_from_gguf + validate_tensors, or "" when both pass.
  std::string error_of(const Spec& s) {
    auto f = open(s);
    try {
      validate_tensors(*f, config_from_gguf(*f));
    } catch (const ModelError& e) {
      return e.what();
    }
    return "";
  }
};

void set_int(Spec& s, const std::string& key, uint32_t v) {
  for (auto& [k, val] : s.ints)
    if (k == key) {
      val = v;
      return;
    }
  s.ints.push_back({key, v});
}

void drop_int(Spec& s, const std::string& key) {
  std::erase_if(s.ints, [&](const auto& kv) { return kv.first == key; });
}

Tensor& tensor_named(Spec& s, const std::string& name) {
  for (auto& t : s.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

TEST_F(ConfigCrafted, LlamaValuesAndDefaults) {
  Spec s = llama_spec();
  auto f = open(s);
  ModelConfig c = config_from_gguf(*f);
  EXPECT_EQ(c.n_head_kv, 1);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.rope_theta, 5e5f);
  EXPECT_EQ(c.rms_eps, 1e-6f);
  EXPECT_EQ(c.n_ctx, 64);
  EXPECT_EQ(c.n_vocab, 5);
  EXPECT_FALSE(c.tied_output);
  EXPECT_EQ(error_of(s), "");

  drop_int(s, "attention.head_count_kv");
  s.floats = {{"attention.layer_norm_rms_epsilon", 1e-5f}};
  tensor_named(s, "blk.0.attn_k.weight").ne = {8, 8};
  tensor_named(s, "blk.0.attn_v.weight").ne = {8, 8};
  c = config_from_gguf(*open(s));
  EXPECT_EQ(c.n_head_kv, 2) << "head_count_kv defaults to head_count";
  EXPECT_EQ(c.rope_theta, 10000.0) << "freq_base defaults to 10000";
  EXPECT_EQ(error_of(s), "");
}

TEST_F(ConfigCrafted, TiedOutput) {
  Spec s = llama_spec();
  std::erase_if(s.tensors, [](const Tensor& t) { return t.name == "output.weight"; });
  auto f = open(s);
  const ModelConfig c = config_from_gguf(*f);
  EXPECT_TRUE(c.tied_output);
  EXPECT_EQ(names_of(expected_tensors(c)).count("output.weight"), 0u);
  EXPECT_EQ(error_of(s), "");
}

TEST_F(ConfigCrafted, Qwen2BiasesAndQwen3NormsWithOwnHeadDim) {
  Spec q2 = llama_spec();
  q2.arch = "qwen2";
  q2.tensors.push_back({"blk.0.attn_q.bias", {8}});
  q2.tensors.push_back({"blk.0.attn_k.bias", {4}});
  q2.tensors.push_back({"blk.0.attn_v.bias", {4}});
  EXPECT_EQ(error_of(q2), "");
  const ModelConfig c2 = config_from_gguf(*open(q2));
  EXPECT_TRUE(c2.qkv_bias);
  EXPECT_EQ(c2.rope_type, RopeType::neox);
  std::erase_if(q2.tensors, [](const Tensor& t) { return t.name == "blk.0.attn_k.bias"; });
  const std::string missing = error_of(q2);
  EXPECT_NE(missing.find("missing tensor 'blk.0.attn_k.bias' (expected shape [4])"), std::string::npos) << missing;

  // Qwen3: key_length 6 while D/H = 4, so the q projection is [D, H*Dh] = [8, 12].
  Spec q3 = llama_spec();
  q3.arch = "qwen3";
  set_int(q3, "attention.key_length", 6);
  set_int(q3, "attention.value_length", 6);
  tensor_named(q3, "blk.0.attn_q.weight").ne = {8, 12};
  tensor_named(q3, "blk.0.attn_k.weight").ne = {8, 6};
  tensor_named(q3, "blk.0.attn_v.weight").ne = {8, 6};
  tensor_named(q3, "blk.0.attn_output.weight").ne = {12, 8};
  q3.tensors.push_back({"blk.0.attn_q_norm.weight", {6}});
  q3.tensors.push_back({"blk.0.attn_k_norm.weight", {6}});
  EXPECT_EQ(error_of(q3), "");
  const ModelConfig c3 = config_from_gguf(*open(q3));
  EXPECT_EQ(c3.head_dim, 6);
  EXPECT_TRUE(c3.qk_norm);
  EXPECT_FALSE(c3.qkv_bias);
  EXPECT_EQ(c3.rope_type, RopeType::neox);
}

TEST_F(ConfigCrafted, UnsupportedArchitectureListsSupportedOnes) {
  Spec s = llama_spec();
  s.arch = "gemma2";
  const std::string e = error_of(s);
  EXPECT_NE(e.find("gemma2"), std::string::npos) << e;
  EXPECT_NE(e.find("llama, qwen2, qwen3"), std::string::npos) << e;
}

TEST_F(ConfigCrafted, MissingOrBadKeysNameTheKey) {
  Spec s = llama_spec();
  drop_int(s, "block_count");
  EXPECT_NE(error_of(s).find("llama.block_count"), std::string::npos) << error_of(s);

  s = llama_spec();
  drop_int(s, "feed_forward_length");
  s.strings.push_back({"feed_forward_length", "16"});
  EXPECT_NE(error_of(s).find("llama.feed_forward_length"), std::string::npos) << error_of(s);

  s = llama_spec();
  set_int(s, "embedding_length", 0);
  EXPECT_NE(error_of(s).find("llama.embedding_length"), std::string::npos) << error_of(s);

  s = llama_spec();
  s.floats = {};
  EXPECT_NE(error_of(s).find("llama.attention.layer_norm_rms_epsilon"), std::string::npos) << error_of(s);

  s = llama_spec();
  set_int(s, "attention.head_count", 3);  // 8 % 3 != 0 and no key_length
  EXPECT_NE(error_of(s).find("key_length"), std::string::npos) << error_of(s);

  s = llama_spec();
  set_int(s, "attention.head_count_kv", 2);
  set_int(s, "attention.head_count", 4);
  set_int(s, "attention.head_count_kv", 3);  // 4 % 3 != 0
  EXPECT_NE(error_of(s).find("head_count_kv"), std::string::npos) << error_of(s);

  s = llama_spec();
  set_int(s, "rope.dimension_count", 2);
  EXPECT_NE(error_of(s).find("partial RoPE"), std::string::npos) << error_of(s);
}

// Found by fuzzing: block_count 2^31-1 made validation list billions of expected tensors.
TEST_F(ConfigCrafted, AbsurdBlockCountFailsFastNamingTheFirstMissingLayer) {
  Spec s = llama_spec();
  set_int(s, "block_count", 0x7fffffff);
  const std::string e = error_of(s);
  EXPECT_NE(e.find("missing tensor 'blk.1.attn_norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("2147483647"), std::string::npos) << e;
}

// A header claiming 100000000 blocks once sized the dump estimate and `validate --skeleton` from the
// count before any tensor was checked: config_from_gguf itself refuses it, naming the first block the
// file lacks.
TEST_F(ConfigCrafted, BlockCountIsCheckedAgainstTheTensorsBeforeTheConfigIsUsed) {
  Spec s = llama_spec();
  set_int(s, "block_count", 100000000);
  auto f = open(s);
  try {
    (void)config_from_gguf(*f);
    ADD_FAILURE() << "no error";
  } catch (const ModelError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("missing tensor 'blk.1.attn_norm.weight' (llama.block_count is 100000000 but the file holds the "
                     "tensors of 1 block"),
              std::string::npos)
        << m;
  }
  set_int(s, "block_count", 1);
  EXPECT_EQ(config_from_gguf(*open(s)).n_layer, 1);
}

TEST_F(ConfigCrafted, ShapeErrorsNameTensorExpectedAndFound) {
  Spec s = llama_spec();
  tensor_named(s, "blk.0.ffn_down.weight").ne = {8, 16};
  EXPECT_NE(error_of(s).find("tensor 'blk.0.ffn_down.weight' has shape [8, 16], expected [16, 8]"), std::string::npos)
      << error_of(s);

  s = llama_spec();
  tensor_named(s, "blk.0.attn_norm.weight").ne = {8, 2};
  EXPECT_NE(error_of(s).find("'blk.0.attn_norm.weight' has shape [8, 2], expected [8]"), std::string::npos)
      << error_of(s);

  s = llama_spec();
  std::erase_if(s.tensors, [](const Tensor& t) { return t.name == "blk.0.ffn_up.weight"; });
  EXPECT_NE(error_of(s).find("missing tensor 'blk.0.ffn_up.weight' (expected shape [8, 16])"), std::string::npos)
      << error_of(s);
}

TEST_F(ConfigCrafted, PaddedVocabRowsAllowedFewerRejected) {
  Spec s = llama_spec();
  tensor_named(s, "token_embd.weight").ne = {8, 8};
  tensor_named(s, "output.weight").ne = {8, 8};
  EXPECT_EQ(error_of(s), "");
  EXPECT_EQ(config_from_gguf(*open(s)).n_vocab, 5) << "V is the token list, not the padded rows";

  tensor_named(s, "output.weight").ne = {8, 4};
  EXPECT_NE(error_of(s).find("'output.weight' has shape [8, 4], expected [8, 5]"), std::string::npos) << error_of(s);

  s = llama_spec();
  tensor_named(s, "token_embd.weight").ne = {5, 8};  // transposed
  EXPECT_NE(error_of(s).find("token_embd.weight"), std::string::npos) << error_of(s);
}

TEST_F(ConfigCrafted, TrailingUnitDimsAreTheSameShape) {
  Spec s = llama_spec();
  tensor_named(s, "output_norm.weight").ne = {8, 1};
  EXPECT_EQ(error_of(s), "");
}

TEST_F(ConfigCrafted, UndequantizableDtypeNamesTensorAndType) {
  Spec s = llama_spec();
  Tensor& t = tensor_named(s, "blk.0.ffn_gate.weight");
  t.ne = {256, 16};  // whole IQ4_XS blocks; the dtype is checked before the shape
  t.type = static_cast<uint32_t>(GgmlType::IQ4_XS);
  const std::string e = error_of(s);
  EXPECT_NE(e.find("blk.0.ffn_gate.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("IQ4_XS"), std::string::npos) << e;
}

// Non-finite or absurd floats once ran without a word (+inf freq_base); a vocab_size that disagrees
// with the token list too; raw control bytes of a GGUF string reached the error line unescaped.
TEST_F(ConfigCrafted, NonFiniteAbsurdOrInconsistentMetadataNamesTheKey) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {inf, -inf, nan, 0.0f, -1.0f, 0.5f, 1e30f}) {
    Spec s = llama_spec();
    s.floats = {{"attention.layer_norm_rms_epsilon", 1e-6f}, {"rope.freq_base", bad}};
    const std::string e = error_of(s);
    EXPECT_NE(e.find("metadata key 'llama.rope.freq_base' = "), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("must be a finite number above 1"), std::string::npos) << bad << ": " << e;
  }
  for (float bad : {inf, nan, 0.0f, -1e-6f, 0.5f}) {
    Spec s = llama_spec();
    s.floats = {{"attention.layer_norm_rms_epsilon", bad}, {"rope.freq_base", 5e5f}};
    const std::string e = error_of(s);
    EXPECT_NE(e.find("'llama.attention.layer_norm_rms_epsilon' = "), std::string::npos) << bad << ": " << e;
  }
  Spec s = llama_spec();
  set_int(s, "vocab_size", 6);
  EXPECT_NE(error_of(s).find("llama.vocab_size = 6 disagrees with the 5 entries of tokenizer.ggml.tokens"),
            std::string::npos)
      << error_of(s);
  set_int(s, "vocab_size", 5);
  EXPECT_EQ(error_of(s), "");

  s = llama_spec();
  s.arch = std::string("ll\x1b[31mama\n\0evil", 16) + std::string(5000, 'x');
  const std::string e = error_of(s);
  EXPECT_NE(e.find("unsupported architecture 'll\\x1b[31mama\\n\\x00evil"), std::string::npos) << e;
  EXPECT_EQ(e.find_first_of(std::string("\n\x1b\0", 3)), std::string::npos) << e;
  EXPECT_NE(e.find("... (5016 bytes)"), std::string::npos) << e;
  EXPECT_LT(e.size(), 600u) << e;
}

// A mixture of experts: llama with llama.expert_count (Mixtral) or qwen3moe, 4 experts of width 8 (qwen3moe's
// expert_feed_forward_length), 2 per token, in place of the dense FFN's three tensors.
Spec moe_spec(const std::string& arch) {
  Spec s = llama_spec();
  s.arch = arch;
  std::erase_if(s.tensors, [](const Tensor& t) { return t.name.find(".ffn_") != std::string::npos &&
                                                        t.name.find("ffn_norm") == std::string::npos; });
  const uint64_t fe = arch == "llama" ? 16 : 8;
  s.tensors.push_back({"blk.0.ffn_gate_inp.weight", {8, 4}});
  s.tensors.push_back({"blk.0.ffn_gate_exps.weight", {8, fe, 4}});
  s.tensors.push_back({"blk.0.ffn_up_exps.weight", {8, fe, 4}});
  s.tensors.push_back({"blk.0.ffn_down_exps.weight", {fe, 8, 4}});
  set_int(s, "expert_count", 4);
  set_int(s, "expert_used_count", 2);
  if (arch == "qwen3moe") {
    set_int(s, "expert_feed_forward_length", 8);
    for (const char* n : {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"}) s.tensors.push_back({n, {4}});
  }
  if (arch == "qwen2moe") {  // qwen2's q/k/v biases and the shared expert, of width 12 (not n_ff)
    set_int(s, "expert_feed_forward_length", 8);
    set_int(s, "expert_shared_feed_forward_length", 12);
    s.tensors.push_back({"blk.0.attn_q.bias", {8}});
    s.tensors.push_back({"blk.0.attn_k.bias", {4}});
    s.tensors.push_back({"blk.0.attn_v.bias", {4}});
    s.tensors.push_back({"blk.0.ffn_gate_inp_shexp.weight", {8}});
    s.tensors.push_back({"blk.0.ffn_gate_shexp.weight", {8, 12}});
    s.tensors.push_back({"blk.0.ffn_up_shexp.weight", {8, 12}});
    s.tensors.push_back({"blk.0.ffn_down_shexp.weight", {12, 8}});
  }
  return s;
}

TEST_F(ConfigCrafted, MoeKeys) {
  for (const std::string arch : {"llama", "qwen3moe", "qwen2moe"}) {
    SCOPED_TRACE(arch);
    auto f = open(moe_spec(arch));
    const ModelConfig c = config_from_gguf(*f);
    EXPECT_TRUE(c.moe);
    EXPECT_EQ(c.n_expert, 4);
    EXPECT_EQ(c.n_expert_used, 2);
    EXPECT_EQ(c.n_ff_exp, arch == "llama" ? 16 : 8);  // llama: feed_forward_length; qwen3moe, qwen2moe: their key
    EXPECT_EQ(c.expert_weights_norm, arch != "qwen2moe");  // llama.cpp's qwen2moe does not renormalise
    EXPECT_EQ(c.moe_shexp, arch == "qwen2moe");
    EXPECT_EQ(c.n_ff_shexp, arch == "qwen2moe" ? 12 : 0);
    EXPECT_TRUE(c.notes.empty());
    EXPECT_NO_THROW(validate_tensors(*f, c));
    // The dense FFN's tensors are not read; the router and the three expert stacks are, 3-D.
    std::set<std::string> want = names_of(*f);
    EXPECT_EQ(names_of(expected_tensors(c)), want);
    for (const ExpectedTensor& e : expected_tensors(c)) {
      if (e.name == "blk.0.ffn_down_exps.weight") {
        EXPECT_EQ(e.ne, (std::vector<int64_t>{c.n_ff_exp, 8, 4}));
      }
    }
  }
  // qwen3moe without expert_feed_forward_length: n_ff / expert_used_count, as llama.cpp.
  Spec s = moe_spec("qwen3moe");
  drop_int(s, "expert_feed_forward_length");
  EXPECT_EQ(config_from_gguf(*open(s)).n_ff_exp, 16 / 2);
  // qwen2moe without expert_shared_feed_forward_length: a shared expert n_ff wide, as llama.cpp.
  s = moe_spec("qwen2moe");
  drop_int(s, "expert_shared_feed_forward_length");
  for (Tensor& t : s.tensors) {
    if (t.name == "blk.0.ffn_gate_shexp.weight" || t.name == "blk.0.ffn_up_shexp.weight") t.ne = {8, 16};
    if (t.name == "blk.0.ffn_down_shexp.weight") t.ne = {16, 8};
  }
  auto f = open(s);
  const ModelConfig c = config_from_gguf(*f);
  EXPECT_EQ(c.n_ff_shexp, 16);
  EXPECT_NO_THROW(validate_tensors(*f, c));
  // A dense llama has no experts.
  EXPECT_FALSE(config_from_gguf(*open(llama_spec())).moe);
}

TEST_F(ConfigCrafted, MoeNotesWhatLlamaCppIgnores) {
  Spec s = moe_spec("qwen3moe");
  set_int(s, "expert_gating_func", 2);  // sigmoid: llama.cpp's qwen3moe routes with a softmax whatever it says
  const ModelConfig c = config_from_gguf(*open(s));
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0].rfind("qwen3moe.expert_gating_func = 2 is not applied", 0), 0u) << c.notes[0];
}

TEST_F(ConfigCrafted, MoeErrors) {
  auto expect_error = [&](Spec s, const std::string& part) {
    const std::string e = error_of(s);
    EXPECT_NE(e.find(part), std::string::npos) << "error: " << e << "\nexpected: " << part;
  };
  Spec s = moe_spec("qwen3moe");
  drop_int(s, "expert_count");
  expect_error(s, "qwen3moe.expert_count is absent; a qwen3moe model needs experts");
  s = moe_spec("qwen3moe");
  set_int(s, "expert_used_count", 5);
  expect_error(s, "qwen3moe.expert_used_count = 5 exceeds qwen3moe.expert_count = 4");
  s = moe_spec("llama");
  drop_int(s, "expert_used_count");
  expect_error(s, "llama.expert_used_count");
  s = moe_spec("llama");
  set_int(s, "expert_count", 513);
  expect_error(s, "llama.expert_count = 513 is outside 0..512");
  s = moe_spec("qwen3moe");
  set_int(s, "expert_shared_count", 1);
  expect_error(s, "qwen3moe.expert_shared_count = 1: shared experts are supported only for qwen2moe");
  s = moe_spec("qwen2moe");
  set_int(s, "expert_shared_count", 2);
  expect_error(s, "qwen2moe.expert_shared_count = 2: qwen2moe is built with exactly one shared expert");
  s = moe_spec("qwen2moe");
  drop_int(s, "expert_count");
  expect_error(s, "qwen2moe.expert_count is absent; a qwen2moe model needs experts");
  s = moe_spec("qwen2moe");
  std::erase_if(s.tensors, [](const Tensor& t) { return t.name == "blk.0.ffn_gate_inp_shexp.weight"; });
  expect_error(s, "missing tensor 'blk.0.ffn_gate_inp_shexp.weight' (expected shape [8])");
  s = moe_spec("llama");
  s.tensors.back().ne = {16, 8, 3};  // ffn_down_exps with 3 experts
  expect_error(s, "tensor 'blk.0.ffn_down_exps.weight' has shape [16, 8, 3], expected [16, 8, 4]");
  s = moe_spec("llama");
  std::erase_if(s.tensors, [](const Tensor& t) { return t.name == "blk.0.ffn_gate_inp.weight"; });
  expect_error(s, "missing tensor 'blk.0.ffn_gate_inp.weight' (expected shape [8, 4])");
  s = moe_spec("qwen2");
  expect_error(s, "qwen2.expert_count = 4, but diffrun runs experts only for qwen3moe, qwen2moe and llama (Mixtral)");
}

TEST(Config, PrintableEscapesAndTruncates) {
  EXPECT_EQ(printable("plain caf\u00e9 \u65e5"), "plain caf\u00e9 \u65e5");
  EXPECT_EQ(printable(std::string("a\0b\n\t\x1b[0m'\\", 11)), "a\\x00b\\n\\t\\x1b[0m\\'\\\\");
  EXPECT_EQ(printable("say \"x\"", 200, '"'), "say \\\"x\\\"");
  EXPECT_EQ(printable("\xff\xc3(\xed\xa0\x80\xc2\x9b"), "\\xff\\xc3(\\xed\\xa0\\x80\\xc2\\x9b");
  EXPECT_EQ(printable(std::string(300, 'y'), 4), "yyyy... (300 bytes)");
}

TEST(Config, Names) {
  EXPECT_EQ(layer_tensor(3, "attn_q.weight"), "blk.3.attn_q.weight");
  EXPECT_STREQ(arch_name(Arch::qwen3), "qwen3");
  EXPECT_STREQ(rope_type_name(RopeType::neox), "neox");
  ModelConfig c;
  c.n_layer = 2;
  c.n_embd = 8;
  c.n_head = 2;
  c.n_head_kv = 1;
  c.head_dim = 4;
  c.n_ff = 16;
  c.n_vocab = 5;
  c.tied_output = true;
  EXPECT_EQ(expected_tensors(c).size(), 2u + 2u * 9u);
  c.qkv_bias = true;
  c.tied_output = false;
  EXPECT_EQ(expected_tensors(c).size(), 3u + 2u * 12u);
}

}  // namespace
}  // namespace diffrun
