// `diffrun faults`: the fault catalog as a table (name, where it must first show, to which models it applies).
#include <cstdio>

#include "cli/command.hpp"
#include "faults/faults.hpp"

namespace diffrun::cli {
namespace {

const CommandRegistrar registrar{
    "faults", "List the injectable faults (--inject NAME) and the checkpoint where each must first show",
    [](CLI::App&) -> std::function<int()> {
      return [] {
        std::fputs(fault_table().c_str(), stdout);
        return 0;
      };
    }};

}  // namespace
}  // namespace diffrun::cli
