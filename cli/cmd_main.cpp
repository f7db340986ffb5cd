// `diffrun --prompt P`: run the reference, then the engine on the same tokens (per precision pair), compare, report, exit 0/1/2.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "checkpoints/dump_schema_names.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "cli/diff_report.hpp"
#include "cli/interrupt.hpp"
#include "cli/pipeline.hpp"
#include "cli/progress.hpp"
#include "cli/run.hpp"
#include "diff/compare.hpp"
#include "dump/dump.hpp"
#include "dump/dump_size.hpp"
#include "dump/replay_sink.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#ifdef DIFFRUN_HAVE_CUDA
#include "engine/engine.hpp"
#endif

namespace diffrun::cli {
namespace {

struct MainOptions {
  std::string model;
  PromptOptions prompt;
  int steps = 8;
  std::string engine = "auto";
  std::string engine_precision;     // empty: on cuda both pairs (f32 and f16), on cpu f32
  std::string reference_precision;  // empty: default_reference_precision of the engine's
  std::string out = "diffrun-out";
  std::string checkpoints;
  std::string inject;    // faults injected into the engine side
  int tp = 1;            // the engine tensor-parallel over this many GPUs (engine/tp_engine.hpp)
  bool no_tp_invariance = false;  // with tp > 1 and both default pairs: no third pair (the f32 engine at tp
                                  // against one GPU)
  bool isolate = false;  // also run the engine in isolation replay (local error per checkpoint)
  std::string dump = "full";  // full, divergence or none
  int stop_at_first = -1;     // >= 0: end the run this many steps after the first divergence
  int threads = 0;            // OpenMP threads of each reference; 0: the cores the engine side leaves
  bool remove_stale = false;  // remove the temporaries killed runs left in --out
  bool no_recording_check = false;  // skip the CUDA engine's unrecorded rerun (PipelineOptions::recording_check)
  DumpSizeOptions size;
  ReportOptions report;
};

// Whether a CUDA device exists, asked once at the start on a thread of its own (the driver takes
// ~0.1 s to answer), which then makes the device's context (several tenths) while the model loads.
// A second thread opens cuBLAS meanwhile (60-100 ms; engine/cublas_api.cuh).
class DeviceProbe {
 public:
  explicit DeviceProbe(const MainOptions& o) {
#ifdef DIFFRUN_HAVE_CUDA
    if (o.engine != "auto" && o.engine != "cuda") return;
    libraries_ = std::jthread([] { cuda_preload_libraries(); });
    thread_ = std::jthread([this] {
      std::string why;
      const bool available = cuda_device_available(&why);
      answer_.set_value({available, why});
      if (available) cuda_warm_up();
    });
    future_ = answer_.get_future();
#else
    (void)o;
#endif
  }
  // A device exists; else false and `why` says why not.
  bool available(std::string* why) {
    if (!future_.valid()) {
      *why = "diffrun was built without the CUDA engine";
      return false;
    }
    const auto [ok, reason] = future_.get();
    if (!ok) *why = reason;
    return ok;
  }

 private:
  std::promise<std::pair<bool, std::string>> answer_;
  std::future<std::pair<bool, std::string>> future_;
  std::jthread libraries_;
  std::jthread thread_;  // last: joined (the context made) before the promise goes
};

// The engine backend: cuda when asked or (auto) when built with it and a device exists.
std::string engine_backend_name(const MainOptions& o, DeviceProbe& probe, std::string* why) {
  if (o.engine != "auto") return o.engine;
  return probe.available(why) ? "cuda" : "cpu";
}

// One engine/reference pair to run and compare; `dir` holds its dumps.
struct RunPair {
  std::string title;
  BackendOptions eng, ref;
  std::string dir;
  bool isolate = false;  // also the isolation replay (its local errors judged by the pair's _local preset)
};

// The pairs to run. On cuda with neither precision given, two: the f32 engine against the f64
// reference (logic: ~1e-6 bounds, any bug shows) and the f16 engine against the reference that
// emulates its f16 storage (precision: bounds 10x tighter than against a plain f32 reference). Else
// one: the given engine precision (f16 on cuda, f32 on cpu) against the given reference precision
// (default_reference_precision: f32-f16store for f16, f64 for the rest). A pair against an emulated
// f16 storage reference (-f16store) runs the isolation replay too.
std::vector<RunPair> run_pairs(const MainOptions& o, DeviceProbe& probe, Progress& progress) {
  if (o.isolate && !o.checkpoints.empty()) {
    throw InputError("--isolate needs every checkpoint: with --checkpoints the replay would replace only those, and "
                     "each local error would span the ops between two of them (drop one of the two options)");
  }
  std::string why;
  const std::string backend = engine_backend_name(o, probe, &why);
  auto pair = [&](const std::string& title, const std::string& eng_precision, const std::string& ref_precision,
                  const std::string& dir) {
    RunPair p;
    p.eng.backend = backend;
    p.eng.precision = eng_precision;
    p.eng.inject = o.inject;
    p.eng.tp = o.tp;
    p.ref.backend = "cpu";
    p.ref.precision = ref_precision;
    p.title = fmt::format("{}: {}/{} engine vs cpu/{} reference", title, backend, eng_precision, ref_precision);
    p.dir = dir;
    // Against the reference that emulates the f16 storage, each op's local error is what reaches the
    // f16 path's bugs (the accumulated one saturates near the f16 roundoff after a few layers): the
    // isolation replay always runs there (DESIGN.md, Precision), unless --checkpoints records only
    // some: replacing those alone, a replay would measure the chain of ops between two of them
    // against one op's tolerance (a false LOCAL).
    p.isolate = o.isolate || (ref_precision.ends_with("-f16store") && o.checkpoints.empty());
    if (o.tp > 1 && p.isolate) {
      // The replay would hand each rank the reference's whole tensor where the rank holds a slice or a partial sum.
      if (o.isolate) throw InputError("--isolate: the isolation replay runs on one GPU, not with --tp");
      p.isolate = false;
      progress.message(fmt::format("the {} pair runs without the isolation replay at --tp {} (it replays on one GPU "
                                   "only), so its verdicts come from the jump rule",
                                   title, o.tp));
    }
    else if (ref_precision.ends_with("-f16store") && !p.isolate) {
      progress.message(fmt::format("the {} pair runs without the isolation replay: --checkpoints records only some "
                                   "checkpoints, so its verdicts come from the jump rule",
                                   title));
    }
    if (p.eng.backend == "cpu" && p.eng.precision == "f16") {
      throw InputError("the CPU backend computes in f32 or f64; --engine-precision f16 needs the CUDA engine (--engine cuda)");
    }
    if (p.eng.backend == "cuda" && p.eng.precision != "f16" && p.eng.precision != "f32") {
      throw InputError("the CUDA engine computes in f16 or f32, not " + p.eng.precision);
    }
    return p;
  };
  if (backend == "cuda" && o.engine_precision.empty() && o.reference_precision.empty()) {
    std::vector<RunPair> pairs = {pair("logic", "f32", "f64", (std::filesystem::path(o.out) / "logic").string()),
                                  pair("precision", "f16", default_reference_precision("f16"),
                                       (std::filesystem::path(o.out) / "precision").string())};
    if (o.tp > 1 && !o.no_tp_invariance) {
      // TP invariance: the f32 engine at --tp N against itself on one GPU (DESIGN.md, "Tensor parallelism").
      RunPair p = pair("tp", "f32", "f32", (std::filesystem::path(o.out) / "tp").string());
      p.ref.backend = "cuda";
      p.ref.tp = 1;
      p.ref.inject.clear();
      p.isolate = false;
      p.title = fmt::format("tp invariance: cuda/f32 engine at --tp {} vs cuda/f32 engine on one GPU", o.tp);
      pairs.push_back(p);
    }
    return pairs;
  }
  const std::string eng_precision = o.engine_precision.empty() ? (backend == "cuda" ? "f16" : "f32") : o.engine_precision;
  const std::string ref_precision =
      o.reference_precision.empty() ? default_reference_precision(eng_precision) : o.reference_precision;
  if (o.engine == "auto" && backend == "cpu") {
    progress.message(fmt::format("no CUDA engine ({}): the engine side is the CPU backend at {} against an {} reference",
                                 why, eng_precision, ref_precision));
  }
  return {pair(eng_precision == "f16" ? "precision" : "logic", eng_precision, ref_precision, o.out)};
}

// Runs `backend_opt` on the prompt, teacher-forced with `forced` unless empty, into a dump at `path`
// (through isolation replay of `replay_of` when given). `reuse`, when given, is an engine of the same
// options already loaded (the pipeline's): reset and run instead of loading another.
StepsResult run_backend(const GgufFile& file, const ModelConfig& cfg, const BackendOptions& backend_opt,
                        const std::string& role, const std::vector<int32_t>& ids, const MainOptions& o,
                        const std::string& prompt, const CheckpointFilter& filter, const DumpWriterOptions& wopt,
                        const std::vector<int32_t>& forced, int steps,
                        const std::string& path, const std::string& run_id, Progress& progress,
                        const std::string& replay_of = {}, std::unique_ptr<Backend> reuse = {}) {
  const int64_t needed = static_cast<int64_t>(ids.size()) + steps;
  std::unique_ptr<Backend> backend = std::move(reuse);
  if (backend && backend->max_ctx() >= needed) {
    backend->reset();
  } else {
    backend = make_backend(file, cfg, backend_opt, static_cast<int>(needed));
  }
  // Every dump of the run carries its id, so compare refuses a new reference beside an interrupted run's old engine.
  DumpMeta meta = dump_meta(file, *backend, prompt, ids);
  meta.facts[attr::run_id] = run_id;
  const TempGuard guard(path);
  DumpWriter writer(path, meta, filter, wopt);
  const std::string what = fmt::format("{} {}/{} step", role, backend_opt.backend, backend_opt.precision);
  auto on_step = [&](int step, int total) { progress.update(what, step + 1, total + 1); };
  StepsResult r;
  if (replay_of.empty()) {
    r = run_steps(*backend, ids, steps, forced, writer, false, on_step);
  } else {
    const DumpReader reference(replay_of);
    ReplaySink replay(writer, reference);
    r = run_steps(*backend, ids, steps, forced, replay, false, on_step);
  }
  set_run_attributes(writer, r, *backend);
  writer.finish();
  progress.finish();
  return r;
}

// The output directory and report files are checked before anything loads.
void check_outputs(const MainOptions& o) {
  check_output_dir("--out", o.out);
  if (!o.report.report_json.empty()) check_output_file("--report-json", o.report.report_json);
  if (!o.report.report_junit.empty()) check_output_file("--report-junit", o.report.report_junit);
}

// The isolation replay takes the reference's checkpoints from memory when they fit the hold limit (no
// dump written for it or read back), else from the reference's dump after the pipeline. The limit is an
// eighth of the memory available at the start, at least 1 GiB and at most 8 GiB (a 13B model's 32-token
// job holds 1.2 GB: on a host of 128 GB it replays beside the pipeline instead of after it, 7 s less).
// DIFFRUN_ISOLATION_HOLD_MAX (bytes) sets another limit (0: always from the dump; the tests compare the
// two ways).
uint64_t isolation_hold_limit() {
  if (const char* v = std::getenv("DIFFRUN_ISOLATION_HOLD_MAX"); v && *v) return parse_bytes(v);
  constexpr uint64_t kGiB = uint64_t(1) << 30;
  uint64_t available = 0;  // MemAvailable (the page cache counts: the model's pages can go), 0 when unknown
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[128];
    unsigned long long kb = 0;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) available = uint64_t(kb) << 10;
    std::fclose(f);
  }
  return std::clamp(available / 8, kGiB, 8 * kGiB);
}

PipelineOptions pipeline_options(const MainOptions& o, DumpMode dump, const CheckpointFilter& filter,
                                 const DumpWriterOptions& wopt, const std::string& prompt) {
  PipelineOptions popt;
  popt.steps = o.steps;
  popt.dump = dump;
  popt.stop_at_first = o.stop_at_first;
  popt.filter = filter;
  popt.writer = wopt;
  popt.prompt = prompt;
  popt.run_id = new_run_id();
  popt.report = o.report;
  popt.recording_check = !o.no_recording_check;
  return popt;
}

// OpenMP threads: each pair's reference, and the engine (a cpu engine's; the same for every pair).
struct ThreadSplit {
  std::vector<int> reference;
  int engine = 1;
};

// Threads: each cpu reference gets --threads; by default the cores the engine side leaves (a cpu
// engine takes a third, a CUDA engine's thread and each comparator mostly wait: one core per pair),
// shared between the references by cost, an f64 reference twice an f32 one. A cpu engine gets the
// rest, at least one. OMP_NUM_THREADS, when set, is every cpu backend's count unless --threads.
ThreadSplit split_threads(const MainOptions& o, const std::vector<RunPair>& pairs) {
  const int cores = available_cores();
  const int n_pairs = static_cast<int>(pairs.size());
  const bool cpu_engine = pairs.front().eng.backend == "cpu";
  const char* omp_env = std::getenv("OMP_NUM_THREADS");
  const int env_threads = omp_env && *omp_env ? std::max(1, std::atoi(omp_env)) : 0;
  // A cuda reference (the tp invariance pair's one-GPU engine) takes no reference cores.
  const auto cost = [](const RunPair& p) { return p.ref.backend != "cpu" ? 0 : p.ref.precision.starts_with("f64") ? 2 : 1; };
  int total_cost = 0;
  for (const RunPair& p : pairs) total_cost += cost(p);
  const int ref_cores = cpu_engine ? std::max(1, 2 * cores / 3) : std::max(1, cores - n_pairs);
  // The reference cores shared in proportion to each pair's cost; the cores the rounding down leaves go
  // one at a time to the pair with the fewest threads for its cost (on 16 cores: 9 + 5, not 9 + 4).
  std::vector<int> shares;
  for (const RunPair& p : pairs) shares.push_back(std::max(1, ref_cores * cost(p) / std::max(1, total_cost)));
  for (int left = ref_cores - std::accumulate(shares.begin(), shares.end(), 0); left > 0; --left) {
    size_t most_starved = 0;
    for (size_t i = 1; i < pairs.size(); ++i)
      if (cost(pairs[i]) > 0 && shares[i] * cost(pairs[most_starved]) < shares[most_starved] * cost(pairs[i]))
        most_starved = i;
    ++shares[most_starved];
  }
  ThreadSplit split;
  for (size_t i = 0; i < pairs.size(); ++i)
    split.reference.push_back(o.threads > 0 ? o.threads : env_threads > 0 ? env_threads : shares[i]);
  split.engine = env_threads > 0 && o.threads <= 0 ? env_threads : std::max(1, cores - split.reference.front());
  return split;
}

// Temporary files of the run (the isolation replay's with --dump divergence|none), removed at the end.
struct TempFiles : std::vector<std::string> {
  ~TempFiles() {
    std::error_code ec;
    for (const std::string& f : *this) std::filesystem::remove(f, ec);
  }
};

// Pair i's part of the pipeline: its dumps' paths and threads; with a dump, its directory made (stale
// temporaries reported) and its files guarded; where its isolation replay reads the reference from.
PipelinePair pipeline_pair(const RunPair& p, size_t i, const MainOptions& o, const PipelineOptions& popt,
                           const ThreadSplit& threads, bool reference_fits,
                           std::vector<std::unique_ptr<TempGuard>>& guards, TempFiles& scratch) {
  PipelinePair pp;
  pp.title = p.title;
  pp.engine = p.eng;
  pp.reference = p.ref;
  pp.engine_path = (std::filesystem::path(p.dir) / "engine.h5").string();
  pp.reference_path = (std::filesystem::path(p.dir) / "reference.h5").string();
  pp.engine_threads = threads.engine;
  pp.reference_threads = threads.reference[i];
  const DumpMode dump = popt.dump;
  if (dump != DumpMode::none) {
    std::filesystem::create_directories(p.dir);
    report_stale_temporaries(p.dir, o.remove_stale);
    guards.push_back(std::make_unique<TempGuard>(pp.engine_path));
    guards.push_back(std::make_unique<TempGuard>(pp.reference_path));
  }
  // The isolation replay reads the reference's checkpoints from memory when they fit the hold limit;
  // else its full dump: with --dump divergence or none a temporary file, removed after the replay,
  // so that the report is the same in every mode.
  pp.hold_reference = p.isolate && reference_fits;
  // A CUDA engine's replay runs beside the pipeline (a second engine on the device), a CPU engine's
  // after it (the cores are the references').
  pp.replay_beside = pp.hold_reference && p.eng.backend == "cuda";
  if (dump == DumpMode::full) pp.isolated_path = (std::filesystem::path(p.dir) / "engine-isolated.h5").string();
  if (p.isolate && !pp.hold_reference) {
    pp.replay_path = dump == DumpMode::full ? pp.reference_path
                                            : (std::filesystem::temp_directory_path() /
                                               fmt::format("diffrun-{}-{}-reference.h5", popt.run_id, i))
                                                  .string();
    if (dump != DumpMode::full) {
      scratch.push_back(pp.replay_path);
      guards.push_back(std::make_unique<TempGuard>(pp.replay_path));
    }
  }
  pp.keep_engine = p.isolate;
  return pp;
}

// What the pipeline's isolated pairs left for the replay after it: their engines, loaded once for the
// run, and their references' checkpoints when held in memory.
struct Kept {
  std::vector<std::unique_ptr<Backend>> engines;
  std::vector<HeldReference> held;
};

// Isolation replay after the pipeline: the engine again, each checkpoint recorded and then replaced by
// the reference's (from memory, or from the reference's dump), for every isolated pair the pipeline did
// not already replay beside itself. `tokens`: the first reference's greedy choices, fed to every run.
void replay_isolated(const GgufFile& file, const ModelConfig& cfg, const MainOptions& o, const std::vector<int32_t>& ids,
                     const std::vector<int32_t>& tokens, const PipelineOptions& popt, const std::vector<RunPair>& pairs,
                     const std::vector<PipelinePair>& ppairs, std::vector<diff::Comparison>& comparisons, Kept& kept,
                     TempFiles& scratch, Progress& progress) {
  const int steps = static_cast<int>(tokens.size()) - 1;
  for (size_t i = 0; i < pairs.size(); ++i) {
    if (!pairs[i].isolate) continue;
    diff::Comparison& c = comparisons[i];
    std::unique_ptr<Backend>& engine = kept.engines[i];
    std::string path = (std::filesystem::path(pairs[i].dir) / "engine-isolated.h5").string();
    if (!c.isolated_path.empty()) {  // replayed beside the pipeline
      engine.reset();
      continue;
    }
    if (ppairs[i].hold_reference) {
      if (!engine || engine->max_ctx() < static_cast<int>(ids.size()) + steps)
        engine = make_backend(file, cfg, pairs[i].eng, static_cast<int>(ids.size()) + steps);
      add_isolation_held(c, file, cfg, *engine, kept.held[i], ppairs[i], ids, popt, progress);
      continue;
    }
    if (popt.dump != DumpMode::full) {
      path = ppairs[i].replay_path.substr(0, ppairs[i].replay_path.size() - 12) + "engine-isolated.h5";
      scratch.push_back(path);
    }
    run_backend(file, cfg, pairs[i].eng, "engine isolated", ids, o, popt.prompt, popt.filter, popt.writer, tokens, steps,
                path, popt.run_id, progress, ppairs[i].replay_path, std::move(engine));
    const DumpReader isolated(path), reference(ppairs[i].replay_path);
    add_isolation_for(c, isolated, reference, o.report);
    if (popt.dump != DumpMode::full) c.isolated_path = not_written(popt.dump);
  }
}

// The report of every pair; its exit code. Both backends of each pair were asked to record the same
// checkpoints: anything less than all of them compared fails.
int report_pairs(const MainOptions& o, const ModelConfig& cfg, const Tokenizer& tok, const std::vector<RunPair>& pairs,
                 std::vector<diff::Comparison>& comparisons, Progress& progress) {
  const auto token_text = [&](int32_t id) {
    if (id < 0 || id >= cfg.n_vocab) return std::string("(outside the vocabulary)");
    const int32_t one[1] = {id};
    return tok.decode(one);
  };
  ReportOptions report = o.report;
  if (report.require_coverage <= 0) report.require_coverage = 100;
  for (diff::Comparison& c : comparisons) c.coverage.required = report.require_coverage;
  std::vector<std::string> titles;
  for (const RunPair& p : pairs) titles.push_back(p.title);
  progress.timing("isolation done");
  const int rc = report_comparisons(titles, comparisons, report, token_text);
  progress.timing("report done");
  return rc;
}

// The tp invariance pair's one-GPU f32 engine shares device 0 with rank 0 of the two tensor-parallel engines; where
// they would not fit in its free memory now, the pair is left out (with a message) rather than the run failing.
void drop_tp_pair_if_too_large(const GgufFile& file, const ModelConfig& cfg, const MainOptions& o, int max_ctx,
                               int tokens, std::vector<RunPair>& pairs, Progress& progress) {
#ifdef DIFFRUN_HAVE_CUDA
  const auto tp_pair = std::find_if(pairs.begin(), pairs.end(), [](const RunPair& p) { return p.ref.backend == "cuda"; });
  if (tp_pair == pairs.end()) return;
  const uint64_t one_gpu = cuda_engine_device_bytes(file, cfg, "f32", max_ctx, tokens);
  const uint64_t ranks = (one_gpu + cuda_engine_device_bytes(file, cfg, "f16", max_ctx, tokens)) / uint64_t(o.tp);
  const uint64_t free_bytes = cuda_free_device_bytes();
  if (one_gpu + ranks <= free_bytes) return;
  progress.message(fmt::format("the tp invariance pair is left out: its one-GPU f32 engine ({:.1f} GiB) and rank 0 of the "
                               "tensor-parallel engines ({:.1f} GiB) do not fit in GPU 0's {:.1f} GiB free",
                               one_gpu / 1073741824.0, ranks / 1073741824.0, free_bytes / 1073741824.0));
  pairs.erase(tp_pair);
#else
  (void)file, (void)cfg, (void)o, (void)max_ctx, (void)tokens, (void)pairs, (void)progress;
#endif
}

// cuBLAS's first use at the prefill's shapes, a thread per CUDA engine precision, while the engines load (the threads
// end long before the job's; joined at its return). Left out where the device's free memory is less than twice what
// the pairs' engines need (an isolation replay's engine is a second one) plus the warm-up's own, and under
// DIFFRUN_GEMM_WARM_UP=0 (the engines' first steps then pay it).
std::vector<std::jthread> start_gemm_warm_ups(const GgufFile& file, const ModelConfig& cfg,
                                              const std::vector<RunPair>& pairs, int prompt, int steps) {
  std::vector<std::jthread> threads;
#ifdef DIFFRUN_HAVE_CUDA
  const char* v = std::getenv("DIFFRUN_GEMM_WARM_UP");
  if (v && std::string(v) == "0") return threads;
  uint64_t reserve = 0;
  for (const RunPair& p : pairs)
    if (p.eng.backend == "cuda")
      reserve += 2 * cuda_engine_device_bytes(file, cfg, p.eng.precision, prompt + steps, prompt);
  std::set<std::string> warmed;
  for (const RunPair& p : pairs)
    if (p.eng.backend == "cuda" && p.eng.tp == 1 && warmed.insert(p.eng.precision).second)
      threads.emplace_back([&cfg, precision = p.eng.precision, prompt, reserve] {
        cuda_warm_up_gemms(cfg, precision, prompt, reserve);
      });
#else
  (void)file, (void)cfg, (void)pairs, (void)prompt, (void)steps;
#endif
  return threads;
}

int run_main(const MainOptions& o) {
  Progress progress("diffrun");
  check_outputs(o);
  const CheckpointFilter filter(o.checkpoints);
  // The CUDA driver starts and makes the context while the model loads and the references start (the
  // engines wait for it).
  DeviceProbe probe(o);
  progress.message(fmt::format("loading {}", o.model));
  const auto file = GgufFile::open(o.model);
  const ModelConfig cfg = load_config(*file);
  validate_tensors(*file, cfg);
  const auto tok = load_tokenizer(*file);
  progress.timing("model and tokenizer loaded");
  std::vector<RunPair> pairs = run_pairs(o, probe, progress);
  progress.timing("pairs chosen");
  // Every option is checked before the reference runs (it may take minutes).
  for (const RunPair& p : pairs) {
    check_run_options(*file, cfg, p.eng, filter, true);
    check_run_options(*file, cfg, p.ref, filter, true);
  }
  const std::vector<int32_t> ids = prompt_tokens(*file, *tok, o.prompt);
  const std::vector<std::jthread> gemm_warm_ups =
      start_gemm_warm_ups(*file, cfg, pairs, static_cast<int>(ids.size()), o.steps);
  const int64_t needed = static_cast<int64_t>(ids.size()) + o.steps;
  if (needed > cfg.n_ctx) {
    throw InputError(fmt::format("the prompt ({} tokens) plus {} steps exceeds the model's context of {}", ids.size(),
                                 o.steps, cfg.n_ctx));
  }
  drop_tp_pair_if_too_large(*file, cfg, o, static_cast<int>(needed), static_cast<int>(ids.size()), pairs, progress);
  uint64_t held_bytes = 0;  // a reference's checkpoints in memory, the cache whole
  const DumpWriterOptions wopt = plan_dump_size(cfg, static_cast<int64_t>(ids.size()), o.steps, filter, o.size,
                                                [&](const std::string& s) { progress.message(s); }, &held_bytes,
                                                parse_dump_mode(o.dump) != DumpMode::none);
  const uint64_t hold_limit = isolation_hold_limit();
  const std::string prompt = prompt_text(*file, o.prompt);
  const PipelineOptions popt = pipeline_options(o, parse_dump_mode(o.dump), filter, wopt, prompt);

  const ThreadSplit threads = split_threads(o, pairs);
  std::vector<PipelinePair> ppairs;
  std::vector<std::unique_ptr<TempGuard>> guards;
  TempFiles scratch;
  for (const RunPair& p : pairs)
    ppairs.push_back(pipeline_pair(p, ppairs.size(), o, popt, threads, held_bytes <= hold_limit, guards, scratch));
  const int n_pairs = static_cast<int>(pairs.size());
  const bool cpu_engine = pairs.front().eng.backend == "cpu";
  progress.message(fmt::format("{} prompt tokens, {} decode steps; {} pair{} at once, reference threads {}{}",
                               ids.size(), o.steps, n_pairs, n_pairs == 1 ? "" : "s", fmt::join(threads.reference, "+"),
                               cpu_engine ? fmt::format(", engine threads {}", threads.engine) : std::string()));
  Kept kept;
  std::vector<diff::Comparison> comparisons =
      run_pipeline(*file, cfg, ppairs, ids, popt, progress, &kept.engines, &kept.held);
  progress.timing("pipeline done");
  const std::vector<int32_t> fed = fed_tokens(comparisons.front());  // fed to every backend, and to any run again
  if (cfg.moe) follow_routing_drift(*file, cfg, ppairs, ids, fed, popt, comparisons, progress, &kept.engines, &kept.held);
  guards.clear();

  if (std::any_of(pairs.begin(), pairs.end(), [](const RunPair& p) { return p.isolate; }))
    replay_isolated(*file, cfg, o, ids, fed, popt, pairs, ppairs, comparisons, kept, scratch, progress);
  return report_pairs(o, cfg, *tok, pairs, comparisons, progress);
}

const CommandRegistrar registrar{
    "", "Run the reference and the engine on a prompt, compare every checkpoint, report the first divergence",
    [](CLI::App& app) -> std::function<int()> {
      auto o = std::make_shared<MainOptions>();
      o->model = default_model_path();
      o->prompt.add_options(app);
      app.add_option("--model,-m", o->model, "GGUF model")->capture_default_str();
      app.add_option("--steps", o->steps, "Decode steps after the prefill")->capture_default_str()->check(count_in(0));
      app.add_option("--engine", o->engine, "Engine side: auto (cuda when a device exists, else cpu), cuda or cpu")
          ->capture_default_str()
          ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
      app.add_option("--engine-precision", o->engine_precision,
                     "Engine precision: f16 or f32 (cuda), f32, f64 or an emulated storage spec (cpu). Default: on "
                     "cuda both pairs (f32 vs f64, f16 vs f32-f16store), on cpu f32")
          ->check(CLI::IsMember(precision_choices()));
      app.add_option("--reference-precision", o->reference_precision,
                     "Reference precision: f32, f64, f32-f16store (the f16 engine's storage emulated), ... "
                     "(default f32-f16store against an f16 engine, else f64)")
          ->check(CLI::IsMember(precision_choices()));
      app.add_option("--out,-o", o->out, "Directory for reference.h5 and engine.h5")->capture_default_str();
      app.add_option("--checkpoints", o->checkpoints, "Record only these checkpoints, e.g. 'attn_*,result_*'");
      o->size.add_options(app);
      app.add_option("--inject", o->inject,
                     "Inject faults into the engine side (diffrun faults lists them), e.g. rope_theta_10000,kv_cache_pos0");
      add_tp_option(app, o->tp);
      app.add_flag("--no-tp-invariance", o->no_tp_invariance,
                   "With --tp N: leave out the third pair, the f32 engine at --tp N against itself on one GPU (TP "
                   "invariance; it is left out anyway, with a message, where the model does not fit on one GPU)");
      app.add_flag("--isolate", o->isolate,
                   "Also run the engine in isolation replay (each op on the reference's inputs): local error per "
                   "checkpoint. Needs every checkpoint (not with --checkpoints)");
      app.add_option("--dump", o->dump,
                     "Dumps to write: full (every checkpoint of every step), divergence (every step's tokens, the "
                     "checkpoints of the steps around the first divergence), none. The report is the same")
          ->capture_default_str()
          ->check(CLI::IsMember({"full", "divergence", "none"}));
      app.add_option("--stop-at-first", o->stop_at_first,
                     "End the run N steps after the step of the first divergence (no value: 0, that step)")
          ->expected(0, 1)
          ->default_str("0")
          ->check(count_in(0));
      app.add_option("--threads", o->threads,
                     "OpenMP threads of each CPU reference (default: the cores the engine side leaves; a CPU engine "
                     "gets the rest)")
          ->check(count_in(1, 4096));
      app.add_flag("--no-recording-check", o->no_recording_check,
                   "Skip the recording check: by default each CUDA engine runs the steps once more with nothing "
                   "recorded, and the run fails (exit 1) unless its logits equal the recorded run's bit for bit");
      app.add_flag("--remove-stale", o->remove_stale,
                   "Remove the dump temporaries (*.diffrun-tmp-PID) that killed runs left in --out (otherwise only listed)");
      o->report.add_options(app);
      o->report.title = "diffrun";
      return [o, &app]() {
        if (app.get_option("--prompt")->count() == 0 && app.get_option("--tokens")->count() == 0) {
          std::fputs(app.help().c_str(), stdout);
          return 2;
        }
        return run_main(*o);
      };
    }};

}  // namespace
}  // namespace diffrun::cli
