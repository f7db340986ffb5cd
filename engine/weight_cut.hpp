// What a tensor-parallel rank uploads of each weight (host code, no CUDA): the rows and columns of its slice
// (checkpoints/tensor_parallel.hpp), and those bytes gathered from the file's blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "checkpoints/tensor_parallel.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"
#include "model/tensor_table.hpp"

namespace diffrun::engine {

// A tensor-parallel rank's cut of the weights: its slice, and the slices its Wq|bq and Wk|Wv|bk|bv rows come from
// (its own, but under the faults tp_wq_shard_offset and tp_kv_head_wrong_rank, faults/tp_faults.hpp).
struct WeightCut {
  TpSlice slice, q_rows, kv_rows;
};

// The part of a tensor a rank uploads: rows [r0, r1) of columns [c0, c1) (GGUF's ne[1..] rows of ne[0] columns; a
// vector is one row); r1 / c1 = -1: to the end.
struct Cut {
  int64_t r0 = 0, r1 = -1, c0 = 0, c1 = -1;
};

// The cut of `role` for a rank (null, or world 1: the whole tensor): Wq|bq rows of its query heads, Wk|Wv|bk|bv of
// its KV heads, Wgate|Wup of its channels (column parallel); Wo and Wdown the columns of its heads and channels (row
// parallel); everything else whole.
Cut cut_of(TensorRole role, const ModelConfig& cfg, const WeightCut* c);

// The bytes of `cut` (resolved: r1, c1 >= 0; columns on block boundaries) of tensor t: the file's own where they are
// contiguous (whole rows), else each row's blocks of the columns gathered into `gathered`.
std::span<const std::byte> cut_bytes(const GgufFile& file, const TensorInfo& t, const Cut& cut,
                                     std::vector<std::byte>& gathered);

}  // namespace diffrun::engine
