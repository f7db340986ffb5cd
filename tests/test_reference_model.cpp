// End-to-end tests of the CPU reference: SmolLM2 answers Paris, f32 agrees with f64 at every checkpoint,
// every tiny fixture (each arch and weight format) runs to finite logits, and `diffrun dump` / `diffrun
// generate` work through the built binary ($DIFFRUN_BIN).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "checkpoints/sink.hpp"
#include "checkpoints/vocabulary.hpp"
#include "cli/run.hpp"
#include "dump/dump.hpp"
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

// reset() empties the cache: a backend reset after a longer prompt computes what a fresh one does,
// even under kv_cache_pos0, whose decode steps read cache rows that the short prompt never wrote.
TEST(TinyFixtures, ResetBackendEqualsAFreshOne) {
  const std::string path = test::fixture_path("tiny-llama-f32.gguf");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " missing (run through ctest: fixture tiny_models)";
  auto file = GgufFile::open(path);
  const ModelConfig cfg = config_from_gguf(*file);
  for (const char* faults : {"", "kv_cache_pos0"}) {
    SCOPED_TRACE(faults);
    auto used = make_cpu_backend(*file, cfg, "f32", 16, parse_faults(faults));
    auto fresh = make_cpu_backend(*file, cfg, "f32", 16, parse_faults(faults));
    NullSink none;
    (void)cli::run_steps(*used, std::vector<int32_t>{3, 1, 4, 1, 5, 9, 2}, 2, {}, none);
    used->reset();
    const std::vector<int32_t> prompt = {2, 7};
    const cli::StepsResult a = cli::run_steps(*used, prompt, 3, {}, none, /*keep_logits=*/true);
    const cli::StepsResult b = cli::run_steps(*fresh, prompt, 3, {}, none, /*keep_logits=*/true);
    EXPECT_EQ(a.last_logits, b.last_logits);
  }
}

// Keeps every call in order: (step, name, shape, values or ids).
class OrderSink final : public Sink {
 public:
  bool wants(std::string_view) const override { return true; }
  void record(int step, std::string_view name, int, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override {
    calls.push_back(fmt::format("{} {} {} {} {}", step, name, layout, fmt::join(shape, "x"), int(native)));
    values.emplace_back(data.begin(), data.end());
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    calls.push_back(fmt::format("{} {} ids {}", step, name, fmt::join(ids, ",")));
    values.emplace_back();
  }
  std::vector<std::string> calls;
  std::vector<std::vector<float>> values;
};

// With a draft (Backend::set_draft) the reference computes the drafted steps in one pass and replays them: every
// step records and returns what it does one step at a time, bit for bit, in the same order: with a draft that
// holds, one that leaves the fed tokens at step 4, one shorter than the run, and one that starts wrong; each arch
// (sliding windows, post norms, qk norms, experts with and without a shared one), both reference precisions.
TEST(TinyFixtures, DraftStepsRecordWhatOneStepAtATimeRecords) {
  if (!std::filesystem::exists(test::fixture_path("tiny-llama-kmix.gguf")))
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("") << " (ctest fixture tiny_models)";
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  const int steps = 9;
  for (const char* model : {"tiny-llama-kmix.gguf", "tiny-gemma3-kmix.gguf", "tiny-qwen3-q4_k.gguf",
                            "tiny-qwen3moe-q8_0.gguf", "tiny-qwen2moe-q8_0.gguf"}) {
    auto file = GgufFile::open(test::fixture_path(model));
    const ModelConfig cfg = config_from_gguf(*file);
    for (const char* precision : {"f64", "f32-f16store"}) {
      SCOPED_TRACE(std::string(model) + " " + precision);
      auto alone = make_cpu_backend(*file, cfg, precision, 16);
      OrderSink want;
      const cli::StepsResult a = cli::run_steps(*alone, prompt, steps, {}, want, /*keep_logits=*/true);
      const std::vector<int32_t> fed(a.tokens.begin() + prompt.size(), a.tokens.end());
      ASSERT_EQ(fed.size(), size_t(steps));
      std::vector<int32_t> leaves = fed, starts_wrong = fed;
      leaves[3] = (leaves[3] + 1) % cfg.n_vocab;
      starts_wrong[0] = (starts_wrong[0] + 1) % cfg.n_vocab;
      const std::vector<int32_t> shorter(fed.begin(), fed.begin() + 4);
      struct Case {
        const char* what;
        std::vector<int32_t> draft;
        int from_draft;  // steps replayed from passes
      };
      for (const Case& c : {Case{"holds", fed, steps}, Case{"leaves at step 4", leaves, 3},
                            Case{"shorter", shorter, 4}, Case{"starts wrong", starts_wrong, 0}}) {
        SCOPED_TRACE(c.what);
        auto drafted = make_cpu_backend(*file, cfg, precision, 16);
        auto draft = std::make_shared<Draft>();
        draft->publish(c.draft);
        drafted->set_draft(draft);
        OrderSink got;
        const cli::StepsResult b = cli::run_steps(*drafted, prompt, steps, {}, got, /*keep_logits=*/true);
        EXPECT_EQ(drafted->steps_from_draft(), c.from_draft);
        EXPECT_EQ(b.tokens, a.tokens);
        EXPECT_EQ(b.argmax, a.argmax);
        EXPECT_EQ(b.last_logits, a.last_logits);
        ASSERT_EQ(got.calls, want.calls);
        for (size_t i = 0; i < got.values.size(); ++i) {
          ASSERT_EQ(got.values[i].size(), want.values[i].size()) << got.calls[i];
          EXPECT_EQ(std::memcmp(got.values[i].data(), want.values[i].data(), got.values[i].size() * sizeof(float)), 0)
              << got.calls[i];
        }
      }
      // prepare() before the first decode step's token is fed (a reference fed by another): the pass guesses the
      // draft's token; fed it, the steps replay; fed another, that step and the later ones run one at a time.
      for (const bool same : {true, false}) {
        SCOPED_TRACE(same ? "prepared, fed the draft's" : "prepared, fed another");
        std::vector<int32_t> guess = fed;
        if (!same) guess[0] = (guess[0] + 1) % cfg.n_vocab;
        auto drafted = make_cpu_backend(*file, cfg, precision, 16);
        auto draft = std::make_shared<Draft>();
        draft->publish(guess);
        drafted->set_draft(draft);
        OrderSink got;
        std::vector<std::vector<float>> logits{drafted->forward(0, prompt, got)};
        drafted->prepare(1, got);
        for (int step = 1; step <= steps; ++step)
          logits.push_back(drafted->forward(step, std::span<const int32_t>(&fed[step - 1], 1), got));
        EXPECT_EQ(drafted->steps_from_draft(), same ? steps : 0);
        EXPECT_EQ(logits, a.last_logits);
        ASSERT_EQ(got.calls, want.calls);
        EXPECT_EQ(got.values, want.values);
      }
    }
  }
}

// Forced routing inside a pass over the draft: each decode step's forced rows are that step's token row of the pass,
// so the steps record what they record one at a time; a forced row past a decode step's one token is the same
// InputError either way.
TEST(TinyFixtures, DraftStepsFollowForcedRouting) {
  if (!std::filesystem::exists(test::fixture_path("tiny-qwen3moe-q8_0.gguf")))
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("") << " (ctest fixture tiny_models)";
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  const int steps = 7;
  for (const char* model : {"tiny-qwen3moe-q8_0.gguf", "tiny-mixtral-f32.gguf"}) {
    SCOPED_TRACE(model);
    auto file = GgufFile::open(test::fixture_path(model));
    const ModelConfig cfg = config_from_gguf(*file);
    const int K = cfg.n_expert_used;
    std::vector<int32_t> last_k(K);  // the last K experts, highest first: not what routing picks everywhere
    for (int j = 0; j < K; ++j) last_k[j] = cfg.n_expert - 1 - j;
    auto forced = std::make_shared<ForcedRouting>();
    forced->rows = {{0, 0, 2, last_k}, {2, 0, 0, last_k}, {5, cfg.n_layer - 1, 0, last_k}};
    auto alone = make_cpu_backend(*file, cfg, "f64", 16, {}, WeightHolding::streamed, forced);
    OrderSink want;
    const cli::StepsResult a = cli::run_steps(*alone, prompt, steps, {}, want, /*keep_logits=*/true);
    auto drafted = make_cpu_backend(*file, cfg, "f64", 16, {}, WeightHolding::streamed, forced);
    auto draft = std::make_shared<Draft>();
    draft->publish({a.tokens.begin() + prompt.size(), a.tokens.end()});
    drafted->set_draft(draft);
    OrderSink got;
    const cli::StepsResult b = cli::run_steps(*drafted, prompt, steps, {}, got, /*keep_logits=*/true);
    EXPECT_EQ(drafted->steps_from_draft(), steps);
    EXPECT_EQ(b.tokens, a.tokens);
    EXPECT_EQ(b.last_logits, a.last_logits);
    ASSERT_EQ(got.calls, want.calls);
    EXPECT_EQ(got.values, want.values);
    // Step 2's forced experts are there.
    const auto topk = std::find_if(got.calls.begin(), got.calls.end(),
                                   [](const std::string& c) { return c.rfind("2 ffn_moe_topk-0 ", 0) == 0; });
    ASSERT_NE(topk, got.calls.end());
    const std::vector<float>& ids = got.values[size_t(topk - got.calls.begin())];
    EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.end()), last_k);
    auto bad = std::make_shared<ForcedRouting>();
    bad->rows = {{3, 0, 1, last_k}};
    auto wrong = make_cpu_backend(*file, cfg, "f64", 16, {}, WeightHolding::streamed, bad);
    wrong->set_draft(draft);
    NullSink none;
    try {
      (void)cli::run_steps(*wrong, prompt, steps, {}, none);
      ADD_FAILURE() << "a forced row past a decode step's token was taken";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("forced routing at step 3, layer 0, token 1: the step has 1 token(s)"),
                std::string::npos)
          << e.what();
    }
  }
}

// Forced routing (the job's routing follow-up): the reference runs the given experts at the given (step, layer,
// token), weighted by its own probabilities of them, records them as chosen and names the rows in its facts; every
// other token's values are the unforced run's, bit for bit. Rows that do not fit the model or the step are
// InputErrors naming them, and so is forced routing on a model without experts.
TEST(TinyFixtures, ForcedRoutingRunsTheGivenExperts) {
  const std::string path = test::fixture_path("tiny-mixtral-f32.gguf");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " missing (run through ctest: fixture tiny_models)";
  auto file = GgufFile::open(path);
  const ModelConfig cfg = config_from_gguf(*file);
  ASSERT_TRUE(cfg.moe);
  const int E = cfg.n_expert, K = cfg.n_expert_used, D = cfg.n_embd;
  const std::vector<int32_t> prompt = {3, 17, 42, 99, 7};
  const int t = 2;  // the token whose experts are forced, at step 0, layer 0
  for (const char* precision : {"f32", "f64"}) {
    SCOPED_TRACE(precision);
    MemorySink own;
    auto plain = make_cpu_backend(*file, cfg, precision, 16);
    (void)cli::run_steps(*plain, prompt, 1, {}, own);
    const std::vector<float>& topk = own.entries.at({0, "ffn_moe_topk-0"}).values;
    // The reference's first choice, then its (K+1)-th: another set of experts.
    std::vector<float> by_prob(own.entries.at({0, "ffn_moe_probs-0"}).values.begin() + size_t(t) * E,
                               own.entries.at({0, "ffn_moe_probs-0"}).values.begin() + size_t(t + 1) * E);
    std::vector<int32_t> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return by_prob[a] > by_prob[b]; });
    ASSERT_EQ(order[0], int32_t(topk[size_t(t) * K]));
    std::vector<int32_t> ids(order.begin(), order.begin() + K);
    ids[K - 1] = order[K];
    auto forced = std::make_shared<ForcedRouting>();
    forced->rows.push_back({0, 0, t, ids});
    MemorySink followed;
    auto follower = make_cpu_backend(*file, cfg, precision, 16, {}, WeightHolding::streamed, forced);
    (void)cli::run_steps(*follower, prompt, 1, {}, followed);
    EXPECT_NE(follower->facts().at("routing_followed").find("step 0 layer 0 token 2:"), std::string::npos);
    const std::vector<float>& ftopk = followed.entries.at({0, "ffn_moe_topk-0"}).values;
    const std::vector<float>& w = followed.entries.at({0, "ffn_moe_weights-0"}).values;
    const std::vector<float>& wn = followed.entries.at({0, "ffn_moe_weights_norm-0"}).values;
    double sum = 0;
    for (int j = 0; j < K; ++j) {
      EXPECT_EQ(ftopk[size_t(t) * K + j], float(ids[j]));
      EXPECT_EQ(w[size_t(t) * K + j], by_prob[ids[j]]);
      sum += w[size_t(t) * K + j];
    }
    for (int j = 0; j < K; ++j) EXPECT_NEAR(wn[size_t(t) * K + j], w[size_t(t) * K + j] / sum, 1e-6);
    // Token t's FFN output is other experts'; every other token's is the unforced run's, bit for bit.
    const std::vector<float>& out = own.entries.at({0, "ffn_moe_out-0"}).values;
    const std::vector<float>& fout = followed.entries.at({0, "ffn_moe_out-0"}).values;
    for (int u = 0; u < static_cast<int>(prompt.size()); ++u) {
      const bool same = std::equal(out.begin() + size_t(u) * D, out.begin() + size_t(u + 1) * D, fout.begin() + size_t(u) * D);
      EXPECT_EQ(same, u != t) << "token " << u;
    }
  }
  const auto fails_with = [&](ForcedRouting::Row row, const std::string& what) {
    auto forced = std::make_shared<ForcedRouting>();
    forced->rows.push_back(std::move(row));
    auto b = make_cpu_backend(*file, cfg, "f32", 16, {}, WeightHolding::streamed, forced);
    NullSink none;
    try {
      (void)cli::run_steps(*b, prompt, 1, {}, none);
      ADD_FAILURE() << "no error for " << what;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  fails_with({0, 0, 5, {0, 1}}, "token 5: the step has 5 token(s)");
  fails_with({0, 1, 0, {0}}, "1 expert ids, the model uses 2 per token");
  fails_with({1, 0, 0, {0, E}}, "expert id " + std::to_string(E) + " outside 0.." + std::to_string(E - 1));
  fails_with({0, 0, 1, {3, 3}}, "expert 3 chosen twice");
  auto dense = GgufFile::open(test::fixture_path("tiny-llama-f32.gguf"));
  auto forced = std::make_shared<ForcedRouting>();
  forced->rows.push_back({0, 0, 0, {0, 1}});
  EXPECT_THROW(make_cpu_backend(*dense, config_from_gguf(*dense), "f32", 16, {}, WeightHolding::streamed, forced),
               InputError);
}

// tiny-gemma3 (window 8 on layers 0-4, layer 5 global, softcap 30) in each of its formats: a 12-token
// prompt and three decode steps, so the window cuts attention in prefill and decode alike. The gemma3
// kinds are recorded, f32 agrees with f64, the embedding scale is sqrt(D) and the softcap bounds the logits.
TEST(TinyFixtures, Gemma3WindowScaleAndSoftcap) {
  if (!std::filesystem::exists(test::fixture_path("tiny-gemma3-f32.gguf")))
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("") << " (ctest fixture tiny_models)";
  const std::vector<int32_t> prompt = {2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50};
  for (const char* fmt : {"f32", "q8_0", "kmix"}) {
    const std::string path = test::fixture_path(std::string("tiny-gemma3-") + fmt + ".gguf");
    SCOPED_TRACE(path);
    auto file = GgufFile::open(path);
    const ModelConfig cfg = config_from_gguf(*file);
    MemorySink runs[2];
    for (int p = 0; p < 2; ++p) {
      auto backend = make_cpu_backend(*file, cfg, p == 0 ? "f64" : "f32", 32);
      cli::run_steps(*backend, prompt, 3, {}, runs[p], /*keep_logits=*/false);
    }
    const auto& ref = runs[0].entries;
    for (const char* name : {"inp_scaled", "attn_post_norm-0", "ffn_geglu-5", "ffn_post_norm-5", "Qnorm-3"})
      EXPECT_EQ(ref.count({0, name}), 1u) << name;
    EXPECT_EQ(ref.count({0, "ffn_swiglu-0"}), 0u);
    // inp_scaled = embd · sqrt(D) (f64: exact to rounding).
    const auto& embd = ref.at({0, "embd"}).values;
    const auto& scaled = ref.at({0, "inp_scaled"}).values;
    for (size_t i = 0; i < embd.size(); i += 97)
      EXPECT_NEAR(scaled[i], embd[i] * std::sqrt(256.0), 1e-5 * std::abs(scaled[i]) + 1e-6);
    // The window: a local layer's last query row sees its own and the 7 positions before it, the global one all.
    for (int step : {0, 3}) {
      const int T = step == 0 ? 12 : 1, S = 12 + step;
      for (int l : {0, 5}) {
        const auto& probs = ref.at({step, "kq_soft_max-" + std::to_string(l)}).values;  // [H,T,S]
        int nonzero = 0;
        for (int s = 0; s < S; ++s) nonzero += probs[static_cast<size_t>(T - 1) * S + s] != 0.0f;
        EXPECT_EQ(nonzero, l == 5 ? S : 8) << "step " << step << " layer " << l;
      }
    }
    // f32 against f64 on every checkpoint of every step, and the softcap.
    double worst = 0;
    for (const auto& [key, e] : ref) {
      const auto& b = runs[1].entries.at(key).values;
      double d = 0, n = 0;
      for (size_t i = 0; i < e.values.size(); ++i) {
        d += (double(b[i]) - e.values[i]) * (double(b[i]) - e.values[i]);
        n += double(e.values[i]) * e.values[i];
      }
      if (n > 0) worst = std::max(worst, std::sqrt(d / n));
    }
    EXPECT_LT(worst, 1e-5);
    for (float v : ref.at({0, "result_output"}).values) ASSERT_LT(std::abs(v), 30.0f);
  }
}

// `diffrun dump` and `diffrun generate` through the built binary.
class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_scratch_dir("test-reference-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Exit status and stdout of `diffrun ARGS`.
  std::pair<int, std::string> run(const std::string& args) const {
    const std::string bin = test::env_or("DIFFRUN_BIN", "build/cli/diffrun");
    const std::string cmd = "'" + bin + "' " + args + " >'" + path("stdout.txt") + "' 2>'" + path("stderr.txt") + "'";
    const int status = std::system(cmd.c_str());
    std::ifstream in(path("stdout.txt"));
    std::ostringstream out;
    out << in.rdbuf();
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out.str()};
  }

  std::filesystem::path dir_;
};

TEST_F(Cli, DumpWritesEveryCheckpointOfEveryStep) {
  const std::string model = test::fixture_path("tiny-qwen3-q8_0.gguf");
  if (!std::filesystem::exists(model)) GTEST_SKIP() << model << " not generated (ctest fixture tiny_models)";
  const auto [rc, out] = run("dump --model '" + model + "' --tokens 1,5,9 --steps 2 --precision f64 --out '" +
                             path("run.h5") + "'");
  ASSERT_EQ(rc, 0) << out;
  auto file = GgufFile::open(model);
  const ModelConfig cfg = config_from_gguf(*file);
  const DumpReader dump(path("run.h5"));
  EXPECT_EQ(dump.meta().backend, "cpu");
  EXPECT_EQ(dump.meta().precision, "f64");
  EXPECT_EQ(dump.meta().token_ids, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(dump.steps(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(dump.int_attribute("all_token_ids").size(), 5u);
  EXPECT_EQ(dump.int_attribute("argmax").size(), 3u);
  for (int step : dump.steps()) {
    std::vector<std::string> names;
    for (const DatasetInfo& d : dump.datasets(step)) names.push_back(d.name);
    EXPECT_EQ(names, checkpoint_names(cfg)) << "step " << step;
  }
  const int64_t H = cfg.n_head, Hkv = cfg.n_head_kv, Dh = cfg.head_dim;
  EXPECT_EQ(dump.find(0, "result_output")->shape, (std::vector<int64_t>{3, cfg.n_vocab}));
  EXPECT_EQ(dump.find(1, "result_output")->shape, (std::vector<int64_t>{1, cfg.n_vocab}));
  EXPECT_EQ(dump.find(2, "cache_k-0")->shape, (std::vector<int64_t>{5, Hkv, Dh}));
  EXPECT_EQ(dump.find(1, "kq_soft_max-1")->shape, (std::vector<int64_t>{H, 1, 4}));
  EXPECT_EQ(dump.find(0, "Qnorm-1")->shape, (std::vector<int64_t>{3, H, Dh}));
  EXPECT_EQ(dump.read_ids(2, "tokens"), (std::vector<int32_t>{dump.int_attribute("argmax")[1]}));
}

TEST_F(Cli, DumpFilterAndErrors) {
  const std::string model = test::fixture_path("tiny-llama-q4_k.gguf");
  if (!std::filesystem::exists(model)) GTEST_SKIP() << model << " not generated (ctest fixture tiny_models)";
  const std::string m = " --model '" + model + "'";
  ASSERT_EQ(run("dump" + m + " --tokens 3,4 --steps 1 --checkpoints 'l_out-*' --out '" + path("f.h5") + "'").first, 0);
  const DumpReader dump(path("f.h5"));
  std::vector<std::string> names;
  for (const DatasetInfo& d : dump.datasets(1)) names.push_back(d.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tokens", "l_out-0", "l_out-1"}));  // the writer always keeps ids

  EXPECT_EQ(run("dump" + m + " --tokens 3 --steps 1000000 --out '" + path("big.h5") + "'").first, 2);
  EXPECT_EQ(run("dump" + m + " --prompt '' --out '" + path("empty.h5") + "'").first, 2);
  EXPECT_EQ(run("dump --model '" + path("missing.gguf") + "' --tokens 1 --out '" + path("m.h5") + "'").first, 2);
  EXPECT_EQ(run("generate" + m + " --tokens 1,2 --precision f16").first, 2);
  for (const char* f : {"big.h5", "empty.h5", "m.h5"}) EXPECT_FALSE(std::filesystem::exists(path(f))) << f;
}

TEST_F(Cli, GenerateAnswersParis) {
  if (!std::filesystem::exists(test::smollm2_path())) GTEST_SKIP() << "SmolLM2 not found at " << test::smollm2_path();
  const auto [rc, out] = run("generate --backend cpu --chat --prompt 'What is the capital of France?' -n 24");
  ASSERT_EQ(rc, 0);
  EXPECT_NE(out.find("Paris"), std::string::npos) << out;
  EXPECT_EQ(out.find("<|im_end|>"), std::string::npos) << "generation must stop at the end-of-turn token";
}

}  // namespace
}  // namespace diffrun
