// Row cuts of a dump: the row dimension of a layout and the rows a writer keeps (dump/rows.hpp).
#include "dump/rows.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "checkpoints/dump_schema.hpp"
#include "checkpoints/vocabulary.hpp"

namespace diffrun {

int row_dim(std::string_view layout) {
  const std::vector<std::string> dims = layout_dims(layout);
  if (!dims.empty() && dims[0] == dim_letter::S) return 0;
  const auto t = std::find(dims.begin(), dims.end(), dim_letter::T);
  return t == dims.end() ? -1 : static_cast<int>(t - dims.begin());
}

bool is_cache_layout(std::string_view layout) { return row_dim(layout) == 0 && layout_dims(layout)[0] == dim_letter::S; }

bool is_cache_kind(std::string_view base) {
  const CheckpointKind* kind = find_checkpoint_kind(base);
  return kind && is_cache_layout(kind->layout);
}

int64_t kept_rows(std::string_view base, int64_t t, const RowLimits& limits) {
  int64_t keep = t;
  const auto cut = [&](int64_t n) {
    if (n > 0) keep = std::min(keep, n);
  };
  if (base == kAttentionProbsKind) cut(limits.softmax_rows);
  if (base == kLogitsCheckpoint) cut(limits.logits_rows);
  if (base != kTokensCheckpoint) cut(limits.token_rows);
  return keep;
}

std::vector<float> rows_from(std::span<const float> values, std::span<const int64_t> shape, int rd, int64_t from) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < rd; ++i) outer *= shape[i];
  for (size_t i = rd + 1; i < shape.size(); ++i) inner *= shape[i];
  const int64_t rows = shape[rd];  // rows of `values`
  const int64_t out_rows = rows - from;
  std::vector<float> out(static_cast<size_t>(outer * out_rows * inner), 0.0f);
  for (int64_t i = 0; i < outer; ++i) {
    if (from >= 0) {
      std::copy_n(values.data() + (i * rows + from) * inner, out_rows * inner, out.data() + i * out_rows * inner);
    } else {
      std::copy_n(values.data() + i * rows * inner, rows * inner, out.data() + (i * out_rows - from) * inner);
    }
  }
  return out;
}

}  // namespace diffrun
