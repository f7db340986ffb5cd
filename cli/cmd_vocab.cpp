// `diffrun vocab [--json]`: the checkpoint vocabulary (names in execution order, layouts, architectures).
#include <memory>
#include <string>

#include <fmt/core.h>

#include "checkpoints/vocabulary.hpp"
#include "cli/command.hpp"

namespace diffrun::cli {
namespace {

int run_vocab(bool json) {
  if (json) {
    fmt::print("{}\n", vocabulary_json());
    return 0;
  }
  fmt::print("{:<16} {:<9} {:<10} {:<18} {}\n", "name", "scope", "layout", "archs", "what");
  for (const auto& k : checkpoint_kinds()) {
    std::string archs;
    for (Arch a : kind_archs(k)) {
      if (!archs.empty()) archs.push_back(',');
      archs += arch_name(a);
    }
    fmt::print("{:<16} {:<9} {:<10} {:<18} {}\n", fmt::format("{}{}", k.base, k.per_layer ? "-L" : ""),
               k.per_layer ? "layer" : "step", k.layout, archs, k.what);
  }
  fmt::print("\nDims: T tokens of the step, S positions attended (cache length after the step), D n_embd,\n"
             "H n_head, Hkv n_head_kv, Dh head_dim, F n_ff, V n_vocab. Rows are in execution order.\n");
  return 0;
}

const CommandRegistrar reg("vocab", "Print the checkpoint vocabulary (names, order, layouts)", [](CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  app.add_flag("--json", *json, "As JSON (what the Python reader's mirror is checked against)");
  return [json] { return run_vocab(*json); };
});

}  // namespace
}  // namespace diffrun::cli
