// Dump size estimate from the vocabulary's shapes (prompt length, steps, filter, softmax rows), for the size guard.
#pragma once

#include <cstdint>
#include <string>

#include "checkpoints/vocabulary.hpp"
#include "model/config.hpp"

namespace diffrun {

// What a run records: step 0 is the prefill of `prompt_tokens`, then `steps` one-token decode steps.
// The row limits are DumpWriterOptions' (dump/dump.hpp): > 0 keeps only the last rows of a
// step, 0 every row.
struct DumpPlan {
  int64_t prompt_tokens = 0;
  int64_t steps = 0;
  CheckpointFilter filter;  // `tokens` is always recorded
  int64_t softmax_rows = 0;  // kq_soft_max's last query rows
  int64_t logits_rows = 64;  // result_output's last rows (DumpWriterOptions' default)
  int64_t token_rows = 0;    // every per-token checkpoint's last rows (kq_soft_max and result_output too)
  bool cache_all_rows = false;  // cache_k/cache_v: every row each step, instead of the rows written in it
};

// Bytes the dump of `plan` will take on disk: the data of every dataset (4 bytes a value, float32 or
// int32) plus HDF5's per-dataset, per-step and per-file overhead. Within a few % of a written dump.
uint64_t estimate_dump_size(const ModelConfig& cfg, const DumpPlan& plan);

// Bytes of kq_soft_max alone in that dump (what --softmax-rows can cut).
uint64_t estimate_softmax_bytes(const ModelConfig& cfg, const DumpPlan& plan);

// The largest softmax_rows (>= 1) that keeps the estimate within max_bytes, or 0 when every row
// fits already; -1 when even one row per step does not fit.
int64_t softmax_rows_within(const ModelConfig& cfg, DumpPlan plan, uint64_t max_bytes);
// The same for token_rows (softmax_rows and logits_rows as in `plan`).
int64_t token_rows_within(const ModelConfig& cfg, DumpPlan plan, uint64_t max_bytes);

// "4.0 GB", "86.1 MB", "12.3 kB" (powers of 1000, as the dump command prints sizes).
std::string format_bytes(uint64_t bytes);

// "4GB", "500M", "1.5G", "123456", "0" -> bytes (k/M/G/T are powers of 1000; a trailing B or iB is
// accepted, KiB/MiB/GiB are powers of 1024). Throws InputError naming the text.
uint64_t parse_bytes(const std::string& text);

}  // namespace diffrun
