// `diffrun sweep --prompts FILE`: a corpus through the pair, every generated token's logits compared, the worst prompts drilled down (cli/sweep.hpp).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <omp.h>

#include "cli/command.hpp"
#include "cli/diff_report.hpp"
#include "cli/interrupt.hpp"
#include "cli/options.hpp"
#include "cli/pipeline.hpp"
#include "cli/progress.hpp"
#include "cli/run.hpp"
#include "cli/sweep.hpp"
#include "diff/metrics.hpp"
#include "diff/tolerances.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#ifdef DIFFRUN_HAVE_CUDA
#include "engine/engine.hpp"
#endif

namespace diffrun::cli {
namespace {

struct SweepOptions {
  std::string model;
  std::string prompts;  // empty: the built-in corpus
  int steps = 64;
  bool chat = false;
  std::string system, tmpl;
  std::string engine = "auto";
  std::string engine_precision = "f32";
  std::string reference_precision;
  std::string inject;
  int drill = 3;
  int margin = 2;
  bool minimize = false;
  int limit = 0;  // > 0: the first N prompts only
  ReportOptions report;
};

// Writes `text` to `path` through a temporary and a rename, so a reader never sees half a file.
void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".diffrun-tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) throw Error("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path);
}

std::string engine_backend(const SweepOptions& o, Progress& progress) {
  if (o.engine != "auto") return o.engine;
#ifdef DIFFRUN_HAVE_CUDA
  std::string why;
  if (cuda_device_available(&why)) return "cuda";
  progress.message(fmt::format("no CUDA engine ({}): the engine side is the CPU backend", why));
#else
  progress.message("diffrun was built without the CUDA engine: the engine side is the CPU backend");
#endif
  return "cpu";
}

// The per-token figures of one prompt: the engine's last logits row of each step against the reference's.
std::vector<TokenStat> token_stats(const StepsResult& eng, const StepsResult& ref, const diff::ToleranceSet& tol,
                                   const diff::DimSizes& dims, int64_t prompt_len) {
  const diff::ToleranceRule& rule = tol.rule_for("result_output");
  std::vector<TokenStat> out;
  for (size_t s = 0; s < ref.last_logits.size() && s < eng.last_logits.size(); ++s) {
    const std::vector<float>& a = eng.last_logits[s];
    const std::vector<float>& b = ref.last_logits[s];
    const int64_t V = static_cast<int64_t>(b.size());
    TokenStat t;
    t.step = static_cast<int>(s);
    if (static_cast<int64_t>(a.size()) != V) {  // a padded vocabulary: a shape mismatch, always bad
      t.bad = true, t.kl = NAN, t.top5 = 0, t.max_abs = NAN;
      t.engine = s < eng.argmax.size() ? eng.argmax[s] : -1, t.reference = s < ref.argmax.size() ? ref.argmax[s] : -1;
      out.push_back(t);
      continue;
    }
    const int64_t shape[2] = {1, V};
    diff::TensorMetrics m = diff::compute_metrics(a, b, shape, "T,V", dims, rule.element);
    m.logits = diff::compute_logit_metrics(a, b, 1, V);
    const int64_t positions = prompt_len + static_cast<int64_t>(s);
    const double scale = tol.length_scale(positions) * tol.reduction_scale("result_output", dims);
    const std::vector<diff::BoundCheck> checks = diff::check_bounds(m, rule, positions, scale);
    t.bad = std::any_of(checks.begin(), checks.end(), [](const diff::BoundCheck& c) { return !c.pass; });
    t.kl = m.logits->kl.empty() ? NAN : m.logits->kl.front();
    t.top5 = m.logits->top5_overlap;
    t.max_abs = m.max_abs;
    t.engine = s < eng.argmax.size() ? eng.argmax[s] : diff::argmax(a);
    t.reference = s < ref.argmax.size() ? ref.argmax[s] : diff::argmax(b);
    // The engine's own choice against its own logits (compare's rule argmax), as in a full run.
    if (t.engine >= 0 && t.engine != diff::argmax(a)) t.bad = true;
    out.push_back(t);
  }
  return out;
}

// Everything one drill-down or minimization trial needs: the pair and the model.
struct DrillContext {
  const GgufFile& file;
  const ModelConfig& cfg;
  BackendOptions eng, ref;
  ReportOptions report;
  Progress& progress;
};

// The main job's pipeline on `ids` for `steps` steps, every checkpoint recorded, no dump: where the
// first divergence is and its verdict.
DrillResult drill_down(const DrillContext& cx, const std::vector<int32_t>& ids, int steps) {
  PipelinePair pp;
  pp.title = "drill-down";
  pp.engine = cx.eng;
  pp.reference = cx.ref;
  const int cores = available_cores();
  pp.reference_threads = std::max(1, cx.eng.backend == "cpu" ? 2 * cores / 3 : cores - 1);
  pp.engine_threads = std::max(1, cores - pp.reference_threads);
  PipelineOptions popt;
  popt.steps = steps;
  popt.dump = DumpMode::none;
  popt.stop_at_first = 0;
  popt.report = cx.report;
  popt.recording_check = false;
  popt.run_id = new_run_id();
  Progress quiet("diffrun sweep", false);
  const std::vector<diff::Comparison> cs = run_pipeline(cx.file, cx.cfg, {pp}, ids, popt, quiet);
  DrillResult d;
  d.ran = true;
  d.steps = steps;
  const diff::Comparison& c = cs.front();
  if (c.first_failure) {
    const diff::CheckpointResult& f = c.results[*c.first_failure];
    d.checkpoint = f.name;
    d.step = f.step;
    d.verdict = diff::verdict_kind_name(c.verdict.kind);
    d.rule = c.verdict.rule;
    d.explanation = c.verdict.explanation;
  }
  return d;
}

// The shortest token prefix, then the fewest steps, whose drill-down still first fails at `target`
// (bisection: a shorter prefix that fails there is kept). Returns {ids, steps}.
std::pair<std::vector<int32_t>, int> minimize(const DrillContext& cx, std::vector<int32_t> ids, int steps,
                                              const std::string& target) {
  const auto fails = [&](const std::vector<int32_t>& p, int s) { return drill_down(cx, p, s).checkpoint == target; };
  int lo = 1, hi = static_cast<int>(ids.size());  // hi fails
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    cx.progress.message(fmt::format("minimize: a prefix of {} of the {} prompt tokens", mid, ids.size()));
    if (fails(std::vector<int32_t>(ids.begin(), ids.begin() + mid), steps)) hi = mid;
    else lo = mid + 1;
  }
  ids.resize(hi);
  int slo = 0, shi = steps;
  while (slo < shi) {
    const int mid = (slo + shi) / 2;
    cx.progress.message(fmt::format("minimize: {} decode steps", mid));
    if (fails(ids, mid)) shi = mid;
    else slo = mid + 1;
  }
  return {ids, shi};
}

int run_sweep(const SweepOptions& o) {
  Progress progress("diffrun sweep");
  if (!o.report.report_json.empty()) check_output_file("--report-json", o.report.report_json);
  if (!o.report.report_junit.empty()) check_output_file("--report-junit", o.report.report_junit);
  std::vector<SweepPrompt> prompts = o.prompts.empty() ? parse_sweep_prompts(sweep_default_corpus(), kSweepDefaultCorpusName)
                                                       : load_sweep_prompts(o.prompts);
  const size_t planned = prompts.size();
  if (o.limit > 0 && static_cast<size_t>(o.limit) < prompts.size()) prompts.resize(o.limit);
  progress.message(fmt::format("loading {}", o.model));
  const auto file = GgufFile::open(o.model);
  const ModelConfig cfg = load_config(*file);
  validate_tensors(*file, cfg);
  const auto tok = load_tokenizer(*file);

  // Every prompt's ids first: a bad line is refused before anything runs.
  SweepReport report;
  report.model = o.model;
  report.corpus = o.prompts.empty() ? kSweepDefaultCorpusName : o.prompts;
  report.planned = static_cast<int>(planned);
  int64_t longest = 0;
  for (SweepPrompt& p : prompts) {
    PromptOptions po;
    po.chat = p.chat.value_or(o.chat);
    po.system = o.system;
    po.tmpl = o.tmpl;
    if (p.tokens.empty()) po.prompt = p.text;
    else po.tokens = fmt::format("{}", fmt::join(p.tokens, ","));
    PromptResult r;
    try {
      r.ids = prompt_tokens(*file, *tok, po);
    } catch (const InputError& e) {
      throw InputError(fmt::format("{} ({}): {}", report.corpus, p.id, e.what()));
    }
    r.steps = p.steps >= 0 ? p.steps : o.steps;
    if (static_cast<int64_t>(r.ids.size()) + r.steps > cfg.n_ctx) {  // skipped, and the report says so
      report.skipped.push_back(fmt::format("{} ({} prompt tokens plus {} steps)", p.id, r.ids.size(), r.steps));
      continue;
    }
    longest = std::max<int64_t>(longest, static_cast<int64_t>(r.ids.size()) + r.steps);
    r.prompt = p;
    report.results.push_back(std::move(r));
  }
  if (!report.skipped.empty())
    progress.message(fmt::format("{} prompt{} longer than the model's context of {} skipped: {}", report.skipped.size(),
                                 report.skipped.size() == 1 ? "" : "s", cfg.n_ctx, fmt::join(report.skipped, ", ")));
  if (report.results.empty())
    throw InputError(fmt::format("{}: no prompt fits the model's context of {} positions", report.corpus, cfg.n_ctx));
  std::vector<PromptResult> todo = std::move(report.results);
  report.results.clear();

  DrillContext cx{*file, cfg, {}, {}, o.report, progress};
  cx.eng.backend = engine_backend(o, progress);
  cx.eng.precision = o.engine_precision;
  cx.eng.inject = o.inject;
  cx.ref.backend = "cpu";
  cx.ref.precision = o.reference_precision.empty() ? default_reference_precision(o.engine_precision) : o.reference_precision;
  if (cx.eng.backend == "cpu" && cx.eng.precision == "f16")
    throw InputError("the CPU backend computes in f32 or f64; --engine-precision f16 needs the CUDA engine (--engine cuda)");
  report.pair = fmt::format("{}/{} engine vs cpu/{} reference", cx.eng.backend, cx.eng.precision, cx.ref.precision);
  const CheckpointFilter everything;
  check_run_options(*file, cfg, cx.eng, everything, true);
  check_run_options(*file, cfg, cx.ref, everything, true);
  omp_set_num_threads(available_cores());
  std::unique_ptr<Backend> ref = make_backend(*file, cfg, cx.ref, static_cast<int>(longest));
  std::unique_ptr<Backend> eng = make_backend(*file, cfg, cx.eng, static_cast<int>(longest));
  const diff::ToleranceSet tol = tolerances_for(dump_meta(*file, *eng, "", {}), dump_meta(*file, *ref, "", {}), o.report);
  const diff::DimSizes dims = diff::dim_sizes(cfg);

  // Phase 1: every prompt, logits only. The JSON report is rewritten after each prompt, marked
  // incomplete until the end, so a killed sweep leaves what it measured.
  const auto write_reports = [&] {
    if (!o.report.report_json.empty()) write_atomically(o.report.report_json, render_sweep_json(report));
    if (!o.report.report_junit.empty()) write_atomically(o.report.report_junit, render_sweep_junit(report));
  };
  report.complete = false;
  NullSink none;
  for (size_t i = 0; i < todo.size(); ++i) {
    PromptResult& r = todo[i];
    progress.update("prompt", static_cast<int>(i) + 1, static_cast<int>(todo.size()));
    ref->reset();
    const StepsResult rr = run_steps(*ref, r.ids, r.steps, {}, none, true);
    const std::vector<int32_t> fed(rr.tokens.begin() + static_cast<std::ptrdiff_t>(r.ids.size()), rr.tokens.end());
    eng->reset();
    const StepsResult er = run_steps(*eng, r.ids, r.steps, fed, none, true);
    r.tokens = token_stats(er, rr, tol, dims, static_cast<int64_t>(r.ids.size()));
    report.results.push_back(std::move(r));
    write_reports();
  }
  progress.finish();
  ref.reset();
  eng.reset();

  // Phase 2: the worst prompts with a bad token, every checkpoint, up to that token plus the margin.
  for (size_t i : worst_prompts(report.results, o.drill)) {
    PromptResult& r = report.results[i];
    const int bad = r.first_bad();
    if (bad < 0) continue;
    progress.message(fmt::format("drill-down: {} (bad from step {}), every checkpoint", r.prompt.id, bad));
    r.drill = drill_down(cx, r.ids, std::min(r.steps, bad + o.margin));
    write_reports();
  }
  const std::vector<SweepProblem> groups = group_problems(report.results);
  if (o.minimize && !groups.empty() && !groups.front().checkpoint.empty()) {
    const PromptResult& r = report.results[groups.front().prompts.front()];
    const auto [ids, steps] = minimize(cx, r.ids, r.drill->steps, groups.front().checkpoint);
    report.minimized = fmt::format("diffrun --model {} --tokens {} --steps {}{}{}", o.model, fmt::join(ids, ","), steps,
                                   o.inject.empty() ? "" : " --inject " + o.inject,
                                   o.engine == "auto" ? "" : " --engine " + o.engine);
  }
  report.complete = true;
  write_reports();
  const std::string text = render_sweep_terminal(report);
  std::fputs(text.c_str(), stdout);
  return text.find("RESULT: PASS") != std::string::npos ? 0 : 1;
}

const CommandRegistrar registrar{
    "sweep", "Run a corpus of prompts: every generated token's logits compared, the worst prompts drilled down",
    [](CLI::App& app) -> std::function<int()> {
      auto o = std::make_shared<SweepOptions>();
      o->model = default_model_path();
      app.add_option("--model,-m", o->model, "GGUF model")->capture_default_str();
      app.add_option("--prompts", o->prompts,
                     "Corpus: one prompt per line, or JSON objects {\"prompt\"|\"tokens\", \"chat\", \"steps\", \"id\"} "
                     "(default: the built-in fixtures/sweep/prompts.jsonl)");
      app.add_option("--steps", o->steps, "Decode steps per prompt (a JSON line's \"steps\" overrides)")
          ->capture_default_str()
          ->check(count_in(0, 100000));
      app.add_flag("--chat", o->chat, "Wrap text prompts in the chat template (a JSON line's \"chat\" overrides)");
      app.add_option("--system", o->system, "System message for --chat");
      app.add_option("--template", o->tmpl, "Chat template name (default: detected from the model)");
      app.add_option("--engine", o->engine, "Engine side: auto (cuda when a device exists, else cpu), cuda or cpu")
          ->capture_default_str()
          ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
      app.add_option("--engine-precision", o->engine_precision, "Engine precision (f32, or f16 on cuda)")
          ->capture_default_str()
          ->check(CLI::IsMember(precision_choices()));
      app.add_option("--reference-precision", o->reference_precision,
                     "Reference precision (default: f64, or f32-f16store against an f16 engine)")
          ->check(CLI::IsMember(precision_choices()));
      app.add_option("--inject", o->inject, "Inject faults into the engine side (diffrun faults lists them)");
      app.add_option("--drill", o->drill, "Drill into the K worst prompts that have a bad token (every checkpoint)")
          ->capture_default_str()
          ->check(count_in(0, 100000));
      app.add_option("--margin", o->margin, "Steps past the first bad token a drill-down runs")
          ->capture_default_str()
          ->check(count_in(0, 100000));
      app.add_flag("--minimize", o->minimize,
                   "Shrink the first problem's prompt to the shortest token prefix and fewest steps that still fail at "
                   "its checkpoint, and print the diffrun command that re-runs it");
      app.add_option("--limit", o->limit, "Only the first N prompts of the corpus")->check(count_in(1));
      app.add_option("--tolerances", o->report.tolerances, "Tolerance rules (default: the pair's preset)");
      app.add_option("--report-json", o->report.report_json,
                     "Write the sweep report as JSON (rewritten after each prompt; \"complete\": false until the end)");
      app.add_option("--report-junit", o->report.report_junit, "Write JUnit XML: one case per prompt, one per problem");
      return [o]() { return run_sweep(*o); };
    }};

}  // namespace
}  // namespace diffrun::cli
