// Checks a dump against docs/dump-format.md and lists every problem at once (`diffrun validate`, the C API's checks).
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace diffrun {

// One problem: where (a root attribute, a group, a dataset as "step_0001/Qcur-0") and what is wrong.
struct DumpProblem {
  std::string where;
  std::string what;
};

// The root attributes of an open dump, checked: every problem, and the config and token ids when
// they could be read (config is empty when any config attribute is missing or unusable).
struct RootCheck {
  std::vector<DumpProblem> problems;
  std::optional<ModelConfig> config;
  std::vector<int32_t> token_ids;
  std::optional<std::vector<int32_t>> all_token_ids;
  std::optional<std::vector<int32_t>> argmax;
  std::optional<int64_t> rank, world_size;  // a tensor-parallel engine's rank dump (docs/dump-format.md, "Shards")
  int format_version = 0;        // 0: unknown (missing or unreadable)
  bool vlen_strings_ok = true;   // version 1 (or unknown): strings may be variable-length
};
RootCheck check_root_attributes(hid_t file);

// Checks one float checkpoint of a step against the vocabulary: its name for this config, the layer
// passed, its shape (T tokens in the step, S positions after it) and its layout ("" = the
// vocabulary's; otherwise its letters must be a permutation of the vocabulary's). Accepted shapes:
// the vocabulary's (permuted by the layout) or, with the vocabulary's layout, the per-head pair
// merged ([T, H*Dh]). Returns "" when it fits, else the problem. `canonical`, when given, receives
// the vocabulary's shape in the stored layout (the shape a writer stores for this data).
std::string check_checkpoint(const ModelConfig& cfg, std::string_view name, int layer, std::span<const int64_t> shape,
                             std::string_view layout, int64_t n_tokens, int64_t n_kv,
                             std::vector<int64_t>* canonical = nullptr);

// A rank dump's slice of a checkpoint of `layout` along the letter `split` at `offset` (docs/dump-format.md,
// "Shards"): `out` gets the config whose size of that letter is the slice's (its element count over the other
// letters'), for check_checkpoint to check the rest. Returns "" when the slice lies within the whole dimension,
// else the problem (a letter that is not the layout's or is T or S, a count that is no slice, a slice past the end).
std::string shard_slice_config(const ModelConfig& cfg, std::string_view layout, const std::string& split,
                               int64_t offset, std::span<const int64_t> shape, int64_t n_tokens, int64_t n_kv,
                               ModelConfig* out);

// What a name map sees of one dataset: its name, the names of its step (to count repeats "#k"),
// the dump's config (absent when incomplete) and its backend facts.
struct ForeignName {
  std::string_view name;
  const std::vector<std::string>& step_names;
  const std::optional<ModelConfig>& config;
  const std::map<std::string, std::string>& facts;
};

struct ValidateOptions {
  // A name map (`--names`): true when it renames or drops the dataset, which is then left to the
  // map (the reader reshapes it) instead of being checked against the vocabulary. Unset: every
  // name outside the vocabulary is a problem.
  std::function<bool(const ForeignName&)> mapped;
};

struct ValidateResult {
  std::vector<DumpProblem> problems;
  // Not problems: what the dump leaves open, e.g. a dataset without a layout attribute whose
  // vocabulary layout has two dims of the same size the data cannot tell apart (one per step and message).
  std::vector<DumpProblem> warnings;
  int n_steps = 0;
  int n_datasets = 0;
};

// Throws DumpError when the file cannot be read at all (missing, not HDF5, damaged); every other
// problem is listed in the result.
ValidateResult validate_dump(const std::string& path, const ValidateOptions& opt = {});

}  // namespace diffrun
