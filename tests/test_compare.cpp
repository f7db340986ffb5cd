// Unit tests of diff/compare, the verdict and the reports, on synthetic dumps written with DumpWriter.
#include <cmath>
#include <filesystem>
#include <limits>
#include <string>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diff/compare.hpp"
#include "diff/report.hpp"
#include "diff/verdict.hpp"
#include "model/error.hpp"
#include "tests/diff_dumps.hpp"

using namespace diffrun;
using namespace diffrun::diff;
using diffrun::test::SyntheticDump;

namespace {

class Compare : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("diffrun_test_compare_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::create_directories(dir_);
    reference.write(path("reference.h5"));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  Comparison run(const SyntheticDump& engine, const ToleranceSet& tol, CompareOptions opt = {}) {
    engine.write(path("engine.h5"));
    DumpReader e(path("engine.h5")), r(path("reference.h5"));
    return compare_dumps(e, r, tol, opt);
  }

  static ToleranceSet rel(double max_rel_l2) {
    return parse_tolerances(fmt::format(R"({{"rules": [], "default": {{"max_rel_l2": {}, "reason": "test"}}}})", max_rel_l2),
                            "test.json");
  }

  static SyntheticDump engine_dump() {
    SyntheticDump d;
    d.meta = test::synthetic_meta("cpu", "f32");
    return d;
  }

  const CheckpointResult& first(const Comparison& c) const { return c.results.at(*c.first_failure); }

  std::filesystem::path dir_;
  SyntheticDump reference;
};

}  // namespace

TEST_F(Compare, IdenticalDumpsPass) {
  Comparison c = run(engine_dump(), rel(0.0));
  EXPECT_FALSE(c.diverged());
  EXPECT_EQ(c.n_fail, 0);
  EXPECT_EQ(c.n_one_sided, 0);
  // Every float checkpoint of the 3 steps; tokens are checked, not compared.
  const int per_step = static_cast<int>(checkpoint_names(test::synthetic_config()).size()) - 1;
  EXPECT_EQ(c.n_pass, 3 * per_step);
  EXPECT_EQ(c.results.front().step, 0);
  EXPECT_EQ(c.results.front().name, "embd");
  EXPECT_EQ(c.results.back().step, 2);
  EXPECT_EQ(c.results.back().name, "result_output");
  ASSERT_EQ(c.tokens.size(), 3u);
  EXPECT_EQ(c.tokens[1].reference, 2);
  EXPECT_TRUE(c.tokens[1].match());
  EXPECT_EQ(exit_code(c), 0);
}

TEST_F(Compare, LocalBugIsTheFirstDivergenceWithAJumpVerdict) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int, const std::string& name, std::vector<float>& v) {
    if (name == "Qcur-2" || name == "l_out-3") v[5] += 0.5f;
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  const CheckpointResult& f = first(c);
  EXPECT_EQ(f.step, 0);
  EXPECT_EQ(f.name, "Qcur-2");
  EXPECT_EQ(f.layer, 2);
  EXPECT_EQ(f.metrics->worst.flat, 5);
  EXPECT_EQ(format_coordinates(f.metrics->worst.coords), "T=0, H=1, Dh=1");
  // The checkpoints just before it passed and are listed in order.
  ASSERT_EQ(c.preceding.size(), 4u);
  EXPECT_EQ(c.results[c.preceding.back()].name, "attn_norm-2");
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "jump");
  ASSERT_EQ(c.verdict.inputs.size(), 1u);
  EXPECT_EQ(c.verdict.inputs[0].name, "attn_norm-2");
  EXPECT_TRUE(std::isinf(c.verdict.ratio));
  EXPECT_EQ(exit_code(c), 1);
}

TEST_F(Compare, JumpRatioAgainstNonZeroInputs) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int, const std::string& name, std::vector<float>& v) {
    if (name == "ffn_norm-1") v[0] *= 1.0f + 1e-4f;  // small error, below tolerance
    if (name == "ffn_up-1") v[3] += 0.3f;            // a big one right after it
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "ffn_up-1");
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "jump");
  EXPECT_GT(c.verdict.ratio, 10.0);
  EXPECT_FALSE(std::isinf(c.verdict.ratio));
  EXPECT_NE(c.verdict.explanation.find("ffn_norm-1"), std::string::npos) << c.verdict.explanation;
}

TEST_F(Compare, SmoothGrowthIsDrift) {
  // Relative error 1e-4 * 2^layer on every checkpoint of a layer: l_out-3 crosses 5e-4 first
  // (1e-4 * 8), with its inputs at the same level.
  SyntheticDump e = engine_dump();
  e.perturb = [](int, const std::string& name, std::vector<float>& v) {
    auto p = parse_checkpoint_name(name);
    double eps = 1e-4 * std::pow(2.0, std::max(p.layer, 0));
    for (size_t i = 0; i < v.size(); ++i) v[i] *= static_cast<float>(1.0 + eps * ((i % 2) ? 1 : -1));
  };
  Comparison c = run(e, rel(5e-4));
  ASSERT_TRUE(c.diverged());
  const CheckpointResult& f = first(c);
  EXPECT_EQ(f.layer, 3);
  EXPECT_EQ(c.verdict.kind, VerdictKind::drift);
  EXPECT_EQ(c.verdict.rule, "smooth_growth");
  ASSERT_EQ(c.verdict.growth.size(), 4u);
  EXPECT_LT(c.verdict.growth[0].rel_l2, c.verdict.growth[3].rel_l2);
}

TEST_F(Compare, StepsAreInOrderStepZeroFirst) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "embd") v[0] += 1.0f;
    if (step == 0 && name == "result_norm") v[0] += 1.0f;
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).step, 0);
  EXPECT_EQ(first(c).name, "result_norm");
  EXPECT_EQ(c.n_fail, 2);
}

TEST_F(Compare, EmbeddingErrorIsLocal) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int, const std::string& name, std::vector<float>& v) {
    if (name == "embd") v[1] = -v[1];
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "embd");
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "embedding");
}

TEST_F(Compare, NonFiniteFailsWhateverTheBounds) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 0 && name == "kq_soft_max-0") v[2] = std::numeric_limits<float>::quiet_NaN();
  };
  ToleranceSet loose = parse_tolerances(R"({"rules": [], "default": {"reason": "no bounds"}})", "t.json");
  Comparison c = run(e, loose);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "kq_soft_max-0");
  EXPECT_EQ(first(c).metrics->nan_a, 1);
  EXPECT_EQ(c.verdict.rule, "nonfinite");
}

TEST_F(Compare, ShapeMismatchIsAFailureNotACrash) {
  SyntheticDump e = engine_dump();
  e.shrink = "cache_k-1";
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  const CheckpointResult& f = first(c);
  EXPECT_EQ(f.name, "cache_k-1");
  EXPECT_EQ(f.status, CheckpointStatus::shape_mismatch);
  EXPECT_FALSE(f.metrics.has_value());
  EXPECT_EQ(f.shape_engine[0], 1);
  EXPECT_EQ(f.shape_reference[0], 3);
  EXPECT_EQ(c.verdict.rule, "shape");
}

TEST_F(Compare, CheckpointInOneDumpOnlyIsReportedNotFailed) {
  SyntheticDump e = engine_dump();
  e.skip = [](int step, const std::string& name) { return step == 1 && name == "ffn_up-0"; };
  Comparison c = run(e, rel(1e-3));
  EXPECT_FALSE(c.diverged());
  EXPECT_EQ(c.n_one_sided, 1);
  auto it = std::find_if(c.results.begin(), c.results.end(),
                         [](const CheckpointResult& r) { return r.status == CheckpointStatus::only_reference; });
  ASSERT_NE(it, c.results.end());
  EXPECT_EQ(it->name, "ffn_up-0");
  EXPECT_EQ(it->step, 1);
  // Still in execution order: between ffn_gate-0 and ffn_swiglu-0.
  EXPECT_EQ((it - 1)->name, "ffn_gate-0");
  EXPECT_EQ((it + 1)->name, "ffn_swiglu-0");
  std::string text = render_terminal(c);
  EXPECT_NE(text.find("1 in one dump only"), std::string::npos) << text;
}

TEST_F(Compare, DifferentModelsTokensOrConfigsAreRefusedUnlessForced) {
  SyntheticDump other_model = engine_dump();
  other_model.meta.model_fingerprint = "size=2;fnv1a64=0000000000000002";
  EXPECT_THROW(run(other_model, rel(1e-3)), InputError);
  CompareOptions force;
  force.force = true;
  Comparison c = run(other_model, rel(1e-3), force);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("different models"), std::string::npos);

  SyntheticDump other_tokens = engine_dump();
  other_tokens.fed[3] = 8;  // the engine was fed a different token at step 1
  try {
    run(other_tokens, rel(1e-3));
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("different input tokens at step 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--force"), std::string::npos);
  }

  SyntheticDump other_config = engine_dump();
  other_config.meta.config.rope_theta = 500000.0;
  EXPECT_THROW(run(other_config, rel(1e-3)), InputError);
}

TEST_F(Compare, NothingInCommonOrNoTokensIsADumpError) {
  SyntheticDump only_tokens = engine_dump();
  only_tokens.skip = [](int, const std::string& name) { return name != "tokens"; };
  EXPECT_THROW(run(only_tokens, rel(1e-3)), DumpError);
  SyntheticDump no_tokens = engine_dump();
  no_tokens.skip = [](int step, const std::string& name) { return step == 2 && name == "tokens"; };
  try {
    run(no_tokens, rel(1e-3));
    FAIL() << "expected DumpError";
  } catch (const DumpError& e) {
    EXPECT_NE(std::string(e.what()).find("step 2 has no \"tokens\""), std::string::npos) << e.what();
  }
}

TEST_F(Compare, TokenAgreementAndLogitMetrics) {
  SyntheticDump e = engine_dump();
  e.argmax = {7, 3, 4};
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "result_output") v[15] = 10.0f;  // the engine now prefers token 15
  };
  Comparison c = run(e, rel(1e9));
  EXPECT_FALSE(c.diverged());
  EXPECT_TRUE(c.tokens[0].match());
  EXPECT_FALSE(c.tokens[1].match());
  EXPECT_EQ(c.tokens[1].engine, 3);
  auto it = std::find_if(c.results.begin(), c.results.end(),
                         [](const CheckpointResult& r) { return r.step == 1 && r.name == "result_output"; });
  ASSERT_TRUE(it->metrics->logits.has_value());
  EXPECT_EQ(it->metrics->logits->argmax_a[0], 15);
  EXPECT_DOUBLE_EQ(it->metrics->logits->top1, 0.0);
  EXPECT_GT(it->metrics->logits->kl_max, 1.0);
  // Without the argmax attribute the last row of result_output decides.
  SyntheticDump no_attr = engine_dump();
  no_attr.argmax.clear();
  no_attr.perturb = e.perturb;
  Comparison c2 = run(no_attr, rel(1e9));
  EXPECT_EQ(c2.tokens[1].engine, 15);
  EXPECT_EQ(c2.tokens[1].reference, 2);
}

TEST_F(Compare, DataflowInputs) {
  auto all = [](const std::string&) { return true; };
  auto none_of_cache = [](const std::string& n) { return n.rfind("cache_", 0) != 0; };
  using V = std::vector<std::string>;
  EXPECT_EQ(dataflow_inputs("attn_norm", 0, 4, all), V{"embd"});
  EXPECT_EQ(dataflow_inputs("attn_norm", 2, 4, all), V{"l_out-1"});
  EXPECT_EQ(dataflow_inputs("kq_soft_max", 1, 4, all), (V{"Qrope-1", "cache_k-1"}));
  EXPECT_EQ(dataflow_inputs("kq_soft_max", 1, 4, none_of_cache), (V{"Qrope-1", "Krope-1"}));
  EXPECT_EQ(dataflow_inputs("Qrope", 1, 4, all), V{"Qnorm-1"});
  EXPECT_EQ(dataflow_inputs("ffn_inp", 0, 4, all), (V{"attn_out-0", "embd"}));
  EXPECT_EQ(dataflow_inputs("result_norm", -1, 4, all), V{"l_out-3"});
  EXPECT_TRUE(dataflow_inputs("embd", -1, 4, all).empty());
  // Unrecorded inputs are replaced by theirs: with only l_out-* recorded, l_out-2 <- l_out-1.
  auto only_l_out = [](const std::string& n) { return n.rfind("l_out-", 0) == 0; };
  EXPECT_EQ(dataflow_inputs("l_out", 2, 4, only_l_out), V{"l_out-1"});
}

TEST_F(Compare, ReportsCarryTheFirstDivergence) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 0 && name == "Vcur-1") v[2] += 0.5f;
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  std::string text = render_terminal(c);
  EXPECT_NE(text.find("FIRST DIVERGENCE  Vcur-1  (step 0, layer 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("verdict   LOCAL (rule jump)"), std::string::npos) << text;
  EXPECT_NE(text.find("T=0, Hkv=0, Dh=2"), std::string::npos) << text;
  EXPECT_NE(text.find("Relative L2 error by layer"), std::string::npos);
  EXPECT_NE(text.find("Token agreement"), std::string::npos);
  EXPECT_EQ(text.find("\033["), std::string::npos);  // no colour unless asked
  EXPECT_NE(render_terminal(c, {.color = true}).find("\033["), std::string::npos);

  nlohmann::json j = nlohmann::json::parse(render_json(c));
  EXPECT_EQ(j["exit_code"], 1);
  EXPECT_EQ(j["first_divergence"]["name"], "Vcur-1");
  EXPECT_EQ(j["first_divergence"]["verdict"]["kind"], "local");
  EXPECT_EQ(j["first_divergence"]["verdict"]["ratio"], "inf");
  const auto& cp = j["checkpoints"][j["first_divergence"]["index"].get<size_t>()];
  EXPECT_EQ(cp["status"], "fail");
  EXPECT_EQ(cp["metrics"]["worst"]["coords"]["Dh"], 2);
  EXPECT_EQ(j["checkpoints"].size(), c.results.size());
  EXPECT_EQ(j["summary"]["fail"], 1);

  std::string xml = render_junit(c);
  EXPECT_NE(xml.find("<testcase classname=\"step_0000\" name=\"Vcur-1\""), std::string::npos);
  EXPECT_NE(xml.find("<failure type=\"fail\" message=\"first divergence: rel_l2"), std::string::npos) << xml;
  EXPECT_NE(xml.find("a &lt;synthetic&gt; &amp; &quot;quoted&quot; prompt"), std::string::npos);
  EXPECT_NE(xml.find(fmt::format("tests=\"{}\" failures=\"1\"", c.results.size())), std::string::npos);
}

TEST_F(Compare, PassingReport) {
  Comparison c = run(engine_dump(), rel(0.0));
  std::string text = render_terminal(c);
  EXPECT_NE(text.find("RESULT: PASS"), std::string::npos) << text;
  EXPECT_EQ(nlohmann::json::parse(render_json(c))["first_divergence"], nullptr);
  EXPECT_EQ(render_junit(c).find("<failure"), std::string::npos);
}
