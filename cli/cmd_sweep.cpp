// `diffrun sweep --prompts FILE`: a corpus through the pair, every generated token's logits compared, the worst prompts drilled down (cli/sweep.hpp).
#include <sys/wait.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <span>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <omp.h>

#include "checkpoints/vocabulary.hpp"
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
  std::string engine_cmd;  // an outside engine: "CMD {reference} {out}"
  std::string check;       // "chunked-prefill[=C]"
  int jobs = 0;            // prompts at once; 0: auto
  ReportOptions report;
};

// --check chunked-prefill[=C]: C (default 8), or 0 without the option; InputError for anything else.
int chunk_of(const std::string& check) {
  if (check.empty()) return 0;
  const std::string name = "chunked-prefill";
  if (check == name) return 8;
  if (check.rfind(name + "=", 0) == 0) {
    const std::string v = check.substr(name.size() + 1);
    if (!v.empty() && v.size() < 7 && v.find_first_not_of("0123456789") == std::string::npos && std::stoi(v) >= 1)
      return std::stoi(v);
  }
  throw InputError(fmt::format("--check {}: the check is chunked-prefill or chunked-prefill=C (C a whole number >= 1)", check));
}

// The largest rel L2 the invariance checks pass with: 0 for the CPU backend, whose sums do not depend on
// how many tokens a step takes (DESIGN.md, the reference's summation order). The CUDA engine's GEMMs
// sum in another order at another T (cuBLAS at T > 1, the GEMV at T = 1), so its bounds are 4x the worst
// measured on the H200 with the full SmolLM2-135M-Instruct Q4_1 over the built-in corpus (100 prompts x 8
// steps; chunks of 1 and 8 tokens at f32, 1, 4, 8 and 16 at f16): f32 4.6e-6, f16 3.5e-3 (README.md).
double invariance_bound(const BackendOptions& eng) {
  if (eng.backend == "cpu") return 0;
  return eng.precision == "f16" ? 0.015 : 2e-5;
}

// The layout of a logits row, as the vocabulary declares result_output's.
const char* logits_layout() { return find_checkpoint_kind("result_output")->layout; }

InvarianceCheck invariance(const std::vector<float>& a, const std::vector<float>& b, double bound) {
  InvarianceCheck c;
  if (a.size() != b.size() || a.empty()) return {NAN, NAN, false};
  const int64_t V = static_cast<int64_t>(a.size());
  const int64_t shape[2] = {1, V};
  const diff::TensorMetrics m = diff::compute_metrics(a, b, shape, logits_layout(), {}, {});
  const diff::LogitMetrics lm = diff::compute_logit_metrics(a, b, 1, V);
  c.rel_l2 = m.rel_l2;
  c.kl = lm.kl.empty() ? NAN : lm.kl.front();
  c.pass = m.finite() && c.rel_l2 <= bound;
  return c;
}

// An outside engine (--engine-cmd): the command with {reference} and {out} replaced, run by /bin/sh.
struct EngineCommand {
  std::string tmpl;
  std::string dir;  // the sweep's scratch directory (removed at the end)

  // Runs it on `reference`, writing `out`; throws Error with its exit status and the end of its output.
  void run(const std::string& reference, const std::string& out, const std::string& id) const {
    std::string cmd = tmpl;
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"{reference}", reference}, {"{out}", out}}) {
      for (size_t at = cmd.find(key); at != std::string::npos; at = cmd.find(key, at + value.size()))
        cmd.replace(at, key.size(), value);
    }
    const std::string log = out + ".log";
    const int status = std::system(fmt::format("{} > '{}' 2>&1", cmd, log).c_str());
    if (status != 0) {
      std::ifstream in(log);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
      throw Error(fmt::format("--engine-cmd failed on prompt {} (exit status {}): {}\n{}", id,
                              WIFEXITED(status) ? WEXITSTATUS(status) : status, cmd, text));
    }
  }
};

// A reference run of `ids` recorded into a dump at `path` (the checkpoints `filter` keeps; logits_rows 1
// keeps each step's last logits row): what an outside engine reads its tokens from. `fed`: the decode steps' tokens
// (else its own greedy ones).
void reference_dump(const GgufFile& file, Backend& ref, const std::vector<int32_t>& ids, int steps,
                    const CheckpointFilter& filter, int64_t logits_rows, const std::string& path,
                    const std::vector<int32_t>& fed = {}) {
  ref.reset();
  DumpWriterOptions w;
  w.logits_rows = logits_rows;
  DumpWriter writer(path, dump_meta(file, ref, "", ids), filter, w);
  const StepsResult r = run_steps(ref, ids, steps, fed, writer);
  set_run_attributes(writer, r, ref);
  writer.finish();
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

// The first bound of `checks` that failed, as "rel_l2 5.1e-03 > max_rel_l2 4.4e-03"; "" when all passed.
std::string first_failed_bound(const std::vector<diff::BoundCheck>& checks) {
  for (const diff::BoundCheck& c : checks)
    if (!c.pass)  // a min_ bound fails below its limit, the others above
      return fmt::format("{} {:.3g} {} {} {:.3g}", c.metric, c.value, c.bound.rfind("min_", 0) == 0 ? "<" : ">", c.bound,
                         c.limit);
  return "";
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
      t.bad = true, t.kl = NAN, t.top5 = 0, t.max_abs = NAN, t.rel_l2 = NAN;
      t.why = fmt::format("the engine's row has {} logits, the reference's {}", a.size(), V);
      t.engine = s < eng.argmax.size() ? eng.argmax[s] : -1, t.reference = s < ref.argmax.size() ? ref.argmax[s] : -1;
      out.push_back(t);
      continue;
    }
    const int64_t shape[2] = {1, V};
    diff::TensorMetrics m = diff::compute_metrics(a, b, shape, logits_layout(), dims, rule.element);
    m.logits = diff::compute_logit_metrics(a, b, 1, V);
    const int64_t positions = prompt_len + static_cast<int64_t>(s);
    const double scale = tol.length_scale(positions) * tol.reduction_scale("result_output", dims);
    const std::vector<diff::BoundCheck> checks = diff::check_bounds(m, rule, positions, scale);
    t.why = first_failed_bound(checks);
    t.bad = !t.why.empty();
    t.kl = m.logits->kl.empty() ? NAN : m.logits->kl.front();
    t.top5 = m.logits->top5_overlap;
    t.max_abs = m.max_abs;
    t.rel_l2 = m.rel_l2;
    const int32_t own = diff::argmax(a);  // the engine's logits' argmax, a full pass over the row
    t.engine = s < eng.argmax.size() ? eng.argmax[s] : own;
    t.reference = s < ref.argmax.size() ? ref.argmax[s] : diff::argmax(b);
    // The engine's own choice against its own logits (compare's rule argmax), as in a full run.
    if (t.engine >= 0 && t.engine != own) {
      if (!t.bad) t.why = fmt::format("the engine picked {}, not its logits' argmax {}", t.engine, own);
      t.bad = true;
    }
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

// The first divergence and verdict of a comparison, as a drill-down reports them.
DrillResult drill_result(const diff::Comparison& c, int steps) {
  DrillResult d;
  d.ran = true;
  d.steps = steps;
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
  std::vector<diff::Comparison> c = run_pipeline(cx.file, cx.cfg, {pp}, ids, popt, quiet);
  if (cx.cfg.moe) follow_routing_drift(cx.file, cx.cfg, {pp}, ids, fed_tokens(c.front()), popt, c, quiet);
  DrillResult d = drill_result(c.front(), steps);
  d.routing_followed = static_cast<int>(c.front().routing.followed.size());
  return d;
}

// An outside engine's dump against the reference's, compared as `diffrun compare` would.
diff::Comparison compare_files(const std::string& engine, const std::string& reference, const ReportOptions& opt) {
  const DumpReader e(engine), r(reference);
  return diff::compare_dumps(e, r, tolerances_for(e.meta(), r.meta(), opt), compare_options(opt));
}

// The per-token figures from an outside engine's dump: its result_output at each step against the
// reference's last logits row (the comparison's metrics, rule and argmax check).
std::vector<TokenStat> token_stats_of(const diff::Comparison& c, int steps) {
  std::vector<TokenStat> out;
  for (int step = 0; step <= steps; ++step) {
    TokenStat t;
    t.step = step;
    t.bad = true, t.kl = NAN, t.top5 = 0, t.max_abs = NAN, t.rel_l2 = NAN;  // unless the engine's dump has the step's logits
    t.why = "the engine's dump has no logits for the step";
    for (const diff::CheckpointResult& r : c.results) {
      if (r.step != step || r.base != "result_output" || !r.metrics || !r.metrics->logits) continue;
      const diff::LogitMetrics& lm = *r.metrics->logits;
      t.bad = r.failed();
      t.why = first_failed_bound(r.checks);
      if (t.bad && t.why.empty()) t.why = "the logits' shapes differ";
      t.kl = lm.kl.empty() ? NAN : lm.kl.back();
      t.top5 = lm.top5_overlap;
      t.max_abs = r.metrics->max_abs;
      t.rel_l2 = r.metrics->rel_l2;
      t.engine = lm.argmax_a.empty() ? -1 : lm.argmax_a.back();
      t.reference = lm.argmax_b.empty() ? -1 : lm.argmax_b.back();
    }
    if (step < static_cast<int>(c.tokens.size()) && c.tokens[step].engine >= 0) t.engine = c.tokens[step].engine;
    out.push_back(t);
  }
  return out;
}

// The shortest token prefix, then the fewest steps, whose drill-down still first fails at `target`
// (bisection: a shorter prefix that fails there is kept). Returns {ids, steps}.
using DrillFn = std::function<DrillResult(const std::vector<int32_t>& ids, int steps)>;

std::pair<std::vector<int32_t>, int> minimize(const DrillContext& cx, const DrillFn& drill, std::vector<int32_t> ids,
                                              int steps, const std::string& target) {
  const auto fails = [&](const std::vector<int32_t>& p, int s) { return drill(p, s).checkpoint == target; };
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

// The report files are checked before anything loads, so a bad path costs nothing.
void check_report_files(const ReportOptions& report) {
  if (!report.report_json.empty()) check_output_file("--report-json", report.report_json);
  if (!report.report_junit.empty()) check_output_file("--report-junit", report.report_junit);
}

// The prompts to run, tokenized, and the most positions one of them needs.
struct PlannedPrompts {
  std::vector<PromptResult> todo;
  int64_t longest = 0;
};

// Every prompt's ids first: a bad line is refused before anything runs; a prompt longer than the model's
// context is skipped (report.skipped, and a message says so).
PlannedPrompts tokenize_prompts(const SweepOptions& o, const GgufFile& file, const Tokenizer& tok,
                                const ModelConfig& cfg, const std::vector<SweepPrompt>& prompts, SweepReport& report,
                                Progress& progress) {
  PlannedPrompts plan;
  for (const SweepPrompt& p : prompts) {
    PromptOptions po;
    po.chat = p.chat.value_or(o.chat);
    po.system = o.system;
    po.tmpl = o.tmpl;
    if (p.tokens.empty()) po.prompt = p.text;
    else po.tokens = fmt::format("{}", fmt::join(p.tokens, ","));
    PromptResult r;
    try {
      r.ids = prompt_tokens(file, tok, po);
    } catch (const InputError& e) {
      throw InputError(fmt::format("{} ({}): {}", report.corpus, p.id, e.what()));
    }
    r.steps = p.steps >= 0 ? p.steps : o.steps;
    if (static_cast<int64_t>(r.ids.size()) + r.steps > cfg.n_ctx) {  // skipped, and the report says so
      report.skipped.push_back(fmt::format("{} ({} prompt tokens plus {} steps)", p.id, r.ids.size(), r.steps));
      continue;
    }
    plan.longest = std::max<int64_t>(plan.longest, static_cast<int64_t>(r.ids.size()) + r.steps);
    r.prompt = p;
    plan.todo.push_back(std::move(r));
  }
  if (!report.skipped.empty())
    progress.message(fmt::format("{} prompt{} longer than the model's context of {} skipped: {}", report.skipped.size(),
                                 report.skipped.size() == 1 ? "" : "s", cfg.n_ctx, fmt::join(report.skipped, ", ")));
  if (plan.todo.empty())
    throw InputError(fmt::format("{}: no prompt fits the model's context of {} positions", report.corpus, cfg.n_ctx));
  return plan;
}

// The pair's two sides (an outside engine's side is described by the CPU backend's options) and the
// report's line naming them.
void set_up_pair(const SweepOptions& o, bool outside, DrillContext& cx, SweepReport& report) {
  cx.eng.backend = outside ? "cpu" : engine_backend(o, cx.progress);
  cx.eng.precision = o.engine_precision;
  cx.eng.inject = o.inject;
  cx.ref.backend = "cpu";
  cx.ref.precision = o.reference_precision.empty() ? default_reference_precision(o.engine_precision) : o.reference_precision;
  if (!outside && cx.eng.backend == "cpu" && cx.eng.precision == "f16")
    throw InputError("the CPU backend computes in f32 or f64; --engine-precision f16 needs the CUDA engine (--engine cuda)");
  report.pair = outside ? fmt::format("outside engine `{}` vs cpu/{} reference", o.engine_cmd, cx.ref.precision)
                        : fmt::format("{}/{} engine vs cpu/{} reference", cx.eng.backend, cx.eng.precision, cx.ref.precision);
}

// Concurrent prompts: --jobs, else one per 4 cores (1 on fewer than 8 cores, with an outside engine, and
// for models over 2 GB: each job holds its own reference's weights); never more than the prompts.
int sweep_jobs(const SweepOptions& o, bool outside, size_t prompts, Progress& progress) {
  int jobs = o.jobs > 0 ? o.jobs : std::max(1, available_cores() / 4);
  if (outside || (o.jobs <= 0 && std::filesystem::file_size(o.model) > (uint64_t(2) << 30))) jobs = 1;
  jobs = std::min<int>(jobs, static_cast<int>(prompts));
  if (jobs > 1) progress.message(fmt::format("{} prompts at once", jobs));
  return jobs;
}

// An outside engine reads a reference dump and writes its own, in a scratch directory of the sweep
// (created only for an outside engine, removed with what it holds at the end).
class Scratch {
 public:
  explicit Scratch(bool create) {
    if (!create) return;
    dir_ = (std::filesystem::temp_directory_path() / ("diffrun-sweep-" + new_run_id())).string();
    std::filesystem::create_directories(dir_);
  }
  ~Scratch() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  const std::string& dir() const { return dir_; }
  std::string file(const std::string& name) const { return (std::filesystem::path(dir_) / name).string(); }

 private:
  std::string dir_;
};

// Phase 1's pair: one reference per job, a CPU engine per job or one CUDA engine shared under a lock (the
// references are the slow side), an outside engine's command, and what the logits are judged by.
class LogitsRunner {
 public:
  LogitsRunner(const SweepOptions& o, const DrillContext& cx, bool outside, int64_t longest)
      : o_(o), cx_(cx), outside_(outside), longest_(static_cast<int>(longest)) {
    refs_.push_back(make_backend(cx.file, cx.cfg, cx.ref, longest_));
    engs_.push_back(outside ? nullptr : make_backend(cx.file, cx.cfg, cx.eng, longest_));
    if (!outside)
      tol_ = tolerances_for(dump_meta(cx.file, *engs_.front(), "", {}), dump_meta(cx.file, *refs_.front(), "", {}),
                            o.report);
    dims_ = diff::dim_sizes(cx.cfg);
  }

  // The invariance check's chunk (0: none) and bound; the outside engine's command and scratch directory.
  void set_check(int chunk, double bound) { chunk_ = chunk, bound_ = bound; }
  void set_command(const EngineCommand& command, const Scratch& scratch) { command_ = command, scratch_ = &scratch; }

  // The backends of jobs 1..jobs-1 (a CUDA engine is not duplicated).
  void add_jobs(int jobs) {
    for (int j = 1; j < jobs; ++j) {
      refs_.push_back(make_backend(cx_.file, cx_.cfg, cx_.ref, longest_));
      if (cx_.eng.backend == "cpu") engs_.push_back(make_backend(cx_.file, cx_.cfg, cx_.eng, longest_));
    }
  }

  Backend& reference(int job) { return *refs_[job]; }
  // Job j's own engine: a CPU engine per job; nullptr where several jobs share one CUDA engine.
  Backend* own_engine(int job, int jobs) { return cx_.eng.backend == "cpu" || jobs == 1 ? engs_[job].get() : nullptr; }
  // After phase 1 the engine goes, and the reference too unless an outside engine's drill-down needs it
  // (the pipeline of a drill-down loads its own).
  void release_first() {
    engs_.front().reset();
    if (!outside_) refs_.front().reset();
  }

  // One prompt's per-token figures (and the invariance checks), on reference `rb`.
  void run_prompt(PromptResult& r, Backend& rb, Backend* own_engine) {
    if (outside_) return run_outside(r, rb);
    NullSink none;
    rb.reset();
    const StepsResult rr = run_steps(rb, r.ids, r.steps, {}, none, true);
    const std::vector<int32_t> fed(rr.tokens.begin() + static_cast<std::ptrdiff_t>(r.ids.size()), rr.tokens.end());
    std::unique_lock shared(engine_lock_, std::defer_lock);
    if (!own_engine) shared.lock();
    Backend& e = own_engine ? *own_engine : *engs_.front();
    e.reset();
    const StepsResult er = run_steps(e, r.ids, r.steps, fed, none, true);
    r.tokens = token_stats(er, rr, tol_, dims_, static_cast<int64_t>(r.ids.size()));
    if (chunk_ > 0) check_invariance(r, e, er, fed);
  }

  // The drill-down of an outside engine: a reference dump of every checkpoint, the command, the comparison. A
  // mixture of experts: then the reference again, fed the same tokens, taking the engine's experts at its routing
  // flips by drift at or before the first divergence (flips_to_follow, as the job and dump --follow-routing do),
  // until none is left to follow; the engine runs once.
  DrillResult drill_outside(const std::vector<int32_t>& ids, int steps) {
    const std::string rpath = scratch_->file("drill-reference.h5"), epath = scratch_->file("drill-engine.h5");
    reference_dump(cx_.file, *refs_.front(), ids, steps, CheckpointFilter(), 0, rpath);
    command_.run(rpath, epath, "drill-down");
    diff::Comparison c = compare_files(epath, rpath, o_.report);
    if (cx_.cfg.moe) {
      const std::vector<int32_t> all = DumpReader(rpath).int_attribute(attr::all_token_ids);
      const std::vector<int32_t> fed(all.begin() + static_cast<std::ptrdiff_t>(ids.size()), all.end());
      const std::string followed_path = scratch_->file("drill-reference-followed.h5");
      std::vector<diff::RoutingFlip> followed;
      follow_flips(c, followed, [&](const std::vector<diff::RoutingFlip>& so_far,
                                    const std::vector<diff::RoutingFlip>&) {
        BackendOptions bo = cx_.ref;
        bo.forced_routing = forced_routing(so_far);
        auto ref = make_backend(cx_.file, cx_.cfg, bo, longest_);
        reference_dump(cx_.file, *ref, ids, steps, CheckpointFilter(), 0, followed_path, fed);
        return compare_files(epath, followed_path, o_.report);
      });
    }
    DrillResult d = drill_result(c, steps);
    d.routing_followed = static_cast<int>(c.routing.followed.size());
    return d;
  }

 private:
  void run_outside(PromptResult& r, Backend& rb) {
    const std::string rpath = scratch_->file("reference.h5"), epath = scratch_->file("engine.h5");
    reference_dump(cx_.file, rb, r.ids, r.steps, CheckpointFilter("result_output"), 1, rpath);
    command_.run(rpath, epath, r.prompt.id);
    r.tokens = token_stats_of(compare_files(epath, rpath, o_.report), r.steps);
  }

  // The engine against itself: its prefill in chunks against the whole, its last decode step against a
  // prefill of every token it was fed.
  void check_invariance(PromptResult& r, Backend& e, const StepsResult& er, const std::vector<int32_t>& fed) {
    NullSink none;
    e.reset();
    std::vector<float> last;
    int step = 0;
    for (size_t at = 0; at < r.ids.size(); at += static_cast<size_t>(chunk_)) {
      const size_t n = std::min(static_cast<size_t>(chunk_), r.ids.size() - at);
      last = e.forward(step++, std::span<const int32_t>(r.ids).subspan(at, n), none);
    }
    r.chunked = invariance(last, er.last_logits.front(), bound_);
    if (r.steps > 0) {
      std::vector<int32_t> all = r.ids;
      all.insert(all.end(), fed.begin(), fed.end());
      e.reset();
      r.reprefill = invariance(er.last_logits.back(), e.forward(0, all, none), bound_);
    }
  }

  const SweepOptions& o_;
  const DrillContext& cx_;
  const bool outside_;
  const int longest_;
  std::vector<std::unique_ptr<Backend>> refs_, engs_;
  diff::ToleranceSet tol_;
  diff::DimSizes dims_;
  int chunk_ = 0;
  double bound_ = 0;
  EngineCommand command_;
  const Scratch* scratch_ = nullptr;
  std::mutex engine_lock_;
};

// The order the jobs take the prompts in: the longest first (positions run: prompt ids plus steps), so that
// a long document does not start last and leave the other jobs idle at the end; ties in corpus order.
std::vector<size_t> longest_first(const std::vector<PromptResult>& todo) {
  std::vector<size_t> order(todo.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto cost = [&](size_t i) { return todo[i].ids.size() + static_cast<size_t>(std::max(todo[i].steps, 0)); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost(a) > cost(b); });
  return order;
}

// Phase 1: every prompt on `jobs` threads, each with its own reference, the longest first; results are
// reported in corpus order, `write_reports` after each prompt. The first failure stops the others and is
// rethrown.
void run_prompts(LogitsRunner& runner, const std::vector<PromptResult>& todo, int jobs, SweepReport& report,
                 Progress& progress, const std::function<void()>& write_reports) {
  std::mutex report_lock;
  std::vector<std::optional<PromptResult>> done(todo.size());
  const std::vector<size_t> order = jobs > 1 ? longest_first(todo) : std::vector<size_t>{};
  size_t next = 0, finished = 0;
  std::exception_ptr failure;
  const int threads_each = std::max(1, available_cores() / jobs);
  const auto worker = [&](int j) {
    omp_set_num_threads(threads_each);
    Backend* own_engine = runner.own_engine(j, jobs);
    for (;;) {
      size_t i;
      {
        std::lock_guard lock(report_lock);
        if (next >= todo.size() || failure) return;
        i = order.empty() ? next : order[next];
        ++next;
      }
      PromptResult r = todo[i];
      try {
        runner.run_prompt(r, runner.reference(j), own_engine);
      } catch (...) {
        std::lock_guard lock(report_lock);
        if (!failure) failure = std::current_exception();
        return;
      }
      std::lock_guard lock(report_lock);
      done[i] = std::move(r);
      ++finished;
      progress.update("prompt", static_cast<int>(finished), static_cast<int>(todo.size()));
      report.results.clear();
      for (const std::optional<PromptResult>& d : done)
        if (d) report.results.push_back(*d);
      write_reports();
    }
  };
  {
    std::vector<std::jthread> pool;
    for (int j = 1; j < jobs; ++j) pool.emplace_back(worker, j);
    worker(0);
  }
  if (failure) std::rethrow_exception(failure);
}

// Phase 2: the worst prompts with a bad token (every one: every_bad_prompt), every checkpoint, up to that token plus
// the margin.
void drill_worst(const SweepOptions& o, const DrillFn& drill, SweepReport& report, Progress& progress,
                 const std::function<void()>& write_reports, bool every_bad_prompt) {
  for (size_t i : worst_prompts(report.results, every_bad_prompt ? INT_MAX : o.drill)) {
    PromptResult& r = report.results[i];
    const int bad = r.first_bad();
    if (bad < 0) continue;
    progress.message(fmt::format("drill-down: {} (bad from step {}), every checkpoint", r.prompt.id, bad));
    // every_bad_prompt (a mixture of experts): every step, so that a drill-down that followed routing flips and
    // found nothing explains all the prompt's bad tokens.
    r.drill = drill(r.ids, every_bad_prompt ? r.steps : std::min(r.steps, bad + o.margin));
    write_reports();
  }
}

// The command that re-runs a minimized problem: the main job's, or for an outside engine the reference
// dump, the engine's command and `diffrun compare`.
std::string minimized_command(const SweepOptions& o, const DrillContext& cx, const std::vector<int32_t>& ids,
                              int steps) {
  if (!o.engine_cmd.empty())
    return fmt::format("diffrun dump --backend cpu --precision {} --model {} --tokens {} --steps {} "
                       "--out reference.h5; then {} and diffrun compare on them",
                       cx.ref.precision, o.model, fmt::join(ids, ","), steps, o.engine_cmd);
  return fmt::format("diffrun --model {} --tokens {} --steps {}{}{}", o.model, fmt::join(ids, ","), steps,
                     o.inject.empty() ? "" : " --inject " + o.inject, o.engine == "auto" ? "" : " --engine " + o.engine);
}

int run_sweep(const SweepOptions& o) {
  Progress progress("diffrun sweep");
  check_report_files(o.report);
  std::vector<SweepPrompt> prompts = o.prompts.empty() ? parse_sweep_prompts(sweep_default_corpus(), kSweepDefaultCorpusName)
                                                       : load_sweep_prompts(o.prompts);
  const size_t planned = prompts.size();
  if (o.limit > 0 && static_cast<size_t>(o.limit) < prompts.size()) prompts.resize(o.limit);
  progress.message(fmt::format("loading {}", o.model));
  const auto file = GgufFile::open(o.model);
  const ModelConfig cfg = load_config(*file);
  validate_tensors(*file, cfg);
  const auto tok = load_tokenizer(*file);

  SweepReport report;
  report.model = o.model;
  report.corpus = o.prompts.empty() ? kSweepDefaultCorpusName : o.prompts;
  report.planned = static_cast<int>(planned);
  const PlannedPrompts plan = tokenize_prompts(o, *file, *tok, cfg, prompts, report, progress);

  DrillContext cx{*file, cfg, {}, {}, o.report, progress};
  const bool outside = !o.engine_cmd.empty();
  set_up_pair(o, outside, cx, report);
  const CheckpointFilter everything;
  if (!outside) check_run_options(*file, cfg, cx.eng, everything, true);
  check_run_options(*file, cfg, cx.ref, everything, true);
  omp_set_num_threads(available_cores());
  LogitsRunner runner(o, cx, outside, plan.longest);
  const int jobs = sweep_jobs(o, outside, plan.todo.size(), progress);
  report.chunk = chunk_of(o.check);
  report.invariance_bound = invariance_bound(cx.eng);
  if (report.chunk > 0 && outside)
    throw InputError("--check needs diffrun's engine: an outside engine runs each prompt as one command");
  runner.set_check(report.chunk, report.invariance_bound);
  const Scratch scratch(outside);
  runner.set_command(EngineCommand{o.engine_cmd, scratch.dir()}, scratch);
  const DrillFn drill = [&](const std::vector<int32_t>& ids, int steps) {
    return outside ? runner.drill_outside(ids, steps) : drill_down(cx, ids, steps);
  };

  // Phase 1: every prompt, logits only. The JSON report is rewritten after each prompt, marked
  // incomplete until the end, so a killed sweep leaves what it measured.
  const std::function<void()> write_reports = [&] {
    if (!o.report.report_json.empty()) write_text_file(o.report.report_json, render_sweep_json(report), "JSON", true);
    if (!o.report.report_junit.empty())
      write_text_file(o.report.report_junit, render_sweep_junit(report), "JUnit", true);
  };
  report.complete = false;
  runner.add_jobs(jobs);
  run_prompts(runner, plan.todo, jobs, report, progress, write_reports);
  progress.finish();
  runner.release_first();

  // Phase 2: the drill-downs, then the first problem minimized.
  // A mixture of experts' bad tokens may be routing flips by drift, which only a drill-down (following them) tells
  // from a bug: every prompt with a bad token is drilled, not only the --drill worst (diffrun's engine: the main
  // job's pipeline; an outside engine: drill_outside).
  drill_worst(o, drill, report, progress, write_reports, cx.cfg.moe);
  const std::vector<SweepProblem> groups = group_problems(report.results);
  if (o.minimize && !groups.empty() && !groups.front().checkpoint.empty()) {
    const PromptResult& r = report.results[groups.front().prompts.front()];
    const auto [ids, steps] = minimize(cx, drill, r.ids, r.drill->steps, groups.front().checkpoint);
    report.minimized = minimized_command(o, cx, ids, steps);
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
      app.add_option("--jobs,-j", o->jobs,
                     "Prompts at once, each with its own reference (default: one per 4 cores; 1 for an outside engine "
                     "or a model over 2 GB)")
          ->check(count_in(1, 256));
      app.add_option("--check", o->check,
                     "chunked-prefill[=C]: also check the engine against itself: the prefill in chunks of C tokens "
                     "(default 8) against the whole prefill, and the last decode step against a prefill of the same "
                     "tokens (CPU: bit for bit; CUDA: rel_l2 2e-5 at f32, 0.015 at f16)");
      app.add_option("--engine-cmd", o->engine_cmd,
                     "An outside engine instead of diffrun's: a shell command containing {reference} and {out}, run per "
                     "prompt on a reference dump (read the step tokens from it) to write the engine's dump at {out}");
      app.add_option("--tolerances", o->report.tolerances, "Tolerance rules (default: the pair's preset)");
      app.add_option("--report-json", o->report.report_json,
                     "Write the sweep report as JSON (rewritten after each prompt; \"complete\": false until the end)");
      app.add_option("--report-junit", o->report.report_junit, "Write JUnit XML: one case per prompt, one per problem");
      return [o]() {
        if (!o->engine_cmd.empty() && (o->engine_cmd.find("{reference}") == std::string::npos ||
                                       o->engine_cmd.find("{out}") == std::string::npos))
          throw InputError("--engine-cmd must contain {reference} and {out}, e.g. \"my_engine --reference {reference} "
                           "--out {out}\"");
        if (!o->engine_cmd.empty() && !o->inject.empty())
          throw InputError("--inject changes diffrun's engine: with --engine-cmd seed the fault in the outside engine");
        return run_sweep(*o);
      };
    }};

}  // namespace
}  // namespace diffrun::cli
