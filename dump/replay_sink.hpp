// Isolation replay: a Sink that records the backend's own tensor, then hands it the reference's to continue from.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoints/sink.hpp"
#include "dump/dump.hpp"

namespace diffrun {

// Wraps the sink that records the isolated run (a DumpWriter) and a reader of the reference dump.
// At each checkpoint the backend records its own tensor into `out`, then continues from the
// reference's tensor of the same step and name (Sink::replacement). Each recorded tensor is then
// the backend's op applied to the reference's inputs: its error against the reference is local.
//
// Decisions:
// - Backends replace what an op reads and never recompute a replaced tensor by another code path:
//   the op under test, fused or not, is what a local error measures (DESIGN.md, isolation).
// - A checkpoint the reference dump lacks (filtered out), or holds only the last rows of (a long
//   prompt's row cuts, DumpWriterOptions), is not replaced: the backend continues from its own
//   values there. The isolated error of an op after it spans several ops; diff::add_isolation gives
//   such checkpoints no local error.
// - replacement() returns null when the backend already recorded this checkpoint with another
//   element count than the reference's (a fault that changes a shape), so a backend never copies
//   a tensor of the wrong size over its buffer. Backends that record after replacing (the engine
//   stages its copies) replace only buffers at least as large as the reference's tensor.
// - The reference's tensors of one step stay in memory until the next step starts, so a backend
//   may upload from them asynchronously until it synchronizes at the end of the step.
// The rule above for any source of the reference's tensors (this sink's dump, the top-level job's
// checkpoints held in memory): per step, the element counts the backend recorded, and whether a
// reference tensor may replace the backend's.
class ReplacementRule {
 public:
  void start_step() { recorded_.clear(); }
  void recorded(std::string_view name, int64_t n) { recorded_[std::string(name)] = n; }
  // A float tensor the dump holds whole, of the element count the backend recorded for it (if it did).
  bool allows(const DatasetInfo& reference) const;

 private:
  std::map<std::string, int64_t, std::less<>> recorded_;
};

class ReplaySink final : public Sink {
 public:
  ReplaySink(Sink& out, const DumpReader& reference) : out_(out), reference_(reference) {}

  bool wants(std::string_view name) const override { return out_.wants(name); }
  void record(int step, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override;
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override;
  const float* replacement(int step, std::string_view name) const override;

 private:
  void start_step(int step) const;

  Sink& out_;
  const DumpReader& reference_;
  mutable int step_ = -1;
  mutable std::map<std::string, std::vector<float>, std::less<>> values_;  // this step's reference tensors
  mutable ReplacementRule rule_;
};

}  // namespace diffrun
