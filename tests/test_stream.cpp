// Unit tests of diff/stream: the streamed comparison equals compare_dumps of the same dumps, whatever the arrival order
// (one by one or a step's worth at once, compared in parallel).
#include <filesystem>
#include <memory>
#include <limits>
#include <random>
#include <span>
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
        // Every second checkpoint's values also held elsewhere (as a dump write holds them): the
        // comparison reads them in place either way.
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

// The comparison of values in memory (the pipeline's) leaves out the rows one side lacks as the comparison of
// values read from files does, the same result and the same values compared: a view into the values where the
// rows left out lead them, a copy where they do not (a row dimension after the first).
TEST(StreamRows, ValuesInMemoryLeaveOutRowsAsValuesReadDo) {
  const DimSizes dims = dim_sizes(test::synthetic_config());
  const ToleranceSet tol = parse_tolerances(R"({"rules": [], "default": {"max_rel_l2": 1e-3, "reason": "test"}})", "t.json");
  struct Case {
    std::string name, layout;
    std::vector<int64_t> shape_a, shape_b;
    int64_t offset_a, offset_b;
    bool view;
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Case& k : {Case{"l_out-0", "T,D", {4, 8}, {6, 8}, 2, 0, true},
                        Case{"kq_soft_max-0", "H,T,S", {2, 3, 6}, {2, 6, 6}, 3, 0, false}}) {
    SCOPED_TRACE(k.name);
    const auto info = [&](const std::vector<int64_t>& shape, int64_t offset) {
      DatasetInfo d{};
      d.step = 0;
      d.name = k.name;
      d.layout = k.layout;
      d.native_dtype = "float32";
      d.shape = shape;
      d.row_offset = offset;
      return d;
    };
    const DatasetInfo a = info(k.shape_a, k.offset_a), b = info(k.shape_b, k.offset_b);
    const auto size = [](const std::vector<int64_t>& shape) {
      int64_t n = 1;
      for (int64_t e : shape) n *= e;
      return static_cast<size_t>(n);
    };
    std::vector<float> va(size(k.shape_a)), vb(size(k.shape_b));
    for (float& v : va) v = normal(rng);
    for (float& v : vb) v = normal(rng);  // unrelated to va: the checkpoint fails, its pattern read from the values
    std::vector<float> read_a, read_b;
    const CheckpointResult read = compare_checkpoint(
        0, &a, &b, tol, dims, 6,
        [&](std::vector<float>& x, std::vector<float>& y) {
          x = va;
          y = vb;
        },
        &read_a, &read_b);
    ComparedValues compared;
    const CheckpointResult in_memory =
        compare_checkpoint(0, &a, &b, tol, dims, 6, std::span<const float>(va), std::span<const float>(vb), &compared);
    ASSERT_TRUE(read.metrics && in_memory.metrics);
    EXPECT_TRUE(in_memory.failed());
    EXPECT_EQ(in_memory.status, read.status);
    EXPECT_EQ(in_memory.row_offset, read.row_offset);
    EXPECT_EQ(in_memory.shape_reference, read.shape_reference);
    EXPECT_EQ(in_memory.metrics->rel_l2, read.metrics->rel_l2);
    EXPECT_EQ(in_memory.metrics->max_abs, read.metrics->max_abs);
    EXPECT_EQ(in_memory.metrics->worst.flat, read.metrics->worst.flat);
    EXPECT_EQ(std::vector<float>(compared.a.begin(), compared.a.end()), read_a);
    EXPECT_EQ(std::vector<float>(compared.b.begin(), compared.b.end()), read_b);
    EXPECT_EQ(compared.a.data(), va.data());  // nothing of the engine's left out
    // Values that do not fill the shape are an error, not a read past them.
    EXPECT_THROW(compare_checkpoint(0, &a, &b, tol, dims, 6, std::span<const float>(va).first(va.size() - 1),
                                    std::span<const float>(vb)),
                 Error);
    if (k.view) {
      EXPECT_EQ(compared.b.data(), vb.data() + 2 * 8);
      EXPECT_TRUE(compared.b_cut.empty());
    } else {
      EXPECT_EQ(compared.b.data(), compared.b_cut.data());
    }
  }
}
