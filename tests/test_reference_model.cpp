// End-to-end tests of the CPU reference: SmolLM2 answers Paris, f32 agrees with f64 at every checkpoint,
// and every tiny fixture (each arch and weight format) runs to finite logits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoints/sink.hpp"
#include "checkpoints/vocabulary.hpp"
#include "cli/run.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "reference_cpu/reference.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

// Keeps every recorded checkpoint in memory, keyed by (step, name).
class MemorySink final : public Sink {
 public:
  struct Entry {
    std::vector<int64_t> shape;
    std::string layout;
    std::vector<float> values;
  };
  bool wants(std::string_view) const override { return true; }
  void record(int step, std::string_view name, int, std::string_view layout, std::span<const int64_t> shape,
              NativeDType, std::span<const float> data) override {
    entries[{step, std::string(name)}] = {{shape.begin(), shape.end()}, std::string(layout), {data.begin(), data.end()}};
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    ids_[{step, std::string(name)}] = {ids.begin(), ids.end()};
  }
  std::map<std::pair<int, std::string>, Entry> entries;
  std::map<std::pair<int, std::string>, std::vector<int32_t>> ids_;
};

// Compares each checkpoint on arrival with a stored run; remembers the worst relative L2 error.
class CompareSink final : public Sink {
 public:
  explicit CompareSink(const MemorySink& want) : want_(want) {}
  bool wants(std::string_view) const override { return true; }
  void record(int step, std::string_view name, int, std::string_view, std::span<const int64_t> shape, NativeDType,
              std::span<const float> data) override {
    const auto it = want_.entries.find({step, std::string(name)});
    ASSERT_NE(it, want_.entries.end()) << "step " << step << " " << name << " missing from the f64 run";
    ASSERT_EQ(std::vector<int64_t>(shape.begin(), shape.end()), it->second.shape) << name;
    double diff = 0, ref = 0;
    for (size_t i = 0; i < data.size(); ++i) {
      const double b = it->second.values[i];
      diff += (data[i] - b) * (data[i] - b);
      ref += b * b;
    }
    const double rel = ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
    EXPECT_LT(rel, 1e-4) << "step " << step << " " << name;
    ++compared;
    if (rel > worst) {
      worst = rel;
      worst_name = "step " + std::to_string(step) + " " + std::string(name);
    }
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {}
  const MemorySink& want_;
  double worst = 0;
  std::string worst_name;
  int compared = 0;
};

class SmolLM2 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(test::smollm2_path())) {
      GTEST_SKIP() << "SmolLM2 not found at " << test::smollm2_path() << " (fetch it with scripts/fetch_models)";
    }
    file = GgufFile::open(test::smollm2_path());
    cfg = config_from_gguf(*file);
    tok = Tokenizer::from_gguf(*file);
    cli::PromptOptions opt;
    opt.prompt = "What is the capital of France?";
    opt.chat = true;
    prompt = cli::prompt_tokens(*file, *tok, opt);
  }
  std::unique_ptr<GgufFile> file;
  ModelConfig cfg;
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> prompt;
};

TEST_F(SmolLM2, GreedyChatAnswerNamesParis) {
  const int steps = 12;
  auto backend = make_cpu_backend(*file, cfg, "f32", static_cast<int>(prompt.size()) + steps);
  NullSink none;
  const cli::StepsResult r = cli::run_steps(*backend, prompt, steps, {}, none);
  const std::string answer = tok->decode(r.argmax);
  std::cout << "SmolLM2 f32 greedy answer: " << answer << "\n";
  EXPECT_NE(answer.find("Paris"), std::string::npos) << answer;
}

TEST_F(SmolLM2, F32AgreesWithF64AtEveryCheckpointOfEveryStep) {
  const int steps = 4;
  const int ctx = static_cast<int>(prompt.size()) + steps;
  MemorySink f64_run;
  cli::StepsResult greedy;
  {
    auto f64 = make_cpu_backend(*file, cfg, "f64", ctx);
    greedy = cli::run_steps(*f64, prompt, steps, {}, f64_run);
  }
  const std::vector<int32_t> fed(greedy.tokens.begin() + static_cast<long>(prompt.size()), greedy.tokens.end());
  CompareSink compare(f64_run);
  auto f32 = make_cpu_backend(*file, cfg, "f32", ctx);
  const cli::StepsResult forced = cli::run_steps(*f32, prompt, steps, fed, compare);
  EXPECT_EQ(forced.tokens, greedy.tokens);
  EXPECT_EQ(forced.argmax, greedy.argmax);

  // Every checkpoint of the vocabulary was recorded at every step, with as many dims as its layout has letters.
  const std::vector<std::string> names = checkpoint_names(cfg);
  for (int step = 0; step <= steps; ++step) {
    for (const std::string& name : names) {
      const auto key = std::make_pair(step, name);
      if (name == "tokens") {
        ASSERT_TRUE(f64_run.ids_.count(key)) << "step " << step << " tokens";
        continue;
      }
      const auto it = f64_run.entries.find(key);
      ASSERT_NE(it, f64_run.entries.end()) << "step " << step << " " << name;
      const auto commas = std::count(it->second.layout.begin(), it->second.layout.end(), ',');
      EXPECT_EQ(static_cast<long>(it->second.shape.size()), commas + 1) << name << " " << it->second.layout;
    }
  }
  EXPECT_EQ(compare.compared, static_cast<int>(f64_run.entries.size()));
  std::cout << "f32 vs f64, " << compare.compared << " checkpoints over " << steps + 1
            << " steps: worst rel L2 " << compare.worst << " at " << compare.worst_name << "\n";
  RecordProperty("worst_checkpoint", compare.worst_name);
  RecordProperty("worst_rel_l2", std::to_string(compare.worst));
}

TEST_F(SmolLM2, ContextOverflowAndBadIdsAreInputErrors) {
  auto backend = make_cpu_backend(*file, cfg, "f32", static_cast<int>(prompt.size()) + 1);
  NullSink none;
  EXPECT_THROW(cli::run_steps(*backend, prompt, 2, {}, none), InputError);
  EXPECT_THROW(cli::run_steps(*backend, {}, 0, {}, none), InputError);
  const std::vector<int32_t> bad = {cfg.n_vocab};
  EXPECT_THROW(backend->forward(0, bad, none), InputError);
  EXPECT_THROW(make_cpu_backend(*file, cfg, "f16", 8), InputError);
  cli::PromptOptions both;
  both.prompt = "x";
  both.tokens = "1,2";
  EXPECT_THROW(cli::prompt_tokens(*file, *tok, both), InputError);
  cli::PromptOptions outside;
  outside.tokens = "1," + std::to_string(cfg.n_vocab);
  EXPECT_THROW(cli::prompt_tokens(*file, *tok, outside), InputError);
  EXPECT_THROW(cli::prompt_tokens(*file, *tok, cli::PromptOptions{}), InputError);
}

TEST_F(SmolLM2, PrefillThenDecodeMatchesOneLongPrefill) {
  // The KV cache path (decode steps) must give what a prefill of the whole sequence gives.
  const int steps = 3;
  const int ctx = static_cast<int>(prompt.size()) + steps;
  auto backend = make_cpu_backend(*file, cfg, "f64", ctx);
  NullSink none;
  const cli::StepsResult stepped = cli::run_steps(*backend, prompt, steps, {}, none, /*keep_logits=*/true);
  backend->reset();
  const std::vector<float> whole = backend->forward(0, stepped.tokens, none);
  const std::vector<float>& last = stepped.last_logits.back();
  ASSERT_EQ(whole.size(), last.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    diff += (whole[i] - last[i]) * (whole[i] - last[i]);
    ref += double(whole[i]) * whole[i];
  }
  EXPECT_LT(std::sqrt(diff / ref), 1e-6);
}

// Every tiny fixture (each arch, each weight format) runs prefill and decode to finite logits over V.
TEST(TinyFixtures, EveryArchAndFormatGivesFiniteLogits) {
  if (!std::filesystem::exists(test::fixture_path("tiny-llama-f32.gguf"))) {
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("")
                 << " (run through ctest: fixture tiny_models)";
  }
  const std::vector<std::string> archs = {"llama", "llama-tied", "qwen2", "qwen3"};
  const std::vector<std::string> formats = {"f32",  "f16",  "bf16", "q8_0", "q4_0", "q4_1", "q5_0",
                                            "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "kmix"};
  const std::vector<int32_t> prompt = {1, 5, 9, 2, 7};
  int ran = 0;
  for (const std::string& arch : archs) {
    for (const std::string& fmt : formats) {
      const std::string path = test::fixture_path("tiny-" + arch + "-" + fmt + ".gguf");
      SCOPED_TRACE(path);
      auto file = GgufFile::open(path);
      const ModelConfig cfg = config_from_gguf(*file);
      for (const char* precision : {"f32", "f64"}) {
        auto backend = make_cpu_backend(*file, cfg, precision, 16);
        MemorySink sink;
        const cli::StepsResult r = cli::run_steps(*backend, prompt, 2, {}, sink, /*keep_logits=*/true);
        ASSERT_EQ(r.last_logits.size(), 3u);
        for (const auto& logits : r.last_logits) {
          ASSERT_EQ(static_cast<int>(logits.size()), cfg.n_vocab);
          for (float v : logits) ASSERT_TRUE(std::isfinite(v));
        }
        const auto& out = sink.entries.at({0, "result_output"});
        EXPECT_EQ(out.shape, (std::vector<int64_t>{static_cast<int64_t>(prompt.size()), cfg.n_vocab}));
        EXPECT_EQ(sink.entries.count({0, "Qnorm-0"}), cfg.qk_norm ? 1u : 0u);
      }
      ++ran;
    }
  }
  EXPECT_EQ(ran, static_cast<int>(archs.size() * formats.size()));
}

}  // namespace
}  // namespace diffrun
