// Shared by `diffrun --prompt` and `diffrun compare`: comparison options, the compare, the reports, the exit code.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/progress.hpp"
#include "diff/compare.hpp"
#include "diff/tolerances.hpp"
#include "dump/dump.hpp"
#include "reference_cpu/reference.hpp"

namespace diffrun::cli {

struct ReportOptions {
  std::string tolerances;    // a rules file; empty: the preset of the dumps' precision pair
  std::string report_json;   // write the JSON report here
  std::string report_junit;  // write the JUnit XML report here
  bool force = false;        // compare dumps of different models, tokens or configs
  bool no_color = false;
  double jump_factor = 10.0;
  std::string names;            // name map of the engine dump ("llamacpp", "hf" or a JSON file)
  std::string reference_names;  // name map of the reference dump
  double require_coverage = 0;  // percent of the reference's float checkpoints that must be compared
  bool summary = false;  // one line instead of the terminal report
  bool full = false;     // every kind in the layer table
  bool explain = false;  // calibration notes and "to pass" for any verdict
  std::string title = "diffrun compare";  // the terminal report's first line
  std::vector<int> steps;   // compare only these steps (empty: all; `compare --steps`)
  std::string checkpoints;  // compare only the checkpoints matching these globs (`compare --checkpoints`)
  std::string unrecorded;   // `compare --unrecorded`: the engine's logits-only dump of its production path
  // --tolerances --report-json --report-junit --force --no-color --jump-factor --names
  // --reference-names --require-coverage --summary --full --explain
  void add_options(CLI::App& app);
};

// Compares the engine dump against the reference dump, prints the terminal report on stdout,
// writes the requested report files, and returns 0 (within tolerance) or 1 (divergence).
// isolated_path (optional): the engine's isolation-replay dump; its comparison with the reference
// gives each checkpoint's local error, shown beside the propagated one and used by the verdict.
// Throws diffrun errors (exit 2) for dumps or tolerances that cannot be used.
// engine_paths: one dump, or a tensor-parallel run's rank dumps (several files, or one directory of them), merged
// (dump/shards.hpp); reference_path likewise one dump or a directory of rank dumps.
int compare_and_report(const std::vector<std::string>& engine_paths, const std::string& reference_path,
                       const ReportOptions& opt, Progress& progress,
                       const std::function<std::string(int32_t)>& token_text = {},
                       const std::string& isolated_path = {});

// One comparison of a run that compares several engine/reference pairs (the default GPU run: the f32
// engine against the f64 reference for logic, the f16 engine against the precision-matched reference).
struct ComparePair {
  std::string title;  // the section heading, e.g. "logic: cuda/f32 engine vs cpu/f64 reference"
  std::string engine_path, reference_path, isolated_path;
};

// Compares every pair: the terminal report of each under its heading, one JSON file holding
// {"pairs": [{"title", "exit_code", "report"}...], "exit_code"}, one JUnit file whose testsuites are
// named "<title>: step N". Returns 1 when any pair diverged, else 0. One pair: compare_and_report.
int compare_and_report_pairs(const std::vector<ComparePair>& pairs, const ReportOptions& opt, Progress& progress,
                             const std::function<std::string(int32_t)>& token_text = {});

// Writes a report's text to `path` (InputError naming it when it cannot). atomic: through "<path>.diffrun-tmp"
// and a rename, so that a reader never sees half a report (the sweep rewrites its reports as it goes).
void write_text_file(const std::string& path, const std::string& text, const char* what, bool atomic = false);

// Following routing flips by drift (mixtures of experts; DESIGN.md, "The job follows a drift flip"): a reference
// runs again taking the engine's experts where a near tie flipped, so that what comes after compares the same
// experts' outputs. At most this many runs again (each follows the flips up to the next divergence: about one a
// decode step that flips, the default run's 8 steps included).
constexpr int kMaxRoutingFollowUps = 8;

// Whether two flips are of the same (step, layer, token).
bool same_routing_row(const diff::RoutingFlip& a, const diff::RoutingFlip& b);

// The drift flips of `c` at or before its first divergence (step order, then execution order) that `followed` does
// not hold yet: what following them may change. None when `c` did not diverge, or when a flip of the comparison is
// local or undetermined (a routing bug, or no evidence): the report shows it as it is. Flips after the first
// divergence are left for a run again: there the router error is inflated by what diverged, and a routing bug of the
// decode steps alone would be judged drift and followed.
std::vector<diff::RoutingFlip> flips_to_follow(const diff::Comparison& c, const std::vector<diff::RoutingFlip>& followed);

// The expert choices a reference takes to follow `followed`: each flip's (step, layer, token) and the engine's ids.
std::shared_ptr<const ForcedRouting> forced_routing(const std::vector<diff::RoutingFlip>& followed);

// The follow-up loop of the job, `dump --follow-routing` and the sweep's outside drill-downs: from `c` (an engine
// against a reference), while flips_to_follow(c, followed) finds flips (at most kMaxRoutingFollowUps times), adds
// them to `followed` and replaces `c` with run_again(followed, the flips just added): the reference run again taking
// the engine's experts at every flip followed so far, compared with the engine again.
using RunAgain = std::function<diff::Comparison(const std::vector<diff::RoutingFlip>& followed,
                                                const std::vector<diff::RoutingFlip>& added)>;
void follow_flips(diff::Comparison& c, std::vector<diff::RoutingFlip>& followed, const RunAgain& run_again);

// The tolerance rules a comparison of these dumps uses: --tolerances, else the preset of their
// precision pair (f32_vs_f64, f16_vs_f32-f16store, f32_vs_f32_cross, ...).
diff::ToleranceSet tolerances_for(const DumpMeta& engine, const DumpMeta& reference, const ReportOptions& opt);

// The comparator's options as the report options give them (--force, --jump-factor, --require-coverage).
diff::CompareOptions compare_options(const ReportOptions& opt);

// Attaches the isolation replay's local errors to `c` (diff::add_isolation). A pair whose preset P
// has a P_local beside it (f16_vs_f32-f16store_local) judges each op's local error by it
// (judge_local: a local failure fails the comparison); otherwise, or with --tolerances, the replay
// takes the comparison's own rules and informs the verdict only.
void add_isolation_for(diff::Comparison& c, const DumpReader& isolated, const DumpReader& reference,
                       const ReportOptions& opt);

// The rules add_isolation_for compares an isolated run with its reference by (from their metadata).
struct IsolationRules {
  diff::ToleranceSet tolerances;
  diff::CompareOptions copt;
};
IsolationRules isolation_rules(const DumpMeta& isolated, const DumpMeta& reference, const ReportOptions& opt);

// Prints and writes the reports of finished comparisons, as compare_and_report (one) or
// compare_and_report_pairs (several, each under its title) do, and returns their exit code.
int report_comparisons(const std::vector<std::string>& titles, const std::vector<diff::Comparison>& comparisons,
                       const ReportOptions& opt, const std::function<std::string(int32_t)>& token_text = {});

}  // namespace diffrun::cli
