// The top-level job's pipeline: backend threads, a comparator thread per pair, dumps by --dump (see pipeline.hpp).
// The comparator is in pipeline_compare.cpp, the isolation replay from memory in pipeline_replay.cpp, what
// they share in pipeline_internal.hpp.
#include "cli/pipeline.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "checkpoints/dump_schema_names.hpp"
#include "cli/pipeline_internal.hpp"
#include "dump/dump_target.hpp"
#include "model/error.hpp"

namespace diffrun::cli {

std::string not_written(DumpMode mode) {
  return std::string("not written (--dump ") +
         (mode == DumpMode::full ? "full" : mode == DumpMode::divergence ? "divergence" : "none") + ")";
}

DumpMode parse_dump_mode(const std::string& s) {
  if (s == "full") return DumpMode::full;
  if (s == "divergence") return DumpMode::divergence;
  if (s == "none") return DumpMode::none;
  throw InputError("--dump: '" + s + "' is not a dump mode (expected full, divergence or none)");
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}


diff::RecordingCheck check_recording_on_engine(Backend& engine, std::span<const int32_t> prompt,
                                               std::span<const int32_t> fed,
                                               const std::vector<std::vector<float>>& recorded) {
  diff::RecordingCheck check;
  check.unrecorded_source = "an unrecorded run of the same tokens";
  engine.reset();
  NullSink none;
  for (size_t step = 0; step < recorded.size() && step <= fed.size(); ++step) {
    const std::vector<float> logits =
        step == 0 ? engine.forward(0, prompt, none)
                  : engine.forward(static_cast<int>(step), std::span<const int32_t>(&fed[step - 1], 1), none);
    if (diff::add_recording_step(check, static_cast<int>(step), recorded[step], logits)) break;
  }
  engine.reset();
  return check;
}


namespace pipeline_detail {

std::shared_ptr<Draft> draft_source(const std::vector<PipelinePair>& pairs, const PipelineOptions& opt, bool& engine) {
  engine = false;
  const std::string mode = draft_mode();
  if (mode == "0" || pairs.empty() || opt.steps < 2) return nullptr;
  if (static_cast<int>(opt.feed.size()) >= opt.steps) return std::make_shared<Draft>(opt.feed);
  for (const PipelinePair& pair : pairs)
    if (!pair.engine.inject.empty() || !pair.reference.inject.empty()) return nullptr;
  if (!opt.feed.empty() || (pairs.front().engine.backend != "cuda" && mode != "1")) return nullptr;
  engine = true;
  return std::make_shared<Draft>();
}

void draft_from_engine(const Context& cx, Backend& engine, int32_t first) {
  const auto t0 = std::chrono::steady_clock::now();
  NullSink none;
  std::vector<int32_t> tokens{first};
  for (int step = 1; step < cx.opt.steps; ++step) {
    {
      std::lock_guard lock(cx.sh.m);
      if (cx.sh.aborted || step > cx.sh.stop_step) return;  // no draft: the references go one step at a time
    }
    const std::vector<float> logits = engine.forward(step, std::span<const int32_t>(&tokens.back(), 1), none);
    tokens.push_back(greedy_token(engine, logits));
    // Published as it grows: on a long run the references' first passes need not wait for the whole draft.
    if (tokens.size() % 16 == 0) cx.sh.draft->publish(tokens);
  }
  cx.sh.draft->publish(tokens);
  engine.reset();
  engine.forward(0, cx.ids, none);
  cx.sh.timing("pair 1 engine: a draft of {} tokens for the references in {:.3f} s", tokens.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// One backend: steps 0..opt.steps unless the run stops earlier; the first pair's reference feeds the tokens.
void backend_thread(const Context& cx, size_t p, int side) {
  const PipelinePair& pair = cx.pairs[p];
  const BackendOptions& bo = side == kEngine ? pair.engine : pair.reference;
  if (bo.backend == "cpu") omp_set_num_threads(side == kEngine ? pair.engine_threads : pair.reference_threads);
  if (side == kReference && bo.backend == "cpu" && pair.engine.backend == "cuda" && spare_cores())
    lower_reference_priority();
  const bool source = p == 0 && side == kReference;
  name_thread(fmt::format("{}{}", side == kEngine ? "engine" : "reference", p + 1));
  const int needed = static_cast<int>(cx.ids.size()) + cx.opt.steps;
  const std::string who = fmt::format("pair {} {} {}/{}", p + 1, side == kEngine ? "engine" : "reference", bo.backend,
                                      bo.precision);
  auto backend = make_backend(cx.file, cx.cfg, bo, needed);
  if (side == kReference && cx.sh.draft) backend->set_draft(cx.sh.draft);
  cx.sh.timing("{}: loaded", who);
  Message meta(Message::meta);
  meta.dump_meta = dump_meta(cx.file, *backend, cx.opt.prompt, cx.ids);
  meta.dump_meta.facts[attr::run_id] = cx.opt.run_id;
  // As the writer fills them, so that the comparison's metadata is the dumps' in every --dump mode.
  meta.dump_meta.created_utc = utc_now_iso8601();
  meta.dump_meta.diffrun_version = DIFFRUN_VERSION;
  cx.sh.push(side, p, std::move(meta));
  QueueSink sink(cx.sh, side, p, cx.opt.filter, cx.opt.writer);
  // The CUDA engine's recording check (check_recording_on_engine): each step's logits, as recorded.
  const bool check_recording = side == kEngine && bo.backend == "cuda" && cx.opt.recording_check;
  std::vector<std::vector<float>> recorded_logits;
  for (int step = 0; step <= cx.opt.steps; ++step) {
    int32_t token = 0;
    {
      std::unique_lock lock(cx.sh.m);
      cx.sh.cv.wait(lock, [&] {
        return cx.sh.aborted || step > cx.sh.stop_step ||
               ((cx.sh.ended[p] >= step - kLookahead || cx.sh.queued[p] < cx.sh.lead_bytes) &&
                (source || step == 0 || static_cast<int>(cx.sh.feed.size()) >= step));
      });
      if (cx.sh.aborted || step > cx.sh.stop_step) break;
      if (step > 0) token = cx.sh.feed[step - 1];
    }
    const auto t0 = std::chrono::steady_clock::now();
    sink.times() = {};
    const std::vector<float> logits =
        step == 0 ? backend->forward(0, cx.ids, sink) : backend->forward(step, std::span<const int32_t>(&token, 1), sink);
    cx.sh.step_done(side, p, step);
    cx.sh.timing("{}: step {} done (forward {:.3f} s, of it recording {:.3f} s, waiting for the other side {:.3f} s)",
                 who, step, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 sink.times().recording, sink.times().waiting);
    if (side == kEngine && step == 0) {
      std::lock_guard lock(cx.sh.m);
      cx.sh.prefilled[p] = 1;
      cx.sh.cv.notify_all();
    }
    Message end(Message::step_end);
    end.step = step;
    end.argmax = greedy_token(*backend, logits);
    const int32_t chosen = end.argmax;
    end.path = backend->last_step_path();
    if (check_recording) recorded_logits.push_back(logits);
    if (source) {
      std::lock_guard lock(cx.sh.m);
      if (static_cast<int>(cx.sh.feed.size()) == step) cx.sh.feed.push_back(end.argmax);  // beyond opt.feed
      cx.sh.cv.notify_all();  // the other backends wait for the token
    }
    cx.sh.push(side, p, std::move(end));
    if (side == kEngine && p == 0 && step == 0 && cx.sh.engine_drafts) draft_from_engine(cx, *backend, chosen);
    // A reference fed by the first pair's computes the draft's next steps while that one computes its token.
    if (side == kReference && !source && cx.sh.draft && step < cx.opt.steps) backend->prepare(step + 1, sink);
  }
  if (check_recording && !recorded_logits.empty()) {
    std::vector<int32_t> fed;
    bool aborted = false;
    {
      std::lock_guard lock(cx.sh.m);
      aborted = cx.sh.aborted;  // another thread failed: its error is the one reported
      fed.assign(cx.sh.feed.begin(), cx.sh.feed.begin() + std::min(cx.sh.feed.size(), recorded_logits.size() - 1));
    }
    if (!aborted) {
      diff::RecordingCheck check = check_recording_on_engine(*backend, cx.ids, fed, recorded_logits);
      cx.sh.timing("{}: recording check on {} steps ({})", who, check.steps, check.same ? "unchanged" : "CHANGED");
      std::lock_guard lock(cx.sh.m);
      cx.sh.recording[p] = std::move(check);
    }
  }
  if (side == kReference && cx.sh.draft)
    cx.sh.timing("{}: {} of {} decode steps out of passes over the draft", who, backend->steps_from_draft(),
                 cx.opt.steps);
  cx.sh.push(side, p, Message(Message::done));
  cx.sh.side_done(side, p);
  if (side == kEngine && pair.keep_engine && cx.kept) {
    (*cx.kept)[p] = std::move(backend);
    return;
  }
  backend.reset();
  cx.sh.timing("{}: released", who);
}

}  // namespace pipeline_detail

using namespace pipeline_detail;

std::vector<diff::Comparison> run_pipeline(const GgufFile& file, const ModelConfig& cfg,
                                           const std::vector<PipelinePair>& pairs, const std::vector<int32_t>& ids,
                                           const PipelineOptions& opt, Progress& progress,
                                           std::vector<std::unique_ptr<Backend>>* kept,
                                           std::vector<HeldReference>* held) {
  // Each dump in a process of its own needs diffrun-dump-child beside diffrun (the build makes both). Without it
  // the run's dumps (up to five) take turns at HDF5's one lock in this process: on the GPU host's SmolLM2 job the
  // dumps then finished 1.0 s after the last comparison instead of 0.3 s (bench/NOTES.md).
  static std::once_flag said;
  if (opt.dump != DumpMode::none && writer_options(opt.writer).child_process && dump_child_executable().empty())
    std::call_once(said, [&] {
      progress.message("diffrun-dump-child is not beside this diffrun: every dump is written from this process, one "
                       "HDF5 call at a time, which is slower (put it there, or name it with DIFFRUN_DUMP_CHILD; "
                       "DIFFRUN_DUMP_PROCESSES=0 writes in this process without this note)");
    });
  Shared sh;
  sh.feed = opt.feed;
  sh.ended.assign(pairs.size(), -1);
  sh.queue[kEngine].resize(pairs.size());
  sh.queue[kReference].resize(pairs.size());
  sh.queued.assign(pairs.size(), 0);
  sh.position[kEngine].resize(pairs.size());
  sh.position[kReference].resize(pairs.size());
  sh.progress = &progress;
  sh.draft = draft_source(pairs, opt, sh.engine_drafts);
  sh.lead_bytes = spare_cores() ? kLeadBytes : 0;
  sh.queue_cv = std::make_unique<std::condition_variable[]>(pairs.size());
  sh.lock_cv = std::make_unique<std::condition_variable[]>(pairs.size());
  if (kept) kept->resize(pairs.size());
  sh.compared_all.assign(pairs.size(), 0);
  sh.prefilled.assign(pairs.size(), 0);
  sh.recording.assign(pairs.size(), std::nullopt);
  if (held) held->assign(pairs.size(), HeldReference{});
  std::vector<BesideReplayPtr> beside;
  for (size_t p = 0; p < pairs.size(); ++p) beside.push_back(make_beside_replay());
  const Context cx{file, cfg, pairs, ids, opt, sh, kept, held};
  std::vector<diff::Comparison> out(pairs.size());
  std::vector<std::thread> threads;
  const auto guarded = [&sh](auto fn) {
    return [&sh, fn]() {
      try {
        fn();
      } catch (...) {
        sh.fail(std::current_exception());
      }
    };
  };
  for (size_t p = 0; p < pairs.size(); ++p) {
    threads.emplace_back(guarded([&cx, p] { backend_thread(cx, p, kReference); }));
    threads.emplace_back(guarded([&cx, p] { backend_thread(cx, p, kEngine); }));
    threads.emplace_back(guarded([&cx, p, &out] { comparator_thread(cx, p, out[p]); }));
    if (held && pairs[p].hold_reference && pairs[p].replay_beside)
      threads.emplace_back(guarded([&cx, p, &beside] { replay_thread(cx, p, *beside[p]); }));
  }
  for (std::thread& t : threads) t.join();
  progress.timing("pipeline threads joined");
  progress.finish();
  if (sh.error) std::rethrow_exception(sh.error);
  for (size_t p = 0; p < pairs.size(); ++p) out[p].recording = sh.recording[p];
  for (size_t p = 0; p < pairs.size(); ++p) {
    if (!held || !attach_beside_replay(*beside[p], out[p], pairs[p], opt.dump, (*held)[p].argmax)) continue;
    progress.timing(fmt::format("pair {} isolation replay attached", p + 1));
  }
  return out;
}

// The routing follow-up (pipeline.hpp).
void follow_routing_drift(const GgufFile& file, const ModelConfig& cfg, const std::vector<PipelinePair>& pairs,
                          const std::vector<int32_t>& ids, const std::vector<int32_t>& fed, const PipelineOptions& popt,
                          std::vector<diff::Comparison>& comparisons, Progress& progress,
                          std::vector<std::unique_ptr<Backend>>* kept, std::vector<HeldReference>* held) {
  for (size_t p = 0; p < pairs.size(); ++p) {
    if (pairs[p].reference.backend != "cpu") continue;
    std::vector<diff::RoutingFlip> followed;
    const auto run_again = [&](const std::vector<diff::RoutingFlip>& so_far,
                               const std::vector<diff::RoutingFlip>& added) {
      const diff::CheckpointResult& failure = comparisons[p].results[*comparisons[p].first_failure];
      progress.message(fmt::format("{}: diverged at {} (step {}) after {} routing flip{} by drift (step {} layer {} "
                                   "token {} the first); running the pair again with the reference following the "
                                   "engine's experts there",
                                   pairs[p].title, failure.name, failure.step, added.size(), added.size() == 1 ? "" : "s",
                                   added.front().step, added.front().layer, added.front().token));
      PipelinePair again = pairs[p];
      again.reference.forced_routing = forced_routing(so_far);
      PipelineOptions opt = popt;
      opt.feed = fed;
      std::vector<std::unique_ptr<Backend>> engines;
      std::vector<HeldReference> references;
      std::vector<diff::Comparison> out = run_pipeline(file, cfg, {again}, ids, opt, progress, &engines, &references);
      diff::Comparison& c = out.front();
      // The engine ran again on the same tokens: where it now chose otherwise at a followed row, it is not
      // deterministic, and that row's flip is judged against experts the reference took from the first run.
      for (const diff::RoutingLayer& l : c.routing.layers) {
        for (const diff::RoutingFlip& f : l.flips) {
          const auto first = std::find_if(so_far.begin(), so_far.end(),
                                          [&](const diff::RoutingFlip& g) { return same_routing_row(f, g); });
          if (first == so_far.end()) continue;
          c.warnings.push_back(fmt::format(
              "routing: at step {} layer {} token {} the engine chose experts {{{}}} in the run again, {{{}}} in the "
              "first run: it does not choose alike on the same tokens",
              f.step, f.layer, f.token, fmt::join(f.engine, ","), fmt::join(first->engine, ",")));
        }
      }
      if (kept && p < kept->size()) (*kept)[p] = std::move(engines.front());
      if (held && p < held->size()) (*held)[p] = std::move(references.front());
      return std::move(c);
    };
    follow_flips(comparisons[p], followed, run_again);
    if (!followed.empty()) comparisons[p].routing.followed = std::move(followed);  // with the first runs' evidence
  }
}


std::vector<int32_t> fed_tokens(const diff::Comparison& first) {
  std::vector<int32_t> fed;
  for (const diff::StepTokens& t : first.tokens) fed.push_back(t.reference);
  return fed;
}

}  // namespace diffrun::cli
