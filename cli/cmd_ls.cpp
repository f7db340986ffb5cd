// `diffrun ls DUMP.h5 [--step N] [--all]`: a dump's root attributes, a line per step, the kinds; every checkpoint with --all or --step.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "checkpoints/name_map.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "dump/dump.hpp"
#include "model/error.hpp"

namespace diffrun::cli {
namespace {

struct LsOptions {
  std::string path;
  std::string names;  // name map (--names)
  int step = -1;  // -1: every step
  bool all = false;  // every checkpoint of every step (the default: one line per step and the kinds)
};

// One line for a string from the dump: newlines, escapes and other control bytes escaped
// (printable), cut after `max` bytes.
std::string one_line(const std::string& s, size_t max) { return printable(s, max, 0); }

std::string ids_text(const std::vector<int32_t>& ids, size_t max) {
  std::string out;
  for (size_t i = 0; i < ids.size() && i < max; ++i) out += (i ? " " : "") + std::to_string(ids[i]);
  if (ids.size() > max) out += fmt::format(" ... ({} more)", ids.size() - max);
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// "12.3 MB", "45.6 KB", "789 B".
std::string size_text(double bytes) {
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  if (bytes >= 1e3) return fmt::format("{:.1f} KB", bytes / 1e3);
  return fmt::format("{:.0f} B", bytes);
}

// "head item, item, ..." wrapped within 100 columns, continuation lines indented by two.
void print_list(std::string line, const std::vector<std::string>& items) {
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string item = " " + items[i] + (i + 1 < items.size() ? "," : "");
    if (line.size() + item.size() > 100 && line.size() > 2) {
      fmt::print("{}\n", line);
      line = " ";
    }
    line += item;
  }
  fmt::print("{}\n", line);
}

int run_ls(const LsOptions& o) {
  const std::optional<NameMap> names = o.names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(o.names));
  const DumpReader r(o.path, names ? &*names : nullptr);
  if (o.step >= 0) r.datasets(o.step);  // a missing step is a DumpError naming it
  const DumpMeta& m = r.meta();
  const ModelConfig& c = m.config;
  fmt::print("{}: diffrun-dump v{}, backend {}, precision {}, written {} by diffrun {}\n", one_line(o.path, 400),
             m.format_version, one_line(m.backend, 100), one_line(m.precision, 100), one_line(m.created_utc, 100),
             one_line(m.diffrun_version, 100));
  fmt::print("  model    {} (fingerprint {})\n", one_line(m.model_path, 400), one_line(m.model_fingerprint, 100));
  fmt::print("  config   {}: {} layers, D={}, H={}, Hkv={}, Dh={}, F={}, V={}, ctx {}, rope {} theta {:g}, rms_eps {:g}{}{}{}\n",
             arch_name(c.arch), c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_vocab, c.n_ctx,
             rope_type_name(c.rope_type), c.rope_theta, c.rms_eps, c.tied_output ? ", tied output" : "",
             c.qkv_bias ? ", qkv bias" : "", c.qk_norm ? ", qk norm" : "");
  fmt::print("  prompt   \"{}\" ({} tokens: {})\n", one_line(m.prompt, 100), m.token_ids.size(),
             ids_text(m.token_ids, 24));
  for (const auto& [key, value] : m.facts) fmt::print("  {:<8} {}\n", one_line(key, 100), one_line(value, 400));
  for (const auto& key : r.int_attribute_names())
    fmt::print("  {:<8} {}\n", one_line(key, 100), ids_text(r.int_attribute(key), 24));

  const auto steps = r.steps();
  fmt::print("{} steps", steps.size());
  if (!steps.empty()) fmt::print(" ({}..{})", steps.front(), steps.back());
  fmt::print("\n");
  const bool every = o.all || o.step >= 0;
  std::vector<std::string> kinds, outside;  // per-layer kinds and the rest, in order of first appearance
  std::vector<std::pair<std::string, uint64_t>> kind_values;  // values per kind, all steps shown
  // Indexes into the lists above: a dump of 100k foreign names stays linear.
  std::unordered_map<std::string, size_t> kind_index;
  std::unordered_map<std::string, bool> listed;
  for (int step : steps) {
    if (o.step >= 0 && step != o.step) continue;
    const auto infos = r.datasets(step);
    uint64_t values = 0;
    for (const auto& d : infos) {
      uint64_t n = 1;
      for (auto x : d.shape) n *= static_cast<uint64_t>(x);
      values += n;
      const std::string base = d.layer >= 0 ? d.name.substr(0, d.name.rfind('-')) : d.name;
      auto& list = d.layer >= 0 ? kinds : outside;
      if (listed.emplace((d.layer >= 0 ? "L" : "O") + base, true).second) list.push_back(one_line(base, 100));
      const auto [kv, added] = kind_index.emplace(base, kind_values.size());
      if (added) kind_values.emplace_back(base, 0);
      kind_values[kv->second].second += n;
    }
    if (!every) {
      fmt::print("  step {:<4} {:>5} checkpoints, {:8.2f} MB as float32\n", step, infos.size(),
                 static_cast<double>(values) * 4 / 1e6);
      continue;
    }
    fmt::print("\nstep {} ({} checkpoints, {:.2f} MB)\n", step, infos.size(), static_cast<double>(values) * 4 / 1e6);
    fmt::print("  {:>5}  {:<18} {:<16} {:<10} {:<7} {}\n", "order", "name", "shape", "layout", "stored", "native");
    for (const auto& d : infos)
      fmt::print("  {:>5}  {:<18} {:<16} {:<10} {:<7} {}\n", d.order, one_line(d.name, 200), shape_text(d.shape),
                 one_line(d.layout, 100), one_line(d.stored_dtype, 100), one_line(d.native_dtype, 100));
  }
  if (!every) {
    print_list(fmt::format("kinds per layer ({}):", kinds.size()), kinds);
    if (!outside.empty()) print_list("outside layers:", outside);
    // Where the size goes (what --checkpoints can leave out): the largest kinds over the steps.
    uint64_t total = 0;
    for (const auto& [base, n] : kind_values) total += n;
    std::stable_sort(kind_values.begin(), kind_values.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    if (total > 0) {
      std::vector<std::string> items;
      for (size_t i = 0; i < kind_values.size() && i < 8; ++i) {
        const auto& [base, n] = kind_values[i];
        items.push_back(fmt::format("{} {} ({:.0f}%)", one_line(base, 100), size_text(static_cast<double>(n) * 4),
                                    100.0 * static_cast<double>(n) / static_cast<double>(total)));
      }
      print_list(fmt::format("largest kinds ({} in all):", size_text(static_cast<double>(total) * 4)), items);
    }
    fmt::print("(--all lists every checkpoint, --step N those of one step)\n");
  }
  return 0;
}

const CommandRegistrar reg("ls", "Summarise a dump: metadata, a line per step, the checkpoint kinds (--all: every checkpoint)", [](CLI::App& app) {
  auto o = std::make_shared<LsOptions>();
  app.add_option("dump", o->path, "HDF5 dump")->required();
  app.add_option("--names", o->names, "Name map of the dump: llamacpp, hf or a JSON file (fixtures/names/README.md)");
  app.add_option("--step", o->step, "Every checkpoint of this step")->check(count_in(0));
  app.add_flag("--all", o->all, "Every checkpoint of every step (default: one line per step and the kinds)");
  return [o] { return run_ls(*o); };
});

}  // namespace
}  // namespace diffrun::cli
