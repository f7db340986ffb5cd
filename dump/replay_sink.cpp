// Isolation replay sink: records through to the wrapped sink, replaces from the reference dump.
#include "dump/replay_sink.hpp"

namespace diffrun {

bool ReplacementRule::allows(const DatasetInfo& reference) const {
  if (reference.is_int || reference.row_offset > 0) return false;  // ids, or its last rows only
  int64_t n = 1;
  for (int64_t d : reference.shape) n *= d;
  const auto it = recorded_.find(reference.name);
  return it == recorded_.end() || it->second == n;
}

void ReplaySink::start_step(int step) const {
  if (step == step_) return;
  step_ = step;
  values_.clear();
  rule_.start_step();
}

void ReplaySink::record(int step, std::string_view name, int layer, std::string_view layout,
                        std::span<const int64_t> shape, NativeDType native, std::span<const float> data) {
  out_.record(step, name, layer, layout, shape, native, data);
  start_step(step);
  rule_.recorded(name, static_cast<int64_t>(data.size()));
}

void ReplaySink::record_ids(int step, std::string_view name, std::span<const int32_t> ids) {
  out_.record_ids(step, name, ids);
}

const float* ReplaySink::replacement(int step, std::string_view name) const {
  start_step(step);
  const DatasetInfo* info = reference_.find(step, std::string(name));
  if (!info || !rule_.allows(*info)) return nullptr;
  auto it = values_.find(name);
  if (it == values_.end()) it = values_.emplace(std::string(name), reference_.read(step, std::string(name))).first;
  return it->second.data();
}

}  // namespace diffrun
