// Streaming comparison: an engine's and a reference's checkpoints compared as the backends record them.
//
// Decisions:
// - One comparison library: each checkpoint is judged by compare_checkpoint, each step's results are
//   ordered and counted by add_step_results, and finish_comparison decides the first divergence, the
//   verdicts and the patterns, exactly as compare_dumps does for two files. Given what the dumps would
//   hold (each DatasetInfo as DumpReader presents it, the values as stored), finish() returns the
//   Comparison that compare_dumps returns for those dumps.
// - Bounded memory: a checkpoint's values are held until the other side's arrive, then compared in
//   place and released. Only the values of the first failing checkpoint and of the first one holding a NaN/Inf
//   are kept (their error patterns), one candidate of each at a time; and, until their step ends, those
//   of the failing MoE slot kinds of that step, which a routing flip by drift may excuse.
// - Steps end in order (end_step), and finish(last_step) keeps the steps up to last_step only: a run
//   stopped after its first divergence (--stop-at-first) reports the steps it promised, whatever the
//   backends computed beyond them.
// - Not thread-safe: one consumer thread feeds it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "diff/compare.hpp"
#include "dump/dump.hpp"

namespace diffrun::diff {

enum class StreamSide { engine = 0, reference = 1 };

class StreamComparison {
 public:
  StreamComparison(DumpMeta engine, DumpMeta reference, ToleranceSet tolerances, CompareOptions opt = {});

  // A float checkpoint as a dump presents it: info.step, name, order, layer, layout, native_dtype,
  // shape and row_offset as DumpReader gives them; `values` as stored. Compared as soon as both
  // sides hold it. Throws Error when a side records the same checkpoint twice.
  void add(StreamSide side, DatasetInfo info, std::vector<float> values);

  // Values shared with whoever else still reads them (a dump write, a held step): the comparison
  // reads them where they are and copies only those a report may need (the first failure's, the first
  // NaN/Inf's), so a passing checkpoint costs no copy.
  using Values = std::shared_ptr<const std::vector<float>>;
  void add(StreamSide side, DatasetInfo info, Values values);

  // add() of each checkpoint of `batch` in order, the comparisons of those whose other side is
  // already held computed in parallel (OpenMP): the same state as the adds one by one.
  void add_all(StreamSide side, std::vector<std::pair<DatasetInfo, Values>> batch);

  // The `tokens` of a step (each side's): the two must be equal.
  void add_tokens(StreamSide side, int step, std::vector<int32_t> tokens);

  // Both sides finished `step`; steps end in increasing order. Throws InputError when the sides were
  // fed different tokens, Error when a checkpoint is still waiting for the other side.
  struct StepEnd {
    bool failed = false;     // a checkpoint of this step failed
    bool nonfinite = false;  // a checkpoint of this step holds a NaN or Inf
  };
  StepEnd end_step(int step);

  // The first step that failed so far (-1: none).
  int first_failed_step() const { return first_failed_step_; }

  // The comparison over the ended steps up to last_step (all of them when negative). The argmax
  // arrays hold each side's greedy choice per step (index = step). Throws DumpError when no
  // checkpoint was in common. Called once: the steps' results move into the Comparison (a second
  // call throws Error).
  Comparison finish(const std::string& engine_path, const std::string& reference_path,
                    std::vector<int32_t> engine_argmax, std::vector<int32_t> reference_argmax, int last_step = -1);

 private:
  struct Pending {
    DatasetInfo info;
    Values values;
  };
  struct Kept {  // the values behind a result a report may need the pattern of
    int step = -1;
    int order = 0;
    std::string name;
    std::vector<float> a, b;
  };
  struct Step {
    std::vector<DatasetInfo> infos[2];                 // per side, in arrival order
    std::unordered_set<std::string> names[2];          // the names of infos[side]
    std::vector<int32_t> tokens[2];
    bool has_tokens[2] = {false, false};
    std::map<std::string, CheckpointResult> results;  // two-sided checkpoints, compared on arrival
    std::vector<CheckpointResult> ordered;             // after end_step
  };

  int64_t positions_through(int step) const;
  // add()'s bookkeeping of `info` for `side`: the pending counterpart when the other side holds one.
  std::optional<std::map<std::pair<int, std::string>, Pending>::iterator> arrive(int s, const DatasetInfo& info);
  // The comparison of a checkpoint held on both sides (values moved into the result's check).
  CheckpointResult compare_pair(const Pending& eng, const Pending& ref, ComparedValues& compared) const;
  // Records a comparison's result (and its values, when a report may need its pattern).
  void settle(CheckpointResult r, std::span<const float> a, std::span<const float> b);
  void keep_candidate(std::optional<Kept>& slot, const CheckpointResult& r, std::span<const float> a,
                      std::span<const float> b);

  DumpMeta meta_[2];
  ToleranceSet tolerances_;
  CompareOptions opt_;
  DimSizes dims_;
  std::map<int, Step> steps_;
  std::map<std::pair<int, std::string>, Pending> pending_[2];
  int last_ended_ = -1;
  bool finished_ = false;
  int first_failed_step_ = -1;
  int first_nonfinite_step_ = -1;
  std::optional<Kept> first_failure_, first_nonfinite_;
  // Failing checkpoints laid out per slot, which a routing flip by drift may still excuse at end_step
  // (diff/routing.hpp): each of the open step, then the first that stayed failing.
  std::vector<Kept> routing_kept_;
};

}  // namespace diffrun::diff
