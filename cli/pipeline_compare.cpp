// The pipeline's comparator: per pair, the two sides' checkpoints compared as they arrive, the dumps written
// as --dump asks, the steps around the first divergence held for --dump divergence (see pipeline.hpp).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>

#include <fmt/core.h>

#include "cli/pipeline_internal.hpp"
#include "model/error.hpp"

namespace diffrun::cli::pipeline_detail {
namespace {

// The checkpoints of one step of one side, held until --dump divergence knows whether they are written.
struct HeldStep {
  int step = -1;
  std::vector<Message> messages[2];
};

class Comparator {
 public:
  struct Aborted {};  // another thread failed

  Comparator(const Context& cx, size_t p) : cx_(cx), p_(p), pair_(cx.pairs[p]) {}

  diff::Comparison run() {
    DumpMeta metas[2];
    for (int side : {kEngine, kReference}) {
      Message m = next(side);
      if (m.kind != Message::meta) throw Error("a backend sent data before its metadata");
      metas[side] = std::move(m.dump_meta);
    }
    stream_.emplace(metas[kEngine], metas[kReference], tolerances_for(metas[kEngine], metas[kReference], cx_.opt.report),
                    compare_options(cx_.opt.report));
    const DumpWriterOptions wopt = writer_options(cx_.opt.writer);
    if (cx_.opt.dump != DumpMode::none) {
      writers_[kEngine] = std::make_unique<DumpWriter>(pair_.engine_path, metas[kEngine], cx_.opt.filter, wopt);
      writers_[kReference] = std::make_unique<DumpWriter>(pair_.reference_path, metas[kReference], cx_.opt.filter, wopt);
    }
    if (!pair_.replay_path.empty() && pair_.replay_path != pair_.reference_path)
      replay_ = std::make_unique<DumpWriter>(pair_.replay_path, metas[kReference], cx_.opt.filter, wopt);
    if (pair_.hold_reference && cx_.held) {
      held_ref_ = &(*cx_.held)[p_];
      held_ref_->meta = metas[kReference];
    }
    int last = -1;
    for (int step = 0; step <= cx_.opt.steps; ++step) {
      {
        // Every comparator has finished the step before: the stop step is final up to this one.
        std::unique_lock lock(cx_.sh.m);
        cx_.sh.cv.wait(lock, [&] { return cx_.sh.aborted || cx_.sh.min_ended() >= step - 1; });
        if (cx_.sh.aborted) return {};
        if (step > cx_.sh.stop_step) break;
      }
      run_step(step);
      last = step;
    }
    if (held_) write_held(false);
    const std::string none = not_written(DumpMode::none);
    std::vector<int32_t> fed(cx_.ids.begin(), cx_.ids.end());
    {
      std::lock_guard lock(cx_.sh.m);
      fed.insert(fed.end(), cx_.sh.feed.begin(), cx_.sh.feed.begin() + std::min<size_t>(cx_.sh.feed.size(), last));
    }
    if (held_ref_) {
      std::lock_guard lock(cx_.sh.m);  // the replay beside the pipeline reads the steps under it
      held_ref_->steps.resize(std::min<size_t>(held_ref_->steps.size(), last + 1));
      held_ref_->argmax.assign(argmax_[kReference].begin(),
                               argmax_[kReference].begin() + std::min<size_t>(argmax_[kReference].size(), last + 1));
    }
    for (int side : {kEngine, kReference}) {
      argmax_[side].resize(std::min<size_t>(argmax_[side].size(), last + 1));
      paths_[side].resize(argmax_[side].size());
      for (DumpWriter* w : {writers_[side].get(), side == kReference ? replay_.get() : nullptr}) {
        if (!w) continue;
        queue_of(*w).post(
            [w, fed, facts = metas[side].facts, argmax = argmax_[side], paths = paths_[side]] {
              set_run_attributes(*w, facts, fed, argmax, paths);
              w->finish();
            },
            0);
      }
    }
    for (WriteQueue& q : writes_) q.drain();
    cx_.sh.timing("pair {} comparator: dumps finished", p_ + 1);
    {
      std::lock_guard lock(cx_.sh.m);
      cx_.sh.compared_all[p_] = 1;
      cx_.sh.cv.notify_all();
    }
    diff::Comparison c = stream_->finish(writers_[kEngine] ? pair_.engine_path : none,
                                         writers_[kReference] ? pair_.reference_path : none, argmax_[kEngine],
                                         argmax_[kReference], last);
    c.step_fused = paths_[kEngine].fused;
    c.step_graph = paths_[kEngine].graph;
    return c;
  }

 private:
  // The next message of `side`.
  Message next(int side) {
    std::unique_lock lock(cx_.sh.m);
    auto& q = cx_.sh.queue[side][p_];
    cx_.sh.queue_cv[p_].wait(lock, [&] { return cx_.sh.aborted || !q.empty(); });
    if (cx_.sh.aborted) throw Aborted();
    Message m = std::move(q.front());
    q.pop_front();
    cx_.sh.unqueue(p_, message_bytes(m));
    return m;
  }

  diff::StreamComparison& stream() { return *stream_; }

  // The checkpoint as DumpReader presents it from the dump (its rows as the writer keeps them).
  DatasetInfo info_of(int side, const Message& m) const {
    return dataset_info(cx_.cfg, side == kEngine ? "engine" : "reference", m.step, m.name, m.layer, m.layout, m.shape,
                        m.native, m.row_dim, m.row_offset);
  }

  // Writes `m` to the dump of `side` (or to `w`), on the write queue's thread when it has one (a
  // message still needed is copied for it).
  void write(int side, const Message& m, bool checkpoints) { write_to(*writers_[side], m, checkpoints); }
  void write(int side, Message&& m, bool checkpoints) { write_to(*writers_[side], std::move(m), checkpoints); }

  void write_to(DumpWriter& w, const Message& m, bool checkpoints) {
    if (queue_of(w).threaded()) write_to(w, Message(m), checkpoints);
    else record_to(w, m, checkpoints);
  }

  void write_to(DumpWriter& w, Message&& m, bool checkpoints) {
    if (m.kind != Message::ids && !checkpoints) return;
    WriteQueue& q = queue_of(w);
    if (!q.threaded()) {
      record_to(w, m, checkpoints);
      return;
    }
    const auto bytes = message_bytes(m);
    q.post([&w, m = std::move(m), checkpoints] { record_to(w, m, checkpoints); }, bytes);
  }

  // Each dump's writes on a thread of their own: one thread for a pair's dumps sent them to their writer processes
  // in turn, so that a dump whose process was busy held back the other's (the 7B shape's job: 2.6 s of dump
  // writes after its last comparison).
  WriteQueue& queue_of(const DumpWriter& w) {
    if (&w == writers_[kEngine].get()) return writes_[0];
    if (&w == replay_.get()) return writes_[2];
    return writes_[1];
  }

  static void record_to(DumpWriter& w, const Message& m, bool checkpoints) {
    if (m.kind == Message::ids) {
      w.record_ids(m.step, kTokensCheckpoint, m.tokens);
    } else if (checkpoints && m.row_offset > 0) {
      // The writer takes the checkpoint as recorded and keeps the same last rows (writer_rows): the
      // rows it drops are put back as zeros for the call.
      std::vector<int64_t> kept = m.shape;
      kept[m.row_dim] -= m.row_offset;
      w.record(m.step, m.name, m.layer, m.layout, m.shape, m.native, rows_from(*m.values, kept, m.row_dim, -m.row_offset));
    } else if (checkpoints) {
      w.record(m.step, m.name, m.layer, m.layout, m.shape, m.native, *m.values);
    }
  }

  // The held step `step` (the deque grows under the lock, which the replay beside the pipeline reads
  // it under; a step's own contents are written before its comparison ends, read after).
  HeldReference::Step& held_step(int step) {
    std::lock_guard lock(cx_.sh.m);  // once per step
    if (held_ref_->steps.size() <= static_cast<size_t>(step)) held_ref_->steps.resize(step + 1);
    return held_ref_->steps[step];
  }

  void write_held(bool checkpoints) {
    for (int side : {kEngine, kReference})
      for (Message& m : held_->messages[side]) write(side, std::move(m), checkpoints);
    held_.reset();
  }

  void run_step(int step) {
    HeldReference::Step* held = held_ref_ ? &held_step(step) : nullptr;  // the reference's, kept for the replay
    bool ended[2] = {false, false};
    HeldStep current;
    current.step = step;
    using clk = std::chrono::steady_clock;
    double t_wait = 0, t_write = 0, t_cmp = 0;
    auto t0 = clk::now();
    const auto lap = [&](double& acc) {
      const auto t = clk::now();
      acc += std::chrono::duration<double>(t - t0).count();
      t0 = t;
    };
    std::vector<Message> run;  // messages of one side taken at once
    std::vector<std::pair<DatasetInfo, diff::StreamComparison::Values>> batch;
    while (!ended[kEngine] || !ended[kReference]) {
      // Both sides record step by step; take whichever has news (the engine's usually comes first),
      // and with a checkpoint the checkpoints queued behind it (up to kBatchBytes), whose comparisons
      // then run in parallel: a comparator behind its backends catches up.
      int side = -1;
      run.clear();
      {
        std::unique_lock lock(cx_.sh.m);
        cx_.sh.queue_cv[p_].wait(lock, [&] {
          return cx_.sh.aborted || (!ended[kEngine] && !cx_.sh.queue[kEngine][p_].empty()) ||
                 (!ended[kReference] && !cx_.sh.queue[kReference][p_].empty());
        });
        if (cx_.sh.aborted) throw Aborted();
        side = !ended[kReference] && !cx_.sh.queue[kReference][p_].empty() ? kReference : kEngine;
        auto& q = cx_.sh.queue[side][p_];
        int64_t taken = 0;  // bytes
        do {
          taken += message_bytes(q.front());
          run.push_back(std::move(q.front()));
          q.pop_front();
        } while (run.back().kind == Message::checkpoint && !q.empty() && q.front().kind == Message::checkpoint &&
                 static_cast<size_t>(taken) < batch_bytes_);
        cx_.sh.unqueue(p_, taken);
      }
      lap(t_wait);
      const auto side_id = side == kEngine ? diff::StreamSide::engine : diff::StreamSide::reference;
      batch.clear();
      for (Message& m : run) {
        if (m.kind == Message::done) throw Error(fmt::format("{} stopped before step {}", side == kEngine ? "the engine" : "the reference", step));
        if (m.step != step) throw Error(fmt::format("step {} arrived while comparing step {}", m.step, step));
        switch (m.kind) {
          case Message::step_end:
            ended[side] = true;
            argmax_[side].push_back(m.argmax);
            paths_[side].add(m.path);
            if (held && side == kReference) {  // the replay beside the pipeline may take the step now
              std::lock_guard lock(cx_.sh.m);
              held->complete = true;
              cx_.sh.cv.notify_all();
            }
            break;
          case Message::ids:
            if (replay_ && side == kReference) write_to(*replay_, m, true);
            if (held && side == kReference) held->tokens = m.tokens;
            stream().add_tokens(side_id, step, m.tokens);
            if (cx_.opt.dump == DumpMode::full) write(side, m, true);
            else if (cx_.opt.dump == DumpMode::divergence) current.messages[side].push_back(std::move(m));
            break;
          case Message::checkpoint: {
            DatasetInfo info = info_of(side, m);
            if (replay_ && side == kReference) write_to(*replay_, m, true);
            // One buffer for every reader: the held step, the dump writes and the comparison (which
            // reads it in place).
            if (held && side == kReference) held->tensors.push_back({info, m.values});
            if (cx_.opt.dump == DumpMode::full) write(side, m, true);
            diff::StreamComparison::Values values = m.values;
            if (cx_.opt.dump == DumpMode::divergence) current.messages[side].push_back(std::move(m));
            batch.emplace_back(std::move(info), std::move(values));
            break;
          }
          default: throw Error("unexpected message from a backend");
        }
      }
      lap(t_write);
      if (!batch.empty()) stream().add_all(side_id, std::move(batch));
      lap(t_cmp);
    }
    const diff::StreamComparison::StepEnd e = stream().end_step(step);
    lap(t_cmp);
    cx_.sh.timing("pair {} comparator: step {}: waited {:.3f} s, wrote {:.3f} s, compared {:.3f} s", p_ + 1,
                              step, t_wait, t_write, t_cmp);
    if (e.nonfinite && first_nonfinite_ < 0) first_nonfinite_ = step;
    if (cx_.opt.dump == DumpMode::divergence) {
      // Around the first divergence k: steps k-1, k, k+1, and the step of the first NaN/Inf.
      const int k = stream().first_failed_step();
      if (held_) write_held(k == step);
      if ((k >= 0 && step <= k + 1) || (e.nonfinite && first_nonfinite_ == step)) {
        held_ = std::move(current);
        write_held(true);
      } else if (k < 0) {
        held_ = std::move(current);
      } else {
        held_ = std::move(current);
        write_held(false);
      }
    }
    std::lock_guard lock(cx_.sh.m);
    if (e.failed && stream().first_failed_step() == step && cx_.opt.stop_at_first >= 0)
      cx_.sh.stop_step = std::min(cx_.sh.stop_step, step + cx_.opt.stop_at_first);
    const int before = cx_.sh.min_ended();
    cx_.sh.ended[p_] = step;
    if (cx_.sh.min_ended() > before && cx_.sh.progress) {
      cx_.sh.progress->update("compared step", step + 1, std::min(cx_.sh.stop_step, cx_.opt.steps) + 1);
    }
    cx_.sh.cv.notify_all();
  }

  const Context& cx_;
  size_t p_;
  const PipelinePair& pair_;
  std::optional<diff::StreamComparison> stream_;
  std::unique_ptr<DumpWriter> writers_[2];
  std::unique_ptr<DumpWriter> replay_;  // the reference's full dump for the isolation replay (replay_path)
  WriteQueue writes_[3];  // the engine's dump, the reference's, replay_ (queue_of); after the writers: their
                          // threads stop before the writers are destroyed
  const size_t batch_bytes_ = spare_cores() ? kBatchBytes : 0;  // one checkpoint at a time without
  HeldReference* held_ref_ = nullptr;    // the reference's checkpoints kept for the isolation replay
  std::vector<int32_t> argmax_[2];
  StepPaths paths_[2];  // per step: StepPath (root attributes step_graph, step_fused)
  std::optional<HeldStep> held_;
  int first_nonfinite_ = -1;
};

}  // namespace

// OpenMP threads of a comparator's or a replay's batch of comparisons (StreamComparison::add_all):
// a share of the cores where there are many (the backends mostly wait on the comparators once the
// prefill is done), else one; DIFFRUN_COMPARISON_THREADS=N sets it.
int comparison_threads(const Context& cx) {
  if (const char* v = std::getenv("DIFFRUN_COMPARISON_THREADS"); v && std::atoi(v) > 0) return std::atoi(v);
  return spare_cores() ? std::max(2, available_cores() / (2 * static_cast<int>(cx.pairs.size()))) : 1;
}

void comparator_thread(const Context& cx, size_t p, diff::Comparison& out) {
  name_thread(fmt::format("comparator{}", p + 1));
  omp_set_num_threads(comparison_threads(cx));
  Comparator c(cx, p);
  try {
    out = c.run();
  } catch (const Comparator::Aborted&) {
  }
}

}  // namespace diffrun::cli::pipeline_detail
