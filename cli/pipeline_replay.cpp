// The pipeline's isolation replay from memory: the engine again on the held reference's checkpoints, each
// compared as it is recorded, beside the pipeline (replay_thread) or after it (add_isolation_held; see
// pipeline.hpp).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>

#include <fmt/core.h>

#include "checkpoints/dump_schema_names.hpp"
#include "cli/pipeline_internal.hpp"
#include "model/error.hpp"

namespace diffrun::cli {
namespace pipeline_detail {
namespace {

// The sink of the isolation replay on a held reference: each checkpoint the engine records goes to
// the isolated dump (when written) and, cut to the rows that dump keeps, to the comparison;
// replacements come from the held reference's current step.
class HeldReplaySink final : public Sink {
 public:
  // `writer` (may be null) is written on `writes`' thread.
  HeldReplaySink(const ModelConfig& cfg, const PipelineOptions& opt, diff::StreamComparison& sc, DumpWriter* writer,
                 WriteQueue& writes)
      : cfg_(cfg), opt_(opt), sc_(sc), writer_(writer), writes_(writes) {}

  bool wants(std::string_view name) const override { return opt_.filter.records(name); }

  void record(int step, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override {
    if (!wants(name)) return;
    const auto [rd, offset] = writer_rows(name, layout, shape, opt_.writer);
    // One copy of the values for the dump write and the comparison, made only where one of them takes
    // every row (the comparison takes the rows the dump keeps).
    diff::StreamComparison::Values all;
    if (writer_ || offset == 0) all = std::make_shared<std::vector<float>>(data.begin(), data.end());
    if (writer_) {
      writes_.post(
          [w = writer_, step, name = std::string(name), layer, layout = std::string(layout),
           shape = std::vector<int64_t>(shape.begin(), shape.end()), native, all] {
            w->record(step, name, layer, layout, shape, native, *all);
          },
          static_cast<int64_t>(data.size_bytes()));
    }
    rule_.recorded(name, static_cast<int64_t>(data.size()));
    const int64_t bytes = static_cast<int64_t>(data.size_bytes());
    recorded_.tensors.emplace_back(
        dataset_info(cfg_, "engine", step, std::string(name), layer, std::string(layout),
                     std::vector<int64_t>(shape.begin(), shape.end()), native, rd, offset),
        offset > 0 ? std::make_shared<std::vector<float>>(rows_from(data, shape, rd, offset)) : std::move(all));
    recorded_.bytes += bytes;
  }

  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    if (name != kTokensCheckpoint) return;
    if (writer_) {
      writes_.post([w = writer_, step, tokens = std::vector<int32_t>(ids.begin(), ids.end())] {
        w->record_ids(step, kTokensCheckpoint, tokens);
      }, 0);
    }
    recorded_.tokens.assign(ids.begin(), ids.end());
  }

  // What the engine recorded of the current step, for the comparison (HeldReplay::step), taken once per step.
  struct Recorded {
    std::vector<int32_t> tokens;
    std::vector<std::pair<DatasetInfo, diff::StreamComparison::Values>> tensors;
    int64_t bytes = 0;
  };
  Recorded take_recorded() { return std::exchange(recorded_, {}); }

  // The reference's tensor of this step and name where ReplaySink's rule allows it; else null, and the
  // engine continues from its own values.
  const float* replacement(int step, std::string_view name) const override {
    if (step != step_ || !held_) return nullptr;
    auto it = index_.find(name);
    if (it == index_.end()) return nullptr;
    const HeldReference::Tensor& t = held_->tensors[it->second];
    return rule_.allows(t.info) ? t.values->data() : nullptr;
  }

  // Starts `step` on the reference's `held` checkpoints of it (indexed by name).
  void start_step(int step, const HeldReference::Step& held) {
    step_ = step;
    held_ = &held;
    index_.clear();
    rule_.start_step();
    for (size_t i = 0; i < held.tensors.size(); ++i) index_.emplace(held.tensors[i].info.name, i);
  }

 private:
  const ModelConfig& cfg_;
  const PipelineOptions& opt_;
  diff::StreamComparison& sc_;
  DumpWriter* writer_;
  WriteQueue& writes_;
  int step_ = -1;
  const HeldReference::Step* held_ = nullptr;
  std::map<std::string, size_t, std::less<>> index_;
  ReplacementRule rule_;
  Recorded recorded_;
};

// The isolation replay of an engine on a held reference, one step at a time: the engine fed the
// reference's tokens, each checkpoint recorded, replaced by the reference's, and compared.
class HeldReplay {
 public:
  HeldReplay(const GgufFile& file, const ModelConfig& cfg, Backend& engine, const DumpMeta& reference_meta,
             const std::vector<int32_t>& ids, const PipelineOptions& opt, const std::string& isolated_path)
      : engine_(engine),
        ids_(ids),
        meta_(meta_of(file, engine, ids, opt)),
        rules_(isolation_rules(meta_, reference_meta, opt.report)),
        sc_(meta_, reference_meta, rules_.tolerances, rules_.copt),
        fed_(ids.begin(), ids.end()) {
    engine.reset();
    if (!isolated_path.empty()) {
      guard_.emplace(isolated_path);
      writer_.emplace(isolated_path, meta_, opt.filter, writer_options(opt.writer));
    }
    sink_.emplace(cfg, opt, sc_, writer_ ? &*writer_ : nullptr, writes_);
  }

  // Step `step` (in order from 0) on the reference's `held` checkpoints of it, which it consumes.
  // Returns the seconds of the engine's forward (its records and replacements included).
  double step(int step, HeldReference::Step& held) {
    if (step > 0 && held.tokens.size() != 1)
      throw Error(fmt::format("the held reference's step {} has {} tokens (expected 1)", step, held.tokens.size()));
    if (ids_.size() + step > static_cast<size_t>(engine_.max_ctx()))
      throw Error("the isolation replay's engine holds too short a context");
    const std::vector<int32_t> tokens = step == 0 ? ids_ : held.tokens;
    if (step > 0) fed_.push_back(tokens[0]);
    sink_->start_step(step, held);
    const auto t0 = std::chrono::steady_clock::now();
    argmax_.push_back(greedy_token(engine_, engine_.forward(step, tokens, *sink_)));
    const double forward_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    paths_.add(engine_.last_step_path());
    // The step's comparison, on compares_' thread while the engine runs the next step (each step's took 12 ms
    // of the SmolLM2 GPU job's replay of 25 ms a step): both sides given to sc_ there, the engine's first as
    // before, the reference's once the engine no longer needs its values.
    HeldReplaySink::Recorded engine_side = sink_->take_recorded();
    std::vector<std::pair<DatasetInfo, diff::StreamComparison::Values>> batch;
    batch.reserve(held.tensors.size());
    int64_t bytes = engine_side.bytes;
    for (HeldReference::Tensor& t : held.tensors) {
      bytes += static_cast<int64_t>(t.values->size() * sizeof(float));
      batch.emplace_back(std::move(t.info), std::move(t.values));
    }
    held.tensors.clear();
    held.tensors.shrink_to_fit();
    compares_.post(
        [this, step, engine_side = std::move(engine_side), tokens = std::move(held.tokens),
         batch = std::move(batch)]() mutable {
          if (compares_.threaded()) omp_set_num_threads(omp_threads_);
          sc_.add_tokens(diff::StreamSide::engine, step, std::move(engine_side.tokens));
          sc_.add_all(diff::StreamSide::engine, std::move(engine_side.tensors));
          sc_.add_tokens(diff::StreamSide::reference, step, std::move(tokens));
          sc_.add_all(diff::StreamSide::reference, std::move(batch));  // the step's comparisons, in parallel
          sc_.end_step(step);
        },
        bytes);
    return forward_s;
  }

  // Writes the isolated dump's run attributes and closes it, once the last step is replayed; after it the
  // replay no longer calls its engine, which may then be released. attach() does it when nobody did.
  void finish_dump() {
    if (dump_finished_) return;
    dump_finished_ = true;
    if (!writer_) return;
    writes_.post([this, facts = engine_.facts()] {
      set_run_attributes(*writer_, facts, fed_, argmax_, paths_);
      writer_->finish();
    }, 0);
    writes_.drain();
  }

  // Attaches the replay's local errors to `c` (diff::add_isolation) and writes the isolated dump.
  void attach(diff::Comparison& c, const std::string& engine_name, const std::string& reference_name,
              const std::vector<int32_t>& reference_argmax) {
    finish_dump();
    compares_.drain();
    diff::Comparison isolated = sc_.finish(engine_name, reference_name, argmax_, reference_argmax);
    isolated.step_fused = paths_.fused;
    isolated.step_graph = paths_.graph;
    diff::add_isolation(c, isolated, rules_.copt);
  }

 private:
  static DumpMeta meta_of(const GgufFile& file, const Backend& engine, const std::vector<int32_t>& ids,
                          const PipelineOptions& opt) {
    DumpMeta meta = dump_meta(file, engine, opt.prompt, ids);
    meta.facts[attr::run_id] = opt.run_id;
    meta.created_utc = utc_now_iso8601();
    meta.diffrun_version = DIFFRUN_VERSION;
    return meta;
  }

  Backend& engine_;
  const std::vector<int32_t>& ids_;
  DumpMeta meta_;
  IsolationRules rules_;
  diff::StreamComparison sc_;
  std::optional<TempGuard> guard_;
  std::optional<DumpWriter> writer_;
  WriteQueue writes_;  // after the writer: its thread stops before the writer is destroyed
  const int omp_threads_ = omp_get_max_threads();  // the caller's, for the comparisons on compares_' thread
  WriteQueue compares_;  // after sc_: its thread stops before sc_ is destroyed
  std::optional<HeldReplaySink> sink_;
  std::vector<int32_t> fed_, argmax_;
  StepPaths paths_;  // the engine's StepPath per replayed step
  bool dump_finished_ = false;
};

// What the isolated comparison calls its dumps: the isolated dump and the reference's, or "not written".
std::pair<std::string, std::string> isolated_names(const PipelinePair& pair, DumpMode mode) {
  return {pair.isolated_path.empty() ? not_written(mode) : pair.isolated_path,
          mode == DumpMode::full ? pair.reference_path : not_written(mode)};
}

}  // namespace

// The isolation replay beside the pipeline (PipelinePair::replay_beside): a second engine replays
// each held step once the pair's comparator has taken the reference's side of it.
struct BesideReplay {
  std::unique_ptr<Backend> engine;  // declared first: the replay refers to it (until its finish_dump)
  std::optional<HeldReplay> replay;
};

// When every engine of the run fits the device twice over (cuda_engines_fit, checked as they load:
// what they hold already only makes it stricter), the second engine loads at once.
void replay_thread(const Context& cx, size_t p, BesideReplay& out) {
  name_thread(fmt::format("replay{}", p + 1));
  const PipelinePair& pair = cx.pairs[p];
  HeldReference& held = (*cx.held)[p];
  const int max_ctx = static_cast<int>(cx.ids.size()) + cx.opt.steps;
  std::vector<BackendOptions> engines;
  for (const PipelinePair& pp : cx.pairs) {
    engines.push_back(pp.engine);
    if (pp.hold_reference && pp.replay_beside) engines.push_back(pp.engine);
  }
  const bool at_once = cuda_engines_fit(cx.file, cx.cfg, engines, max_ctx, static_cast<int>(cx.ids.size()));
  omp_set_num_threads(comparison_threads(cx));
  const auto say = [&](const std::string& text) {
    std::lock_guard lock(cx.sh.m);
    if (cx.sh.progress) cx.sh.progress->message(text);
  };
  const auto after = [&](const Error& e) {
    out.replay.reset();
    out.engine.reset();
    say(fmt::format("the isolation replay runs after the pipeline: {}", e.what()));
  };
  if (at_once) {
    try {
      out.engine = make_backend(cx.file, cx.cfg, pair.engine, max_ctx);
    } catch (const Error& e) {
      after(e);
      return;
    }
    cx.sh.timing("pair {} isolation replay: engine loaded", p + 1);
  } else {
    // Every pair's engine has made its largest allocations (its prefill) before a third one loads.
    std::unique_lock lock(cx.sh.m);
    const auto all_prefilled = [&] {
      return std::all_of(cx.sh.prefilled.begin(), cx.sh.prefilled.end(), [](char c) { return c != 0; });
    };
    cx.sh.cv.wait(lock, [&] { return cx.sh.aborted || all_prefilled() || cx.sh.compared_all[p]; });
    if (cx.sh.aborted || !all_prefilled()) return;
  }
  for (int step = 0;; ++step) {
    HeldReference::Step* st = nullptr;
    {
      // The step once the comparator has taken all of the reference's side of it (before it has
      // compared them all).
      std::unique_lock lock(cx.sh.m);
      const auto complete = [&] { return held.steps.size() > static_cast<size_t>(step) && held.steps[step].complete; };
      cx.sh.cv.wait(lock, [&] { return cx.sh.aborted || complete() || cx.sh.compared_all[p]; });
      if (cx.sh.aborted) return;
      if (!complete()) break;  // the comparator is done: no such step
      st = &held.steps[step];
    }
    if (step == 0) {
      // A second engine that does not fit (device memory) leaves the replay to after the pipeline.
      try {
        if (!out.engine) {
          out.engine = make_backend(cx.file, cx.cfg, pair.engine, max_ctx);
          cx.sh.timing("pair {} isolation replay: engine loaded", p + 1);
        }
        cx.sh.timing("pair {} isolation replay: the reference's step 0 is held", p + 1);
        out.replay.emplace(cx.file, cx.cfg, *out.engine, held.meta, cx.ids, cx.opt, pair.isolated_path);
        const double forward_s = out.replay->step(0, *st);
        cx.sh.timing("pair {} isolation replay: step 0 done (forward {:.3f} s)", p + 1, forward_s);
      } catch (const Error& e) {
        after(e);
        return;
      }
    } else {
      const double forward_s = out.replay->step(step, *st);
      cx.sh.timing("pair {} isolation replay: step {} done (forward {:.3f} s)", p + 1, step, forward_s);
    }
    if (step >= cx.opt.steps) break;  // the last step a run can have
  }
  // The isolated dump closed and the engine released here, beside the comparators' last dump writes, rather than
  // after the pipeline's threads are joined (0.13-0.15 s of the SmolLM2 GPU job's end).
  if (!out.replay) return;
  out.replay->finish_dump();
  out.engine.reset();
  cx.sh.timing("pair {} isolation replay: dump finished, engine released", p + 1);
}

void BesideReplayDeleter::operator()(BesideReplay* r) const { delete r; }

BesideReplayPtr make_beside_replay() { return BesideReplayPtr(new BesideReplay); }

bool attach_beside_replay(BesideReplay& r, diff::Comparison& c, const PipelinePair& pair, DumpMode mode,
                          const std::vector<int32_t>& argmax) {
  if (!r.replay) return false;
  const auto [engine_name, reference_name] = isolated_names(pair, mode);
  r.replay->attach(c, engine_name, reference_name, argmax);
  r.replay.reset();
  r.engine.reset();
  return true;
}

}  // namespace pipeline_detail

using namespace pipeline_detail;

void add_isolation_held(diff::Comparison& c, const GgufFile& file, const ModelConfig& cfg, Backend& engine,
                        HeldReference& reference, const PipelinePair& pair, const std::vector<int32_t>& ids,
                        const PipelineOptions& opt, Progress& progress) {
  const int steps = static_cast<int>(reference.steps.size()) - 1;
  if (steps < 0) throw Error("the isolation replay has no reference step to replay");
  progress.message(fmt::format("isolation replay: the {}/{} engine on the reference's checkpoints", engine.name(),
                               engine.precision()));
  HeldReplay replay(file, cfg, engine, reference.meta, ids, opt, pair.isolated_path);
  const std::string what = fmt::format("engine isolated {}/{} step", engine.name(), engine.precision());
  for (int step = 0; step <= steps; ++step) {
    replay.step(step, reference.steps[step]);
    progress.update(what, step + 1, steps + 1);
  }
  progress.finish();
  const auto [engine_name, reference_name] = isolated_names(pair, opt.dump);
  replay.attach(c, engine_name, reference_name, reference.argmax);
}

}  // namespace diffrun::cli
