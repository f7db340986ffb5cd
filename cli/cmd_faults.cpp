// `diffrun faults`: the fault catalog as a table (name, where it must first show, to which models it applies).
#include <cstdio>
#include <string>

#include "cli/command.hpp"
#include "faults/faults.hpp"
#include "faults/tp_faults.hpp"

namespace diffrun::cli {
namespace {

const CommandRegistrar registrar{
    "faults", "List the injectable faults (--inject NAME) and the checkpoint where each must first show",
    [](CLI::App&) -> std::function<int()> {
      return [] {
        std::fputs(fault_table().c_str(), stdout);
        std::printf("\ntensor-parallel faults (the cuda engine at --tp N >= 2; compare the rank dumps of dump --tp N):\n");
        std::printf("%-26s %-16s %4s  %-30s %s\n", "fault", "first shows at", "step", "ranks named", "what");
        for (const TpFaultInfo& f : tp_fault_catalog())
          std::printf("%-26s %-16s %4d  %-30s %s\n", f.name, f.first_shows, f.step, f.ranks, f.what);
        return 0;
      };
    }};

}  // namespace
}  // namespace diffrun::cli
