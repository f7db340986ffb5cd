// Unit tests of diff/compare, the verdict and the reports, on synthetic dumps written with DumpWriter.
#include <algorithm>
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
#include "tests/test_util.hpp"

using namespace diffrun;
using namespace diffrun::diff;
using diffrun::test::SyntheticDump;

namespace {

class Compare : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_scratch_dir("test-compare-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
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
  ToleranceSet loose = parse_tolerances(R"({"rules": [], "default": {"max_fail_frac": 1, "reason": "the loosest bound"}})", "t.json");
  Comparison c = run(e, loose);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "kq_soft_max-0");
  EXPECT_EQ(first(c).metrics->nan_a, 1);
  EXPECT_EQ(c.verdict.rule, "nonfinite");
}

// A NaN in a weight row reaches both sides: Qcur-1 onwards hold the same NaN in the engine and the
// reference. It must fail where it appears, with the verdict local, not pass as agreement.
TEST_F(Compare, SameNaNOnBothSidesIsLocatedAndFails) {
  auto nan_from_qcur1 = [](int step, const std::string& name, std::vector<float>& v) {
    auto p = parse_checkpoint_name(name);
    if (step == 0 && (p.layer >= 2 || name == "Qcur-1" || p.base == "result_norm" || p.base == "result_output")) {
      v[name == "Qcur-1" ? 6 : 0] = std::numeric_limits<float>::quiet_NaN();
    }
  };
  reference.perturb = nan_from_qcur1;
  reference.write(path("reference.h5"));
  SyntheticDump e = engine_dump();
  e.perturb = nan_from_qcur1;
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(exit_code(c), 1);
  EXPECT_EQ(first(c).name, "Qcur-1");
  ASSERT_TRUE(c.first_nonfinite.has_value());
  EXPECT_EQ(*c.first_nonfinite, *c.first_failure);
  const TensorMetrics& m = *first(c).metrics;
  EXPECT_EQ(m.nan_a, 1);
  EXPECT_EQ(m.nan_b, 1);
  EXPECT_EQ(m.nonfinite_mismatch, 0);
  EXPECT_EQ(format_coordinates(m.first_nonfinite_a.coords), "T=0, H=1, Dh=2");
  EXPECT_TRUE(std::isnan(m.rel_l2));
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "nonfinite");
  EXPECT_NE(c.verdict.explanation.find("both sides"), std::string::npos) << c.verdict.explanation;

  TerminalOptions full;
  full.full = true;  // every kind's row, l_out's included
  std::string text = render_terminal(c, full);
  EXPECT_NE(text.find("FIRST DIVERGENCE  Qcur-1  (step 0, layer 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("engine NaN 1, Inf 0, first nan at T=0, H=1, Dh=2"), std::string::npos) << text;
  EXPECT_NE(text.find("reference NaN 1, Inf 0, first nan at T=0, H=1, Dh=2"), std::string::npos) << text;
  EXPECT_NE(text.find("verdict   LOCAL (rule nonfinite)"), std::string::npos) << text;
  // The layer table never shows a number for NaN data: layer 2 and 3 say NaN, max names layer 2.
  const size_t row = text.find("\n  l_out ");
  ASSERT_NE(row, std::string::npos) << text;
  const std::string l_out = text.substr(row + 1, text.find('\n', row + 1) - row - 1);
  EXPECT_NE(l_out.find("NaN (2)"), std::string::npos) << l_out;
  EXPECT_NE(l_out.find("!!"), std::string::npos) << l_out;
  // Without --full, the kinds failing at every layer downstream are one line.
  EXPECT_NE(render_terminal(c).find("17 more kinds fail at every layer from layer 2 on, downstream"), std::string::npos);
  EXPECT_EQ(text.find("rel_l2 0 "), std::string::npos) << text;
  EXPECT_NE(text.find("RESULT: DIVERGED at Qcur-1 (step 0, layer 1); verdict local; NaN/Inf there"), std::string::npos)
      << text;

  nlohmann::json j = nlohmann::json::parse(render_json(c));
  EXPECT_EQ(j["exit_code"], 1);
  EXPECT_EQ(j["first_nonfinite"]["name"], "Qcur-1");
  EXPECT_EQ(j["first_nonfinite"]["engine"]["nan"], 1);
  EXPECT_EQ(j["first_nonfinite"]["reference"]["first"]["coords"]["Dh"], 2);
  EXPECT_EQ(j["first_nonfinite"]["verdict"]["rule"], "nonfinite");
  const auto& cp = j["checkpoints"][j["first_nonfinite"]["index"].get<size_t>()];
  for (const char* k : {"rel_l2", "cosine", "max_abs", "nmse", "sqnr_db"}) EXPECT_TRUE(cp["metrics"][k].is_null()) << k;
  EXPECT_EQ(cp["checks"][0]["metric"], "nonfinite");

  std::string xml = render_junit(c);
  EXPECT_NE(xml.find("message=\"first divergence and first NaN/Inf Qcur-1 (step 0, layer 1): NaN/Inf: engine NaN 1 Inf 0, first nan at T=0, H=1, Dh=2"),
            std::string::npos) << xml;
  EXPECT_NE(xml.find("<property name=\"first_nonfinite\" value=\"Qcur-1 at step 0\"/>"), std::string::npos);
}

// The f16 softmax overflow: a small finite failure first, NaN later. The report leads with the first
// failure and still locates the first NaN, with its own verdict.
TEST_F(Compare, FirstNaNIsReportedEvenAfterAnEarlierFailure) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step != 0) return;
    if (name == "kq_soft_max-0") v[1] *= 1.01f;
    auto p = parse_checkpoint_name(name);
    if (name == "kq_soft_max-2") v[4] = std::numeric_limits<float>::quiet_NaN();
    if (p.layer == 2 && p.base != "kq_soft_max" && checkpoint_order(test::synthetic_config(), p.base, 2) >
                                                     checkpoint_order(test::synthetic_config(), "kq_soft_max", 2)) {
      for (auto& x : v) x = std::numeric_limits<float>::quiet_NaN();
    }
    if (p.layer == 3 || p.base == "result_norm" || p.base == "result_output") {
      for (auto& x : v) x = std::numeric_limits<float>::quiet_NaN();
    }
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "kq_soft_max-0");
  ASSERT_TRUE(c.first_nonfinite.has_value());
  const CheckpointResult& nf = c.results[*c.first_nonfinite];
  EXPECT_EQ(nf.name, "kq_soft_max-2");
  EXPECT_EQ(nf.step, 0);
  EXPECT_EQ(format_coordinates(nf.metrics->first_nonfinite_a.coords), "H=0, T=1, S=1");
  EXPECT_EQ(nf.metrics->first_nonfinite_b.flat, -1);
  EXPECT_EQ(c.nonfinite_verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.nonfinite_verdict.rule, "nonfinite");
  std::string text = render_terminal(c);
  EXPECT_NE(text.find("FIRST NaN/Inf  kq_soft_max-2  (step 0, layer 2)"), std::string::npos) << text;
  EXPECT_NE(text.find("engine NaN 1, Inf 0, first nan at H=0, T=1, S=1"), std::string::npos) << text;
  EXPECT_NE(text.find("reference finite"), std::string::npos) << text;
  EXPECT_NE(text.find("first NaN/Inf at kq_soft_max-2"), std::string::npos) << text;
  nlohmann::json j = nlohmann::json::parse(render_json(c));
  EXPECT_EQ(j["first_divergence"]["name"], "kq_soft_max-0");
  EXPECT_EQ(j["first_nonfinite"]["name"], "kq_soft_max-2");
  // Every all-NaN checkpoint: null metrics, never cosine 1 or rel_l2 0.
  for (const auto& cp : j["checkpoints"]) {
    if (cp["metrics"].is_null() || cp["metrics"]["nan_engine"] == 0) continue;
    EXPECT_TRUE(cp["metrics"]["cosine"].is_null()) << cp["name"];
    EXPECT_TRUE(cp["metrics"]["rel_l2"].is_null()) << cp["name"];
    EXPECT_EQ(cp["status"], "fail") << cp["name"];
  }
  // JUnit: two failing cases (the first divergence, and the NaN that appears from finite inputs);
  // everything else failing downstream is one skipped case per step, consequences of the first divergence.
  const std::string xml = render_junit(c);
  EXPECT_NE(xml.find("message=\"first NaN/Inf kq_soft_max-2 (step 0, layer 2): NaN/Inf: engine NaN 1 Inf 0, first nan at "
                     "H=0, T=1, S=1"),
            std::string::npos) << xml;
  EXPECT_NE(xml.find("message=\"first divergence kq_soft_max-0 (step 0, layer 0): "), std::string::npos) << xml;
  EXPECT_NE(xml.find("failures=\"2\""), std::string::npos) << xml;
  EXPECT_EQ(xml.find("classname=\"step_0000\" name=\"kq_soft_max-3\""), std::string::npos) << xml;
  EXPECT_NE(xml.find("<testcase classname=\"step_0000\" name=\"consequences of kq_soft_max-0 (step 0)\" time=\"0\">"),
            std::string::npos) << xml;
  const size_t listed = xml.find("fail downstream of kq_soft_max-0 (step 0)\">");
  ASSERT_NE(listed, std::string::npos) << xml;
  // The kinds and layers of the consequences, in execution order; the first NaN/Inf is a case of its own.
  EXPECT_NE(xml.find("kq_soft_max 3, ", listed), std::string::npos) << xml;
  EXPECT_EQ(xml.substr(listed, xml.find("</skipped>", listed) - listed).find("kq_soft_max 2"), std::string::npos) << xml;
}

// An Inf in the reference only, in dumps that record a subset (a --checkpoints filter): located and
// failing; its input is the nearest recorded one (l_out-1), finite. The ops between l_out-1 and
// ffn_out-2 were not recorded, so the verdict is undetermined (local or upstream), never local.
TEST_F(Compare, InfInASubsetDumpFailsTheRun) {
  auto subset = [](int, const std::string& name) {
    return name != "tokens" && name.rfind("ffn_out-", 0) != 0 && name.rfind("l_out-", 0) != 0;
  };
  reference.skip = subset;
  reference.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "ffn_out-2") v[3] = -std::numeric_limits<float>::infinity();
  };
  reference.write(path("reference.h5"));
  SyntheticDump e = engine_dump();
  e.skip = subset;
  Comparison c = run(e, rel(1e9));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(exit_code(c), 1);
  EXPECT_EQ(first(c).name, "ffn_out-2");
  EXPECT_EQ(first(c).step, 1);
  EXPECT_EQ(first(c).metrics->inf_b, 1);
  EXPECT_EQ(format_coordinates(first(c).metrics->first_nonfinite_b.coords), "T=0, D=3");
  EXPECT_EQ(c.verdict.rule, "nonfinite");
  EXPECT_EQ(c.verdict.kind, VerdictKind::undetermined);
  EXPECT_FALSE(c.verdict.unrecorded_inputs.empty());
  ASSERT_EQ(c.verdict.inputs.size(), 1u);
  EXPECT_EQ(c.verdict.inputs[0].name, "l_out-1");
  // The l_out after it inherits nothing: it is finite here, and passes.
  auto l_out = std::find_if(c.results.begin(), c.results.end(),
                            [](const CheckpointResult& r) { return r.step == 1 && r.name == "l_out-2"; });
  ASSERT_NE(l_out, c.results.end());
  EXPECT_EQ(l_out->status, CheckpointStatus::pass);
  EXPECT_NE(render_terminal(c).find("reference NaN 0, Inf 1, first -inf at T=0, D=3"), std::string::npos)
      << render_terminal(c);
}

// One token row off by 3e-3 in a 3-token prefill: tensor-wide rel L2 ~1.7e-3 passes a 2e-3 bound,
// the row's 3e-3 fails a 2e-3 row bound. Likewise one head of two.
TEST_F(Compare, RowAndHeadBoundsCatchWhatTheTensorBoundDilutes) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 0 && name == "ffn_out-1") {
      for (size_t i = 8; i < 16; ++i) v[i] *= 1.003f;  // token row 1 of [3, D=8]
    }
    if (step == 0 && name == "Qcur-2") {
      for (size_t t = 0; t < 3; ++t) {
        for (size_t i = 4; i < 8; ++i) v[t * 8 + i] *= 1.0025f;  // head 1 of [3, H=2, Dh=4]
      }
    }
  };
  Comparison tensor_only = run(e, rel(2e-3));
  EXPECT_FALSE(tensor_only.diverged());
  ToleranceSet slices = parse_tolerances(
      R"({"rules": [], "default": {"max_rel_l2": 2e-3, "max_row_rel_l2": 2e-3, "max_head_rel_l2": 2e-3, "reason": "t"}})",
      "t.json");
  Comparison c = run(e, slices);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.n_fail, 2);
  EXPECT_EQ(first(c).name, "ffn_out-1");
  EXPECT_EQ(first(c).metrics->row.index, 1);
  auto failing = [](const CheckpointResult& r) {
    std::vector<std::string> out;
    for (const auto& k : r.checks) {
      if (!k.pass) out.push_back(k.bound);
    }
    return out;
  };
  EXPECT_EQ(failing(first(c)), std::vector<std::string>{"max_row_rel_l2"});
  auto q = std::find_if(c.results.begin(), c.results.end(), [](const CheckpointResult& r) { return r.name == "Qcur-2"; });
  ASSERT_TRUE(q->failed());
  EXPECT_EQ(q->metrics->head.index, 1);
  const auto qf = failing(*q);
  EXPECT_NE(std::find(qf.begin(), qf.end(), "max_head_rel_l2"), qf.end());
  EXPECT_EQ(std::find(qf.begin(), qf.end(), "max_rel_l2"), qf.end());
  EXPECT_NE(render_terminal(c).find("slices    worst row T=1 rel_l2"), std::string::npos) << render_terminal(c);
}

// The precision pair judges each op's local error (isolation replay) by its own tight bounds: an
// error of one op deep in the model that the propagated tensor's loose bound lets through fails
// there, as the first divergence, with verdict local and the isolated run's pattern; without
// judge_local the same local error only informs the verdict.
TEST_F(Compare, LocalErrorsJudgedByTheirOwnBounds) {
  // Propagated: every checkpoint from layer 1 on carries accumulated noise of 1e-3, under a 5e-3 bound.
  SyntheticDump e = engine_dump();
  e.perturb = [](int, const std::string& name, std::vector<float>& v) {
    if (name.back() != '0' && name.find('-') != std::string::npos)
      for (size_t i = 0; i < v.size(); ++i) v[i] *= 1.0f + 1e-3f * ((i % 2) ? 1.0f : -1.0f);
  };
  const ToleranceSet loose = rel(5e-3);
  Comparison c = run(e, loose);
  ASSERT_FALSE(c.diverged());
  // Isolated: exact but for one token row of ffn_out-2 at step 1, 2e-3 off.
  SyntheticDump iso = engine_dump();
  iso.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "ffn_out-2")
      for (float& x : v) x *= 1.002f;
  };
  iso.write(path("isolated.h5"));
  const DumpReader ir(path("isolated.h5")), r(path("reference.h5"));
  const ToleranceSet local = parse_tolerances(
      R"({"preset": "t_local", "rules": [], "default": {"max_rel_l2": 1e-4, "max_row_rel_l2": 1e-4, "reason": "local"}})",
      "t_local.json");
  Comparison informed = c;
  add_isolation(informed, compare_dumps(ir, r, local));
  EXPECT_FALSE(informed.diverged());
  CompareOptions judge;
  judge.judge_local = true;
  add_isolation(c, compare_dumps(ir, r, local, judge), judge);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "ffn_out-2");
  EXPECT_EQ(first(c).step, 1);
  EXPECT_EQ(c.n_fail, 1);
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "isolation");
  ASSERT_TRUE(c.pattern.has_value());
  bool local_check = false;
  for (const auto& k : first(c).checks) local_check |= !k.pass && k.metric == "local rel_l2";
  EXPECT_TRUE(local_check);
  EXPECT_FALSE(c.preceding.empty());
  EXPECT_EQ(exit_code(c), 1);
  const std::string text = render_terminal(c);
  EXPECT_NE(text.find("local rel_l2"), std::string::npos) << text;
}

// compare --unrecorded: the engine's recorded dump against a logits-only dump of its production path,
// every step's last logits row bit for bit; a one-ulp difference at step 2 is "recording changed the
// result" (exit 1), a dump without result_output cannot be checked (InputError).
TEST_F(Compare, RecordingCheckOfTwoDumps) {
  engine_dump().write(path("engine.h5"));
  SyntheticDump logits_only = engine_dump();
  logits_only.skip = [](int, const std::string& name) { return name != "tokens" && name != "result_output"; };
  logits_only.write(path("unrecorded.h5"));
  SyntheticDump changed = logits_only;
  changed.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 2 && name == "result_output") v.back() = std::nextafter(v.back(), 1e30f);
  };
  changed.write(path("changed.h5"));
  SyntheticDump no_logits = engine_dump();
  no_logits.skip = [](int, const std::string& name) { return name == "result_output"; };
  no_logits.write(path("no-logits.h5"));
  const DumpReader e(path("engine.h5"));

  const RecordingCheck same = check_recording_dumps(e, DumpReader(path("unrecorded.h5")));
  EXPECT_TRUE(same.same);
  EXPECT_EQ(same.steps, 3);
  const RecordingCheck diff = check_recording_dumps(e, DumpReader(path("changed.h5")));
  EXPECT_FALSE(diff.same);
  EXPECT_EQ(diff.step, 2);
  Comparison c = compare_dumps(e, DumpReader(path("reference.h5")), rel(5e-3));
  ASSERT_FALSE(c.failed());
  c.recording = diff;
  EXPECT_TRUE(c.failed());
  EXPECT_EQ(exit_code(c), 1);
  const std::string text = render_terminal(c);
  EXPECT_NE(text.find("recording changed the result (step 2"), std::string::npos) << text;
  EXPECT_THROW(check_recording_dumps(e, DumpReader(path("no-logits.h5"))), InputError);
}

// A step whose engine ran a fused kernel that the isolation replay ran as its unfused twins (facts
// fused_kernel_checkpoints, step_fused): the replay measured another kernel, so the fused kernel's
// checkpoints get no local error at that step (and the report says so); at a step where both ran the
// same path, the same local error counts.
TEST_F(Compare, NoLocalErrorWhereTheReplayRanAnotherKernel) {
  SyntheticDump iso = engine_dump();
  iso.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (name == "ffn_out-2" && step >= 1)
      for (float& x : v) x *= 1.002f;
  };
  iso.write(path("isolated.h5"));
  const DumpReader ir(path("isolated.h5")), r(path("reference.h5"));
  const ToleranceSet local = parse_tolerances(
      R"({"preset": "t_local", "rules": [], "default": {"max_rel_l2": 1e-4, "reason": "local"}})", "t_local.json");
  CompareOptions judge;
  judge.judge_local = true;
  for (const bool replay_fused : {false, true}) {
    SCOPED_TRACE(replay_fused ? "the replay ran the fused kernel" : "the replay ran the unfused twins");
    Comparison c = run(engine_dump(), rel(5e-3));
    c.engine_meta.facts["fused_kernel_checkpoints"] = "1 embd; 4 ffn_gate,ffn_up,ffn_out";
    c.step_fused.assign(3, 0);
    c.step_fused[1] = 4;  // step 1 ran kernel 4; steps 0 and 2 ran nothing fused
    c.step_graph.assign(3, 0);
    Comparison isolated = compare_dumps(ir, r, local, judge);
    isolated.step_fused.assign(3, replay_fused ? 4 : 0);
    isolated.step_graph.assign(3, 0);
    add_isolation(c, isolated, judge);
    ASSERT_TRUE(c.diverged());
    EXPECT_EQ(first(c).name, "ffn_out-2");
    EXPECT_EQ(first(c).step, replay_fused ? 1 : 2);
    bool warned = false;
    for (const std::string& w : c.warnings) warned |= w.find("unfused twins") != std::string::npos;
    EXPECT_EQ(warned, !replay_fused);
  }
}

// A replay from a reference that lacks an op's inputs (here one recorded with a filter, l_out alone) ran
// the op on the engine's own values there: its isolated error spans the whole layer, so it is no local
// error. add_isolation leaves it out (and says so), where the same replay against the full reference
// makes l_out-2 a local failure.
TEST_F(Compare, NoLocalErrorWhereTheReplayCouldNotReplaceTheInputs) {
  SyntheticDump filtered_reference = reference;
  filtered_reference.skip = [](int, const std::string& name) {
    return name != "tokens" && name.rfind("l_out-", 0) != 0;
  };
  filtered_reference.write(path("reference-l_out.h5"));
  SyntheticDump iso = engine_dump();
  iso.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "l_out-2")
      for (float& x : v) x *= 1.002f;
  };
  iso.write(path("isolated.h5"));
  engine_dump().write(path("engine.h5"));
  const ToleranceSet local = parse_tolerances(
      R"({"preset": "t_local", "rules": [], "default": {"max_rel_l2": 1e-4, "reason": "local"}})", "t_local.json");
  CompareOptions judge;
  judge.judge_local = true;
  const DumpReader e(path("engine.h5")), ir(path("isolated.h5"));

  const DumpReader full(path("reference.h5"));
  Comparison with_inputs = compare_dumps(e, full, rel(5e-3));
  add_isolation(with_inputs, compare_dumps(ir, full, local, judge), judge);
  ASSERT_TRUE(with_inputs.diverged());
  EXPECT_EQ(first(with_inputs).name, "l_out-2");
  EXPECT_EQ(with_inputs.verdict.kind, VerdictKind::local);
  EXPECT_TRUE(with_inputs.warnings.empty());
  // Comparing a part (compare --checkpoints) says nothing of what the replay replaced: the same local error.
  CompareOptions part_of_it = judge;
  part_of_it.checkpoints = CheckpointFilter("l_out-*");
  Comparison selected = compare_dumps(e, full, rel(5e-3), part_of_it);
  add_isolation(selected, compare_dumps(ir, full, local, part_of_it), part_of_it);
  ASSERT_TRUE(selected.diverged());
  EXPECT_EQ(first(selected).name, "l_out-2");
  EXPECT_TRUE(selected.warnings.empty());

  const DumpReader part(path("reference-l_out.h5"));
  Comparison c = compare_dumps(e, part, rel(5e-3));
  add_isolation(c, compare_dumps(ir, part, local, judge), judge);
  EXPECT_FALSE(c.diverged());
  for (const CheckpointResult& r : c.results) EXPECT_FALSE(r.local.has_value()) << r.name << " step " << r.step;
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("l_out-0 at step 0 the first"), std::string::npos) << c.warnings[0];
  EXPECT_NE(render_terminal(c).find("have no local error"), std::string::npos);
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
  e.argmax = {7, 15, 4};
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "result_output") v[15] = 10.0f;  // the engine now prefers token 15
  };
  Comparison c = run(e, rel(1e9));
  EXPECT_FALSE(c.diverged());
  EXPECT_TRUE(c.tokens[0].match());
  EXPECT_FALSE(c.tokens[1].match());
  EXPECT_EQ(c.tokens[1].engine, 15);
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

// The engine's own argmax attribute against its own logits: a token other than their argmax fails
// result_output at that step with check "argmax", verdict local, whatever the reference says; an exact
// tie goes to the lower id in f32 logits.
TEST_F(Compare, EngineArgmaxAgainstItsOwnLogits) {
  SyntheticDump e = engine_dump();
  e.argmax = {7, 3, 4};
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "result_output") v[15] = 10.0f;  // the logits prefer 15; the engine chose 3
  };
  Comparison c = run(e, rel(1e9));
  ASSERT_TRUE(c.diverged());
  const CheckpointResult& f = c.results[*c.first_failure];
  EXPECT_EQ(f.name, "result_output");
  EXPECT_EQ(f.step, 1);
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "argmax");
  ASSERT_FALSE(f.checks.empty());
  EXPECT_EQ(f.checks.back().metric, "argmax");

  SyntheticDump tie = engine_dump();  // tokens 2 and 9 tie at step 1: 9 is the wrong one, 2 the right one
  tie.argmax = {7, 9, 4};
  tie.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "result_output") v[2] = v[9] = 5.0f;
  };
  Comparison ct = run(tie, rel(1e9));
  ASSERT_TRUE(ct.diverged());
  EXPECT_EQ(ct.verdict.rule, "argmax");
  tie.argmax = {7, 2, 4};
  EXPECT_FALSE(run(tie, rel(1e9)).diverged());
}

TEST_F(Compare, DataflowInputs) {
  // Recorded: every kind of a qwen3 dump (gemma3's own kinds absent).
  auto all = [](const std::string& n) {
    return n.find("post_norm") == std::string::npos && n.find("geglu") == std::string::npos && n != "inp_scaled";
  };
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

// A partial dump: only Qrope, kq_soft_max and kqv_out recorded, and the probabilities wrong (a KV
// write position). The jump over Qrope alone is no evidence of a local bug: the scores' other
// operand, the cache, was not recorded, and the verdict says so instead of "local".
TEST_F(Compare, PartialDumpVerdictNamesUnrecordedInputs) {
  SyntheticDump e = engine_dump();
  const auto recorded_only = [](std::vector<std::string> kinds) {
    return [kinds](int, const std::string& name) {
      if (name == "tokens") return false;
      const std::string base = parse_checkpoint_name(name).base;
      return std::find(kinds.begin(), kinds.end(), base) == kinds.end();
    };
  };
  e.skip = recorded_only({"Qrope", "kq_soft_max", "kqv_out"});
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "kq_soft_max-0") v[0] += 0.5f;
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "kq_soft_max-0");
  EXPECT_EQ(c.verdict.kind, VerdictKind::undetermined) << c.verdict.explanation;
  EXPECT_EQ(c.verdict.rule, "unrecorded_input");
  EXPECT_EQ(c.verdict.unrecorded_inputs, std::vector<std::string>{"cache_k-0 or Krope-0"});
  EXPECT_NE(c.verdict.explanation.find("local or upstream"), std::string::npos) << c.verdict.explanation;
  const std::string report = render_terminal(c, {});
  EXPECT_NE(report.find("not recorded: cache_k-0 or Krope-0"), std::string::npos) << report;
  EXPECT_NE(report.find("UNDETERMINED"), std::string::npos) << report;
  EXPECT_EQ(nlohmann::json::parse(render_json(c))["first_divergence"]["verdict"]["unrecorded_inputs"][0],
            "cache_k-0 or Krope-0");

  // The cache recorded too: every input is there, the jump is local.
  e.skip = recorded_only({"Qrope", "cache_k", "kq_soft_max", "kqv_out"});
  c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.verdict.kind, VerdictKind::local) << c.verdict.explanation;
  EXPECT_EQ(c.verdict.rule, "jump");
  EXPECT_TRUE(c.verdict.unrecorded_inputs.empty());

  // kq_soft_max is no operand anyone reads back: kqv_out without it, with Qrope and the cache, has
  // every input.
  using V = std::vector<std::string>;
  auto all_but_probs = [](const std::string& n) { return n.rfind("kq_soft_max", 0) != 0; };
  EXPECT_TRUE(unrecorded_inputs("kqv_out", 0, 4, all_but_probs).empty());
  auto qrope_only = [](const std::string& n) { return n.rfind("Qrope", 0) == 0; };
  EXPECT_EQ(unrecorded_inputs("kqv_out", 0, 4, qrope_only), (V{"cache_k-0 or Krope-0", "cache_v-0 or Vcur-0"}));
}

// T = H (2 tokens, 2 heads): an unlabelled [T, H, S] kq_soft_max has the shape of the vocabulary's
// [H, T, S] and is read so. The engine is right; only the layout is wrong: the comparison says that
// layout, not a causal mask or any other bug.
TEST_F(Compare, AmbiguousLayoutIsNamed) {
  reference.step_tokens = {2, 1, 1};
  reference.meta.token_ids = {1, 5};
  reference.fed = {1, 5, 9, 7};
  reference.write(path("reference.h5"));
  SyntheticDump e = engine_dump();
  e.step_tokens = reference.step_tokens;
  e.meta.token_ids = reference.meta.token_ids;
  e.fed = reference.fed;
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step != 0 || name.rfind("kq_soft_max-", 0) != 0) return;
    ASSERT_EQ(v.size(), 8u);  // [H=2, T=2, S=2] stored as [T, H, S]
    std::vector<float> t(v.size());
    for (int h = 0; h < 2; ++h)
      for (int tok = 0; tok < 2; ++tok)
        for (int pos = 0; pos < 2; ++pos) t[(tok * 2 + h) * 2 + pos] = v[(h * 2 + tok) * 2 + pos];
    v = t;
  };
  Comparison c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "kq_soft_max-0");
  EXPECT_EQ(first(c).layout_suspect, "T,H,S");
  EXPECT_EQ(first(c).layout_suspect_rel_l2, 0.0);
  EXPECT_EQ(c.verdict.rule, "layout");
  EXPECT_EQ(c.verdict.kind, VerdictKind::undetermined);
  EXPECT_NE(c.verdict.explanation.find("the layout looks like [T,H,S], not [H,T,S]"), std::string::npos)
      << c.verdict.explanation;
  ASSERT_TRUE(c.pattern);
  EXPECT_NE(c.pattern->hint.find("label it with the layout attribute"), std::string::npos) << c.pattern->hint;
  const std::string report = render_terminal(c, {});
  EXPECT_NE(report.find("warning: kq_soft_max-0 at step 0: the layout looks like [T,H,S]"), std::string::npos) << report;
  EXPECT_NE(report.find("(4 checkpoints look so)"), std::string::npos) << report;  // every layer's
  EXPECT_EQ(report.find("causal mask"), std::string::npos) << report;

  // A real error in such a tensor is no layout question.
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 0 && name == "kq_soft_max-0") v[1] += 0.5f;
  };
  c = run(e, rel(1e-3));
  ASSERT_TRUE(c.diverged());
  EXPECT_TRUE(first(c).layout_suspect.empty());
  EXPECT_EQ(c.verdict.rule, "jump");
}

namespace {
// Nearest-even f16 of a float (normal range), as an engine storing it in f16 holds it.
float to_f16(float x) {
  if (x == 0) return x;
  int e = 0;
  std::frexp(x, &e);
  const double q = std::ldexp(1.0, std::max(e - 1, -14) - 10);
  return static_cast<float>(std::nearbyint(static_cast<double>(x) / q) * q);
}
}  // namespace

// An engine keeping its residual stream in f16 (and not declaring it: native dtype f32): the error
// at ffn_inp-0 is one rounding to f16, a precision choice, judged by its structure (every value an f16
// value, within half an f16 spacing), not its size. An error of the same size that is not f16
// rounding stays local.
TEST_F(Compare, ResidualStoredInF16IsPrecisionByItsStructure) {
  SyntheticDump e = engine_dump();
  const auto residual = [](const std::string& name) { return name.rfind("ffn_inp-", 0) == 0 || name.rfind("l_out-", 0) == 0; };
  e.perturb = [&](int, const std::string& name, std::vector<float>& v) {
    if (residual(name))
      for (float& x : v) x = to_f16(x);
  };
  Comparison c = run(e, rel(1e-5));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "ffn_inp-0");
  ASSERT_TRUE(first(c).f16_fit);
  EXPECT_TRUE(first(c).f16_fit->engine_exact);
  EXPECT_LE(first(c).f16_fit->max_half_ulps, 1.0);
  EXPECT_EQ(c.verdict.kind, VerdictKind::drift) << c.verdict.explanation;
  EXPECT_EQ(c.verdict.rule, "f16_storage");
  EXPECT_TRUE(c.verdict.precision);
  EXPECT_NE(c.verdict.explanation.find("precision: the engine stores this tensor in f16"), std::string::npos);
  EXPECT_NE(c.verdict.explanation.find("native dtype says f32"), std::string::npos) << c.verdict.explanation;
  const double rounded_rel = first(c).metrics->rel_l2;

  // The same size, not a rounding: a scale 1 + rel (an RMSNorm one element short moves a row so).
  e.perturb = [&](int, const std::string& name, std::vector<float>& v) {
    if (name == "ffn_inp-0")
      for (float& x : v) x *= static_cast<float>(1 + rounded_rel);
  };
  c = run(e, rel(1e-5));
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(first(c).name, "ffn_inp-0");
  EXPECT_FALSE(first(c).f16_fit->engine_exact);
  EXPECT_EQ(c.verdict.kind, VerdictKind::local) << c.verdict.explanation;

  // f16 values, but one of them a spacing off: no rounding gives that.
  e.perturb = [&](int, const std::string& name, std::vector<float>& v) {
    if (!residual(name)) return;
    for (float& x : v) x = to_f16(x);
    if (name == "ffn_inp-0") v[3] = to_f16(v[3] * (1 + 1.5f / 1024));
  };
  c = run(e, rel(1e-5));
  ASSERT_TRUE(c.diverged());
  EXPECT_TRUE(first(c).f16_fit->engine_exact);
  EXPECT_GT(first(c).f16_fit->max_half_ulps, 1.5);
  EXPECT_EQ(c.verdict.kind, VerdictKind::local) << c.verdict.explanation;

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
  EXPECT_NE(text.find("Tokens (reference's next token vs engine argmax)"), std::string::npos);
  EXPECT_EQ(text.find("\033["), std::string::npos);  // no colour unless asked
  TerminalOptions colored;
  colored.color = true;
  EXPECT_NE(render_terminal(c, colored).find("\033["), std::string::npos);

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
  EXPECT_NE(xml.find("<failure type=\"fail\" message=\"first divergence " + first(c).name), std::string::npos) << xml;
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
