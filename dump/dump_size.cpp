// Dump size estimate (dump/dump_size.hpp): the vocabulary's shapes per step, plus HDF5's overhead per object.
#include "dump/dump_size.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "checkpoints/vocabulary.hpp"
#include "dump/rows.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

// HDF5 overhead measured on DumpWriter's files (format version 2: v1.8+ object headers, contiguous
// datasets without attributes): a dataset's object header, its link in the step group and its row
// of the step's attribute table; a step group and its table; the superblock, root group and root
// attributes (token_ids adds its 4 bytes an id).
constexpr uint64_t kDatasetOverhead = 340;
constexpr uint64_t kStepOverhead = 400;
constexpr uint64_t kFileOverhead = 9600;

struct Counted {
  uint64_t total = 0;
  uint64_t softmax = 0;
};

Counted count(const ModelConfig& cfg, const DumpPlan& plan) {
  Counted c;
  const std::vector<std::string> names = checkpoint_names(cfg);
  c.total = kFileOverhead + 4 * static_cast<uint64_t>(plan.prompt_tokens + plan.steps) * 2;  // ids attributes
  for (int64_t s = 0; s <= plan.steps; ++s) {
    const int64_t t = s == 0 ? plan.prompt_tokens : 1;
    const int64_t n_kv = plan.prompt_tokens + s;
    c.total += kStepOverhead;
    for (const auto& name : names) {
      if (name != "tokens" && !plan.filter.matches(name)) continue;
      const ParsedCheckpointName parsed = parse_checkpoint_name(name);
      const CheckpointKind* kind = find_checkpoint_kind(parsed.base);
      const bool softmax = parsed.base == kAttentionProbsKind;
      uint64_t n = 1;
      if (is_cache_kind(parsed.base)) {
        // The rows written in the step (all of them at the prefill), or every valid row.
        for (int64_t d : checkpoint_shape(cfg, *kind, t, plan.cache_all_rows ? n_kv : t)) n *= static_cast<uint64_t>(d);
      } else {
        const int64_t keep = kept_rows(parsed.base, t, {plan.softmax_rows, plan.logits_rows, plan.token_rows});
        for (int64_t d : checkpoint_shape(cfg, *kind, keep, n_kv)) n *= static_cast<uint64_t>(d);
      }
      c.total += kDatasetOverhead + 4 * n;
      if (softmax) c.softmax += 4 * n;
    }
  }
  return c;
}

}  // namespace

uint64_t estimate_dump_size(const ModelConfig& cfg, const DumpPlan& plan) { return count(cfg, plan).total; }

uint64_t estimate_softmax_bytes(const ModelConfig& cfg, const DumpPlan& plan) { return count(cfg, plan).softmax; }

namespace {

int64_t rows_within(const ModelConfig& cfg, DumpPlan plan, uint64_t max_bytes, int64_t DumpPlan::*rows) {
  plan.*rows = 0;
  if (estimate_dump_size(cfg, plan) <= max_bytes) return 0;
  // The size grows with the rows kept; the largest count that fits, by bisection over 1..prompt.
  int64_t lo = 0, hi = std::max<int64_t>(plan.prompt_tokens, 1);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    plan.*rows = mid;
    if (estimate_dump_size(cfg, plan) <= max_bytes) lo = mid;
    else hi = mid - 1;
  }
  return lo == 0 ? -1 : lo;
}

}  // namespace

int64_t softmax_rows_within(const ModelConfig& cfg, DumpPlan plan, uint64_t max_bytes) {
  return rows_within(cfg, std::move(plan), max_bytes, &DumpPlan::softmax_rows);
}

int64_t token_rows_within(const ModelConfig& cfg, DumpPlan plan, uint64_t max_bytes) {
  return rows_within(cfg, std::move(plan), max_bytes, &DumpPlan::token_rows);
}

std::string format_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e12) return fmt::format("{:.1f} TB", b / 1e12);
  if (b >= 1e9) return fmt::format("{:.1f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", bytes);
}

uint64_t parse_bytes(const std::string& text) {
  const auto bad = [&] {
    return InputError("size '" + text + "': expected a number of bytes with an optional unit (k, M, G, T, or KiB, MiB, GiB), e.g. 4GB");
  };
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw bad();
  }
  if (!std::isfinite(value) || value < 0) throw bad();
  std::string unit = text.substr(pos);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char ch) { return std::isspace(ch); }), unit.end());
  std::string u;
  for (char ch : unit) u.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  double mult = 1;
  if (u.empty() || u == "b") mult = 1;
  else if (u == "k" || u == "kb") mult = 1e3;
  else if (u == "m" || u == "mb") mult = 1e6;
  else if (u == "g" || u == "gb") mult = 1e9;
  else if (u == "t" || u == "tb") mult = 1e12;
  else if (u == "ki" || u == "kib") mult = 1024.0;
  else if (u == "mi" || u == "mib") mult = 1024.0 * 1024;
  else if (u == "gi" || u == "gib") mult = 1024.0 * 1024 * 1024;
  else if (u == "ti" || u == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else throw bad();
  const double bytes = value * mult;
  if (bytes > 1.8e19) throw bad();
  return static_cast<uint64_t>(std::llround(bytes));
}

}  // namespace diffrun
