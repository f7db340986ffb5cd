// Unit tests of diff/stream: the streamed comparison equals compare_dumps of the same dumps, whatever the arrival order
// (one by one or a step's worth at once, compared in parallel).
#include <filesystem>
#include <memory>
#include <limits>
#include <string>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "diff/compare.hpp"
#include "diff/report.hpp"
#include "diff/stream.hpp"
#include "model/error.hpp"
#include "tests/diff_dumps.hpp"
#include "tests/test_util.hpp"

using namespace diffrun;
using namespace diffrun::diff;
using diffrun::test::SyntheticDump;

namespace {

class Stream : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_scratch_dir("test-stream-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    engine.meta = test::synthetic_meta("cpu", "f32");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static ToleranceSet rel(double max_rel_l2) {
    return parse_tolerances(fmt::format(R"({{"rules": [], "default": {{"max_rel_l2": {}, "reason": "test"}}}})", max_rel_l2),
                            "test.json");
  }

  // Feeds what the two dumps hold to a StreamComparison, step by step: the engine's checkpoints
  // first (it runs ahead), or interleaved with the reference's, or the engine's first and then the
  // reference's step at once (add_all, as the isolation replay does), and returns finish(last_step).
  Comparison streamed(const DumpReader& e, const DumpReader& r, const ToleranceSet& tol, bool engine_first,
                      int last_step = -1, bool batched = false) {
    StreamComparison s(e.meta(), r.meta(), tol);
    for (int step : r.steps()) {
      const std::vector<DatasetInfo> de = e.datasets(step), dr = r.datasets(step);
      const auto feed = [&](StreamSide side, const DumpReader& d, const DatasetInfo& info) {
        if (info.is_int) s.add_tokens(side, step, d.read_ids(step, info.name));
        else s.add(side, info, d.read(step, info.name));
      };
      if (engine_first && batched) {
        for (const auto& i : de) feed(StreamSide::engine, e, i);
        // Every second checkpoint's values also held elsewhere (as a dump write holds them): those
        // the comparison copies, the others it takes.
        std::vector<std::pair<DatasetInfo, StreamComparison::Values>> batch;
        std::vector<StreamComparison::Values> also_held;
        for (const auto& i : dr) {
          if (i.is_int) {
            s.add_tokens(StreamSide::reference, step, r.read_ids(step, i.name));
            continue;
          }
          batch.emplace_back(i, std::make_shared<std::vector<float>>(r.read(step, i.name)));
          if (batch.size() % 2 == 0) also_held.push_back(batch.back().second);
        }
        s.add_all(StreamSide::reference, std::move(batch));
      } else if (engine_first) {
        for (const auto& i : de) feed(StreamSide::engine, e, i);
        for (const auto& i : dr) feed(StreamSide::reference, r, i);
      } else {
        for (size_t k = 0; k < std::max(de.size(), dr.size()); ++k) {
          if (k < dr.size()) feed(StreamSide::reference, r, dr[k]);
          if (k < de.size()) feed(StreamSide::engine, e, de[k]);
        }
      }
      s.end_step(step);
    }
    return s.finish(e.path(), r.path(), e.int_attribute("argmax"), r.int_attribute("argmax"), last_step);
  }

  // compare_dumps and both streamed orders give the same JSON report.
  void expect_same(const ToleranceSet& tol) {
    engine.write(path("engine.h5"));
    reference.write(path("reference.h5"));
    const DumpReader e(path("engine.h5")), r(path("reference.h5"));
    const std::string files = render_json(compare_dumps(e, r, tol));
    EXPECT_EQ(render_json(streamed(e, r, tol, true)), files);
    EXPECT_EQ(render_json(streamed(e, r, tol, false)), files);
    EXPECT_EQ(render_json(streamed(e, r, tol, true, -1, true)), files);
  }

  std::filesystem::path dir_;
  SyntheticDump engine, reference;
};

}  // namespace

TEST_F(Stream, IdenticalDumps) { expect_same(rel(1e-6)); }

TEST_F(Stream, LocalBugWithPatternAndVerdict) {
  // Qcur-2 of step 1 and everything after it in the step fail: the pattern is the first one's.
  engine.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    const int order = checkpoint_order(test::synthetic_config(), parse_checkpoint_name(name).base,
                                       parse_checkpoint_name(name).layer);
    if (step == 1 && order >= checkpoint_order(test::synthetic_config(), "Qcur", 2)) v[1 + order % 3] += 0.5f;
  };
  expect_same(rel(1e-3));
}

TEST_F(Stream, FirstNaNAfterAnEarlierFailureKeepsBothPatterns) {
  engine.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 0 && name == "attn_out-1") v[3] *= 1.5f;
    const int order = checkpoint_order(test::synthetic_config(), parse_checkpoint_name(name).base,
                                       parse_checkpoint_name(name).layer);
    if (step == 2 && order >= checkpoint_order(test::synthetic_config(), "ffn_up", 3))
      v[order % 2] = std::numeric_limits<float>::quiet_NaN();
  };
  expect_same(rel(1e-3));
}

// The engine's own argmax against its own logits (compare's rule argmax) needs no values kept: streamed,
// the report is compare_dumps' (step 1's result_output fails; a larger logit was passed over).
TEST_F(Stream, EngineArgmaxAgainstItsOwnLogits) {
  engine.argmax = {7, 3, 4};
  engine.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "result_output") v[15] = 10.0f;
  };
  expect_same(rel(1e9));
  const DumpReader e(path("engine.h5")), r(path("reference.h5"));
  const Comparison c = streamed(e, r, rel(1e9), true);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.results[*c.first_failure].name, "result_output");
  EXPECT_EQ(c.verdict.rule, "argmax");
}

TEST_F(Stream, OneSidedCheckpointsAndShapeMismatch) {
  engine.skip = [](int step, const std::string& name) { return step == 1 && name == "ffn_gate-0"; };
  reference.skip = [](int, const std::string& name) { return name == "kq_soft_max-3"; };
  engine.shrink = "kqv_out-2";
  expect_same(rel(1e-3));
}

TEST_F(Stream, FinishKeepsTheStepsUpToTheLast) {
  engine.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "l_out-0") v[0] += 1.0f;
  };
  engine.write(path("engine.h5"));
  reference.write(path("reference.h5"));
  const DumpReader e(path("engine.h5")), r(path("reference.h5"));
  const Comparison c = streamed(e, r, rel(1e-3), true, 1);
  ASSERT_TRUE(c.diverged());
  EXPECT_EQ(c.results[*c.first_failure].name, "l_out-0");
  for (const auto& res : c.results) EXPECT_LE(res.step, 1);
  ASSERT_EQ(c.tokens.size(), 2u);
  EXPECT_EQ(c.tokens.back().step, 1);
}

TEST_F(Stream, DifferentTokensOrRecordingTwiceIsRefused) {
  engine.write(path("engine.h5"));
  reference.write(path("reference.h5"));
  const DumpReader e(path("engine.h5")), r(path("reference.h5"));
  StreamComparison s(e.meta(), r.meta(), rel(1e-3));
  s.add_tokens(StreamSide::engine, 0, {1, 5, 9});
  s.add_tokens(StreamSide::reference, 0, {1, 5, 8});
  EXPECT_THROW(s.end_step(0), InputError);

  StreamComparison twice(e.meta(), r.meta(), rel(1e-3));
  const DatasetInfo* info = e.find(0, "embd");
  ASSERT_NE(info, nullptr);
  twice.add(StreamSide::engine, *info, e.read(0, "embd"));
  EXPECT_THROW(twice.add(StreamSide::engine, *info, e.read(0, "embd")), Error);
}
