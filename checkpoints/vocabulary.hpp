// The checkpoint vocabulary: names, execution order within a step, layouts, which architectures emit which.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace diffrun {

// What a backend computed a checkpoint in (stored values are always float32, or int32 for ids).
enum class NativeDType { f16, bf16, f32, f64, i32 };
const char* native_dtype_name(NativeDType d);

// One kind of checkpoint. Per-layer kinds are named "<base>-<layer>" ("Qcur-3").
struct CheckpointKind {
  const char* base;    // "Qcur"
  bool per_layer;
  const char* layout;  // dimension letters of the stored array, e.g. "T,H*Dh" or "H,T,S"
  const char* what;    // one line for help and reports
};

// Every kind, in execution order within a step (per-layer kinds in their order inside a layer).
const std::vector<CheckpointKind>& checkpoint_kinds();
const CheckpointKind* find_checkpoint_kind(std::string_view base);  // nullptr if unknown
bool kind_applies(const CheckpointKind& k, const ModelConfig& cfg);  // qwen3 adds Qnorm/Knorm

std::string checkpoint_name(std::string_view base, int layer);  // layer < 0: base alone

struct ParsedCheckpointName {
  std::string base;
  int layer;  // -1 outside layers
};
ParsedCheckpointName parse_checkpoint_name(std::string_view name);

// Canonical execution index of a checkpoint within a step for this config (the dump's `order`).
int checkpoint_order(const ModelConfig& cfg, std::string_view base, int layer);

// Every checkpoint name a full step records for this config, in execution order.
std::vector<std::string> checkpoint_names(const ModelConfig& cfg);

// `--checkpoints 'attn_*,result_*'`: comma-separated globs (* and ?) over full names; empty = all.
class CheckpointFilter {
 public:
  CheckpointFilter() = default;  // matches everything
  explicit CheckpointFilter(std::string_view spec);  // throws InputError on an empty pattern
  bool matches(std::string_view name) const;
  bool all() const { return patterns_.empty(); }
  const std::string& spec() const { return spec_; }

 private:
  std::string spec_;
  std::vector<std::string> patterns_;
};

bool glob_match(std::string_view pattern, std::string_view text);

}  // namespace diffrun
