// checkpoints/step_batch: a pass over k one-token steps split back into what each step records alone.
#include "checkpoints/step_batch.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace diffrun {
namespace {

class Calls final : public Sink {
 public:
  struct Call {
    int step;
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> data;
    std::vector<int32_t> ids;
  };
  bool wants(std::string_view name) const override { return name != "unwanted"; }
  void record(int step, std::string_view name, int, std::string_view, std::span<const int64_t> shape, NativeDType,
              std::span<const float> data) override {
    calls.push_back({step, std::string(name), {shape.begin(), shape.end()}, {data.begin(), data.end()}, {}});
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    calls.push_back({step, std::string(name), {}, {}, {ids.begin(), ids.end()}});
  }
  std::vector<Call> calls;
};

std::vector<float> iota(size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.0f);
  return v;
}

// Steps 4..6 at positions 2..4: T rows one each, S positions 3, 4 and 5, in the order recorded; ids one each; the
// checkpoints the sink does not want are not replayed, those named as taken anyway are kept.
TEST(StepBatch, SplitsTokenRowsAndCachePositions) {
  Calls to;
  StepBatch batch(to, 4, 2, 3, {"result_output"});
  EXPECT_TRUE(batch.wants("result_output"));
  EXPECT_FALSE(batch.wants("unwanted"));
  const std::vector<int32_t> tokens = {7, 8, 9};
  batch.record_ids(4, "tokens", tokens);
  const std::vector<float> td = iota(3 * 2);  // [T=3, D=2]
  const std::vector<int64_t> td_shape = {3, 2};
  batch.record(4, "embd", -1, "T,D", td_shape, NativeDType::f32, td);
  const std::vector<float> hts = iota(2 * 3 * 5);  // [H=2, T=3, S=5]
  const std::vector<int64_t> hts_shape = {2, 3, 5};
  batch.record(4, "kq_soft_max-0", 0, "H,T,S", hts_shape, NativeDType::f32, hts);
  const std::vector<float> s = iota(5 * 2);  // [S=5, Hkv*Dh=2]
  const std::vector<int64_t> s_shape = {5, 1, 2};
  batch.record(4, "cache_k-0", 0, "S,Hkv,Dh", s_shape, NativeDType::f32, s);
  batch.record(4, "result_output", -1, "T,V", td_shape, NativeDType::f32, td);

  for (int j = 0; j < 3; ++j) {
    SCOPED_TRACE(j);
    to.calls.clear();
    batch.replay(j, 10 + j, to);
    ASSERT_EQ(to.calls.size(), 5u);
    EXPECT_EQ(to.calls[0].name, "tokens");
    EXPECT_EQ(to.calls[0].ids, std::vector<int32_t>{tokens[j]});
    EXPECT_EQ(to.calls[1].step, 10 + j);
    EXPECT_EQ(to.calls[1].shape, (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(to.calls[1].data, (std::vector<float>{td[2 * j], td[2 * j + 1]}));
    const int S = 2 + j + 1;
    EXPECT_EQ(to.calls[2].shape, (std::vector<int64_t>{2, 1, S}));
    std::vector<float> want;
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < S; ++p) want.push_back(hts[(h * 3 + j) * 5 + p]);
    EXPECT_EQ(to.calls[2].data, want);
    EXPECT_EQ(to.calls[3].shape, (std::vector<int64_t>{S, 1, 2}));
    EXPECT_EQ(to.calls[3].data, std::vector<float>(s.begin(), s.begin() + 2 * S));
    EXPECT_EQ(to.calls[4].name, "result_output");
    EXPECT_EQ(batch.values(j, "result_output"), to.calls[1].data);
  }
  EXPECT_TRUE(batch.values(0, "absent").empty());
}

// A checkpoint with neither token rows nor cache positions, or with sizes not the pass's, cannot be split.
TEST(StepBatch, WhatCannotBeSplitIsALogicError) {
  Calls to;
  StepBatch batch(to, 1, 0, 2, {});
  const std::vector<float> v = iota(4);
  const std::vector<int64_t> shape = {2, 2};
  EXPECT_THROW(batch.record(1, "x", -1, "H,Dh", shape, NativeDType::f32, v), std::logic_error);
  const std::vector<int64_t> three = {4, 1};
  EXPECT_THROW(batch.record(1, "x", -1, "T,D", three, NativeDType::f32, v), std::logic_error);
  EXPECT_THROW(batch.record(2, "x", -1, "T,D", shape, NativeDType::f32, v), std::logic_error);
  EXPECT_THROW(batch.record_ids(1, "tokens", std::vector<int32_t>{1}), std::logic_error);
  EXPECT_THROW(batch.replay(2, 3, to), std::logic_error);
}

}  // namespace
}  // namespace diffrun
