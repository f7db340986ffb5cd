// Isolation replay sink: records through to the wrapped sink, replaces from the reference dump.
#include "checkpoints/replay_sink.hpp"

namespace diffrun {

void ReplaySink::start_step(int step) const {
  if (step == step_) return;
  step_ = step;
  values_.clear();
  recorded_n_.clear();
}

void ReplaySink::record(int step, std::string_view name, int layer, std::string_view layout,
                        std::span<const int64_t> shape, NativeDType native, std::span<const float> data) {
  out_.record(step, name, layer, layout, shape, native, data);
  start_step(step);
  recorded_n_[std::string(name)] = static_cast<int64_t>(data.size());
}

void ReplaySink::record_ids(int step, std::string_view name, std::span<const int32_t> ids) {
  out_.record_ids(step, name, ids);
}

const float* ReplaySink::replacement(int step, std::string_view name) const {
  start_step(step);
  auto it = values_.find(name);
  if (it == values_.end()) {
    const DatasetInfo* info = reference_.find(step, std::string(name));
    if (!info || info->is_int || info->row_offset > 0) return nullptr;  // absent, ids, or its last rows only
    it = values_.emplace(std::string(name), reference_.read(step, std::string(name))).first;
  }
  if (auto rec = recorded_n_.find(name);
      rec != recorded_n_.end() && rec->second != static_cast<int64_t>(it->second.size())) {
    return nullptr;
  }
  return it->second.data();
}

}  // namespace diffrun
