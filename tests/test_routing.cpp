// The routing verdict (diff/routing.hpp) on synthetic mixture-of-experts dumps: a flip across a near tie
// within the router's error is drift, one across a wide margin is local, wrong weights with the same
// experts are local by the ordinary rules, and the reports lead with the flips.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diff/compare.hpp"
#include "diff/report.hpp"
#include "diff/routing.hpp"
#include "diff/stream.hpp"
#include "model/error.hpp"
#include "tests/diff_dumps.hpp"
#include "tests/test_util.hpp"

using namespace diffrun;
using namespace diffrun::diff;
using diffrun::test::SyntheticDump;

namespace {

constexpr int kExperts = 8, kUsed = 2;

ModelConfig moe_config() {
  ModelConfig c = test::synthetic_config();
  c.arch = Arch::qwen3moe;
  c.moe = true;
  c.n_expert = kExperts;
  c.n_expert_used = kUsed;
  c.n_ff_exp = 4;
  return c;
}

// Router logits of token t: expert e at 2 - 0.5 e + 0.01 t, so experts 0 and 1 are chosen with a margin
// of 0.5 over expert 2; `near_tie` (a token of step 0, layer 1) puts expert 2 just below expert 1.
constexpr int kTieLayer = 1, kTieToken = 1;
constexpr float kTieMargin = 1e-6f;

void routing_values(const std::string& name, int step, std::vector<float>& v, bool engine, bool flip_tie,
                    int flip_wide, int wrong_reference = -1) {
  const ParsedCheckpointName p = parse_checkpoint_name(name);
  const bool logits = p.base == "ffn_moe_logits", topk = p.base == "ffn_moe_topk";
  if (!logits && !topk) return;
  const size_t width = logits ? kExperts : kUsed;
  const size_t T = v.size() / width;
  for (size_t t = 0; t < T; ++t) {
    std::vector<float> l(kExperts);
    for (int e = 0; e < kExperts; ++e) l[e] = 2.0f - 0.5f * e + 0.01f * static_cast<float>(t);
    const bool tie = step == 0 && p.layer == kTieLayer && static_cast<int>(t) == kTieToken;
    if (tie) l[2] = l[1] - kTieMargin;
    // The engine's logits: 3e-6 more on expert 2 at the near tie, which puts it above expert 1.
    if (tie && engine && flip_tie) l[2] += 3e-6f;
    std::vector<int32_t> ids = {0, 1};
    if (tie && engine && flip_tie) ids = {0, 2};
    // A flip across the 0.5 margin at token `flip_wide` of step 0, layer 2, its logits right.
    if (engine && step == 0 && p.layer == 2 && static_cast<int>(t) == flip_wide) ids = {0, 3};
    // A reference whose choice contradicts its own logits (expert 3 where its logits rank expert 1 second).
    if (!engine && step == 0 && p.layer == 2 && static_cast<int>(t) == wrong_reference) ids = {0, 3};
    for (size_t i = 0; i < width; ++i) v[t * width + i] = logits ? l[i] : static_cast<float>(ids[i]);
  }
}

class Routing : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_scratch_dir("test-routing-" +
                                  std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    SyntheticDump r = dump("cpu", "f64", false, false, -1);
    r.write(path("reference.h5"));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static SyntheticDump dump(const char* backend, const char* precision, bool engine, bool flip_tie, int flip_wide,
                            int wrong_reference = -1) {
    SyntheticDump d;
    d.meta = test::synthetic_meta(backend, precision);
    d.meta.config = moe_config();
    d.perturb = [=](int step, const std::string& name, std::vector<float>& v) {
      routing_values(name, step, v, engine, flip_tie, flip_wide, wrong_reference);
    };
    return d;
  }

  // The committed f32_vs_f64 preset's shape: ids exact, everything else 1e-5 relative.
  static ToleranceSet tolerances() {
    return parse_tolerances(R"({"rules": [{"match": "ffn_moe_topk-*", "max_abs": 0, "reason": "ids"}],
                                "default": {"max_rel_l2": 1e-5, "max_row_rel_l2": 5e-5, "reason": "test"}})",
                            "test.json");
  }

  Comparison run(const SyntheticDump& engine) {
    engine.write(path("engine.h5"));
    return compare_dumps(DumpReader(path("engine.h5")), DumpReader(path("reference.h5")), tolerances());
  }

  std::filesystem::path dir_;
};

}  // namespace

const CheckpointResult& result(const Comparison& c, int step, const std::string& name) {
  for (const CheckpointResult& r : c.results)
    if (r.step == step && r.name == name) return r;
  throw Error(name + " not compared");
}

TEST_F(Routing, NearTieFlipWithinTheRouterErrorIsDriftAndNoFailure) {
  const Comparison c = run(dump("cpu", "f32", true, true, -1));
  EXPECT_FALSE(c.diverged()) << render_terminal(c);
  EXPECT_EQ(exit_code(c), 0);
  // ffn_moe_topk-1 passes over the slots whose expert is the same: slot 1 of token 1 is left out.
  const CheckpointResult& topk = result(c, 0, "ffn_moe_topk-1");
  EXPECT_EQ(topk.status, CheckpointStatus::pass);
  EXPECT_EQ(topk.routing_excused, 1);
  EXPECT_EQ(topk.metrics->max_abs, 0.0);
  // The summary: one (token, layer) of 3 steps x 4 layers x their tokens flipped, one of its two ids kept.
  EXPECT_EQ(c.routing.flipped, 1);
  EXPECT_EQ(c.routing.drift, 1);
  EXPECT_EQ(c.routing.local, 0);
  EXPECT_EQ(c.routing.token_layers, (3 + 1 + 1) * 4);
  EXPECT_NEAR(c.routing.flip_rate(), 1.0 / 20, 1e-12);
  EXPECT_NEAR(c.routing.topk_overlap(), (40.0 - 1) / 40, 1e-12);
  const RoutingFlip* flip = nullptr;
  for (const RoutingLayer& l : c.routing.layers)
    for (const RoutingFlip& f : l.flips) flip = &f;
  ASSERT_NE(flip, nullptr);
  EXPECT_EQ(flip->token, kTieToken);
  EXPECT_EQ(flip->layer, kTieLayer);
  EXPECT_EQ(flip->overlap, 1);
  EXPECT_NEAR(flip->margin, kTieMargin, 2e-7);
  EXPECT_NEAR(flip->gap, kTieMargin, 2e-7);
  // The router error is the larger of the observed 3e-6 and the rule's row bound times the row's norm.
  EXPECT_GE(flip->router_error, 3e-6 * 0.99);
  EXPECT_EQ(flip->kind, FlipKind::drift);

  // The reports lead with it, and pass.
  const std::string text = render_terminal(c);
  const size_t routing = text.find("ROUTING");
  ASSERT_NE(routing, std::string::npos) << text;
  EXPECT_LT(routing, text.find("within tolerance")) << text;
  EXPECT_NE(text.find("drift (routing flip)"), std::string::npos) << text;
  EXPECT_NE(text.find("RESULT: PASS"), std::string::npos) << text;
  EXPECT_NE(render_summary(c).find("PASS"), std::string::npos);
  EXPECT_NE(render_summary(c).find("routing: 1 of 20 (token, layer) chose other experts, 1 drift, 0 local"),
            std::string::npos)
      << render_summary(c);
  const nlohmann::json j = nlohmann::json::parse(render_json(c));
  EXPECT_EQ(j["routing"]["flipped"], 1);
  EXPECT_EQ(j["routing"]["flips"][0]["kind"], "drift");
  EXPECT_EQ(j["routing"]["flips"][0]["engine"], nlohmann::json::array({0, 2}));
  EXPECT_TRUE(j["first_divergence"].is_null());
}

// The flipped slot's expert FFN (gate .. down) holds another expert's values: left out. ffn_moe_out mixes
// them into the token's row: it fails, and the verdict calls it the flip's consequence.
TEST_F(Routing, DownstreamOfADriftFlipIsDriftNotALocalBug) {
  SyntheticDump e = dump("cpu", "f32", true, true, -1);
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    routing_values(name, step, v, true, true, -1);
    if (step != 0) return;
    const ParsedCheckpointName p = parse_checkpoint_name(name);
    if (p.layer != kTieLayer) return;
    if (p.base == "ffn_moe_gate" || p.base == "ffn_moe_up" || p.base == "ffn_moe_swiglu" || p.base == "ffn_moe_down" ||
        p.base == "ffn_moe_weights" || p.base == "ffn_moe_weights_norm") {
      const size_t slot = v.size() / (3 * kUsed);  // T = 3 at step 0
      for (size_t i = 0; i < slot; ++i) v[(kTieToken * kUsed + 1) * slot + i] *= -2.0f;
    }
    if (p.base == "ffn_moe_out") v[kTieToken * 8] += 0.2f;  // D = 8
  };
  const Comparison c = run(e);
  ASSERT_TRUE(c.diverged());
  for (const char* name : {"ffn_moe_weights-1", "ffn_moe_gate-1", "ffn_moe_swiglu-1", "ffn_moe_down-1"}) {
    EXPECT_EQ(result(c, 0, name).status, CheckpointStatus::pass) << name;
    EXPECT_EQ(result(c, 0, name).routing_excused, 1) << name;
  }
  EXPECT_EQ(c.results[*c.first_failure].name, "ffn_moe_out-1");
  EXPECT_EQ(c.verdict.kind, VerdictKind::drift) << c.verdict.explanation;
  EXPECT_EQ(c.verdict.rule, "routing_flip");
  EXPECT_TRUE(c.verdict.routing_flip);
  EXPECT_NE(render_terminal(c).find("DRIFT (routing flip)"), std::string::npos);
  EXPECT_TRUE(nlohmann::json::parse(render_json(c))["first_divergence"]["verdict"]["routing_flip"].get<bool>());
}

TEST_F(Routing, FlipAcrossAWideMarginIsLocal) {
  // The near-tie flip of layer 1 passes; the one across the 0.5 margin in layer 2 is the first divergence.
  const Comparison c = run(dump("cpu", "f32", true, true, 2));
  EXPECT_EQ(c.routing.drift, 1);
  EXPECT_EQ(c.routing.local, 1);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.results[*c.first_failure].name, "ffn_moe_topk-2");
  EXPECT_EQ(c.verdict.kind, VerdictKind::local) << c.verdict.explanation;
  EXPECT_EQ(c.verdict.rule, "routing");
  ASSERT_EQ(c.verdict.flips.size(), 1u);
  EXPECT_NEAR(c.verdict.flips[0].gap, 1.0, 1e-5);  // experts 1 and 3: 2 x 0.5 apart
  EXPECT_NEAR(c.verdict.flips[0].margin, 0.5, 1e-5);
  EXPECT_EQ(c.verdict.flips[0].kind, FlipKind::local);
  EXPECT_NE(c.verdict.explanation.find("the selection is wrong"), std::string::npos) << c.verdict.explanation;
  const std::string text = render_terminal(c);
  EXPECT_LT(text.find("layer 2 token 2"), text.find("layer 1 token 1")) << "local flips are listed first:\n" << text;
  EXPECT_NE(text.find("RESULT: DIVERGED at ffn_moe_topk-2"), std::string::npos) << text;
}

// A flip whose pair the reference's own logits order the engine's way, by far more than the router's error: the
// reference's choice contradicts its router (a flawed reference, or a dump that is not what it says), which no drift
// of the engine explains. Its gap is negative (-1: expert 3 is 1.0 below expert 1): local, not drift.
TEST_F(Routing, AReferenceChoiceAgainstItsOwnLogitsIsLocal) {
  dump("cpu", "f64", false, false, -1, 2).write(path("reference.h5"));
  const Comparison c = run(dump("cpu", "f32", true, false, -1));
  EXPECT_EQ(c.routing.local, 1);
  EXPECT_EQ(c.routing.drift, 0);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.results[*c.first_failure].name, "ffn_moe_topk-2");
  EXPECT_EQ(c.verdict.kind, VerdictKind::local) << c.verdict.explanation;
  ASSERT_EQ(c.verdict.flips.size(), 1u);
  EXPECT_NEAR(c.verdict.flips[0].gap, -1.0, 1e-5);
  EXPECT_EQ(c.verdict.flips[0].kind, FlipKind::local);
}

TEST_F(Routing, WrongWeightsWithTheSameExpertsAreLocal) {
  SyntheticDump e = dump("cpu", "f32", true, false, -1);
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    routing_values(name, step, v, true, false, -1);
    if (name == "ffn_moe_weights_norm-1") v[0] += 0.25f;
  };
  const Comparison c = run(e);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.results[*c.first_failure].name, "ffn_moe_weights_norm-1");
  EXPECT_EQ(c.verdict.kind, VerdictKind::local);
  EXPECT_EQ(c.verdict.rule, "jump");
  EXPECT_EQ(c.routing.differing(), 0);
  EXPECT_EQ(render_terminal(c).find("ROUTING"), std::string::npos);
}

TEST_F(Routing, FlipWithoutTheEnginesRouterLogitsIsUndetermined) {
  SyntheticDump e = dump("cpu", "f32", true, true, -1);
  e.skip = [](int, const std::string& name) { return name.rfind("ffn_moe_logits-", 0) == 0; };
  const Comparison c = run(e);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.results[*c.first_failure].name, "ffn_moe_topk-1");
  EXPECT_EQ(c.verdict.kind, VerdictKind::undetermined);
  EXPECT_EQ(c.routing.undetermined, 1);
  EXPECT_NE(c.verdict.explanation.find("ffn_moe_logits-1 was not compared"), std::string::npos) << c.verdict.explanation;
}

TEST_F(Routing, StreamingComparisonJudgesAlike) {
  const SyntheticDump e = dump("cpu", "f32", true, true, 2);
  const Comparison files = run(e);
  const DumpReader er(path("engine.h5")), rr(path("reference.h5"));
  StreamComparison s(er.meta(), rr.meta(), tolerances());
  for (int step : rr.steps()) {
    for (const DumpReader* d : {&er, &rr}) {
      const StreamSide side = d == &er ? StreamSide::engine : StreamSide::reference;
      s.add_tokens(side, step, d->read_ids(step, "tokens"));
      for (const DatasetInfo& info : d->datasets(step))
        if (!info.is_int) s.add(side, info, d->read(step, info.name));
    }
    s.end_step(step);
  }
  const Comparison streamed = s.finish(files.engine_path, files.reference_path, er.int_attribute("argmax"),
                                       rr.int_attribute("argmax"));
  EXPECT_EQ(streamed.routing.flipped, files.routing.flipped);
  EXPECT_EQ(streamed.routing.drift, files.routing.drift);
  EXPECT_EQ(streamed.routing.local, files.routing.local);
  EXPECT_EQ(streamed.verdict.rule, files.verdict.rule);
  ASSERT_EQ(streamed.results.size(), files.results.size());
  for (size_t i = 0; i < files.results.size(); ++i) {
    EXPECT_EQ(streamed.results[i].status, files.results[i].status) << files.results[i].name;
    EXPECT_EQ(streamed.results[i].routing_excused, files.results[i].routing_excused) << files.results[i].name;
  }
  ASSERT_TRUE(streamed.first_failure.has_value());
  EXPECT_EQ(streamed.results[*streamed.first_failure].name, "ffn_moe_topk-2");
}

// The reference's fact routing_followed as compare reads it back: every row, or nothing for a fact that does not read
// so (compare then warns and lists no followed flip).
TEST(RoutingFollowed, FactReadsBackRowByRow) {
  const auto rows = parse_routing_followed("step 0 layer 1 token 8: 1,0; step 3 layer 0 token 0: 7,2");
  ASSERT_TRUE(rows.has_value());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].step, 0);
  EXPECT_EQ((*rows)[0].layer, 1);
  EXPECT_EQ((*rows)[0].token, 8);
  EXPECT_EQ((*rows)[0].engine, (std::vector<int32_t>{1, 0}));
  EXPECT_TRUE((*rows)[0].reference.empty());
  EXPECT_EQ((*rows)[0].kind, FlipKind::drift);
  EXPECT_EQ((*rows)[1].step, 3);
  EXPECT_EQ((*rows)[1].engine, (std::vector<int32_t>{7, 2}));
  EXPECT_TRUE(parse_routing_followed("").has_value());
  EXPECT_TRUE(parse_routing_followed("")->empty());
  for (const char* bad : {"step 0 layer 1 token 8:", "step 0 layer 1 token 8 1,0", "step x layer 1 token 8: 1",
                          "step 0 layer -1 token 8: 1", "step 0 layer 1 token 8: 1,,2", "step 0 layer 1 token 8: 1,a",
                          "step 0 layer 1 token 8: 1,0 extra", "step 0 layer 1 token 8: 99999999999",
                          "stop 0 layer 1 token 8: 1", "step 0 layer 1 token 8: -3"}) {
    EXPECT_FALSE(parse_routing_followed(bad).has_value()) << bad;
  }
}
