// GPU test: the engine end to end against the CPU reference, teacher-forced (the reference picks the tokens).
// f32 engine vs f64 reference: every checkpoint of every step within rel L2 1e-4, on every tiny
// fixture (arch × format) and, when their paths are given, on a SmolLM2 slice
// (DIFFRUN_SMOLLM2_SLICE) and the Qwen2.5-0.5B-shaped F16 fixture (DIFFRUN_QWEN05B).
// f16 engine vs f32 reference: per-kind worst rel L2 and top-1 agreement over 16 decode steps;
// every top-1 miss must be explained by a reference top-2 margin below the f16 logit error.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/engine.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/reference.hpp"
#include "tests/test_engine_common.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

using test::MemorySink;
using test::prompt_ids;
using test::rel_l2;

constexpr double kF32Tolerance = 1e-4;

int32_t host_argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

struct Worst {
  double rel = 0;
  std::string name;
  int step = 0;
};

// Per checkpoint kind (base name), the worst rel L2 over every layer and step.
using WorstByKind = std::map<std::string, Worst>;

// Compares every checkpoint the reference recorded with the engine's (same names, shapes, values).
void compare_sinks(const MemorySink& eng, const MemorySink& ref, double tolerance, WorstByKind& worst) {
  for (const auto& [step, tensors] : ref.tensors) {
    ASSERT_TRUE(eng.tensors.count(step)) << "engine recorded nothing for step " << step;
    const auto& et = eng.tensors.at(step);
    EXPECT_EQ(et.size(), tensors.size()) << "step " << step << ": checkpoint counts differ";
    for (const auto& [name, r] : tensors) {
      auto it = et.find(name);
      if (it == et.end()) {
        ADD_FAILURE() << "engine did not record " << name << " at step " << step;
        continue;
      }
      const test::Recorded& e = it->second;
      EXPECT_EQ(e.shape, r.shape) << name << " step " << step;
      EXPECT_EQ(e.layout, r.layout) << name << " step " << step;
      if (e.shape != r.shape) continue;
      const double rel = rel_l2(e.data, r.data);
      const std::string base = parse_checkpoint_name(name).base;
      Worst& w = worst[base];
      if (!(rel <= w.rel) || w.name.empty()) w = {rel, name, step};
      if (tolerance > 0) {
        EXPECT_LT(rel, tolerance) << name << " at step " << step;
      }
    }
  }
}

void print_worst(const std::string& title, const ModelConfig& cfg, const WorstByKind& worst) {
  std::printf("%s\n", title.c_str());
  for (const std::string& name : checkpoint_names(cfg)) {
    const auto parsed = parse_checkpoint_name(name);
    if (parsed.layer > 0) continue;  // one line per kind
    auto it = worst.find(parsed.base);
    if (it == worst.end()) continue;
    std::printf("  %-14s worst rel L2 %.3e  (%s, step %d)\n", parsed.base.c_str(), it->second.rel,
                it->second.name.c_str(), it->second.step);
  }
  std::fflush(stdout);
}

struct Models {
  std::unique_ptr<GgufFile> file;
  ModelConfig cfg;
};

Models open_model(const std::string& path) {
  Models m;
  m.file = GgufFile::open(path);
  m.cfg = config_from_gguf(*m.file);
  return m;
}

// f32 engine vs f64 reference: prefill of 7 tokens then `decode_steps` teacher-forced steps, every
// checkpoint recorded on both sides.
WorstByKind f32_agreement(const std::string& path, int decode_steps) {
  WorstByKind worst;
  Models m = open_model(path);
  const int ctx = 8 + decode_steps;
  auto ref = make_cpu_backend(*m.file, m.cfg, "f64", ctx);
  auto eng = make_cuda_engine(*m.file, m.cfg, "f32", ctx);
  std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 7);
  for (int step = 0; step <= decode_steps; ++step) {
    MemorySink rs, es;
    const std::vector<float> rl = ref->forward(step, tokens, rs);
    const std::vector<float> el = eng->forward(step, tokens, es);
    EXPECT_EQ(eng->last_argmax(), host_argmax(el)) << "device argmax vs the returned logits, step " << step;
    EXPECT_EQ(es.ids[step]["tokens"], tokens);
    compare_sinks(es, rs, kF32Tolerance, worst);
    tokens = {host_argmax(rl)};
  }
  EXPECT_EQ(eng->n_past(), ref->n_past());
  return worst;
}

TEST(EngineModel, F32MatchesF64ReferenceOnEveryTinyFixture) {
  DIFFRUN_REQUIRE_CUDA();
  const char* archs[] = {"llama", "llama-tied", "qwen2", "qwen3"};
  const char* formats[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0",
                           "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "kmix"};
  WorstByKind overall;
  for (const char* arch : archs) {
    for (const char* fmt : formats) {
      const std::string path = test::fixture_path(std::string("tiny-") + arch + "-" + fmt + ".gguf");
      SCOPED_TRACE(path);
      ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture (scripts/gen_fixtures.py --out DIR)";
      const WorstByKind worst = f32_agreement(path, 4);
      for (const auto& [base, w] : worst)
        if (!(w.rel <= overall[base].rel) || overall[base].name.empty())
          overall[base] = {w.rel, std::string(arch) + "-" + fmt + " " + w.name, w.step};
    }
  }
  print_worst("f32 engine vs f64 reference, tiny fixtures (worst over all):",
              open_model(test::fixture_path("tiny-qwen3-f32.gguf")).cfg, overall);
}

// tiny-gemma3 (window 8 on layers 0-4, softcap 30): 7 prompt tokens and 4 decode steps, so the decode
// steps attend past the window, in each of its formats.
TEST(EngineModel, F32MatchesF64ReferenceOnTinyGemma3) {
  DIFFRUN_REQUIRE_CUDA();
  WorstByKind overall;
  for (const char* fmt : {"f32", "q8_0", "kmix"}) {
    const std::string path = test::fixture_path(std::string("tiny-gemma3-") + fmt + ".gguf");
    SCOPED_TRACE(path);
    ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture (scripts/gen_fixtures.py --out DIR)";
    for (const auto& [base, w] : f32_agreement(path, 4))
      if (!(w.rel <= overall[base].rel) || overall[base].name.empty())
        overall[base] = {w.rel, std::string("gemma3-") + fmt + " " + w.name, w.step};
  }
  print_worst("f32 engine vs f64 reference, tiny gemma3 (worst over its formats):",
              open_model(test::fixture_path("tiny-gemma3-f32.gguf")).cfg, overall);
}

// Llama 3 RoPE scaling (rope_freqs.weight with factors 1, smooth and 8): the engine's rope with freq factors.
TEST(EngineModel, F32MatchesF64ReferenceOnLlama3RopeFixture) {
  DIFFRUN_REQUIRE_CUDA();
  const std::string path = test::fixture_path("tiny-llama3rope-f32.gguf");
  ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture (scripts/gen_fixtures.py --out DIR)";
  ASSERT_FALSE(open_model(path).cfg.rope_freq_factors.empty());
  print_worst("f32 engine vs f64 reference, " + path + ":", open_model(path).cfg, f32_agreement(path, 4));
}

// tiny-mistral (llama with llama.attention.sliding_window = 8, not applied as in llama.cpp): 7 prompt tokens
// and 4 decode steps, so the last steps attend past the window in both backends.
TEST(EngineModel, F32MatchesF64ReferenceOnMistralFixture) {
  DIFFRUN_REQUIRE_CUDA();
  const std::string path = test::fixture_path("tiny-mistral-f32.gguf");
  ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture (scripts/gen_fixtures.py --out DIR)";
  ASSERT_FALSE(open_model(path).cfg.notes.empty());
  print_worst("f32 engine vs f64 reference, " + path + ":", open_model(path).cfg, f32_agreement(path, 4));
}

// Mixture of experts (qwen3moe, Mixtral, qwen2moe with its shared expert; F32 and Q8_0 experts): the routing
// checkpoints (logits, probabilities, ids, weights) and each selected expert's gate, up, SwiGLU and down in the
// [T, K, ...] layout, 7 prompt tokens and 4 decode steps.
TEST(EngineModel, F32MatchesF64ReferenceOnMoeFixtures) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* arch : {"qwen3moe", "mixtral", "qwen2moe"}) {
    WorstByKind overall;
    for (const char* fmt : {"f32", "q8_0"}) {
      const std::string path = test::fixture_path(std::string("tiny-") + arch + "-" + fmt + ".gguf");
      SCOPED_TRACE(path);
      ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture (scripts/gen_fixtures.py --out DIR)";
      for (const auto& [base, w] : f32_agreement(path, 4))
        if (!(w.rel <= overall[base].rel) || overall[base].name.empty())
          overall[base] = {w.rel, std::string(arch) + "-" + fmt + " " + w.name, w.step};
    }
    print_worst(std::string("f32 engine vs f64 reference, tiny ") + arch + " (worst over F32 and Q8_0):",
                open_model(test::fixture_path(std::string("tiny-") + arch + "-f32.gguf")).cfg, overall);
  }
}

void f32_agreement_on_env_model(const char* env) {
  const char* path = std::getenv(env);
  if (!path || !*path) GTEST_SKIP() << env << " is not set (path of the model to check)";
  const WorstByKind worst = f32_agreement(path, 4);
  print_worst(std::string("f32 engine vs f64 reference, ") + path + ":", open_model(path).cfg, worst);
}

TEST(EngineModel, F32MatchesF64ReferenceOnSmolLM2Slice) {
  DIFFRUN_REQUIRE_CUDA();
  f32_agreement_on_env_model("DIFFRUN_SMOLLM2_SLICE");
}

TEST(EngineModel, F32MatchesF64ReferenceOnGemma3) {
  DIFFRUN_REQUIRE_CUDA();
  f32_agreement_on_env_model("DIFFRUN_GEMMA3");
}

TEST(EngineModel, F32MatchesF64ReferenceOnQwen05BShape) {
  DIFFRUN_REQUIRE_CUDA();
  f32_agreement_on_env_model("DIFFRUN_QWEN05B");
}

// f16 engine vs f32 reference, 16 teacher-forced decode steps after a 7-token prefill.
void f16_agreement(const std::string& path) {
  Models m = open_model(path);
  const int decode_steps = 16;
  const int ctx = 8 + decode_steps;
  auto ref = make_cpu_backend(*m.file, m.cfg, "f32", ctx);
  auto eng = make_cuda_engine(*m.file, m.cfg, "f16", ctx);
  std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 7);
  WorstByKind worst;
  int agree = 0, total = 0;
  for (int step = 0; step <= decode_steps; ++step) {
    MemorySink rs, es;
    const std::vector<float> rl = ref->forward(step, tokens, rs);
    const std::vector<float> el = eng->forward(step, tokens, es);
    compare_sinks(es, rs, /*tolerance=*/0, worst);
    for (float v : el) ASSERT_TRUE(std::isfinite(v)) << "non-finite f16 logit at step " << step;
    const int32_t r1 = host_argmax(rl), e1 = eng->last_argmax();
    EXPECT_EQ(e1, host_argmax(el)) << "device argmax vs the returned logits, step " << step;
    std::vector<float> sorted = rl;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    const double margin = double(sorted[0]) - double(sorted[1]);
    double err = 0;
    for (size_t i = 0; i < rl.size(); ++i) err = std::max(err, std::fabs(double(el[i]) - double(rl[i])));
    if (step > 0) {  // the decode steps
      ++total;
      if (r1 == e1) {
        ++agree;
      } else {
        std::printf("  step %2d: top-1 miss (reference %d, engine %d): reference top-2 margin %.4g, f16 logit "
                    "max abs error %.4g -> %s\n",
                    step, r1, e1, margin, err, margin < err ? "explained" : "NOT explained");
        EXPECT_LT(margin, err) << "unexplained top-1 miss at step " << step;
      }
    }
    tokens = {r1};
  }
  print_worst("f16 engine vs f32 reference, " + path + ":", m.cfg, worst);
  std::printf("  top-1 agreement over %d teacher-forced decode steps: %d/%d\n", total, agree, total);
  std::fflush(stdout);
  for (const auto& [base, w] : worst) EXPECT_TRUE(std::isfinite(w.rel)) << base << " " << w.name;
}

TEST(EngineModel, F16AgainstF32ReferenceOnTinyFixtures) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* name : {"tiny-llama-f16.gguf", "tiny-qwen2-q8_0.gguf", "tiny-qwen3-kmix.gguf",
                           "tiny-gemma3-kmix.gguf"}) {
    SCOPED_TRACE(name);
    f16_agreement(test::fixture_path(name));
  }
}

TEST(EngineModel, F16AgainstF32ReferenceOnEnvModels) {
  DIFFRUN_REQUIRE_CUDA();
  bool any = false;
  for (const char* env : {"DIFFRUN_SMOLLM2_SLICE", "DIFFRUN_QWEN05B"}) {
    const char* path = std::getenv(env);
    if (!path || !*path) continue;
    any = true;
    SCOPED_TRACE(path);
    f16_agreement(path);
  }
  if (!any) GTEST_SKIP() << "neither DIFFRUN_SMOLLM2_SLICE nor DIFFRUN_QWEN05B is set";
}

// On dense weights (f16) and quantized ones (Q4_1 with bias; the K-quant mix with a Q5_K attn_v
// after Q4_K attn_q|attn_k, which the GEMV runs as two segments).
TEST(EngineModel, HooksDoNotChangeResultsAndGraphDecodeMatches) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* fixture : {"tiny-qwen2-f16.gguf", "tiny-qwen2-q4_1.gguf", "tiny-qwen3-kmix.gguf"})
  for (const char* precision : {"f32", "f16"}) {
    SCOPED_TRACE(std::string(fixture) + " " + precision);
    Models m = open_model(test::fixture_path(fixture));
    auto hooked = make_cuda_engine(*m.file, m.cfg, precision, 32);   // every step launched op by op
    auto plain = make_cuda_engine(*m.file, m.cfg, precision, 32);    // decode steps replay the graph
    auto argmaxer = make_cuda_engine(*m.file, m.cfg, precision, 32); // graph without the logits copy
    // Everything but result_output, which changes the lm head's row count (as in the reference).
    MemorySink all(CheckpointFilter("embd,attn_*,Q*,K*,V*,cache_*,kq_*,kqv_*,ffn_*,l_out-*,result_norm"));
    NullSink none;
    std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 5);
    for (int step = 0; step < 6; ++step) {
      const std::vector<float> a = hooked->forward(step, tokens, all);
      const std::vector<float> b = plain->forward(step, tokens, none);
      const int32_t c = argmaxer->forward_argmax(step, tokens, none);
      EXPECT_EQ(a, b) << "logits differ with hooks on, step " << step;
      EXPECT_EQ(c, host_argmax(b)) << "step " << step;
      EXPECT_FALSE(all.tensors[step].empty());
      tokens = {host_argmax(a)};
    }
  }
}

// The engine with every fused kernel off (the knobs the fused-vs-unfused tests turn off together).
std::unique_ptr<CudaEngine> make_unfused_engine(const Models& m, const char* precision, int ctx) {
  const char* knobs[] = {"DIFFRUN_SWIGLU_IN_GEMV", "DIFFRUN_ROPE_IN_GEMV", "DIFFRUN_EMBEDDING_NORM_FUSED",
                         "DIFFRUN_LM_HEAD_ARGMAX", "DIFFRUN_QK_NORM_IN_ROPE", "DIFFRUN_QK_NORM_IN_ATTENTION"};
  for (const char* v : knobs) setenv(v, "0", 1);
  auto e = make_cuda_engine(*m.file, m.cfg, precision, ctx);
  for (const char* v : knobs) unsetenv(v);
  return e;
}

// Recording never changes which kernels run (DESIGN.md, "Observing the production path"): one engine
// records every checkpoint of every step, a second records nothing (forward, the graph with the logits
// copy), a third runs forward_argmax (generate's and the benchmark's graph). The logits and argmax of
// each step are bit-identical, each step took the same path (graph replay, the same fused kernels), and
// the decode steps of the recorded engine did run as graph replays with the fused kernels the model
// allows. Every recorded tensor also equals, bit for bit, what an engine with graphs and fusion off
// records (the fused kernels' optional outputs hold what the unfused twins compute; the cache and
// probabilities copied under capture have the right length at every position).
void expect_recording_is_production(const std::string& path, int decode_steps) {
  Models m = open_model(path);
  for (const char* precision : {"f32", "f16"}) {
    SCOPED_TRACE(path + " " + precision);
    const int ctx = 8 + decode_steps;
    auto recorded = make_cuda_engine(*m.file, m.cfg, precision, ctx);
    auto plain = make_cuda_engine(*m.file, m.cfg, precision, ctx);
    auto argmaxer = make_cuda_engine(*m.file, m.cfg, precision, ctx);
    setenv("DIFFRUN_CUDA_GRAPHS", "0", 1);
    auto unfused = make_unfused_engine(m, precision, ctx);
    unsetenv("DIFFRUN_CUDA_GRAPHS");
    MemorySink all, all_unfused;
    NullSink none;
    std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 7);
    uint32_t fused_seen = 0;
    for (int step = 0; step <= decode_steps; ++step) {
      const std::vector<float> a = recorded->forward(step, tokens, all);
      const StepPath pa = recorded->last_step_path();
      const std::vector<float> b = plain->forward(step, tokens, none);
      const StepPath pb = plain->last_step_path();
      const int32_t c = argmaxer->forward_argmax(step, tokens, none);
      const StepPath pc = argmaxer->last_step_path();
      unfused->forward(step, tokens, all_unfused);
      EXPECT_TRUE(a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0)
          << "recording changed the logits, step " << step;
      EXPECT_EQ(recorded->last_argmax(), c) << "step " << step;
      EXPECT_EQ(c, host_argmax(b)) << "step " << step;
      EXPECT_EQ(pa.graph, pb.graph) << "step " << step;
      EXPECT_EQ(pa.graph, pc.graph) << "step " << step;
      EXPECT_EQ(pa.fused, pb.fused) << "step " << step;
      EXPECT_EQ(pa.fused, pc.fused) << "step " << step;
      // MoE decode steps too: their experts are gathered on the device (the "moe" fact).
      EXPECT_EQ(pa.graph, step > 0) << "decode steps replay the graph, recorded or not; step " << step;
      if (step > 0) fused_seen |= pa.fused;
      ASSERT_EQ(all.order[step], all_unfused.order[step]) << "recording order, step " << step;
      for (const std::string& name : all.order[step]) {
        const test::Recorded& x = all.tensors[step].at(name);
        const test::Recorded& y = all_unfused.tensors[step].at(name);
        EXPECT_EQ(x.shape, y.shape) << name << " step " << step;
        EXPECT_TRUE(x.data.size() == y.data.size() &&
                    std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)) == 0)
            << name << " differs from the unfused engine's, step " << step;
      }
      tokens = {host_argmax(a)};
    }
    // A dense llama fuses all four (gemma3 only its q/k norms with the RoPE, in the attention launch at a decode
    // step, bit 64: GeGLU, the embedding scale and the softcap keep the others apart; qwen3's K-quants none in the
    // f32 engine, whose SIMT GEMV keeps them unfused, and the tiny qwen3's heads of 32 are too narrow for
    // qk_norm_rope and the attention launch's norms).
    std::printf("fused kernels of the recorded decode steps: %s %s bits %u\n", path.c_str(), precision, fused_seen);
    if (path.find("tiny-llama-f32") != std::string::npos) {
      EXPECT_EQ(fused_seen, 15u);
    }
    if (path.find("tiny-gemma3") != std::string::npos) {
      EXPECT_EQ(fused_seen & 64u, 64u) << "gemma3's heads of 128 take attention_split_qk_norm_rope";
    }
  }
}

TEST(EngineModel, RecordingRunsTheProductionPathOnEveryTinyFixture) {
  DIFFRUN_REQUIRE_CUDA();
  std::vector<std::string> names;
  for (const char* arch : {"llama", "llama-tied", "qwen2", "qwen3"})
    for (const char* fmt : {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                            "q5_k", "q6_k", "kmix"})
      names.push_back(std::string("tiny-") + arch + "-" + fmt + ".gguf");
  for (const char* extra : {"tiny-gemma3-f32.gguf", "tiny-gemma3-q8_0.gguf", "tiny-gemma3-kmix.gguf",
                            "tiny-llama3rope-f32.gguf", "tiny-mistral-f32.gguf", "tiny-qwen3moe-q8_0.gguf",
                            "tiny-mixtral-f32.gguf", "tiny-qwen2moe-q8_0.gguf", "tiny-mixtral-q4_k.gguf"})
    names.push_back(extra);
  for (const std::string& name : names) {
    const std::string path = test::fixture_path(name);
    ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture " << path;
    expect_recording_is_production(path, 5);
  }
}

TEST(EngineModel, RecordingRunsTheProductionPathOnEnvModels) {
  DIFFRUN_REQUIRE_CUDA();
  bool any = false;
  for (const char* env : {"DIFFRUN_SMOLLM2_SLICE", "DIFFRUN_GEMMA3", "DIFFRUN_QWEN05B"}) {
    const char* path = std::getenv(env);
    if (!path || !*path) continue;
    any = true;
    expect_recording_is_production(path, 4);
  }
  if (!any) GTEST_SKIP() << "none of DIFFRUN_SMOLLM2_SLICE, DIFFRUN_GEMMA3, DIFFRUN_QWEN05B is set";
}

// The two ways of copying recorded checkpoints (engine/checkpoint_stager.cuh): batched gather kernels
// flushed before each overwrite (with the default arena, and with a 16 KiB one that fills mid-step and
// sends the larger tensors straight to pinned memory), and one cudaMemcpyAsync per tensor. Every tensor of
// a prefill and three decode steps, in the same order with the same bits, on biases (qwen2), q/k norms
// (qwen3), gemma3's post-norms, embedding scale and softcap, and a fault that changes the dataflow
// (residual_skipped copies attn_out into ffn_inp).
TEST(EngineModel, CheckpointCopyModesRecordTheSameValues) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    const char* fixture;
    const char* faults;
  };
  for (const Case& c : {Case{"tiny-qwen2-f16.gguf", ""}, Case{"tiny-qwen3-kmix.gguf", ""},
                        Case{"tiny-gemma3-f32.gguf", ""}, Case{"tiny-llama-f32.gguf", "residual_skipped"}})
  for (const char* precision : {"f32", "f16"}) {
    SCOPED_TRACE(std::string(c.fixture) + " " + precision + " " + c.faults);
    Models m = open_model(test::fixture_path(c.fixture));
    const FaultSet faults = parse_faults(c.faults);
    setenv("DIFFRUN_CHECKPOINT_COPY", "gather", 1);
    auto gather = make_cuda_engine(*m.file, m.cfg, precision, 32, faults);
    setenv("DIFFRUN_CHECKPOINT_ARENA_KIB", "16", 1);  // a full arena mid-step, large tensors written directly
    auto small_arena = make_cuda_engine(*m.file, m.cfg, precision, 32, faults);
    unsetenv("DIFFRUN_CHECKPOINT_ARENA_KIB");
    setenv("DIFFRUN_CHECKPOINT_COPY", "memcpy", 1);
    auto memcpy_each = make_cuda_engine(*m.file, m.cfg, precision, 32, faults);
    unsetenv("DIFFRUN_CHECKPOINT_COPY");
    EXPECT_EQ(gather->facts().at("checkpoint_copies").rfind("gather", 0), 0u);
    EXPECT_EQ(memcpy_each->facts().at("checkpoint_copies").rfind("memcpy", 0), 0u);
    MemorySink a, b, c2;
    std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 5);
    for (int step = 0; step < 4; ++step) {
      const std::vector<float> la = gather->forward(step, tokens, a);
      const std::vector<float> lb = memcpy_each->forward(step, tokens, b);
      const std::vector<float> lc = small_arena->forward(step, tokens, c2);
      EXPECT_EQ(la, lb) << "logits, step " << step;
      EXPECT_EQ(lc, lb) << "logits, step " << step;
      for (const MemorySink* other : {&a, &c2}) {
        ASSERT_EQ(other->order.at(step), b.order[step]) << "recording order, step " << step;
        for (const std::string& name : b.order[step]) {
          const test::Recorded& x = other->tensors.at(step).at(name);
          const test::Recorded& y = b.tensors[step].at(name);
          EXPECT_EQ(x.shape, y.shape) << name << " step " << step;
          EXPECT_EQ(x.native, y.native) << name << " step " << step;
          EXPECT_TRUE(x.data.size() == y.data.size() &&
                      std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)) == 0)
              << name << " differs, step " << step << (other == &c2 ? " (16 KiB arena)" : "");
        }
      }
      tokens = {host_argmax(la)};
    }
  }
}

// reset() empties the cache (zero rows, as at construction): an engine reset after a longer prompt
// computes what a fresh one does, even under kv_cache_pos0, whose decode steps read rows that the
// short prompt never wrote (device memory is not zeroed by cudaMalloc).
TEST(EngineModel, ResetEngineEqualsAFreshOne) {
  DIFFRUN_REQUIRE_CUDA();
  Models m = open_model(test::fixture_path("tiny-llama-f32.gguf"));
  for (const char* faults : {"", "kv_cache_pos0"})
  for (const char* precision : {"f32", "f16"}) {
    SCOPED_TRACE(std::string(faults) + " " + precision);
    auto used = make_cuda_engine(*m.file, m.cfg, precision, 16, parse_faults(faults));
    NullSink none;
    std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2};
    for (int step = 0; step < 3; ++step) tokens = {host_argmax(used->forward(step, tokens, none))};
    used->reset();
    auto fresh = make_cuda_engine(*m.file, m.cfg, precision, 16, parse_faults(faults));
    std::vector<int32_t> a = {2, 7}, b = {2, 7};
    for (int step = 0; step < 4; ++step) {
      const std::vector<float> la = used->forward(step, a, none), lb = fresh->forward(step, b, none);
      EXPECT_EQ(la, lb) << "step " << step;
      a = b = {host_argmax(lb)};
    }
  }
}

// The decode fusions of one-token steps without hooks (SwiGLU in the gate|up GEMV, RoPE and the cache
// write in the qkv GEMV; the q/k norms with the RoPE at every step) against the same engine with them off: the
// same logits bit for bit, on norm and neox pairing, freq factors (llama3rope), biases (qwen2), q/k norms (gemma3),
// dense and quantized weights (kmix: Wq|Wk and Wv in two formats, one launch in the f16 engine).
TEST(EngineModel, FusedDecodeMatchesUnfusedDecode) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* fixture : {"tiny-llama-f32.gguf", "tiny-llama-q4_k.gguf", "tiny-llama3rope-f32.gguf",
                              "tiny-mistral-f32.gguf", "tiny-qwen2-q8_0.gguf", "tiny-llama-kmix.gguf",
                              "tiny-gemma3-f32.gguf"})
  for (const char* precision : {"f32", "f16"}) {
    SCOPED_TRACE(std::string(fixture) + " " + precision);
    Models m = open_model(test::fixture_path(fixture));
    auto fused = make_cuda_engine(*m.file, m.cfg, precision, 32);
    auto unfused = make_unfused_engine(m, precision, 32);
    EXPECT_EQ(unfused->facts().at("qk_norm_in_rope"), "off");
    EXPECT_EQ(fused->facts().at("swiglu_in_gate_up_gemv"), "one-token steps, recorded or not");
    EXPECT_EQ(fused->facts().at("rope_in_qkv_gemv"), "one-token steps, recorded or not");
    EXPECT_EQ(fused->facts().at("embedding_rms_norm"), "one-token steps, recorded or not (dense token_embd)");
    EXPECT_EQ(unfused->facts().at("swiglu_in_gate_up_gemv"), "off");
    EXPECT_EQ(unfused->facts().at("rope_in_qkv_gemv"), "off");
    EXPECT_EQ(unfused->facts().at("embedding_rms_norm"), "off");
    EXPECT_EQ(fused->facts().at("lm_head_argmax"), "every step's last token, recorded or not (dense lm head)");
    EXPECT_EQ(unfused->facts().at("lm_head_argmax"), "off");
    NullSink none;
    std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 5);
    for (int step = 0; step < 6; ++step) {
      const std::vector<float> a = fused->forward(step, tokens, none);
      const std::vector<float> b = unfused->forward(step, tokens, none);
      EXPECT_EQ(a, b) << "logits differ, step " << step;
      EXPECT_EQ(fused->last_argmax(), unfused->last_argmax()) << "step " << step;
      EXPECT_EQ(fused->last_argmax(), host_argmax(a)) << "step " << step;
      tokens = {host_argmax(a)};
    }
  }
}

// Quantized weights kept as blocks against the same model expanded at load (DIFFRUN_QUANT_WEIGHTS=0,
// the path before quantized kernels): the prefill (cuBLAS on the dequantized scratch) is bit-identical,
// decode steps (the quantized GEMV) agree to f32 rounding, and the engine says which weights it kept.
TEST(EngineModel, QuantizedWeightsMatchExpandedWeights) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* fixture : {"tiny-qwen3-kmix.gguf", "tiny-llama-q5_0.gguf"})
  for (const char* precision : {"f32", "f16"}) {
    SCOPED_TRACE(std::string(fixture) + " " + precision);
    Models m = open_model(test::fixture_path(fixture));
    auto quant = make_cuda_engine(*m.file, m.cfg, precision, 32);
    setenv("DIFFRUN_QUANT_WEIGHTS", "0", 1);
    auto expanded = make_cuda_engine(*m.file, m.cfg, precision, 32);
    unsetenv("DIFFRUN_QUANT_WEIGHTS");
    EXPECT_NE(quant->facts().at("quantized_weights"), "none");
    EXPECT_EQ(expanded->facts().at("quantized_weights"), "none");
    EXPECT_LT(quant->weight_bytes(), expanded->weight_bytes());
    std::vector<int32_t> tokens = prompt_ids(m.cfg.n_vocab, 5);
    for (int step = 0; step < 5; ++step) {
      MemorySink qs, es;
      const std::vector<float> a = quant->forward(step, tokens, qs);
      const std::vector<float> b = expanded->forward(step, tokens, es);
      ASSERT_EQ(qs.tensors[step].size(), es.tensors[step].size());
      for (const auto& [name, e] : es.tensors[step]) {
        const test::Recorded& q = qs.tensors[step].at(name);
        if (step == 0 && name == "result_output") {
          // The last row is the production lm head's: matmul_argmax (a GEMV) on the dense head, cuBLAS on the
          // dequantized one; the rows before it are cuBLAS on both.
          const size_t V = static_cast<size_t>(e.shape.back());
          const std::vector<float> qh(q.data.begin(), q.data.end() - V), eh(e.data.begin(), e.data.end() - V);
          EXPECT_EQ(qh, eh) << name << ": the prefill's rows before the last differ";
          const std::vector<float> ql(q.data.end() - V, q.data.end()), el(e.data.end() - V, e.data.end());
          EXPECT_LT(rel_l2(ql, el), std::string(precision) == "f32" ? 1e-5 : 2e-2) << name << ": the prefill's last row";
        } else if (step == 0) {
          EXPECT_EQ(q.data, e.data) << name << ": the prefill differs";
        } else {
          // f16: the expanded decode reads f16-rounded weights, the quantized one exact weights.
          EXPECT_LT(rel_l2(q.data, e.data), std::string(precision) == "f32" ? 1e-5 : 2e-2) << name << " step " << step;
        }
      }
      tokens = {host_argmax(b)};
    }
  }
}

TEST(EngineModel, ErrorsAreTyped) {
  DIFFRUN_REQUIRE_CUDA();
  Models m = open_model(test::fixture_path("tiny-llama-f32.gguf"));
  EXPECT_THROW(make_cuda_engine(*m.file, m.cfg, "bf16", 8), InputError);
  auto eng = make_cuda_engine(*m.file, m.cfg, "f32", 4);
  NullSink none;
  EXPECT_THROW(eng->forward(0, std::vector<int32_t>{}, none), InputError);
  EXPECT_THROW(eng->forward(0, std::vector<int32_t>{m.cfg.n_vocab}, none), InputError);
  EXPECT_THROW(eng->forward(0, std::vector<int32_t>(5, 1), none), InputError);  // beyond max_ctx 4
  EXPECT_NO_THROW(eng->forward(0, std::vector<int32_t>(4, 1), none));
  EXPECT_THROW(eng->forward(1, std::vector<int32_t>{1}, none), InputError);  // cache full
}

}  // namespace
}  // namespace diffrun
