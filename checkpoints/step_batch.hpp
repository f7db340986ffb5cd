// One pass over k one-token steps, split back into the steps (Backend::set_draft): a Sink that takes the pass's
// checkpoints and keeps for each step what that step records alone.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoints/sink.hpp"

namespace diffrun {

// The pass runs steps first_step .. first_step + k - 1 at positions base .. base + k - 1: each checkpoint comes with
// k token rows (layout letter T) and base + k cache positions (S). Step j (0 ≤ j < k) recorded alone holds token row j
// and the first base + j + 1 positions, so that is what it replays: the same values, since the backend's every value
// depends on its own token row and the positions before it, summed in one order whatever the rows of the pass
// (DESIGN.md, "One summation order"). It holds the pass's checkpoints once, as a step of k tokens records them, and
// cuts each step's out as it replays it. A checkpoint with neither T nor S is a std::logic_error: nothing says which
// step it belongs to.
class StepBatch final : public Sink {
 public:
  // `like` answers wants() while the pass records (the sink the steps will be replayed into, asked nothing after);
  // `also` names checkpoints taken whatever it wants (the logits of every row, which a step returns).
  StepBatch(const Sink& like, int first_step, int base, int k, std::vector<std::string> also);

  bool wants(std::string_view name) const override;
  void record(int step, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override;
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override;

  int first_step() const { return first_; }
  int size() const { return k_; }
  // Step j's records into `to`, in the order the pass recorded them, as step `step`: those `to` wants.
  void replay(int j, int step, Sink& to) const;
  // Step j's values of checkpoint `name` (empty when not taken).
  std::vector<float> values(int j, std::string_view name) const;

 private:
  struct Record {
    std::string name;
    int layer = -1;
    std::string layout;
    std::vector<int64_t> shape;  // the pass's
    int iT = -1, iS = -1;        // the token and cache dimensions (-1: none)
    NativeDType native = NativeDType::f32;
    std::vector<float> data;
    std::vector<int32_t> ids;
    bool is_ids = false;
  };
  // Step j's cut of r: its shape and values.
  std::vector<float> cut(const Record& r, int j, std::vector<int64_t>& shape) const;

  const Sink& like_;
  int first_, base_, k_;
  std::vector<std::string> also_;
  std::vector<Record> records_;  // in recording order
};

}  // namespace diffrun
