// `diffrun --prompt P`: run the reference, then the engine on the same tokens, compare, report, exit 0/1/2.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "checkpoints/dump.hpp"
#include "checkpoints/replay_sink.hpp"
#include "cli/command.hpp"
#include "cli/diff_report.hpp"
#include "cli/interrupt.hpp"
#include "cli/progress.hpp"
#include "cli/run.hpp"
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
  std::string engine_precision;     // empty: f16 on cuda, f32 on cpu
  std::string reference_precision;  // empty: f32 against cuda, f64 against the cpu engine
  std::string out = "diffrun-out";
  std::string checkpoints;
  std::string inject;    // faults injected into the engine side
  bool isolate = false;  // also run the engine in isolation replay (local error per checkpoint)
  bool remove_stale = false;  // remove the temporaries killed runs left in --out
  ReportOptions report;
};

// The engine side: cuda when asked or (auto) when built with it and a device exists.
BackendOptions engine_backend(const MainOptions& o, Progress& progress) {
  BackendOptions b;
  b.backend = o.engine;
  if (o.engine == "auto") {
    std::string why = "diffrun was built without the CUDA engine";
#ifdef DIFFRUN_HAVE_CUDA
    b.backend = cuda_device_available(&why) ? "cuda" : "cpu";
#else
    b.backend = "cpu";
#endif
    if (b.backend == "cpu") {
      progress.message(fmt::format("no CUDA engine ({}): the engine side is the CPU backend at {} against an {} reference",
                                   why, o.engine_precision.empty() ? "f32" : o.engine_precision,
                                   o.reference_precision.empty() ? "f64" : o.reference_precision));
    }
  }
  b.precision = o.engine_precision.empty() ? (b.backend == "cuda" ? "f16" : "f32") : o.engine_precision;
  b.inject = o.inject;
  if (b.backend == "cpu" && b.precision == "f16") {
    throw InputError("the CPU backend computes in f32 or f64; --engine-precision f16 needs the CUDA engine (--engine cuda)");
  }
  return b;
}

int run_main(const MainOptions& o) {
  Progress progress("diffrun");
  const CheckpointFilter filter(o.checkpoints);
  const BackendOptions eng = engine_backend(o, progress);
  BackendOptions ref;
  ref.backend = "cpu";
  ref.precision = o.reference_precision.empty() ? (eng.backend == "cuda" ? "f32" : "f64") : o.reference_precision;

  progress.message(fmt::format("loading {}", o.model));
  const auto file = GgufFile::open(o.model);
  const ModelConfig cfg = config_from_gguf(*file);
  validate_tensors(*file, cfg);
  // Every option is checked before the reference runs (it may take minutes).
  check_run_options(*file, cfg, eng, filter, true);
  check_run_options(*file, cfg, ref, filter, true);
  const auto tok = load_tokenizer(*file);
  const std::vector<int32_t> ids = prompt_tokens(*file, *tok, o.prompt);
  const int64_t needed = static_cast<int64_t>(ids.size()) + o.steps;
  if (needed > cfg.n_ctx) {
    throw InputError(fmt::format("the prompt ({} tokens) plus {} steps exceeds the model's context of {}", ids.size(),
                                 o.steps, cfg.n_ctx));
  }
  const std::string prompt = prompt_text(*file, o.prompt);
  std::filesystem::create_directories(o.out);
  report_stale_temporaries(o.out, o.remove_stale);
  const std::string ref_path = (std::filesystem::path(o.out) / "reference.h5").string();
  const std::string eng_path = (std::filesystem::path(o.out) / "engine.h5").string();
  // Both dumps carry the run id, so compare refuses a new reference beside an interrupted run's old engine.
  const std::string run_id = new_run_id();
  const auto meta = [&](const Backend& backend) {
    DumpMeta m = dump_meta(*file, backend, prompt, ids);
    m.facts["run_id"] = run_id;
    return m;
  };
  progress.message(fmt::format("{} prompt tokens, {} decode steps; engine {}/{}, reference {}/{}", ids.size(), o.steps,
                               eng.backend, eng.precision, ref.backend, ref.precision));

  // The reference chooses the tokens greedily.
  StepsResult ref_run;
  {
    auto backend = make_backend(*file, cfg, ref, static_cast<int>(needed));
    const TempGuard guard(ref_path);
    DumpWriter writer(ref_path, meta(*backend), filter);
    const std::string what = fmt::format("reference {}/{} step", ref.backend, ref.precision);
    ref_run = run_steps(*backend, ids, o.steps, {}, writer, false,
                        [&](int step, int total) { progress.update(what, step + 1, total + 1); });
    writer.set_attribute("all_token_ids", ref_run.tokens);
    writer.set_attribute("argmax", ref_run.argmax);
    writer.finish();
    progress.finish();
  }
  // The engine is fed the same tokens (teacher forcing); its own argmax is recorded.
  {
    auto backend = make_backend(*file, cfg, eng, static_cast<int>(needed));
    const TempGuard guard(eng_path);
    DumpWriter writer(eng_path, meta(*backend), filter);
    const std::string what = fmt::format("engine {}/{} step", eng.backend, eng.precision);
    const StepsResult r = run_steps(*backend, ids, o.steps, ref_run.argmax, writer, false,
                                    [&](int step, int total) { progress.update(what, step + 1, total + 1); });
    writer.set_attribute("all_token_ids", r.tokens);
    writer.set_attribute("argmax", r.argmax);
    writer.finish();
    progress.finish();
  }
  // Isolation replay: the engine again, each checkpoint recorded and then replaced by the reference's.
  std::string iso_path;
  if (o.isolate) {
    iso_path = (std::filesystem::path(o.out) / "engine-isolated.h5").string();
    const DumpReader reference(ref_path);
    auto backend = make_backend(*file, cfg, eng, static_cast<int>(needed));
    const TempGuard guard(iso_path);
    DumpWriter writer(iso_path, meta(*backend), filter);
    ReplaySink replay(writer, reference);
    const std::string what = fmt::format("engine {}/{} isolated step", eng.backend, eng.precision);
    const StepsResult r = run_steps(*backend, ids, o.steps, ref_run.argmax, replay, false,
                                    [&](int step, int total) { progress.update(what, step + 1, total + 1); });
    writer.set_attribute("all_token_ids", r.tokens);
    writer.set_attribute("argmax", r.argmax);
    writer.finish();
    progress.finish();
  }
  const auto token_text = [&](int32_t id) {
    if (id < 0 || id >= cfg.n_vocab) return std::string("(outside the vocabulary)");
    const int32_t one[1] = {id};
    return tok->decode(one);
  };
  // Both backends were asked to record the same checkpoints: anything less than all of them compared fails.
  ReportOptions report = o.report;
  if (report.require_coverage <= 0) report.require_coverage = 100;
  return compare_and_report(eng_path, ref_path, report, progress, token_text, iso_path);
}

const CommandRegistrar registrar{
    "", "Run the reference and the engine on a prompt, compare every checkpoint, report the first divergence",
    [](CLI::App& app) -> std::function<int()> {
      auto o = std::make_shared<MainOptions>();
      o->model = default_model_path();
      o->prompt.add_options(app);
      app.add_option("--model,-m", o->model, "GGUF model")->capture_default_str();
      app.add_option("--steps", o->steps, "Decode steps after the prefill")->capture_default_str()->check(
          CLI::NonNegativeNumber);
      app.add_option("--engine", o->engine, "Engine side: auto (cuda when a device exists, else cpu), cuda or cpu")
          ->capture_default_str()
          ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
      app.add_option("--engine-precision", o->engine_precision, "Engine precision: f16 or f32 (default f16 on cuda, f32 on cpu)")
          ->check(CLI::IsMember({"f16", "f32", "f64"}));
      app.add_option("--reference-precision", o->reference_precision,
                     "Reference precision: f32 or f64 (default f32 against cuda, f64 against the cpu engine)")
          ->check(CLI::IsMember({"f32", "f64"}));
      app.add_option("--out,-o", o->out, "Directory for reference.h5 and engine.h5")->capture_default_str();
      app.add_option("--checkpoints", o->checkpoints, "Record only these checkpoints, e.g. 'attn_*,result_*'");
      app.add_option("--inject", o->inject,
                     "Inject faults into the engine side (diffrun faults lists them), e.g. rope_theta_10000,kv_cache_pos0");
      app.add_flag("--isolate", o->isolate,
                   "Also run the engine in isolation replay (each op on the reference's inputs): local error per checkpoint");
      app.add_flag("--remove-stale", o->remove_stale,
                   "Remove the dump temporaries (*.tmp-PID) that killed runs left in --out (otherwise only listed)");
      o->report.add_options(app);
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
