// `diffrun dump`: runs one backend (prefill, then greedy decode steps) and writes every checkpoint to an HDF5 dump.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/core.h>
#include <omp.h>

#include "checkpoints/dump_schema_names.hpp"
#include "cli/command.hpp"
#include "cli/diff_report.hpp"
#include "cli/options.hpp"
#include "cli/interrupt.hpp"
#include "cli/run.hpp"
#include "dump/dump.hpp"
#include "dump/replay_sink.hpp"
#include "diff/compare.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#ifdef DIFFRUN_HAVE_CUDA
#include "engine/tp_engine.hpp"
#endif

namespace diffrun::cli {
namespace {

struct DumpOptions {
  std::string model;
  PromptOptions prompt;
  BackendOptions backend;
  int steps = 4;
  std::string out;
  std::string checkpoints;
  std::string replay;  // isolation replay from this reference dump
  std::string follow_routing;  // an engine's dump whose drift routing flips the reference follows
  std::string feed;            // teacher forcing: the prompt and the decode tokens of this dump
  bool steps_given = false;    // --steps on the command line (else, with --feed, the dump's)
  bool remove_stale = false;  // remove the temporaries killed runs left beside --out
  DumpSizeOptions size;
  int threads = 0;  // OpenMP threads of the cpu backend; 0: OMP_NUM_THREADS or every core
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --tp N: where rank r's dump goes, DIR/rank<r>.h5. The directory is made where missing; one holding other dumps
// is refused (compare DIR would take them for ranks of this run).
std::vector<std::string> rank_dump_paths(const std::string& dir, int world) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw InputError(fmt::format("--out {}: with --tp {} it names a directory for the rank dumps, and this is a file",
                                 dir, world));
  fs::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("--out {}: cannot make the directory: {}", dir, ec.message()));
  std::vector<std::string> paths;
  for (int r = 0; r < world; ++r) paths.push_back((fs::path(dir) / fmt::format("rank{}.h5", r)).string());
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".h5") continue;
    if (std::find(paths.begin(), paths.end(), entry.path().string()) == paths.end())
      throw InputError(fmt::format("--out {}: holds {}, which is not a rank dump of this --tp {} run; remove it or "
                                   "give another directory (compare reads every .h5 file there)",
                                   dir, entry.path().filename().string(), world));
  }
  for (const std::string& p : paths) check_dump_output_file("--out", p);
  return paths;
}

#ifdef DIFFRUN_HAVE_CUDA
// `dump --tp N`: every rank records its own shard into its rank dump (docs/dump-format.md, "Shards").
int run_rank_dumps(const DumpOptions& o, const GgufFile& file, TpCudaEngine& tp, const std::vector<int32_t>& ids,
                   std::span<const int32_t> forced, const std::string& prompt, const CheckpointFilter& filter,
                   DumpWriterOptions wopt) {
  const int world = tp.world_size();
  const std::vector<std::string> paths = rank_dump_paths(o.out, world);
  std::vector<std::unique_ptr<TempGuard>> guards;
  std::vector<std::unique_ptr<DumpWriter>> writers;
  std::vector<Sink*> sinks;
  for (int r = 0; r < world; ++r) {
    DumpMeta meta = dump_meta(file, tp, prompt, ids);
    meta.facts = tp.rank(r).facts();
    meta.rank = r;
    meta.world_size = world;
    const TpSlice slice = tp.slice(r);
    wopt.shard = [slice](std::string_view name) { return megatron_shard(name, slice); };
    guards.push_back(std::make_unique<TempGuard>(paths[size_t(r)]));
    writers.push_back(std::make_unique<DumpWriter>(paths[size_t(r)], meta, filter, wopt));
    sinks.push_back(writers.back().get());
  }
  RankSinks ranks(sinks);
  const auto t1 = std::chrono::steady_clock::now();
  const StepsResult res = run_steps(tp, ids, o.steps, forced, ranks, false, [&](int step, int total) {
    fmt::print(stderr, "diffrun dump: step {}/{} done ({:.1f} s)\n", step + 1, total + 1, seconds_since(t1));
  });
  uint64_t bytes = 0;
  for (int r = 0; r < world; ++r) {
    set_run_attributes(*writers[size_t(r)], tp.rank(r).facts(), res.tokens, res.argmax, res.paths);
    writers[size_t(r)]->finish();
    bytes += writers[size_t(r)]->bytes_written();
  }
  fmt::print("{}: {} rank dumps of {} steps, {:.1f} MB, {} tokens (diffrun compare {} REFERENCE.h5 merges them)\n",
             o.out, world, o.steps + 1, bytes / 1e6, res.tokens.size(), o.out);
  return 0;
}
#endif

// `dump --follow-routing ENGINE`: the cpu reference for an engine's dump of a mixture of experts, fed its tokens, run
// again (at most kMaxRoutingFollowUps times) taking the engine's experts wherever the comparison of the two dumps
// finds a routing flip by drift at or before its first divergence (flips_to_follow), as the main job does with its
// own engines. The dump names the rows in its fact routing_followed; `compare ENGINE OUT` then lists them.
int run_followed_dump(const DumpOptions& o, const GgufFile& file, const ModelConfig& cfg,
                      const std::vector<int32_t>& ids, const CheckpointFilter& filter, const DumpWriterOptions& wopt) {
  const auto t0 = std::chrono::steady_clock::now();
  const DumpReader engine(o.follow_routing);
  const std::vector<int32_t> all = engine.int_attribute(attr::all_token_ids);
  if (engine.meta().token_ids != ids || all.size() < ids.size() + o.steps) {
    throw InputError(fmt::format("--follow-routing {}: the engine dump does not hold this prompt and {} decode steps "
                                 "(its root attributes token_ids and all_token_ids)",
                                 o.follow_routing, o.steps));
  }
  const std::vector<int32_t> fed(all.begin() + static_cast<std::ptrdiff_t>(ids.size()), all.end());
  const int max_ctx = static_cast<int>(ids.size()) + o.steps;
  // The reference, following `followed` (none: the first run), written to --out and compared with the engine's dump.
  const auto write_and_compare = [&](const std::vector<diff::RoutingFlip>& followed) {
    BackendOptions bo = o.backend;
    if (!followed.empty()) bo.forced_routing = forced_routing(followed);
    auto backend = make_backend(file, cfg, bo, max_ctx);
    draft_fed_tokens(*backend, fed);
    {
      const TempGuard guard(o.out);
      DumpWriter writer(o.out, dump_meta(file, *backend, prompt_text(file, o.prompt), ids), filter, wopt);
      const StepsResult r = run_steps(*backend, ids, o.steps, fed, writer, false, [&](int step, int total) {
        fmt::print(stderr, "diffrun dump: step {}/{} done ({:.1f} s)\n", step + 1, total + 1, seconds_since(t0));
      });
      set_run_attributes(writer, r, *backend);
      writer.finish();
    }
    const DumpReader reference(o.out);
    const ReportOptions defaults;  // the preset of the two dumps' precisions
    return diff::compare_dumps(engine, reference, tolerances_for(engine.meta(), reference.meta(), defaults),
                               compare_options(defaults));
  };
  std::vector<diff::RoutingFlip> followed;
  diff::Comparison c = write_and_compare(followed);
  follow_flips(c, followed, [&](const std::vector<diff::RoutingFlip>& so_far,
                                const std::vector<diff::RoutingFlip>& added) {
    fmt::print(stderr,
               "diffrun dump: {} routing flip{} by drift against {} (step {} layer {} token {} the first); running "
               "again with the engine's experts there\n",
               added.size(), added.size() == 1 ? "" : "s", o.follow_routing, added.front().step, added.front().layer,
               added.front().token);
    return write_and_compare(so_far);
  });
  fmt::print("{}: {} steps fed the tokens of {}; followed {} routing flip{} by drift (fact routing_followed)\n", o.out,
             o.steps + 1, o.follow_routing, followed.size(), followed.size() == 1 ? "" : "s");
  return 0;
}

int run_dump(DumpOptions o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!o.feed.empty() && (!o.replay.empty() || !o.follow_routing.empty()))
    throw InputError("--feed and --" + std::string(o.replay.empty() ? "follow-routing" : "replay") +
                     " each feed a dump's tokens: give one");
  if (o.backend.tp > 1 && !o.replay.empty())
    throw InputError("--replay: the isolation replay runs on one GPU, not with --tp");
  if (o.backend.tp <= 1) check_dump_output_file("--out", o.out);
  if (!o.follow_routing.empty()) {
    if (!o.replay.empty()) throw InputError("--follow-routing and --replay: give one");
    if (o.backend.backend != "cpu" || o.backend.tp > 1)
      throw InputError("--follow-routing: the reference that follows an engine's routing is the cpu backend's");
    std::error_code ec;
    if (std::filesystem::exists(o.out, ec) && std::filesystem::equivalent(o.out, o.follow_routing, ec))
      throw InputError("--follow-routing " + o.follow_routing + " is the --out file: the engine dump would be overwritten");
  }
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const CheckpointFilter filter(o.checkpoints);
  fmt::print(stderr, "diffrun dump: loading {}\n", o.model);
  const auto file = GgufFile::open(o.model);
  const ModelConfig cfg = load_config(*file);
  check_run_options(*file, cfg, o.backend, filter);
  if (!o.follow_routing.empty() && !cfg.moe)
    throw InputError("--follow-routing: " + o.model + " has no experts (routing is a mixture of experts')");
  const auto tok = load_tokenizer(*file);
  // --feed: the prompt (unless given) and the tokens of the dump's decode steps, fed instead of this backend's own.
  std::vector<int32_t> forced;
  std::string fed_prompt;
  std::vector<int32_t> ids;
  if (!o.feed.empty()) {
    const DumpReader fed(o.feed);
    const std::vector<int32_t>& held = fed.meta().token_ids;
    const bool given = !o.prompt.prompt.empty() || !o.prompt.tokens.empty();
    ids = given ? prompt_tokens(*file, *tok, o.prompt) : held;
    if (ids != held)
      throw InputError(fmt::format("--feed {}: its prompt ({} tokens) is not this one ({} tokens); leave out --prompt "
                                   "and --tokens to take its own",
                                   o.feed, held.size(), ids.size()));
    const std::vector<int32_t> all = fed.int_attribute(attr::all_token_ids);
    if (all.empty())
      throw InputError(fmt::format("--feed {}: it has no root attribute all_token_ids (the tokens its run was fed; "
                                   "docs/dump-format.md)",
                                   o.feed));
    if (all.size() < ids.size())
      throw InputError(fmt::format("--feed {}: its all_token_ids hold {} tokens, fewer than its prompt's {}", o.feed,
                                   all.size(), ids.size()));
    const int held_steps = static_cast<int>(all.size() - ids.size());
    if (!o.steps_given) o.steps = held_steps;
    if (o.steps > held_steps)
      throw InputError(fmt::format("--feed {}: it holds the tokens of {} decode steps, --steps asks {}", o.feed,
                                   held_steps, o.steps));
    forced.assign(all.begin() + static_cast<std::ptrdiff_t>(ids.size()),
                  all.begin() + static_cast<std::ptrdiff_t>(ids.size()) + o.steps);
    fed_prompt = fed.meta().prompt;
  } else {
    ids = prompt_tokens(*file, *tok, o.prompt);
  }
  const int64_t needed = static_cast<int64_t>(ids.size()) + o.steps;
  if (needed > cfg.n_ctx) {
    throw InputError(fmt::format("the prompt ({} tokens) plus {} steps exceeds the model's context of {}",
                                 ids.size(), o.steps, cfg.n_ctx));
  }
  const DumpWriterOptions wopt = plan_dump_size(cfg, static_cast<int64_t>(ids.size()), o.steps, filter, o.size,
                                                [](const std::string& s) { fmt::print(stderr, "diffrun dump: {}\n", s); });
  if (!o.follow_routing.empty()) {
    report_stale_temporaries(std::filesystem::path(o.out).parent_path().string(), o.remove_stale);
    return run_followed_dump(o, *file, cfg, ids, filter, wopt);
  }
  auto backend = make_backend(*file, cfg, o.backend, static_cast<int>(needed));
  fmt::print(stderr, "diffrun dump: {} {} ready in {:.1f} s; prompt {} tokens, {} decode steps\n", backend->name(),
             backend->precision(), seconds_since(t0), ids.size(), o.steps);

#ifdef DIFFRUN_HAVE_CUDA
  if (o.backend.tp > 1) {
    report_stale_temporaries(o.out, o.remove_stale);
    return run_rank_dumps(o, *file, dynamic_cast<TpCudaEngine&>(*backend), ids, forced,
                          o.feed.empty() ? prompt_text(*file, o.prompt) : fed_prompt, filter, wopt);
  }
#endif
  report_stale_temporaries(std::filesystem::path(o.out).parent_path().string(), o.remove_stale);
  const TempGuard guard(o.out);
  DumpWriter writer(o.out, dump_meta(*file, *backend, o.feed.empty() ? prompt_text(*file, o.prompt) : fed_prompt, ids),
                    filter, wopt);
  // Isolation replay: fed the reference's tokens, continuing from its tensor at every checkpoint.
  std::unique_ptr<DumpReader> reference;
  std::unique_ptr<ReplaySink> replay;
  if (!o.replay.empty()) {
    reference = std::make_unique<DumpReader>(o.replay);
    const std::vector<int32_t> all = reference->int_attribute(attr::all_token_ids);
    if (reference->meta().token_ids != ids || all.size() < ids.size() + o.steps) {
      throw InputError(fmt::format("--replay {}: the reference dump does not hold this prompt and {} decode steps",
                                   o.replay, o.steps));
    }
    forced.assign(all.begin() + static_cast<std::ptrdiff_t>(ids.size()), all.end());
    // A checkpoint the reference lacks is not replaced: the op after it runs on this backend's own
    // values, so its isolated error spans several ops (compare --isolated gives it no local error).
    const std::vector<std::string> names = checkpoint_names(cfg);
    const auto held = std::count_if(names.begin(), names.end(), [&](const std::string& n) {
      return n == kTokensCheckpoint || reference->find(0, n) != nullptr;
    });
    if (held < static_cast<std::ptrdiff_t>(names.size())) {
      fmt::print(stderr,
                 "diffrun dump: warning: --replay {} holds {} of this model's {} checkpoints at step 0; the ops whose "
                 "inputs it lacks run on this backend's own values, so their isolated errors span several ops "
                 "(compare --isolated gives those no local error)\n",
                 o.replay, held, names.size());
    }
    replay = std::make_unique<ReplaySink>(writer, *reference);
  }
  Sink& sink = replay ? static_cast<Sink&>(*replay) : writer;
  // --feed: the fed steps in passes (not under --replay, whose sink replaces what the steps compute).
  if (!replay) draft_fed_tokens(*backend, forced);
  const auto t1 = std::chrono::steady_clock::now();
  const StepsResult r = run_steps(*backend, ids, o.steps, forced, sink, false, [&](int step, int total) {
    fmt::print(stderr, "diffrun dump: step {}/{} done ({:.1f} s)\n", step + 1, total + 1, seconds_since(t1));
  });
  set_run_attributes(writer, r, *backend);
  writer.finish();
  if (backend->steps_from_draft() > 0)
    fmt::print(stderr, "diffrun dump: {} of {} decode steps computed in passes over the fed tokens\n",
               backend->steps_from_draft(), o.steps);
  // The ids in short (a long prompt has thousands): their count, the first and the last few.
  constexpr size_t kHead = 8, kTail = 4;
  std::string shown;
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    if (r.tokens.size() > kHead + kTail && i == kHead) {
      shown += " ...";
      i = r.tokens.size() - kTail;
    }
    shown += " " + std::to_string(r.tokens[i]);
  }
  fmt::print("{}: {} steps, {:.1f} MB, {} tokens:{} (ls lists them)\n", o.out, o.steps + 1, writer.bytes_written() / 1e6,
             r.tokens.size(), shown);
  return 0;
}

const CommandRegistrar reg("dump", "Run one backend and write its checkpoints to an HDF5 dump", [](CLI::App& app) {
  auto o = std::make_shared<DumpOptions>();
  o->model = default_model_path();
  app.add_option("--model,-m", o->model, "GGUF model")->capture_default_str();
  o->prompt.add_options(app);
  o->backend.add_options(app);
  CLI::Option* steps = app.add_option("--steps", o->steps, "Greedy decode steps after the prefill (with --feed: the dump's)")
      ->capture_default_str()
      ->check(count_in(0));
  app.add_option("--out,-o", o->out, "Dump file to write (HDF5); with --tp N a directory for rank0.h5 .. rankN-1.h5")
      ->required();
  app.add_flag("--remove-stale", o->remove_stale,
               "Remove the dump temporaries (*.diffrun-tmp-PID) that killed runs left beside --out (otherwise only listed)");
  app.add_option("--checkpoints", o->checkpoints, "Record only these checkpoints, e.g. 'attn_*,result_*'");
  o->size.add_options(app);
  app.add_option("--threads", o->threads, "OpenMP threads of the cpu backend (default: OMP_NUM_THREADS, else every core)")
      ->check(count_in(1, 4096));
  app.add_option("--replay", o->replay,
                 "Isolation replay: feed this reference dump's tokens and continue from its tensor at every checkpoint");
  app.add_option("--follow-routing", o->follow_routing,
                 "Mixtures of experts, cpu: the reference for this engine dump, fed its tokens and run again taking "
                 "its experts where a near tie of the router flipped (a routing flip by drift), so that compare "
                 "judges what comes after on the same experts");
  app.add_option("--feed", o->feed,
                 "Teacher forcing, as an outside engine is fed: this dump's prompt (unless --prompt or --tokens give "
                 "the same) and, at each decode step, its token instead of this backend's argmax; --steps defaults to "
                 "the steps it holds");
  return [o, steps] {
    o->steps_given = steps->count() > 0;
    return run_dump(*o);
  };
});

}  // namespace
}  // namespace diffrun::cli
