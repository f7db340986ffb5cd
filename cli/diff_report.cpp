// Shared by `diffrun --prompt` and `diffrun compare`: comparison options, the compare, the reports, the exit code.
#include "cli/diff_report.hpp"

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <optional>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/options.hpp"
#include "checkpoints/name_map.hpp"
#include "checkpoints/vocabulary.hpp"
#include "diff/compare.hpp"
#include "diff/report.hpp"
#include "diff/tolerances.hpp"
#include "dump/dump.hpp"
#include "dump/shards.hpp"
#include "model/error.hpp"

namespace diffrun::cli {
void write_text_file(const std::string& path, const std::string& text, const char* what, bool atomic) {
  const std::string target = atomic ? path + ".diffrun-tmp" : path;
  std::ofstream out(target, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw InputError(fmt::format("{}: cannot write the {} report", target, what));
  if (!atomic) return;
  std::error_code ec;
  std::filesystem::rename(target, path, ec);
  if (ec) throw InputError(fmt::format("{}: cannot write the {} report: {}", path, what, ec.message()));
}

namespace {

bool use_color(bool no_color) {
  if (no_color) return false;
  if (const char* v = std::getenv("NO_COLOR"); v && *v) return false;
  return isatty(fileno(stdout)) != 0;
}

}  // namespace

void ReportOptions::add_options(CLI::App& app) {
  app.add_option("--tolerances", tolerances,
                 "Tolerance rules file (JSON, format in fixtures/tolerances/README.md); default: the built-in preset "
                 "of the precision pair (f32_vs_f64, f16_vs_f32, ...)");
  app.add_option("--report-json", report_json, "Write the full report as JSON to this file");
  app.add_option("--report-junit", report_junit,
                 "Write JUnit XML to this file: one test case per checkpoint, the first divergence the failing one, its "
                 "consequences one skipped case per step");
  app.add_flag("--force", force, "Compare dumps of different models, token ids or configs anyway");
  app.add_flag("--no-color", no_color, "No ANSI colours (also: NO_COLOR set, or stdout not a terminal)");
  app.add_option("--jump-factor", jump_factor,
                 "Verdict: an error this many times its inputs' is a local bug (default 10)")
      ->check(finite_positive());
  app.add_option("--names", names,
                 "Name map of the engine dump: llamacpp, hf or a JSON file (fixtures/names/README.md)");
  app.add_option("--reference-names", reference_names, "Name map of the reference dump (as --names)");
  app.add_option("--require-coverage", require_coverage,
                 "Fail (exit 1) when fewer than this percent of the reference's float checkpoints are compared")
      ->check(CLI::Range(0.0, 100.0));
  app.add_flag("--summary", summary, "Print one line (PASS or DIVERGED at ...) instead of the report");
  app.add_flag("--full", full, "Layer table: every checkpoint kind, also those failing everywhere downstream");
  app.add_flag("--explain", explain,
               "Show the tolerance rule's calibration and the bounds that would pass, whatever the verdict");
}

namespace {

bool has_preset(const std::string& name) {
  for (const std::string& n : diff::preset_names())
    if (n == name) return true;
  return false;
}

// The tolerance preset of a precision pair. Same precision on the same backend is bit-identical
// (f32_vs_f32); on different backends (cuda f32 against cpu f32) the summation orders differ, so it
// takes <p>_vs_<p>_cross. Emulated storage specs (reference_cpu/storage.hpp): an engine "A-f16store"
// is the f16 engine's storage (preset of f16), "A-f16residual" a storage choice judged by its
// arithmetic A's preset (the verdict's storage rule names it); a reference "f64-f16store" takes the
// f32-f16store preset (the arithmetic's share of the error is ~1e-6 next to the flips of f16 rounding).
// A tensor-parallel engine against one GPU of the same engine (the "tensor_parallel" fact on one side only) sums in
// other orders too (the all-reduce's partial sums, each rank's shorter GEMM rows): it takes the _cross preset, whose
// bounds are twice f32_vs_f64's, since each side is within f32_vs_f64 of the exact values.
std::string preset_for(const DumpMeta& engine, const DumpMeta& reference) {
  std::string e = engine.precision, r = reference.precision;
  const bool other_order = engine.backend != reference.backend ||
                           engine.facts.count("tensor_parallel") != reference.facts.count("tensor_parallel");
  if (e == r && other_order && has_preset(e + "_vs_" + r + "_cross")) return e + "_vs_" + r + "_cross";
  const std::string exact = diff::preset_name(e, r);
  if (has_preset(exact)) return exact;
  if (e.ends_with("-f16store") || e.find("-f16store-") != std::string::npos) e = "f16";
  else if (const size_t dash = e.find('-'); dash != std::string::npos) e = e.substr(0, dash);
  if (r.ends_with("-f16store")) r = "f32-f16store";
  const std::string mapped = diff::preset_name(e, r);
  return has_preset(mapped) ? mapped : exact;  // preset_tolerances names the missing one and lists the others
}

}  // namespace

diff::CompareOptions compare_options(const ReportOptions& opt) {
  diff::CompareOptions copt;
  copt.force = opt.force;
  copt.jump_factor = opt.jump_factor;
  copt.require_coverage = opt.require_coverage;
  copt.steps = opt.steps;
  copt.checkpoints = CheckpointFilter(opt.checkpoints);
  return copt;
}

diff::ToleranceSet tolerances_for(const DumpMeta& engine, const DumpMeta& reference, const ReportOptions& opt) {
  if (!opt.tolerances.empty()) return diff::load_tolerances(opt.tolerances);
  const std::string name = preset_for(engine, reference);
  // No preset for (engine, reference) but one for the swapped pair: the dumps were given the other
  // way round (the f64 reference as the engine).
  if (const std::string swapped = preset_for(reference, engine); !has_preset(name) && has_preset(swapped))
    throw InputError(fmt::format(
        "no tolerance preset \"{}\" for an engine dump of precision {} against a reference of {}, but there is one "
        "for the swapped pair (\"{}\"): the arguments look swapped; compare takes the engine dump first, then the "
        "reference (diffrun compare ENGINE.h5 REFERENCE.h5), or pass --tolerances FILE",
        printable(name, 100, 0), printable(engine.precision, 100, 0), printable(reference.precision, 100, 0), swapped));
  return diff::preset_tolerances(name);
}

IsolationRules isolation_rules(const DumpMeta& isolated, const DumpMeta& reference, const ReportOptions& opt) {
  const std::string local = preset_for(isolated, reference) + "_local";
  IsolationRules r;
  r.copt = compare_options(opt);
  r.copt.judge_local = opt.tolerances.empty() && has_preset(local);
  r.tolerances = r.copt.judge_local ? diff::preset_tolerances(local) : tolerances_for(isolated, reference, opt);
  return r;
}

void add_isolation_for(diff::Comparison& c, const DumpReader& isolated, const DumpReader& reference,
                       const ReportOptions& opt) {
  const IsolationRules r = isolation_rules(isolated.meta(), reference.meta(), opt);
  diff::add_isolation(c, diff::compare_dumps(isolated, reference, r.tolerances, r.copt), r.copt);
}

namespace {

// The comparison of one engine dump with one reference dump (and its isolated run), as the options ask.
diff::Comparison compare(const std::vector<std::string>& engine_paths, const std::string& reference_path,
                         const ReportOptions& opt, Progress& progress, const std::string& isolated_path) {
  const std::optional<NameMap> engine_names =
      opt.names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(opt.names));
  const std::optional<NameMap> reference_names =
      opt.reference_names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(opt.reference_names));
  // Either side may be a tensor-parallel run's rank dumps (several files, or their directory), merged.
  const std::unique_ptr<DumpReader> engine_dump =
      open_dump_set(dump_set_paths(engine_paths), engine_names ? &*engine_names : nullptr);
  const std::unique_ptr<DumpReader> reference_dump =
      open_dump_set(dump_set_paths({reference_path}), reference_names ? &*reference_names : nullptr);
  const DumpReader &engine = *engine_dump, &reference = *reference_dump;
  const std::string& engine_path = engine.path();
  const diff::ToleranceSet tolerances = tolerances_for(engine.meta(), reference.meta(), opt);
  progress.message(fmt::format("comparing {} ({}) with {} ({})", engine_path, engine.meta().precision, reference_path,
                               reference.meta().precision));
  const diff::CompareOptions copt = compare_options(opt);
  diff::Comparison c = diff::compare_dumps(engine, reference, tolerances, copt);
  if (!opt.unrecorded.empty()) c.recording = diff::check_recording_dumps(engine, DumpReader(opt.unrecorded));
  if (!isolated_path.empty()) {
    const DumpReader isolated(isolated_path, engine_names ? &*engine_names : nullptr);
    add_isolation_for(c, isolated, reference, opt);
  }
  progress.finish();
  return c;
}

}  // namespace

int compare_and_report(const std::vector<std::string>& engine_paths, const std::string& reference_path,
                       const ReportOptions& opt, Progress& progress,
                       const std::function<std::string(int32_t)>& token_text, const std::string& isolated_path) {
  return report_comparisons({opt.title}, {compare(engine_paths, reference_path, opt, progress, isolated_path)}, opt,
                            token_text);
}

int compare_and_report_pairs(const std::vector<ComparePair>& pairs, const ReportOptions& opt, Progress& progress,
                             const std::function<std::string(int32_t)>& token_text) {
  if (pairs.size() == 1) {
    const ComparePair& p = pairs.front();
    return compare_and_report({p.engine_path}, p.reference_path, opt, progress, token_text, p.isolated_path);
  }
  std::vector<std::string> titles;
  std::vector<diff::Comparison> comparisons;
  for (const ComparePair& p : pairs) {
    titles.push_back(p.title);
    comparisons.push_back(compare({p.engine_path}, p.reference_path, opt, progress, p.isolated_path));
  }
  return report_comparisons(titles, comparisons, opt, token_text);
}

int report_comparisons(const std::vector<std::string>& titles, const std::vector<diff::Comparison>& comparisons,
                       const ReportOptions& opt, const std::function<std::string(int32_t)>& token_text) {
  if (comparisons.size() == 1) {
    const diff::Comparison& c = comparisons.front();
    diff::TerminalOptions topt;
    topt.color = use_color(opt.no_color);
    topt.token_text = token_text;
    topt.title = opt.title;
    topt.full = opt.full;
    topt.explain = opt.explain;
    std::fputs((opt.summary ? diff::render_summary(c) : diff::render_terminal(c, topt)).c_str(), stdout);
    std::fflush(stdout);
    if (!opt.report_json.empty()) write_text_file(opt.report_json, diff::render_json(c), "JSON");
    if (!opt.report_junit.empty()) write_text_file(opt.report_junit, diff::render_junit(c), "JUnit");
    return diff::exit_code(c);
  }
  diff::TerminalOptions topt;
  topt.color = use_color(opt.no_color);
  topt.token_text = token_text;
  topt.title = opt.title;
  topt.full = opt.full;
  topt.explain = opt.explain;
  // The JSON report (every checkpoint of every step: ~0.3 s for the 0.5B shape's two pairs) only when asked for.
  nlohmann::ordered_json json = {{"pairs", nlohmann::ordered_json::array()}};
  int code = 0;
  std::vector<int> codes;
  for (size_t i = 0; i < comparisons.size(); ++i) {
    const diff::Comparison& c = comparisons[i];
    const std::string& title = titles[i];
    const int pair_code = diff::exit_code(c);
    codes.push_back(pair_code);
    code = std::max(code, pair_code);
    if (opt.summary) {  // one line per pair, led by its title
      std::fputs(fmt::format("{}: {}", title.substr(0, title.find(':')), diff::render_summary(c)).c_str(), stdout);
    } else {
      std::fputs(fmt::format("\n=== {} ===\n", title).c_str(), stdout);
      std::fputs(diff::render_terminal(c, topt).c_str(), stdout);
    }
    std::fflush(stdout);
    if (!opt.report_json.empty())
      json["pairs"].push_back({{"title", title}, {"exit_code", pair_code}, {"report", diff::report_json(c)}});
  }
  json["exit_code"] = code;
  if (!opt.summary) {
    std::fputs(fmt::format("\n=== {} ===\n", code == 0 ? "every pair within tolerance" : "a pair diverged: exit 1").c_str(),
               stdout);
    for (size_t i = 0; i < comparisons.size(); ++i)
      std::fputs(fmt::format("  {}: {}\n", titles[i],
                             codes[i] == 0 ? "PASS" : "DIVERGED").c_str(), stdout);
  }
  if (!opt.report_json.empty()) write_text_file(opt.report_json, json.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n", "JSON");
  if (!opt.report_junit.empty()) {
    std::vector<std::pair<std::string, const diff::Comparison*>> titled;
    for (size_t i = 0; i < comparisons.size(); ++i) titled.emplace_back(titles[i], &comparisons[i]);
    write_text_file(opt.report_junit, diff::render_junit(titled), "JUnit");
  }
  return code;
}

bool same_routing_row(const diff::RoutingFlip& a, const diff::RoutingFlip& b) {
  return a.step == b.step && a.layer == b.layer && a.token == b.token;
}

std::vector<diff::RoutingFlip> flips_to_follow(const diff::Comparison& c, const std::vector<diff::RoutingFlip>& followed) {
  if (!c.diverged() || c.routing.local > 0 || c.routing.undetermined > 0) return {};
  const diff::CheckpointResult& failure = c.results[*c.first_failure];
  const auto topk_order = [&](int step, int layer) {
    const std::string name = checkpoint_name(kExpertIdsKind, layer);
    for (const diff::CheckpointResult& r : c.results)
      if (r.step == step && r.name == name) return r.order;
    return INT_MAX;
  };
  std::vector<diff::RoutingFlip> out;
  for (const diff::RoutingLayer& l : c.routing.layers) {
    if (l.step > failure.step || (l.step == failure.step && topk_order(l.step, l.layer) > failure.order)) continue;
    for (const diff::RoutingFlip& f : l.flips) {
      if (f.kind != diff::FlipKind::drift) continue;
      if (std::none_of(followed.begin(), followed.end(),
                       [&](const diff::RoutingFlip& g) { return same_routing_row(f, g); }))
        out.push_back(f);
    }
  }
  return out;
}

std::shared_ptr<const ForcedRouting> forced_routing(const std::vector<diff::RoutingFlip>& followed) {
  auto forced = std::make_shared<ForcedRouting>();
  for (const diff::RoutingFlip& f : followed) forced->rows.push_back({f.step, f.layer, f.token, f.engine});
  return forced;
}

void follow_flips(diff::Comparison& c, std::vector<diff::RoutingFlip>& followed, const RunAgain& run_again) {
  for (int round = 0; round < kMaxRoutingFollowUps; ++round) {
    const std::vector<diff::RoutingFlip> added = flips_to_follow(c, followed);
    if (added.empty()) return;
    followed.insert(followed.end(), added.begin(), added.end());
    c = run_again(followed, added);
  }
}

}  // namespace diffrun::cli
