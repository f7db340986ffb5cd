// diffrun's entry point: builds the CLI from the registered subcommands and maps errors to exit codes.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cli/terminal.hpp"
#include "cli/command.hpp"
#include "cli/error_report.hpp"
#include "cli/help_format.hpp"
#include "cli/progress.hpp"
#include "cli/interrupt.hpp"
#include "model/error.hpp"

namespace diffrun::cli {

std::vector<CommandSpec>& command_registry() {
  static std::vector<CommandSpec> registry;
  return registry;
}

std::string models_dir() {
  if (const char* d = std::getenv("DIFFRUN_MODELS"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/diffrun/models";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/diffrun/models";
}

std::string default_model_path() { return models_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

}  // namespace diffrun::cli

namespace {

// A command that returned has closed every file it wrote (the dumps' HDF5 library keeps no exit-time cleanup:
// dump/dump_format.cpp's h5::silence) and printed its report. What an ordinary exit adds is teardown: the static
// destructors and the CUDA runtime's release of its context, device memory and pinned host buffers, which the
// kernel reclaims at the process's end anyway. The process ends here without it, its output flushed;
// DIFFRUN_FAST_EXIT=0 keeps the ordinary exit, as does a sanitizer build (LeakSanitizer checks at the exit).
int end_process(int rc) {
#if defined(__SANITIZE_ADDRESS__)
  return rc;
#endif
  const char* v = std::getenv("DIFFRUN_FAST_EXIT");
  if (v && std::strcmp(v, "0") == 0) return rc;
  std::fflush(nullptr);
  std::_Exit(rc);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace diffrun::cli;
  install_interrupt_handlers();
  CLI::App app{"diffrun: layer-by-layer differential debugging of LLM inference engines"};
  app.set_version_flag("--version", std::string("diffrun ") + DIFFRUN_VERSION);
  app.formatter(help_formatter());  // before the subcommands, which inherit it
  app.require_subcommand(0, 1);

  std::function<int()> run;
  std::function<int()> top_level;
  for (auto& spec : command_registry()) {
    if (spec.name.empty()) {
      top_level = spec.setup(app);
      continue;
    }
    CLI::App* sub = app.add_subcommand(spec.name, spec.help);
    auto fn = spec.setup(*sub);
    sub->callback([&run, fn] { run = fn; });
  }
  // Set after the subcommands, which would otherwise inherit it.
  app.footer(R"(Examples:
  diffrun --prompt "What is the capital of France?" --chat     reference vs engine, report
  diffrun --prompt "The capital of France is" --engine cpu --inject rope_theta_10000
  diffrun compare diffrun-out/engine.h5 diffrun-out/reference.h5 --report-junit junit.xml
  diffrun compare diffrun-out --steps 0 --full                 the last run's report again
  diffrun show diffrun-out/engine.h5 diffrun-out/reference.h5 Qrope-0 --slice T=3
  diffrun ls diffrun-out/engine.h5;  diffrun faults;  diffrun SUBCOMMAND --help
  python3 -m diffrun.plot diffrun-out --out plots     error by op and by layer, |a-b| heatmap

Exit codes:
  0  every compared checkpoint within tolerance (or the subcommand succeeded)
  1  a divergence, a NaN/Inf, coverage below --require-coverage or a step of the reference
     missing (validate: problems found)
  2  the run could not be done: bad input, missing or unreadable file, no GPU for --engine cuda
  130, 143, 141, 129  interrupted by SIGINT, SIGTERM, SIGPIPE, SIGHUP (the run's dump temporaries
     are removed))");
  // Exit 2 with one error line; the reports asked for (--report-json, --report-junit) say it too.
  auto fail = [&](const char* kind, const std::string& what) {
    write_error_reports(argc, argv, what);
    // Names and strings from a dump or a file reach the message: no control byte reaches the terminal.
    fmt::print(stderr, "diffrun: {}: {}\n", kind, diffrun::cli::terminal_safe(what));
    return 2;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    return fail("error", diffrun::printable(e.what(), 400, 0) + " (--help lists the options)");
  }
  try {
    if (run) return end_process(run());
    if (top_level) {
      const int rc = top_level();
      Progress().timing("the job returned");
      return end_process(rc);
    }
    std::fputs(app.help().c_str(), stdout);
    return 2;
  } catch (const diffrun::Error& e) {
    return fail("error", e.what());
  } catch (const std::filesystem::filesystem_error& e) {
    // A directory that cannot be made or a file that cannot be moved: what and where, not "internal".
    std::string what = e.code().message();
    if (!e.path1().empty()) what = fmt::format("{}: {}", diffrun::printable(e.path1().string()), what);
    return fail("error", what);
  } catch (const std::exception& e) {
    return fail("internal error", e.what());
  }
}
