// The Sink interface backends call at each checkpoint; recording nothing costs nothing.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoints/vocabulary.hpp"

namespace diffrun {

// A backend makes every call for a step before its forward() returns (the top-level job ends a
// step there, cli/pipeline.hpp), from any one thread at a time.
class Sink {
 public:
  virtual ~Sink() = default;

  // Asked before a backend copies or converts anything for a checkpoint: false means skip it.
  virtual bool wants(std::string_view name) const = 0;

  // A float checkpoint: row-major values of `shape` (its dims named by `layout`, e.g. "T,D").
  virtual void record(int step, std::string_view name, int layer, std::string_view layout,
                      std::span<const int64_t> shape, NativeDType native,
                      std::span<const float> data) = 0;

  // The `tokens` checkpoint (and any other id array).
  virtual void record_ids(int step, std::string_view name, std::span<const int32_t> ids) = 0;

  // Isolation replay: when this returns non-null, the backend continues from these values
  // (same shape as recorded) instead of its own. Default: no replacement.
  virtual const float* replacement(int step, std::string_view name) const { return nullptr; }
};

// The sinks of a tensor-parallel run, one per rank: each rank records its own shard into rank(r) (a rank dump).
// Handed to a tensor-parallel backend as its Sink; another Sink given to one gets the ranks' checkpoints merged
// into whole tensors. As a Sink itself it records nothing and asks what rank 0's sink asks.
class RankSinks final : public Sink {
 public:
  explicit RankSinks(std::vector<Sink*> ranks) : ranks_(std::move(ranks)) {}
  int world_size() const { return static_cast<int>(ranks_.size()); }
  Sink& rank(int r) const { return *ranks_.at(static_cast<size_t>(r)); }
  bool wants(std::string_view name) const override { return !ranks_.empty() && ranks_.front()->wants(name); }
  void record(int, std::string_view, int, std::string_view, std::span<const int64_t>, NativeDType,
              std::span<const float>) override {}
  void record_ids(int, std::string_view, std::span<const int32_t>) override {}

 private:
  std::vector<Sink*> ranks_;
};

// Records nothing.
class NullSink final : public Sink {
 public:
  bool wants(std::string_view) const override { return false; }
  void record(int, std::string_view, int, std::string_view, std::span<const int64_t>, NativeDType,
              std::span<const float>) override {}
  void record_ids(int, std::string_view, std::span<const int32_t>) override {}
};

}  // namespace diffrun
