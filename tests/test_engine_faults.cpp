// GPU: catalog faults injected into the CUDA engine are found where the catalog says; isolation replay; sensitivity.
//
// The two pairs of the default GPU run: engine f32 against the f64 reference (logic, preset
// f32_vs_f64) and engine f16 against the reference that emulates its f16 storage (precision, preset
// f16_vs_f32-f16store, its isolation replay judged by f16_vs_f32-f16store_local), on the tiny
// llama/qwen2/qwen3 f32 fixtures, a Q8_0 fixture for dequant_scale_offset, and the SmolLM2 slice when
// DIFFRUN_SMOLLM2_SLICE names it. Each applicable fault must diverge first at its catalog checkpoint
// and step with the verdict "local", and in isolation replay its local error must be at least 100x
// the largest local error of the clean run (for a fault that makes NaN/Inf: non-finite values in
// isolation too), and only the fault's own ops (the catalog's `ops`) may fail locally; the clean
// engine passes in isolation everywhere. The subtle RMSNorm faults (rms_eps_1e5, rms_norm_off_by_one,
// rms_eps_outside_sqrt) move attn_norm-0 by 7e-6 to 3e-3: the logic pair finds each; the precision
// pair finds them by their local error, the ones under 1e-3 (within what one f16 flip of an outlier
// element gives in rel_l2) by the share of attn_norm's f16 values that differ (max_fail_frac of the
// _local preset). rms_eps_outside_sqrt on models with rms_eps 1e-6 moves attn_norm-0 by only 7e-6
// (tiny qwen2/qwen3), which changes almost no f16 value: the f16 check prints it and asserts nothing.
// For these three the local error is not asserted to be 100x the clean run's largest (which comes from
// other kinds, and in the f16 path from single flips). rope_cache_unrotated is the fused-write check of isolation: its cache_k-0 must
// be local in isolation as in the plain run.
//
// Printed figures (for the project notes): one line per fault and configuration ("fault-table"),
// and the smallest scale error 1+eps of one weight row that the default f16_vs_f32 preset catches
// per checkpoint kind ("sensitivity").
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diff/compare.hpp"
#include "diff/tolerances.hpp"
#include "dump/dump.hpp"
#include "dump/replay_sink.hpp"
#include "engine/engine.hpp"
#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/reference.hpp"
#include "test_engine_common.hpp"
#include "test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;

const std::vector<int32_t> kPrompt = {1, 17, 42, 99, 5, 63, 120, 7, 200};
constexpr int kSteps = 2;

// Dumps go here; the directory is removed when the test program exits.
fs::path temp_dir() {
  static const test::ScratchDir dir("test-engine-faults");
  return dir.path;
}

struct Model {
  std::string path;
  std::unique_ptr<GgufFile> file;
  ModelConfig cfg;
};

Model open_model(const std::string& path) {
  Model m;
  m.path = path;
  m.file = GgufFile::open(path);
  m.cfg = config_from_gguf(*m.file);
  return m;
}

// The argmax of each step; `fused` and `graph` (when given) receive each step's StepPath.
std::vector<int32_t> run(Backend& b, const std::vector<int32_t>& forced, Sink& sink,
                         std::vector<int32_t>* fused = nullptr, std::vector<int32_t>* graph = nullptr) {
  std::vector<int32_t> argmax;
  std::vector<float> logits = b.forward(0, kPrompt, sink);
  for (int step = 0;; ++step) {
    if (fused) fused->push_back(static_cast<int32_t>(b.last_step_path().fused));
    if (graph) graph->push_back(b.last_step_path().graph ? 1 : 0);
    const int32_t own = b.last_argmax();  // the engine's device argmax (argmax_ties_highest changes it)
    argmax.push_back(own >= 0 ? own : static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                                            logits.begin()));
    if (step == kSteps) break;
    const int32_t next = forced.empty() ? argmax.back() : forced[step];
    logits = b.forward(step + 1, std::span<const int32_t>(&next, 1), sink);
  }
  return argmax;
}

struct Dump {
  std::string path;
  std::vector<int32_t> argmax;
};

// One backend's run into a dump; the engine side is teacher-forced with `forced` and isolated when
// `reference` is given.
Dump dump(const Model& m, Backend& b, const std::vector<int32_t>& forced, const std::string& name,
          const DumpReader* reference = nullptr) {
  DumpMeta meta;
  meta.backend = b.name();
  meta.precision = b.precision();
  meta.model_path = m.path;
  meta.model_fingerprint = m.file->fingerprint();
  meta.config = m.cfg;
  meta.token_ids = kPrompt;
  meta.facts = b.facts();
  Dump d;
  d.path = (temp_dir() / (name + ".h5")).string();
  DumpWriter writer(d.path, meta);
  std::vector<int32_t> fused, graph;
  if (reference) {
    ReplaySink replay(writer, *reference);
    d.argmax = run(b, forced, replay, &fused, &graph);
  } else {
    d.argmax = run(b, forced, writer, &fused, &graph);
  }
  writer.set_attribute("argmax", d.argmax);
  if (meta.facts.count("fused_kernel_bits")) {
    writer.set_attribute("step_fused", fused);
    writer.set_attribute("step_graph", graph);
  }
  writer.finish();
  return d;
}

const int kCtx = static_cast<int>(kPrompt.size()) + kSteps;

Dump engine_dump(const Model& m, const std::string& precision, const FaultSet& faults,
                 const std::vector<int32_t>& forced, const std::string& name, const DumpReader* reference = nullptr) {
  auto e = make_cuda_engine(*m.file, m.cfg, precision, kCtx, faults);
  return dump(m, *e, forced, name, reference);
}

diff::Comparison compare(const std::string& engine, const std::string& reference, const std::string& preset) {
  return diff::compare_dumps(DumpReader(engine), DumpReader(reference), diff::preset_tolerances(preset));
}

std::string first_of(const diff::Comparison& c) {
  if (!c.first_failure) return "none";
  const diff::CheckpointResult& f = c.results[*c.first_failure];
  return f.name + "@" + std::to_string(f.step);
}

// The largest local rel_l2 (isolation replay of the engine against the reference) over every checkpoint.
double max_local(const diff::Comparison& isolated) {
  double mx = 0;
  for (const auto& r : isolated.results) {
    if (r.metrics && std::isfinite(r.metrics->rel_l2)) mx = std::max(mx, r.metrics->rel_l2);
  }
  return mx;
}

// Engine precision, its reference precision and preset, and the preset of its local errors (the
// isolation replay judged on its own, as the default run does for the precision pair) or "".
struct Pair {
  const char* engine;
  const char* reference;
  const char* preset;
  const char* local_preset;
};
// The two pairs of the default GPU run: logic and precision.
constexpr Pair kPairs[] = {{"f32", "f64", "f32_vs_f64", ""},
                           {"f16", "f32-f16store", "f16_vs_f32-f16store", "f16_vs_f32-f16store_local"}};

// Every applicable fault (or only `only`) on one model, both precision pairs.
void check_model(const std::string& path, const std::string& label, std::vector<Fault> only = {}) {
  const Model m = open_model(path);
  for (const Pair& p : kPairs) {
    SCOPED_TRACE(label + " engine " + p.engine);
    auto ref_backend = make_cpu_backend(*m.file, m.cfg, p.reference, kCtx);
    const Dump ref = dump(m, *ref_backend, {}, label + "-ref-" + p.reference);
    const DumpReader ref_reader(ref.path);

    // The clean engine: no divergence; its isolated local errors set the bar for the faults.
    const Dump clean = engine_dump(m, p.engine, {}, ref.argmax, label + "-clean-" + p.engine);
    const diff::Comparison cc = compare(clean.path, ref.path, p.preset);
    EXPECT_FALSE(cc.diverged()) << "clean engine diverges at " << first_of(cc);
    const std::string local_preset = *p.local_preset ? p.local_preset : p.preset;
    diff::CompareOptions iopt;
    iopt.judge_local = *p.local_preset != 0;
    const Dump clean_iso = engine_dump(m, p.engine, {}, ref.argmax, label + "-clean-iso-" + p.engine, &ref_reader);
    const diff::Comparison clean_ci = compare(clean_iso.path, ref.path, local_preset);
    EXPECT_FALSE(clean_ci.diverged()) << "a clean op fails in isolation at " << first_of(clean_ci);
    const double clean_local = max_local(clean_ci);
    std::printf("fault-table %-12s %-4s %-24s local max %.3g (clean)\n", label.c_str(), p.engine, "none", clean_local);

    for (const FaultInfo& info : fault_catalog()) {
      if (!only.empty() && std::find(only.begin(), only.end(), info.id) == only.end()) continue;
      if (!fault_not_applicable(info.id, m.cfg, m.file.get()).empty()) continue;
      if (fault_in_production_path_only(info.id)) continue;  // check_production_path_faults
      if (const std::string why = fault_dormant(info.id, m.cfg, m.file.get(), p.engine); !why.empty()) {
        std::printf("fault-table %-12s %-4s %-24s dormant: %s\n", label.c_str(), p.engine, info.name, why.c_str());
        continue;
      }
      const bool rms_subtle = info.id == Fault::rms_eps_1e5 || info.id == Fault::rms_norm_off_by_one ||
                              info.id == Fault::rms_eps_outside_sqrt;
      const bool tiny_effect = info.id == Fault::rms_eps_outside_sqrt && m.cfg.rms_eps < 5e-6;
      // 7e-6 at attn_norm-0 (tiny_effect) changes almost no f16 value: the f16 path cannot show it.
      // gemma3 scales its embeddings by sqrt(D): mean(x^2) dwarfs eps, and the eps faults move attn_norm-0
      // below the f32 bound too (the CPU catalog test checks them f32 against f32 there).
      const bool eps_fault = info.id == Fault::rms_eps_1e5 || info.id == Fault::rms_eps_outside_sqrt;
      const bool subtle = (std::string(p.engine) == "f16" && tiny_effect) || (eps_fault && m.cfg.embd_scale);
      SCOPED_TRACE(info.name);
      const std::string expected = expected_checkpoint(info.id, m.cfg, m.file.get());
      const std::string name = label + "-" + info.name + "-" + p.engine;
      const Dump faulty = engine_dump(m, p.engine, FaultSet{info.id}, ref.argmax, name);
      diff::Comparison c = compare(faulty.path, ref.path, p.preset);
      const Dump iso = engine_dump(m, p.engine, FaultSet{info.id}, ref.argmax, name + "-iso", &ref_reader);
      const diff::Comparison ci = compare(iso.path, ref.path, local_preset);
      diff::add_isolation(c, ci, iopt);

      std::string local = "-";
      double local_err = 0;
      bool local_shape = false, local_nonfinite = false;
      if (c.first_failure && c.results[*c.first_failure].local) {
        const diff::CheckpointResult& f = c.results[*c.first_failure];
        const diff::LocalError& l = *f.local;
        local_shape = l.status == diff::CheckpointStatus::shape_mismatch;
        local_err = l.rel_l2;
        for (const auto& r : ci.results)
          if (r.step == f.step && r.name == f.name && r.metrics) local_nonfinite = !r.metrics->finite();
        local = local_shape ? "shape" : std::to_string(l.rel_l2) + (local_nonfinite ? " non-finite" : "");
      }
      std::printf("fault-table %-12s %-4s %-24s expected %s@%d found %s verdict %s (%s) local %s\n", label.c_str(),
                  p.engine, info.name, expected.c_str(), info.step, first_of(c).c_str(),
                  diff::verdict_kind_name(c.verdict.kind), c.verdict.rule.c_str(), local.c_str());
      if (subtle) continue;  // the engine's own error hides it: the catalog says so
      ASSERT_TRUE(c.diverged()) << "the fault went unnoticed";
      const diff::CheckpointResult& f = c.results[*c.first_failure];
      EXPECT_EQ(f.name, expected);
      EXPECT_EQ(f.step, info.step);
      EXPECT_EQ(c.verdict.kind, diff::VerdictKind::local) << c.verdict.rule << ": " << c.verdict.explanation;
      // A decode step's cache or RoPE came from the fused qkv GEMV or a graph replay, which the replay (unfused,
      // one by one) did not run: no local error there (kv_cache_pos0's cache_k-0 at step 1); the jump rule
      // decides, and the isolation checks below still hold.
      bool other_path = false;
      for (const std::string& w : c.warnings) other_path |= w.find("unfused twins") != std::string::npos;
      if (info.id == Fault::argmax_ties_highest) {  // right logits, a wrong choice made from them
        EXPECT_EQ(c.verdict.rule, "argmax");
      } else if (!f.local && other_path && f.step > 0) {
        EXPECT_EQ(c.verdict.rule, "jump");
      } else {
        ASSERT_TRUE(f.local.has_value());
        EXPECT_TRUE(f.local->failed()) << "local rel_l2 " << f.local->rel_l2;
      }
      // Isolation measures the op under test, fused or not: only the fault's own ops fail locally.
      const std::string ops = std::string(",") + info.ops + ",";
      for (const auto& r : ci.results) {
        if (r.failed()) {
          EXPECT_NE(ops.find("," + r.base + ","), std::string::npos)
              << r.name << " at step " << r.step << " fails in isolation; the fault changes only " << info.ops;
        }
      }
      // The f16 path's clean local errors (one-ulp f16 flips, up to ~1e-4) leave the subtle faults no 100x.
      // sliding_window_ignored on the 9-token prompt against tiny-gemma3's window of 8 adds one key to one
      // query row: on the H100 its local error was 80x the f16 engine's largest clean local error (0.027
      // against 3.4e-4, f16 against f32), so it is held to 50x.
      const double margin = info.id == Fault::sliding_window_ignored ? 50 : 100;
      // argmax_ties_highest: right logits, a wrong choice made from them (rule argmax): no error to measure.
      if (f.local && !local_shape && !local_nonfinite && !tiny_effect && info.id != Fault::argmax_ties_highest &&
          !(rms_subtle && std::string(p.engine) == "f16")) {
        EXPECT_GE(local_err, margin * clean_local) << "local error against the clean run's largest local error";
      }
    }
  }
}

// The faults of the production path (fused one-token kernels, the captured decode graph), each found by
// the plain run of both default pairs at its catalog checkpoint and step, with the verdict local: the
// recorded steps run the fused kernels and replay the graph. The precision pair also runs the isolation
// replay as the job does; the replay runs the unfused twins, which these faults leave alone, so the
// fused kernels' checkpoints get no local error where the step ran them (step_fused), and the verdict
// stays local (the jump rule) instead of drift.
void check_production_path_faults(const std::string& path, const std::string& label) {
  const Model m = open_model(path);
  int checked = 0;
  for (const Pair& p : kPairs) {
    SCOPED_TRACE(label + " engine " + p.engine);
    auto ref_backend = make_cpu_backend(*m.file, m.cfg, p.reference, kCtx);
    const Dump ref = dump(m, *ref_backend, {}, label + "-pp-ref-" + p.reference);
    for (const FaultInfo& info : fault_catalog()) {
      if (!fault_in_production_path_only(info.id)) continue;
      if (!fault_not_applicable(info.id, m.cfg, m.file.get()).empty()) continue;
      if (const std::string why = fault_dormant(info.id, m.cfg, m.file.get(), p.engine); !why.empty()) {
        std::printf("fault-table %-12s %-4s %-28s dormant: %s\n", label.c_str(), p.engine, info.name, why.c_str());
        continue;
      }
      SCOPED_TRACE(info.name);
      const std::string expected = expected_checkpoint(info.id, m.cfg, m.file.get());
      const Dump faulty =
          engine_dump(m, p.engine, FaultSet{info.id}, ref.argmax, label + "-" + info.name + "-" + p.engine);
      diff::Comparison c = compare(faulty.path, ref.path, p.preset);
      if (*p.local_preset) {
        const DumpReader ref_reader(ref.path);
        const Dump iso = engine_dump(m, p.engine, FaultSet{info.id}, ref.argmax,
                                     label + "-" + info.name + "-" + p.engine + "-iso", &ref_reader);
        diff::CompareOptions iopt;
        iopt.judge_local = true;
        diff::add_isolation(c, compare(iso.path, ref.path, p.local_preset), iopt);
      }
      std::printf("fault-table %-12s %-4s %-28s expected %s@%d found %s verdict %s (%s)\n", label.c_str(), p.engine,
                  info.name, expected.c_str(), info.step, first_of(c).c_str(),
                  diff::verdict_kind_name(c.verdict.kind), c.verdict.rule.c_str());
      ++checked;
      ASSERT_TRUE(c.diverged()) << "the fault went unnoticed";
      const diff::CheckpointResult& f = c.results[*c.first_failure];
      EXPECT_EQ(f.name, expected);
      EXPECT_EQ(f.step, info.step);
      EXPECT_EQ(c.verdict.kind, diff::VerdictKind::local) << c.verdict.rule << ": " << c.verdict.explanation;
    }
  }
  EXPECT_GT(checked, 0) << "no production-path fault applies to " << path;
}

TEST(EngineFaults, ProductionPathFaultsTinyLlama) {
  DIFFRUN_REQUIRE_CUDA();
  check_production_path_faults(test::fixture_path("tiny-llama-f32.gguf"), "tiny-llama");
}

TEST(EngineFaults, ProductionPathFaultsTinyQwen2Q8) {
  DIFFRUN_REQUIRE_CUDA();
  check_production_path_faults(test::fixture_path("tiny-qwen2-q8_0.gguf"), "tiny-qwen2-q8");
}

TEST(EngineFaults, ProductionPathFaultsTinyQwen3) {
  DIFFRUN_REQUIRE_CUDA();
  check_production_path_faults(test::fixture_path("tiny-qwen3-f32.gguf"), "tiny-qwen3");
}

TEST(EngineFaults, ProductionPathFaultsSmolLM2Slice) {
  DIFFRUN_REQUIRE_CUDA();
  const char* slice = std::getenv("DIFFRUN_SMOLLM2_SLICE");
  if (!slice || !*slice) GTEST_SKIP() << "DIFFRUN_SMOLLM2_SLICE is not set";
  check_production_path_faults(slice, "smollm2");
}

TEST(EngineFaults, TinyLlama) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-llama-f32.gguf"), "tiny-llama");
}

TEST(EngineFaults, TinyQwen2) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-qwen2-f32.gguf"), "tiny-qwen2");
}

TEST(EngineFaults, TinyQwen3) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-qwen3-f32.gguf"), "tiny-qwen3");
}

// Every fault with the weights kept quantized (Q4_1 blocks read by the quantized GEMV, dequantized
// for the prefill's cuBLAS and for the faults that read a matrix through cuBLAS or as a table).
TEST(EngineFaults, TinyQwen2Q4_1) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-qwen2-q4_1.gguf"), "tiny-qwen2-q4_1");
}

TEST(EngineFaults, TinyGemma3) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-gemma3-f32.gguf"), "tiny-gemma3");
}

// Mixture of experts: the routing faults (softmax over the top-k, weights not renormalised, expert id off by one,
// one expert's gate and up swapped, qwen2moe's shared expert ungated) and every other fault that applies, both
// default pairs, the clean engines passing in isolation (forced routing: the replay runs the reference's experts).
// tiny-mixtral-q4_k: the f16 engine's decode reads its K-quant experts in place (no gather).
TEST(EngineFaults, TinyMoe) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* name :
       {"tiny-qwen3moe-f32.gguf", "tiny-mixtral-f32.gguf", "tiny-qwen2moe-f32.gguf", "tiny-mixtral-q4_k.gguf"}) {
    const std::string path = test::fixture_path(name);
    check_model(path, fs::path(path).stem().string());
    check_production_path_faults(path, fs::path(path).stem().string());
  }
}

// Every token's logits tie exactly (lm head rows in equal pairs): the engine's argmax and matmul_argmax
// breaking ties toward the higher id are caught at result_output of step 0 by the engine's own argmax.
TEST(EngineFaults, ArgmaxTiesOnTiedLogits) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-llama-tiedrows-f32.gguf"), "tiedrows", {Fault::argmax_ties_highest});
}

TEST(EngineFaults, DequantScaleOffsetOnQ8_0) {
  DIFFRUN_REQUIRE_CUDA();
  check_model(test::fixture_path("tiny-llama-q8_0.gguf"), "llama-q8_0", {Fault::dequant_scale_offset});
}

TEST(EngineFaults, SmolLM2Slice) {
  DIFFRUN_REQUIRE_CUDA();
  const std::string path = test::env_or("DIFFRUN_SMOLLM2_SLICE", "");
  if (path.empty()) GTEST_SKIP() << "DIFFRUN_SMOLLM2_SLICE is not set";
  check_model(path, "smollm2-slice");
}

// Every applicable catalog fault on the models DIFFRUN_FAULT_MODELS names (paths separated by ':'), both default
// pairs, the production-path faults too: the full-size shapes (`gen_fixtures.py --shape llama-7b-q4k`) have
// reduction lengths 8-16x the tiny fixtures', so this checks that the size-scaled bounds still leave every
// fault at its checkpoint, step and verdict. Unset: skipped.
TEST(EngineFaults, EnvModels) {
  DIFFRUN_REQUIRE_CUDA();
  const std::string list = test::env_or("DIFFRUN_FAULT_MODELS", "");
  if (list.empty()) GTEST_SKIP() << "DIFFRUN_FAULT_MODELS is not set (GGUF paths separated by ':')";
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t end = std::min(list.find(':', begin), list.size());
    const std::string path = list.substr(begin, end - begin);
    begin = end + 1;
    if (path.empty()) continue;
    SCOPED_TRACE(path);
    const std::string label = fs::path(path).stem().string();
    check_model(path, label);
    check_production_path_faults(path, label);
  }
}

// --- Sensitivity: the smallest relative error of one weight row the default GPU run catches ---

// A copy of an f32 model with row `row` of tensor `tensor` scaled by (1 + eps).
std::string scaled_copy(const Model& m, const std::string& tensor, int64_t row, double eps) {
  const TensorInfo& t = m.file->tensor(tensor);
  if (t.type != GgmlType::F32) throw Error(tensor + " is not F32: the sensitivity figures need an f32 model");
  const std::string out = (temp_dir() / "scaled.gguf").string();
  std::ifstream in(m.path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t cols = t.ne[0];
  float* p = reinterpret_cast<float*>(bytes.data() + m.file->data_offset() + t.offset) + row * cols;
  for (int64_t i = 0; i < cols; ++i) p[i] = static_cast<float>(p[i] * (1.0 + eps));
  std::ofstream(out, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return out;
}

// Each pair of the default run (kPairs: its tensor-wide, row and head bounds, and for the precision pair its local
// errors from the isolation replay) against one scaled weight row; the default run catches what either pair does.
// The goal of the precision issue: every kind caught at eps <= 0.01 (fixtures/tolerances/README.md has the table).
TEST(EngineSensitivity, SmallestRowScaleCaughtByTheDefaultPairs) {
  DIFFRUN_REQUIRE_CUDA();
  const Model m = open_model(test::fixture_path("tiny-qwen2-f32.gguf"));
  struct Reference {
    Dump dump;
    std::unique_ptr<DumpReader> reader;
  };
  std::vector<Reference> refs;
  for (const Pair& p : kPairs) {
    auto backend = make_cpu_backend(*m.file, m.cfg, p.reference, kCtx);
    Dump d = dump(m, *backend, {}, std::string("sens-ref-") + p.reference);
    refs.push_back({d, std::make_unique<DumpReader>(d.path)});
  }
  // The weight whose row is scaled, and the checkpoint kind its op computes (row = output feature;
  // for token_embd the first prompt token's row).
  const std::pair<const char*, const char*> kinds[] = {
      {"token_embd.weight", "embd"},      {"blk.0.attn_q.weight", "Qcur"},   {"blk.0.attn_k.weight", "Kcur"},
      {"blk.0.attn_v.weight", "Vcur"},    {"blk.0.attn_output.weight", "attn_out"},
      {"blk.0.ffn_gate.weight", "ffn_gate"}, {"blk.0.ffn_up.weight", "ffn_up"}, {"blk.0.ffn_down.weight", "ffn_out"}};
  const std::vector<double> grid = {1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0};
  for (const auto& [tensor, kind] : kinds) {
    const int64_t row = std::string(tensor) == "token_embd.weight" ? kPrompt[0] : 0;
    double caught[2] = {NAN, NAN};
    std::string where[2] = {"-", "-"};
    // Each scaled model is written once and tried on every pair that has not caught a smaller eps yet.
    for (double eps : grid) {
      if (!std::isnan(caught[0]) && !std::isnan(caught[1])) break;
      const Model scaled = open_model(scaled_copy(m, tensor, row, eps));
      for (size_t i = 0; i < refs.size(); ++i) {
        if (!std::isnan(caught[i])) continue;
        const Pair& p = kPairs[i];
        const Dump d = engine_dump(scaled, p.engine, {}, refs[i].dump.argmax, "sens-eng");
        diff::Comparison c = compare(d.path, refs[i].dump.path, p.preset);
        if (!c.diverged() && *p.local_preset) {
          const Dump iso = engine_dump(scaled, p.engine, {}, refs[i].dump.argmax, "sens-iso", refs[i].reader.get());
          c = compare(iso.path, refs[i].dump.path, p.local_preset);
        }
        if (c.diverged()) {
          caught[i] = eps;
          where[i] = first_of(c);
        }
      }
    }
    const double either = std::fmin(caught[0], caught[1]);
    std::printf("sensitivity %-9s %-26s row %-4lld logic %-8.3g (%s) precision %-8.3g (%s) default %.3g\n", kind,
                tensor, static_cast<long long>(row), caught[0], where[0].c_str(), caught[1], where[1].c_str(), either);
    EXPECT_LE(either, 0.01) << tensor << ": the default run misses a row scaled by 1%";
  }
}

}  // namespace
}  // namespace diffrun
