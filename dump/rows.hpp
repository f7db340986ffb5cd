// Row cuts of a dump (docs/dump-format.md, "Rows"): which dimension a checkpoint's rows are, how many a writer keeps.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace diffrun {

// How many last rows of a step a writer keeps (0: every row); DumpWriterOptions and DumpPlan carry them.
struct RowLimits {
  int64_t softmax_rows = 0;  // kq_soft_max [H, T, S]: the last query rows
  int64_t logits_rows = 0;   // result_output [T, V]: the last rows
  int64_t token_rows = 0;    // every per-token checkpoint (kq_soft_max and result_output too)
};

// The dimension of `layout` that holds a checkpoint's rows: the cache position S where the layout
// starts with it (cache_k, cache_v: "S,Hkv,Dh"), else the token T ("T,D": 0, "H,T,S": 1); -1 when
// it has neither.
int row_dim(std::string_view layout);

// Whether the layout's rows are cache positions (cache_k, cache_v).
bool is_cache_layout(std::string_view layout);
bool is_cache_kind(std::string_view base);

// Rows a writer keeps of a per-token checkpoint `base` in a step of t tokens under `limits`.
int64_t kept_rows(std::string_view base, int64_t t, const RowLimits& limits);

// Row-major `shape` along dimension rd: rows from..end of every outer index (from > 0), or all rows
// of `values` with zero rows 0..from-1 put back in front (from < 0: -from rows added).
std::vector<float> rows_from(std::span<const float> values, std::span<const int64_t> shape, int rd, int64_t from);

}  // namespace diffrun
