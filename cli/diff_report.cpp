// Shared by `diffrun --prompt` and `diffrun compare`: comparison options, the compare, the reports, the exit code.
#include "cli/diff_report.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>

#include <fmt/core.h>

#include "checkpoints/dump.hpp"
#include "checkpoints/name_map.hpp"
#include "diff/compare.hpp"
#include "diff/report.hpp"
#include "diff/tolerances.hpp"
#include "model/error.hpp"

namespace diffrun::cli {
namespace {

void write_text_file(const std::string& path, const std::string& text, const char* what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw InputError(fmt::format("{}: cannot write the {} report", path, what));
}

bool use_color(bool no_color) {
  if (no_color) return false;
  if (const char* v = std::getenv("NO_COLOR"); v && *v) return false;
  return isatty(fileno(stdout)) != 0;
}

}  // namespace

void ReportOptions::add_options(CLI::App& app) {
  app.add_option("--tolerances", tolerances,
                 "Tolerance rules (JSON); default: the preset of the precision pair, e.g. fixtures/tolerances/f32_vs_f64.json");
  app.add_option("--report-json", report_json, "Write the full report as JSON to this file");
  app.add_option("--report-junit", report_junit, "Write one JUnit test case per checkpoint to this file");
  app.add_flag("--force", force, "Compare dumps of different models, token ids or configs anyway");
  app.add_flag("--no-color", no_color, "No ANSI colours (also: NO_COLOR set, or stdout not a terminal)");
  app.add_option("--jump-factor", jump_factor,
                 "Verdict: an error this many times its inputs' is a local bug (default 10)")
      ->check(CLI::PositiveNumber);
  app.add_option("--names", names,
                 "Name map of the engine dump: llamacpp, hf or a JSON file (fixtures/names/README.md)");
  app.add_option("--reference-names", reference_names, "Name map of the reference dump (as --names)");
  app.add_option("--require-coverage", require_coverage,
                 "Fail (exit 1) when fewer than this percent of the reference's float checkpoints are compared")
      ->check(CLI::Range(0.0, 100.0));
}

int compare_and_report(const std::string& engine_path, const std::string& reference_path, const ReportOptions& opt,
                       Progress& progress, const std::function<std::string(int32_t)>& token_text,
                       const std::string& isolated_path) {
  const std::optional<NameMap> engine_names =
      opt.names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(opt.names));
  const std::optional<NameMap> reference_names =
      opt.reference_names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(opt.reference_names));
  const DumpReader engine(engine_path, engine_names ? &*engine_names : nullptr);
  const DumpReader reference(reference_path, reference_names ? &*reference_names : nullptr);
  const diff::ToleranceSet tolerances =
      opt.tolerances.empty()
          ? diff::preset_tolerances(diff::preset_name(engine.meta().precision, reference.meta().precision))
          : diff::load_tolerances(opt.tolerances);
  progress.message(fmt::format("comparing {} ({}) with {} ({})", engine_path, engine.meta().precision, reference_path,
                               reference.meta().precision));
  diff::CompareOptions copt;
  copt.force = opt.force;
  copt.jump_factor = opt.jump_factor;
  copt.require_coverage = opt.require_coverage;
  diff::Comparison c = diff::compare_dumps(engine, reference, tolerances, copt);
  if (!isolated_path.empty()) {
    const DumpReader isolated(isolated_path, engine_names ? &*engine_names : nullptr);
    diff::add_isolation(c, diff::compare_dumps(isolated, reference, tolerances, copt), copt);
  }
  progress.finish();

  diff::TerminalOptions topt;
  topt.color = use_color(opt.no_color);
  topt.token_text = token_text;
  std::fputs(diff::render_terminal(c, topt).c_str(), stdout);
  std::fflush(stdout);
  if (!opt.report_json.empty()) write_text_file(opt.report_json, diff::render_json(c), "JSON");
  if (!opt.report_junit.empty()) write_text_file(opt.report_junit, diff::render_junit(c), "JUnit");
  return diff::exit_code(c);
}

}  // namespace diffrun::cli
