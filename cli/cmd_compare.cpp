// `diffrun compare ENGINE.h5 REFERENCE.h5`: the first divergence between two existing dumps from any writer.
#include <memory>
#include <string>

#include "cli/command.hpp"
#include "cli/diff_report.hpp"
#include "cli/progress.hpp"

namespace diffrun::cli {
namespace {

struct CompareCommand {
  std::string engine;
  std::string reference;
  std::string isolated;
  ReportOptions report;
};

const CommandRegistrar registrar{
    "compare", "Compare an engine dump (A) with a reference dump (B): first divergence, verdict, per-layer errors",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<CompareCommand>();
      sub.add_option("engine", o->engine, "Engine dump (side a)")->required();
      sub.add_option("reference", o->reference, "Reference dump (side b)")->required();
      sub.add_option("--isolated", o->isolated,
                     "The engine's isolation-replay dump (diffrun dump --replay REFERENCE): local error per checkpoint");
      o->report.add_options(sub);
      return [o] {
        Progress progress("diffrun compare");
        return compare_and_report(o->engine, o->reference, o->report, progress, {}, o->isolated);
      };
    }};

}  // namespace
}  // namespace diffrun::cli
