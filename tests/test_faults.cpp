// Fault injection and isolation replay on the CPU reference: every catalog fault is found where the catalog says.
//
// For each tiny fixture (llama, qwen2, qwen3; f32, plus quantized ones for dequant_scale_offset) the
// reference computes in f64 without faults; the f32 reference with one fault injected must diverge
// first at the catalog's checkpoint and step with the verdict "local", under the committed
// f32_vs_f64 preset. A subtle fault whose change on a fixture lies under that preset is checked
// against a reference of its own precision instead (against the clean f32 reference, f32_vs_f32:
// bit-identical, and exact in isolation too, since dumps store f32). Without faults, every fixture, precision pair and step must pass (no
// false alarm). Isolation replay must give a faulty op a failing local error and no other op one.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "diff/compare.hpp"
#include "diff/tolerances.hpp"
#include "dump/dump.hpp"
#include "dump/replay_sink.hpp"
#include "faults/fault_plan.hpp"
#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/reference.hpp"
#include "test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;

// 9 prompt tokens (ids valid in both vocabularies), then 2 teacher-forced decode steps.
const std::vector<int32_t> kPrompt = {1, 17, 42, 99, 5, 63, 120, 7, 200};
constexpr int kSteps = 2;

// Dumps go here; the directory is removed when the test program exits.
fs::path temp_dir() {
  static const test::ScratchDir dir("test-faults");
  return dir.path;
}

struct Model {
  std::unique_ptr<GgufFile> file;
  ModelConfig cfg;
};

Model open_model(const std::string& fixture) {
  const std::string path = test::fixture_path(fixture);
  if (!fs::exists(path)) throw Error(path + " is missing: run the tiny_models fixture (scripts/gen_fixtures.py)");
  Model m;
  m.file = GgufFile::open(path);
  m.cfg = config_from_gguf(*m.file);
  return m;
}

// Runs one CPU backend over the prompt and kSteps forced tokens (`forced` empty: its own argmax) into
// `sink`; returns the argmax of every step.
std::vector<int32_t> run(Backend& b, const std::vector<int32_t>& forced, Sink& sink) {
  std::vector<int32_t> argmax;
  std::vector<float> logits = b.forward(0, kPrompt, sink);
  for (int step = 0;; ++step) {
    const int32_t own = b.last_argmax();  // the reference's own choice (argmax_ties_highest changes it)
    argmax.push_back(own >= 0 ? own : static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                                            logits.begin()));
    if (step == kSteps) break;
    const int32_t next = forced.empty() ? argmax.back() : forced[step];
    logits = b.forward(step + 1, std::span<const int32_t>(&next, 1), sink);
  }
  return argmax;
}

DumpMeta meta_for(const Model& m, const Backend& b) {
  DumpMeta meta;
  meta.backend = b.name();
  meta.precision = b.precision();
  meta.model_path = m.file->path();
  meta.model_fingerprint = m.file->fingerprint();
  meta.config = m.cfg;
  meta.token_ids = kPrompt;
  meta.facts = b.facts();
  return meta;
}

struct Dump {
  std::string path;
  std::vector<int32_t> argmax;
};

// A dump of the CPU backend at `precision` with `faults`, teacher-forced on `forced`; isolated
// (replaying `reference`) when given.
Dump dump(const Model& m, const std::string& precision, const FaultSet& faults, const std::vector<int32_t>& forced,
          const std::string& name, const DumpReader* reference = nullptr) {
  auto b = make_cpu_backend(*m.file, m.cfg, precision, static_cast<int>(kPrompt.size()) + kSteps, faults);
  Dump d;
  d.path = (temp_dir() / (name + ".h5")).string();
  DumpWriter writer(d.path, meta_for(m, *b));
  if (reference) {
    ReplaySink replay(writer, *reference);
    d.argmax = run(*b, forced, replay);
  } else {
    d.argmax = run(*b, forced, writer);
  }
  writer.set_attribute("argmax", d.argmax);
  writer.finish();
  return d;
}

diff::Comparison compare(const std::string& engine, const std::string& reference, const char* preset) {
  return diff::compare_dumps(DumpReader(engine), DumpReader(reference), diff::preset_tolerances(preset));
}

std::string describe_failure(const diff::Comparison& c) {
  if (!c.first_failure) return "no divergence";
  const diff::CheckpointResult& f = c.results[*c.first_failure];
  return f.name + " at step " + std::to_string(f.step) + ", verdict " + diff::verdict_kind_name(c.verdict.kind) +
         " (" + c.verdict.rule + ": " + c.verdict.explanation + ")";
}

std::set<std::string> split_kinds(const char* csv) {
  std::set<std::string> out;
  std::string s(csv);
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    out.insert(s.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

// The clean f64 reference of a fixture, written once; the clean f32 one when asked for.
struct Reference {
  Model model;
  Dump f64;
  Dump f32;  // path empty until matched_reference()
};

Reference& reference_of(const std::string& fixture) {
  static std::map<std::string, std::unique_ptr<Reference>> cache;
  auto& r = cache[fixture];
  if (!r) {
    r = std::make_unique<Reference>();
    r->model = open_model(fixture);
    r->f64 = dump(r->model, "f64", {}, {}, fixture + "-f64");
  }
  return *r;
}

// The clean f32 reference of a fixture (teacher-forced like every faulty run), written once.
const Dump& matched_reference(Reference& ref, const std::string& fixture) {
  if (ref.f32.path.empty()) ref.f32 = dump(ref.model, "f32", {}, ref.f64.argmax, fixture + "-f32");
  return ref.f32;
}

// Injects `f` into the f32 reference of `fixture` and checks the first divergence against the catalog
// (against the clean f64 reference, or when `matched` the clean f32 one), then the isolation replay's
// local errors.
void check_fault(const std::string& fixture, Fault f, bool matched = false) {
  const FaultInfo& info = fault_info(f);
  SCOPED_TRACE(fixture + " with " + info.name + (matched ? " (f32 vs f32)" : ""));
  Reference& ref = reference_of(fixture);
  const std::string expected = expected_checkpoint(f, ref.model.cfg, ref.model.file.get());
  const std::string ref_path = matched ? matched_reference(ref, fixture).path : ref.f64.path;
  const char* preset = matched ? "f32_vs_f32" : "f32_vs_f64";
  const std::string name = fixture + "-" + info.name + (matched ? "-matched" : "");

  const Dump faulty = dump(ref.model, "f32", FaultSet{f}, ref.f64.argmax, name);
  diff::Comparison c = compare(faulty.path, ref_path, preset);
  ASSERT_TRUE(c.diverged()) << "the fault went unnoticed";
  const diff::CheckpointResult& first = c.results[*c.first_failure];
  EXPECT_EQ(first.name, expected) << describe_failure(c);
  EXPECT_EQ(first.step, info.step) << describe_failure(c);
  EXPECT_EQ(c.verdict.kind, diff::VerdictKind::local) << describe_failure(c);

  // Isolation: the faulty op's local error fails its tolerance; ops the fault does not touch pass.
  const DumpReader reference(ref_path);
  const Dump isolated = dump(ref.model, "f32", FaultSet{f}, ref.f64.argmax, name + "-isolated", &reference);
  diff::add_isolation(c, compare(isolated.path, ref_path, preset));
  const diff::CheckpointResult& again = c.results[*c.first_failure];
  ASSERT_TRUE(again.local.has_value());
  EXPECT_TRUE(again.local->failed()) << "local rel_l2 " << again.local->rel_l2;
  EXPECT_EQ(c.verdict.kind, diff::VerdictKind::local) << describe_failure(c);
  const bool own_argmax = f == Fault::argmax_ties_highest;  // right logits, a wrong choice made from them
  EXPECT_EQ(c.verdict.rule, again.status == diff::CheckpointStatus::shape_mismatch ? "shape"
                            : own_argmax                                           ? "argmax"
                                                                                   : "isolation");
  const std::set<std::string> ops = split_kinds(info.ops);
  for (const auto& r : c.results) {
    if (r.local && r.local->failed()) {
      EXPECT_TRUE(ops.count(r.base)) << r.name << " at step " << r.step << " fails in isolation (local rel_l2 "
                                     << r.local->rel_l2 << ") but the fault changes only " << info.ops;
    }
  }
}

struct ArchCase {
  const char* fixture;
  std::set<Fault> not_applicable;
  std::set<Fault> subtle;  // under the f32_vs_f64 preset on this fixture: checked f32 vs f32
};

class FaultCatalog : public ::testing::TestWithParam<ArchCase> {};

TEST_P(FaultCatalog, EveryApplicableFaultIsFoundWhereTheCatalogSays) {
  const ArchCase& a = GetParam();
  Reference& ref = reference_of(a.fixture);
  int tested = 0;
  for (const FaultInfo& info : fault_catalog()) {
    const std::string why = fault_not_applicable(info.id, ref.model.cfg, ref.model.file.get());
    EXPECT_EQ(why.empty(), !a.not_applicable.count(info.id)) << info.name << ": " << why;
    if (!why.empty()) {
      EXPECT_THROW(make_cpu_backend(*ref.model.file, ref.model.cfg, "f32", 16, FaultSet{info.id}), InputError);
      continue;
    }
    check_fault(a.fixture, info.id, a.subtle.count(info.id) > 0);
    ++tested;
  }
  EXPECT_EQ(tested, kFaultCount - static_cast<int>(a.not_applicable.size()));
}

INSTANTIATE_TEST_SUITE_P(
    TinyF32, FaultCatalog,
    ::testing::Values(ArchCase{"tiny-llama-f32.gguf",
                               {Fault::moe_softmax_over_topk, Fault::moe_weights_not_renormalised,
                                Fault::moe_expert_id_off_by_one, Fault::moe_expert_gate_up_swapped,
                                Fault::moe_shared_expert_gate_skipped,
                                Fault::qkv_bias_missing, Fault::rope_theta_10000, Fault::rms_eps_1e5,
                                Fault::dequant_scale_offset, Fault::embd_scale_missing, Fault::post_norm_skipped,
                                Fault::sliding_window_ignored, Fault::rope_local_theta_global,
                                Fault::argmax_ties_highest},
                               {}},
                      ArchCase{"tiny-qwen2-f32.gguf",
                               {Fault::moe_softmax_over_topk, Fault::moe_weights_not_renormalised,
                                Fault::moe_expert_id_off_by_one, Fault::moe_expert_gate_up_swapped,
                                Fault::moe_shared_expert_gate_skipped,
                                Fault::dequant_scale_offset, Fault::embd_scale_missing, Fault::post_norm_skipped,
                                Fault::sliding_window_ignored, Fault::rope_local_theta_global,
                                Fault::argmax_ties_highest},
                               {}},
                      ArchCase{"tiny-qwen3-f32.gguf",
                               {Fault::moe_softmax_over_topk, Fault::moe_weights_not_renormalised,
                                Fault::moe_expert_id_off_by_one, Fault::moe_expert_gate_up_swapped,
                                Fault::moe_shared_expert_gate_skipped,
                                Fault::qkv_bias_missing, Fault::dequant_scale_offset, Fault::embd_scale_missing,
                                Fault::post_norm_skipped, Fault::sliding_window_ignored,
                                Fault::rope_local_theta_global, Fault::rope_fused_position_off,
                                Fault::argmax_ties_highest},
                               {}},
                      // 9 prompt tokens against a window of 8: sliding_window_ignored shows in prefill. The
                      // embeddings scaled by sqrt(D) make mean(x^2) large, so an eps fault moves attn_norm-0
                      // below the f32_vs_f64 bound: checked f32 vs f32.
                      ArchCase{"tiny-gemma3-f32.gguf",
                               {Fault::moe_softmax_over_topk, Fault::moe_weights_not_renormalised,
                                Fault::moe_expert_id_off_by_one, Fault::moe_expert_gate_up_swapped,
                                Fault::moe_shared_expert_gate_skipped,
                                Fault::qkv_bias_missing, Fault::gqa_head_modulo, Fault::dequant_scale_offset,
                                Fault::swiglu_fused_gate_up_swapped, Fault::rope_fused_position_off,
                                Fault::embd_norm_fused_no_weight, Fault::argmax_ties_highest},
                               {Fault::rms_eps_1e5, Fault::rms_eps_outside_sqrt}},
                      // Mixtures of experts: the dense FFN's faults do not apply; the routing faults do, each
                      // found at its own routing checkpoint of layer 0 (ffn_moe_topk, ffn_moe_weights,
                      // ffn_moe_weights_norm), and expert 0's swapped gate and up at ffn_moe_gate-0 (the prompt
                      // selects expert 0 in layer 0 on every MoE fixture).
                      ArchCase{"tiny-qwen3moe-f32.gguf",
                               {Fault::qkv_bias_missing, Fault::dequant_scale_offset, Fault::embd_scale_missing,
                                Fault::post_norm_skipped, Fault::sliding_window_ignored,
                                Fault::rope_local_theta_global, Fault::rope_fused_position_off,
                                Fault::argmax_ties_highest, Fault::swiglu_gate_up_swapped,
                                Fault::ffn_down_transposed, Fault::swiglu_fused_gate_up_swapped,
                                Fault::moe_shared_expert_gate_skipped},
                               {}},
                      ArchCase{"tiny-mixtral-f32.gguf",
                               {Fault::qkv_bias_missing, Fault::rms_eps_1e5, Fault::dequant_scale_offset,
                                Fault::embd_scale_missing, Fault::post_norm_skipped, Fault::sliding_window_ignored,
                                Fault::rope_local_theta_global, Fault::argmax_ties_highest,
                                Fault::swiglu_gate_up_swapped, Fault::ffn_down_transposed,
                                Fault::swiglu_fused_gate_up_swapped, Fault::moe_shared_expert_gate_skipped},
                               {}},
                      // qwen2moe: qwen2's attention (q/k/v biases), routed experts whose weights are not
                      // renormalised, and the shared expert, whose dropped gate is found at ffn_shexp_out-0.
                      ArchCase{"tiny-qwen2moe-f32.gguf",
                               {Fault::moe_weights_not_renormalised, Fault::dequant_scale_offset,
                                Fault::embd_scale_missing, Fault::post_norm_skipped, Fault::sliding_window_ignored,
                                Fault::rope_local_theta_global, Fault::argmax_ties_highest,
                                Fault::swiglu_gate_up_swapped, Fault::ffn_down_transposed,
                                Fault::swiglu_fused_gate_up_swapped},
                               {}}),
    [](const auto& param_info) {
      std::string name = param_info.param.fixture;
      name = name.substr(5, name.find('-', 5) - 5);  // "tiny-qwen2-f32.gguf" -> "qwen2"
      return name;
    });

// The routing verdict on the CPU pair: the f32 reference against the f64 one chooses the same experts
// everywhere; with moe_expert_id_off_by_one, ffn_moe_topk-0 is the first divergence and the rule routing
// calls it local (before any isolation replay): the ids moved across margins far above the router error.
TEST(FaultMoe, ExpertIdOffByOneIsALocalRoutingFlipAndTheCleanPairFlipsNothing) {
  for (const char* fixture : {"tiny-qwen3moe-f32.gguf", "tiny-mixtral-f32.gguf", "tiny-qwen2moe-f32.gguf"}) {
    SCOPED_TRACE(fixture);
    Reference& ref = reference_of(fixture);
    const diff::Comparison clean = compare(matched_reference(ref, fixture).path, ref.f64.path, "f32_vs_f64");
    EXPECT_FALSE(clean.diverged()) << describe_failure(clean);
    EXPECT_EQ(clean.routing.token_layers, static_cast<int64_t>(kPrompt.size() + kSteps) * ref.model.cfg.n_layer);
    EXPECT_EQ(clean.routing.differing(), 0);
    EXPECT_EQ(clean.routing.topk_overlap(), 1.0);

    const Dump faulty = dump(ref.model, "f32", FaultSet{Fault::moe_expert_id_off_by_one}, ref.f64.argmax,
                             std::string(fixture) + "-routing-off-by-one");
    const diff::Comparison c = compare(faulty.path, ref.f64.path, "f32_vs_f64");
    ASSERT_TRUE(c.diverged());
    EXPECT_EQ(c.results[*c.first_failure].name, "ffn_moe_topk-0");
    EXPECT_EQ(c.verdict.kind, diff::VerdictKind::local) << describe_failure(c);
    EXPECT_EQ(c.verdict.rule, "routing") << describe_failure(c);
    EXPECT_GT(c.routing.local, 0);
    EXPECT_LT(c.routing.topk_overlap(), 1.0);
  }
}

// Exact ties in every token's logits (lm head rows in equal pairs): the f32 reference breaking them toward the
// higher id is caught at result_output of step 0 by its own argmax, though its logits pass.
TEST(FaultArgmax, TiesBrokenTheWrongWayAreFoundOnTiedLogits) {
  check_fault("tiny-llama-tiedrows-f32.gguf", Fault::argmax_ties_highest);
  Reference& ref = reference_of("tiny-llama-f32.gguf");
  EXPECT_NE(fault_not_applicable(Fault::argmax_ties_highest, ref.model.cfg, ref.model.file.get()), "")
      << "a model without tied logits cannot show the fault";
}

TEST(FaultDequant, FoundAtTheFirstCheckpointReadingALegacyFormatTensor) {
  for (const char* fixture : {"tiny-llama-q8_0.gguf", "tiny-qwen2-q4_1.gguf", "tiny-qwen3-q5_0.gguf"}) {
    check_fault(fixture, Fault::dequant_scale_offset);
  }
}

TEST(FaultDequant, NotApplicableWithoutLegacyFormats) {
  const Model m = open_model("tiny-llama-q4_k.gguf");
  EXPECT_FALSE(fault_not_applicable(Fault::dequant_scale_offset, m.cfg, m.file.get()).empty());
  EXPECT_EQ(expected_checkpoint(Fault::dequant_scale_offset, open_model("tiny-qwen2-q8_0.gguf").cfg,
                                open_model("tiny-qwen2-q8_0.gguf").file.get()),
            "embd");
}

// The fused embedding norm takes rows up to kFusedEmbeddingNormMaxWidth: a wider model runs the gather and the norm
// apart, where embd_norm_fused_no_weight cannot act, so the catalog calls it not applicable there.
TEST(FaultFusedEmbeddingNorm, NotApplicableToRowsWiderThanTheFusedKernelTakes) {
  Model m = open_model("tiny-llama-f32.gguf");
  EXPECT_EQ(fault_not_applicable(Fault::embd_norm_fused_no_weight, m.cfg, m.file.get()), "");
  m.cfg.n_embd = kFusedEmbeddingNormMaxWidth;
  EXPECT_EQ(fault_not_applicable(Fault::embd_norm_fused_no_weight, m.cfg, m.file.get()), "");
  m.cfg.n_embd = kFusedEmbeddingNormMaxWidth + 1;
  EXPECT_NE(fault_not_applicable(Fault::embd_norm_fused_no_weight, m.cfg, m.file.get()).find("two kernels"),
            std::string::npos);
}

// What a CUDA engine never runs on a model (fault_dormant): the f32 engine keeps K-quant gate|up out of the fused
// SwiGLU GEMV (the f16 engine fuses them; dense ones fuse in both). A mixture of experts' decode steps are graphs too
// (their experts gathered on the device), so graph_position_frozen runs there.
TEST(FaultDormant, NamesWhatAnEngineNeverRuns) {
  const Model q4k = open_model("tiny-llama-q4_k.gguf");
  EXPECT_FALSE(fault_dormant(Fault::swiglu_fused_gate_up_swapped, q4k.cfg, q4k.file.get(), "f32").empty());
  EXPECT_EQ(fault_dormant(Fault::swiglu_fused_gate_up_swapped, q4k.cfg, q4k.file.get(), "f16"), "");
  const Model f32 = open_model("tiny-llama-f32.gguf");
  EXPECT_EQ(fault_dormant(Fault::swiglu_fused_gate_up_swapped, f32.cfg, f32.file.get(), "f32"), "");
  EXPECT_EQ(fault_dormant(Fault::graph_position_frozen, f32.cfg, f32.file.get(), "f32"), "");
  const Model moe = open_model("tiny-qwen3moe-f32.gguf");
  EXPECT_EQ(fault_dormant(Fault::graph_position_frozen, moe.cfg, moe.file.get(), "f16"), "");
}

// The subtle one: epsilon 1e-5 instead of 1e-6 moves attn_norm-0 by about 1e-4 relative: above the
// f32_vs_f64 bound (2e-5), far below the f16 presets' (0.02), as the catalog says.
TEST(FaultSubtle, RmsEpsCaughtByTheF32PresetNotTheF16One) {
  for (const char* fixture : {"tiny-qwen2-f32.gguf", "tiny-qwen3-f32.gguf"}) {
    SCOPED_TRACE(fixture);
    Reference& ref = reference_of(fixture);
    const Dump faulty = dump(ref.model, "f32", FaultSet{Fault::rms_eps_1e5}, ref.f64.argmax,
                             std::string(fixture) + "-eps-subtle");
    const diff::Comparison c = compare(faulty.path, ref.f64.path, "f32_vs_f64");
    ASSERT_TRUE(c.diverged());
    const diff::CheckpointResult& f = c.results[*c.first_failure];
    ASSERT_EQ(f.name, "attn_norm-0");
    EXPECT_GT(f.metrics->rel_l2, 3 * 2e-5);
    EXPECT_LT(f.metrics->rel_l2, 0.02 / 50);
    EXPECT_FALSE(compare(faulty.path, ref.f64.path, "f16_vs_f64").diverged());
  }
}

// The new subtle RMSNorm faults, where the catalog puts them: rms_norm_off_by_one moves attn_norm-0 by
// about 1/(2D) (2e-3 at D 256), rms_eps_outside_sqrt by about 7e-5 on the tiny llama (eps 1e-5) and 7e-6
// on qwen2/qwen3 (eps 1e-6): the f32_vs_f64 bound at attn_norm-0 (2.5e-6: layer 0 reads exact
// embeddings, so a clean norm is within one rounding) catches all three; the f16 presets miss all
// three at attn_norm-0.
TEST(FaultSubtle, RmsNormFaultsAgainstTheF32AndF16Presets) {
  struct Case {
    const char* fixture;
    Fault fault;
    double low, high;  // attn_norm-0 rel_l2 against the f64 reference
    bool f32_catches;
  };
  const Case cases[] = {{"tiny-llama-f32.gguf", Fault::rms_norm_off_by_one, 5e-4, 1e-2, true},
                        {"tiny-qwen2-f32.gguf", Fault::rms_norm_off_by_one, 5e-4, 1e-2, true},
                        {"tiny-llama-f32.gguf", Fault::rms_eps_outside_sqrt, 3 * 2e-5, 2e-4, true},
                        {"tiny-qwen2-f32.gguf", Fault::rms_eps_outside_sqrt, 2.5e-6, 2e-5, true}};
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(k.fixture) + " with " + fault_info(k.fault).name);
    Reference& ref = reference_of(k.fixture);
    const Dump faulty = dump(ref.model, "f32", FaultSet{k.fault}, ref.f64.argmax,
                             std::string(k.fixture) + "-" + fault_info(k.fault).name + "-band");
    const diff::Comparison f32 = compare(faulty.path, ref.f64.path, "f32_vs_f64");
    const auto it = std::find_if(f32.results.begin(), f32.results.end(),
                                 [](const diff::CheckpointResult& r) { return r.step == 0 && r.name == "attn_norm-0"; });
    ASSERT_NE(it, f32.results.end());
    ASSERT_TRUE(it->metrics.has_value());
    EXPECT_GT(it->metrics->rel_l2, k.low);
    EXPECT_LT(it->metrics->rel_l2, k.high);
    EXPECT_EQ(f32.diverged() && f32.results[*f32.first_failure].name == "attn_norm-0", k.f32_catches)
        << describe_failure(f32);
    const diff::Comparison f16 = compare(faulty.path, ref.f64.path, "f16_vs_f64");
    EXPECT_FALSE(f16.diverged() && f16.results[*f16.first_failure].name == "attn_norm-0") << describe_failure(f16);
  }
}

// Every field of a fault plan that a fault can set, one line each.
std::string plan_fields(const FaultPlan& p) {
  auto norm = [](const RmsNormFlaws& f) {
    return std::to_string(f.off_by_one) + std::to_string(f.eps_outside_sqrt) + std::to_string(f.unweighted) +
           std::to_string(f.skipped);
  };
  auto ops = [&](const OpArgs& o) {
    return norm(o.norm) + " " + norm(o.first_norm) + " " + norm(o.attn_post_norm) + " " +
           std::to_string(o.attention.causal) + std::to_string(o.attention.f16_exp) + " " +
           std::to_string(o.gqa_head_modulo) + std::to_string(o.rope_cache_unrotated) + " " +
           std::to_string(o.rope_position_offset) + " " + std::to_string(o.act_swapped) + " " +
           std::to_string(o.embd_scale) + " " + std::to_string(o.logit_columns) + " " +
           std::to_string(static_cast<int>(o.argmax_ties)) + " " + std::to_string(o.moe_routing.softmax_over_topk) +
           std::to_string(o.moe_routing.not_renormalised) + std::to_string(o.moe_routing.id_off_by_one) +
           std::to_string(o.shexp_gate_skipped);
  };
  const ModelConfig& c = p.config;
  const WeightEdits& w = p.weights;
  return "config " + std::to_string(c.rope_theta) + " " + std::to_string(c.rope_theta_swa) + " " +
         rope_type_name(c.rope_type) + " " + std::to_string(c.rms_eps) + " " + std::to_string(c.attn_scale) + " " +
         std::to_string(c.sliding_window) + "\nweights " + std::to_string(w.dequant_scale_offset) +
         std::to_string(w.embd_transposed) + std::to_string(w.qkv_bias_missing) +
         std::to_string(w.attn_out_transposed) + std::to_string(w.ffn_down_transposed) +
         std::to_string(w.weight_row_nan) + std::to_string(w.rms_norm_weight_twice) +
         std::to_string(w.expert_gate_up_swapped) + "\nops " + ops(p.ops) +
         "\none_token " + ops(p.one_token) + "\nfused " + std::to_string(p.fused.gate_up_swapped) +
         std::to_string(p.fused.rope_position_offset) + std::to_string(p.fused.embd_norm_unweighted) +
         std::to_string(p.fused.graph_position_frozen) + "\nhooks " + std::to_string(p.hooks.kv_cache_pos0) +
         std::to_string(p.hooks.kv_cache_not_read) + std::to_string(p.hooks.residual_skipped) + "\n";
}

// Without faults the plan is production: the model's config and every op's default argument.
TEST(FaultPlan, NoFaultIsProduction) {
  for (const char* fixture : {"tiny-llama-f32.gguf", "tiny-gemma3-f32.gguf"}) {
    SCOPED_TRACE(fixture);
    const ModelConfig& cfg = reference_of(fixture).model.cfg;
    const FaultPlan p = plan_faults({}, cfg);
    FaultPlan expected;
    expected.config = cfg;
    expected.ops.embd_scale = std::sqrt(static_cast<double>(cfg.n_embd));
    expected.ops.logit_columns = cfg.n_vocab;
    expected.one_token = expected.ops;
    EXPECT_EQ(plan_fields(p), plan_fields(expected));
  }
}

// Every applicable fault lands somewhere in the plan, and the production-path ones leave every step's ops alone.
TEST(FaultPlan, EveryFaultChangesThePlan) {
  for (const char* fixture :
       {"tiny-llama-f32.gguf", "tiny-qwen2-f32.gguf", "tiny-gemma3-f32.gguf", "tiny-qwen3moe-f32.gguf",
        "tiny-qwen2moe-f32.gguf"}) {
    SCOPED_TRACE(fixture);
    const Model& m = reference_of(fixture).model;
    const ModelConfig& cfg = m.cfg;
    const FaultPlan clean = plan_faults({}, cfg);
    for (const FaultInfo& info : fault_catalog()) {
      if (!fault_not_applicable(info.id, cfg, m.file.get()).empty()) continue;
      SCOPED_TRACE(info.name);
      const FaultPlan p = plan_faults(FaultSet{info.id}, cfg);
      EXPECT_NE(plan_fields(p), plan_fields(clean));
      if (fault_in_production_path_only(info.id)) {
        FaultPlan every_step = clean;
        every_step.ops = p.ops;
        every_step.config = p.config;
        every_step.weights = p.weights;
        every_step.hooks = p.hooks;
        EXPECT_EQ(plan_fields(every_step), plan_fields(clean)) << "a production-path fault acts on every step";
      }
    }
  }
}

TEST(FaultSet, ParseNamesAndRefuseUnknown) {
  EXPECT_TRUE(parse_faults("").empty());
  const FaultSet s = parse_faults(" rope_theta_10000 ,kv_cache_pos0");
  EXPECT_TRUE(s.has(Fault::rope_theta_10000));
  EXPECT_TRUE(s.has(Fault::kv_cache_pos0));
  EXPECT_EQ(s.names(), "rope_theta_10000,kv_cache_pos0");
  try {
    parse_faults("rope_theta_10000,rope_theta_1000");
    FAIL() << "an unknown fault was accepted";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'rope_theta_1000'"), std::string::npos) << msg;
    for (const FaultInfo& f : fault_catalog()) EXPECT_NE(msg.find(f.name), std::string::npos) << msg;
  }
  EXPECT_THROW(parse_faults("a,,b"), InputError);
  ASSERT_EQ(static_cast<int>(fault_catalog().size()), kFaultCount);
  for (int i = 0; i < kFaultCount; ++i) EXPECT_EQ(static_cast<int>(fault_catalog()[i].id), i);
}

TEST(FaultDequant, BytesMoveTheScaleOnly) {
  std::vector<std::byte> raw(34 * 2);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<std::byte>(i);
  const std::vector<std::byte> bad = dequant_fault_bytes(GgmlType::Q8_0, raw);
  ASSERT_EQ(bad.size(), raw.size());
  for (size_t b : {size_t(0), size_t(34)}) {
    EXPECT_EQ(bad[b], raw[b + 2]);
    EXPECT_EQ(bad[b + 1], raw[b + 3]);
    for (size_t i = 2; i < 34; ++i) EXPECT_EQ(bad[b + i], raw[b + i]);
  }
  EXPECT_THROW(dequant_fault_bytes(GgmlType::Q4_K, raw), InputError);
}

// No false alarms: every fixture (all formats) f32 vs f64, the f32 fixtures also f32 vs f32, all steps.
TEST(FaultClean, EveryFixturePassesEveryPresetPair) {
  std::vector<std::string> fixtures;
  for (const auto& e : fs::directory_iterator(test::fixture_path(""))) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tiny-", 0) == 0 && e.path().extension() == ".gguf") fixtures.push_back(name);
  }
  std::sort(fixtures.begin(), fixtures.end());
  ASSERT_GE(fixtures.size(), 50u) << "expected the tiny fixtures of every arch and format";
  for (const std::string& fixture : fixtures) {
    SCOPED_TRACE(fixture);
    Reference& ref = reference_of(fixture);
    const Dump f32 = dump(ref.model, "f32", {}, ref.f64.argmax, fixture + "-clean-f32");
    const diff::Comparison c = compare(f32.path, ref.f64.path, "f32_vs_f64");
    EXPECT_FALSE(c.diverged()) << describe_failure(c);
    EXPECT_EQ(c.n_fail, 0);
    if (fixture.find("-f32.gguf") != std::string::npos) {  // two f32 runs of the same code: bit-identical
      const Dump f32b = dump(ref.model, "f32", {}, ref.f64.argmax, fixture + "-clean-f32b");
      const diff::Comparison same = compare(f32b.path, f32.path, "f32_vs_f32");
      EXPECT_FALSE(same.diverged()) << describe_failure(same);
    }
  }
}

// Isolation without a fault: every local error is tiny and passes.
TEST(FaultClean, IsolatedLocalErrorsAreTinyEverywhere) {
  for (const char* fixture : {"tiny-llama-f32.gguf", "tiny-qwen2-f32.gguf", "tiny-qwen3-q4_k.gguf"}) {
    SCOPED_TRACE(fixture);
    Reference& ref = reference_of(fixture);
    const DumpReader reference(ref.f64.path);
    const Dump iso = dump(ref.model, "f32", {}, ref.f64.argmax, std::string(fixture) + "-clean-isolated", &reference);
    const diff::Comparison c = compare(iso.path, ref.f64.path, "f32_vs_f64");
    EXPECT_FALSE(c.diverged()) << describe_failure(c);
    for (const auto& r : c.results) {
      ASSERT_TRUE(r.metrics.has_value()) << r.name;
      EXPECT_LT(r.metrics->rel_l2, 2e-6) << r.name << " at step " << r.step;
    }
  }
}

// The same through the diffrun binary: exit code 1, the catalog's checkpoint, verdict local by isolation.
struct Cli {
  int rc;
  std::string out;
};

Cli run_cli(const std::string& args) {
  const std::string cmd = test::env_or("DIFFRUN_BIN", "build/cli/diffrun") + " " + args + " 2>&1";
  Cli r{-1, {}};
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = ::pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A routing tie that precision tips, through the whole top-level job: on the CPU twin of the precision pair
// (f32-f16store vs f64-f16store, its replay under the _local preset) this prompt makes tiny-qwen3moe Q8_0
// order its top two experts of token 12 in layer 1 the other way (6.5e-4 apart): a reorder by drift, listed
// and excused (both slots), and the run passes.
TEST(FaultCli, ARoutingReorderByDriftPassesAndIsListed) {
  const std::string model = test::fixture_path("tiny-qwen3moe-q8_0.gguf");
  const std::string out = (temp_dir() / "cli-routing").string();
  const Cli r = run_cli("--model " + model + " --tokens 14,131,242,156,227,118,248,84,53,146,242,103,156,201,79,218,211 "
                        "--steps 4 --engine cpu --engine-precision f32-f16store --reference-precision f64-f16store "
                        "--threads 1 --dump none --no-color --out " + out + " --report-json " + out + ".json");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("ROUTING  0 of 42 (token, layer) chose other experts"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 0 layer 1 token 12: experts {4,7} vs reference {7,4}"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("drift (routing flip)"), std::string::npos) << r.out;
  std::ifstream in(out + ".json");
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(json.find("\"reordered\": 1"), std::string::npos);
  EXPECT_NE(json.find("\"routing_excused\": 2"), std::string::npos);
}

TEST(FaultCli, InjectAndIsolateThroughTheBinary) {
  const std::string model = test::fixture_path("tiny-qwen3-f32.gguf");
  const std::string out = (temp_dir() / "cli").string();
  const Cli r = run_cli("--model " + model + " --tokens 1,17,42,99,5 --steps 2 --engine cpu --inject "
                        "rope_pairing_swapped --isolate --no-color --out " + out);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("FIRST DIVERGENCE  Qrope-0  (step 0, layer 0)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verdict   LOCAL (rule isolation)"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(fs::path(out) / "engine-isolated.h5"));

  const Cli clean = run_cli("--model " + model + " --tokens 1,17,42,99,5 --steps 2 --engine cpu --isolate "
                            "--no-color --out " + out);
  EXPECT_EQ(clean.rc, 0) << clean.out;

  const Cli unknown = run_cli("--model " + model + " --tokens 1,2 --engine cpu --inject no_such_fault --out " + out);
  EXPECT_EQ(unknown.rc, 2);
  EXPECT_NE(unknown.out.find("unknown fault 'no_such_fault'"), std::string::npos) << unknown.out;
  const Cli not_here = run_cli("dump --model " + model + " --tokens 1,2 --inject qkv_bias_missing --out " + out +
                               "/x.h5");
  EXPECT_EQ(not_here.rc, 2);
  EXPECT_NE(not_here.out.find("does not apply"), std::string::npos) << not_here.out;

  const Cli table = run_cli("faults");
  EXPECT_EQ(table.rc, 0);
  for (const FaultInfo& f : fault_catalog()) EXPECT_NE(table.out.find(f.name), std::string::npos) << f.name;
}

}  // namespace
}  // namespace diffrun
