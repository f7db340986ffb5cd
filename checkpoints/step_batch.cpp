#include "checkpoints/step_batch.hpp"

#include <algorithm>
#include <stdexcept>

#include "checkpoints/dump_schema.hpp"
#include "checkpoints/tensor_parallel.hpp"
#include "checkpoints/vocabulary.hpp"

namespace diffrun {

StepBatch::StepBatch(const Sink& like, int first_step, int base, int k, std::vector<std::string> also)
    : like_(like), first_(first_step), base_(base), k_(k), also_(std::move(also)) {
  if (k < 1 || base < 0) throw std::logic_error("StepBatch: a pass of at least one step at a position >= 0");
}

bool StepBatch::wants(std::string_view name) const {
  return like_.wants(name) || std::find(also_.begin(), also_.end(), name) != also_.end();
}

void StepBatch::record(int step, std::string_view name, int layer, std::string_view layout,
                       std::span<const int64_t> shape, NativeDType native, std::span<const float> data) {
  const std::vector<std::string> dims = layout_dims(layout);
  if (step != first_ || dims.size() != shape.size())
    throw std::logic_error("StepBatch: " + std::string(name) + " does not match its layout or the pass's step");
  const auto at = [&](const std::string& letter) {
    const auto it = std::find(dims.begin(), dims.end(), letter);
    return it == dims.end() ? -1 : static_cast<int>(it - dims.begin());
  };
  Record r;
  r.name = std::string(name);
  r.layer = layer;
  r.layout = std::string(layout);
  r.shape.assign(shape.begin(), shape.end());
  r.iT = at(token_rows_dim());
  r.iS = at(cache_rows_dim());
  if ((r.iT < 0 && r.iS < 0) || (r.iT >= 0 && shape[r.iT] != k_) || (r.iS >= 0 && shape[r.iS] != base_ + k_))
    throw std::logic_error("StepBatch: " + std::string(name) + " [" + std::string(layout) +
                           "] has no token rows or cache positions of the pass to split");
  r.native = native;
  r.data.assign(data.begin(), data.end());
  records_.push_back(std::move(r));
}

void StepBatch::record_ids(int step, std::string_view name, std::span<const int32_t> ids) {
  if (step != first_ || static_cast<int>(ids.size()) != k_)
    throw std::logic_error("StepBatch: ids " + std::string(name) + " are not one per token of the pass");
  Record r;
  r.name = std::string(name);
  r.ids.assign(ids.begin(), ids.end());
  r.is_ids = true;
  records_.push_back(std::move(r));
}

std::vector<float> StepBatch::cut(const Record& r, int j, std::vector<int64_t>& shape) const {
  // Token row j along T, then the first base + j + 1 positions along S (record() took only checkpoints with one).
  shape = r.shape;
  std::span<const float> from = r.data;
  std::vector<float> out;
  if (r.iT >= 0) {
    out = take_slice(from, shape, r.iT, j, j + 1);
    shape[r.iT] = 1;
    from = out;
  }
  if (r.iS >= 0) {
    out = take_slice(from, shape, r.iS, 0, base_ + j + 1);
    shape[r.iS] = base_ + j + 1;
  }
  return out;
}

void StepBatch::replay(int j, int step, Sink& to) const {
  if (j < 0 || j >= k_) throw std::logic_error("StepBatch: no step " + std::to_string(j) + " in the pass");
  std::vector<int64_t> shape;
  for (const Record& r : records_) {
    if (!to.wants(r.name)) continue;
    if (r.is_ids) {
      to.record_ids(step, r.name, std::span<const int32_t>(&r.ids[j], 1));
    } else {
      const std::vector<float> values = cut(r, j, shape);
      to.record(step, r.name, r.layer, r.layout, shape, r.native, values);
    }
  }
}

std::vector<float> StepBatch::values(int j, std::string_view name) const {
  std::vector<int64_t> shape;
  for (const Record& r : records_)
    if (!r.is_ids && r.name == name) return cut(r, j, shape);
  return {};
}

}  // namespace diffrun
