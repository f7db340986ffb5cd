// Streaming comparison: checkpoints compared on arrival by the comparator's own building blocks (diff/compare.hpp).
#include "diff/stream.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/error.hpp"

namespace diffrun::diff {

StreamComparison::StreamComparison(DumpMeta engine, DumpMeta reference, ToleranceSet tolerances, CompareOptions opt)
    : meta_{std::move(engine), std::move(reference)},
      tolerances_(std::move(tolerances)),
      opt_(opt),
      dims_(dim_sizes(meta_[1].config)) {
  std::vector<std::string> refused = incompatibilities(meta_[0], meta_[1]);
  if (!refused.empty()) {
    if (!opt_.force) throw InputError(fmt::format("the engine and the reference are not comparable: {}", fmt::join(refused, "; ")));
  }
}

void StreamComparison::keep_candidate(std::optional<Kept>& slot, const CheckpointResult& r, std::span<const float> a,
                                      std::span<const float> b) {
  if (slot && std::make_pair(slot->step, slot->order) < std::make_pair(r.step, r.order)) return;
  slot = Kept{r.step, r.order, r.name, {a.begin(), a.end()}, {b.begin(), b.end()}};
}

std::optional<std::map<std::pair<int, std::string>, StreamComparison::Pending>::iterator> StreamComparison::arrive(
    int s, const DatasetInfo& info) {
  if (info.step <= last_ended_) {
    throw Error(fmt::format("{} checkpoint {} of step {} arrived after the step ended", s ? "reference" : "engine",
                            info.name, info.step));
  }
  Step& step = steps_[info.step];
  if (!step.names[s].insert(info.name).second) {
    throw Error(fmt::format("{} recorded {} twice in step {}", s ? "the reference" : "the engine", info.name, info.step));
  }
  step.infos[s].push_back(info);
  auto other = pending_[1 - s].find(std::make_pair(info.step, info.name));
  if (other == pending_[1 - s].end()) return std::nullopt;
  return other;
}

CheckpointResult StreamComparison::compare_pair(const Pending& eng, const Pending& ref, ComparedValues& compared) const {
  return compare_checkpoint(eng.info.step, &eng.info, &ref.info, tolerances_, dims_, positions_through(eng.info.step),
                            *eng.values, *ref.values, &compared);
}

void StreamComparison::settle(CheckpointResult r, std::span<const float> a, std::span<const float> b) {
  // A routing flip by drift, judged as end_step will judge it (add_step_results) from the step's routing
  // checkpoints settled so far (they come first in execution order), so that its slots hold no candidate.
  if (r.failed() && r.routing) {
    const auto& settled = steps_[r.step].results;
    excuse_routing_flip(r, [&](const std::string& name) -> const CheckpointResult* {
      const auto it = settled.find(name);
      return it == settled.end() ? nullptr : &it->second;
    }, tolerances_);
  }
  const bool excusable = r.routing && !r.routing->slot_err2.empty();
  if (r.failed() && r.metrics && (first_failed_step_ < 0 || r.step <= first_failed_step_)) {
    // A slot kind may still pass at end_step (a flip judged with the whole step): kept beside the candidate.
    if (excusable) routing_kept_.push_back(Kept{r.step, r.order, r.name, {a.begin(), a.end()}, {b.begin(), b.end()}});
    else keep_candidate(first_failure_, r, a, b);
  }
  if (r.metrics && !r.metrics->finite() && (first_nonfinite_step_ < 0 || r.step <= first_nonfinite_step_))
    keep_candidate(first_nonfinite_, r, a, b);
  steps_[r.step].results.emplace(r.name, std::move(r));
}

void StreamComparison::add(StreamSide side, DatasetInfo info, std::vector<float> values) {
  add(side, std::move(info), std::make_shared<std::vector<float>>(std::move(values)));
}

void StreamComparison::add(StreamSide side, DatasetInfo info, Values values) {
  std::vector<std::pair<DatasetInfo, Values>> one;
  one.emplace_back(std::move(info), std::move(values));
  add_all(side, std::move(one));
}

void StreamComparison::add_all(StreamSide side, std::vector<std::pair<DatasetInfo, Values>> batch) {
  const int s = static_cast<int>(side);
  struct Job {
    Pending mine;
    std::map<std::pair<int, std::string>, Pending>::iterator other;
    CheckpointResult result;
    ComparedValues compared;  // views into mine's and other's values (or rows cut from them)
  };
  std::vector<Job> jobs;
  for (auto& [info, values] : batch) {
    const auto other = arrive(s, info);
    if (!other) {
      const std::pair<int, std::string> key(info.step, info.name);
      pending_[s].emplace(key, Pending{std::move(info), std::move(values)});
    } else {
      jobs.push_back(Job{Pending{std::move(info), std::move(values)}, *other, {}, {}});
    }
  }
  const auto compare = [&](Job& j) {
    j.result = s == 0 ? compare_pair(j.mine, j.other->second, j.compared)
                      : compare_pair(j.other->second, j.mine, j.compared);
  };
  // The largest checkpoints and the logits one at a time, each with every thread for its own parallel
  // loops (the logits' exps: ~15M over a prefill's rows, 450k in a decode step's one row of a 152k
  // vocabulary, which inside the loop below would run on one thread while the rest of the batch is
  // done); then the others in parallel. The results are the same.
  constexpr size_t kLarge = size_t{1} << 20;
  std::vector<Job*> small;
  for (Job& j : jobs) {
    if (j.mine.values->size() >= kLarge || j.mine.info.name == kLogitsCheckpoint) compare(j);
    else small.push_back(&j);
  }
  const int64_t n = static_cast<int64_t>(small.size());
  // Dynamic: the checkpoints' sizes differ by 1000x (a norm's row against the prefill's logits).
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t i = 0; i < n; ++i) compare(*small[i]);
  for (Job& j : jobs) {  // in arrival order, as add() would
    settle(std::move(j.result), j.compared.a, j.compared.b);
    pending_[1 - s].erase(j.other);
  }
}

// The KV length after `step`: the token counts of the steps up to it (the reference's, else the
// engine's), as compare_dumps counts them from the dumps. Every writer records a step's tokens
// before its checkpoints, so they are known when a checkpoint of the step arrives.
int64_t StreamComparison::positions_through(int step) const {
  int64_t n = 0;
  for (const auto& [k, st] : steps_) {
    if (k > step) break;
    if (st.has_tokens[1]) n += static_cast<int64_t>(st.tokens[1].size());
    else if (st.has_tokens[0]) n += static_cast<int64_t>(st.tokens[0].size());
  }
  return n;
}

void StreamComparison::add_tokens(StreamSide side, int step, std::vector<int32_t> tokens) {
  const int s = static_cast<int>(side);
  Step& st = steps_[step];
  st.tokens[s] = std::move(tokens);
  st.has_tokens[s] = true;
}

StreamComparison::StepEnd StreamComparison::end_step(int step) {
  if (step != last_ended_ + 1) throw Error(fmt::format("step {} ended after step {}", step, last_ended_));
  last_ended_ = step;
  Step& st = steps_[step];
  for (int s = 0; s < 2; ++s) {
    if (!st.has_tokens[s]) {
      throw DumpError(fmt::format("the {} recorded no \"tokens\" at step {}: cannot check that both sides ran on the same tokens",
                                  s ? "reference" : "engine", step));
    }
  }
  if (st.tokens[0] != st.tokens[1]) {
    const std::string why =
        fmt::format("different input tokens at step {} (the engine must be fed the reference's tokens)", step);
    if (!opt_.force) throw InputError("the engine and the reference are not comparable: " + why);
  }
  // What stayed one-sided is final now: the other side ended the step without it.
  for (int s = 0; s < 2; ++s) {
    for (auto it = pending_[s].begin(); it != pending_[s].end();) {
      if (it->first.first == step) it = pending_[s].erase(it);
      else ++it;
    }
  }
  const auto by_order = [](const DatasetInfo& x, const DatasetInfo& y) { return x.order < y.order; };
  std::stable_sort(st.infos[0].begin(), st.infos[0].end(), by_order);
  std::stable_sort(st.infos[1].begin(), st.infos[1].end(), by_order);
  Comparison part;
  add_step_results(part, st.infos[0], st.infos[1], [&](const DatasetInfo* e, const DatasetInfo* r) {
    if (e && r) return std::move(st.results.at(e->name));
    return compare_checkpoint(step, e, r, tolerances_, dims_, positions_through(step),
                              [](std::vector<float>&, std::vector<float>&) {});
  }, tolerances_);
  st.results.clear();
  st.ordered = std::move(part.results);
  StepEnd out;
  for (const CheckpointResult& r : st.ordered) {
    out.failed = out.failed || r.failed();
    out.nonfinite = out.nonfinite || (r.metrics && !r.metrics->finite());
  }
  if (out.failed && first_failed_step_ < 0) first_failed_step_ = step;
  // The slot kinds' values kept at settle: those that passed in the end are not needed, nor any but the first.
  std::erase_if(routing_kept_, [&](const Kept& k) {
    if (first_failed_step_ >= 0 && k.step > first_failed_step_) return true;
    if (k.step != step) return false;
    const auto it = std::find_if(st.ordered.begin(), st.ordered.end(), [&](const CheckpointResult& r) { return r.name == k.name; });
    return it == st.ordered.end() || !it->failed();
  });
  std::sort(routing_kept_.begin(), routing_kept_.end(),
            [](const Kept& x, const Kept& y) { return std::make_pair(x.step, x.order) < std::make_pair(y.step, y.order); });
  if (routing_kept_.size() > 1) routing_kept_.resize(1);
  if (out.nonfinite && first_nonfinite_step_ < 0) first_nonfinite_step_ = step;
  // Candidates of later steps than the first failing one are never needed.
  if (first_failure_ && first_failed_step_ >= 0 && first_failure_->step > first_failed_step_) first_failure_.reset();
  if (first_nonfinite_ && first_nonfinite_step_ >= 0 && first_nonfinite_->step > first_nonfinite_step_)
    first_nonfinite_.reset();
  return out;
}

Comparison StreamComparison::finish(const std::string& engine_path, const std::string& reference_path,
                                    std::vector<int32_t> engine_argmax, std::vector<int32_t> reference_argmax,
                                    int last_step) {
  if (finished_) throw Error("a streamed comparison was finished twice");
  finished_ = true;
  Comparison c;
  c.engine_path = engine_path;
  c.reference_path = reference_path;
  c.engine_meta = meta_[0];
  c.reference_meta = meta_[1];
  c.tolerance_source = tolerances_.source;
  c.tolerance_preset = tolerances_.preset;
  for (const auto& r : incompatibilities(meta_[0], meta_[1])) c.warnings.push_back("forced: " + r);
  if (last_step < 0) last_step = last_ended_;
  std::vector<int> steps;
  for (auto& [n, st] : steps_) {
    if (n > last_step || n > last_ended_) continue;
    steps.push_back(n);
    if (st.tokens[0] != st.tokens[1])
      c.warnings.push_back(fmt::format(
          "forced: different input tokens at step {} (the engine must be fed the reference's tokens)", n));
    size_t next = 0;
    auto& ordered = st.ordered;  // a lambda may not capture a structured binding (clang 14)
    add_step_results(c, st.infos[0], st.infos[1],
                     [&](const DatasetInfo*, const DatasetInfo*) { return std::move(ordered.at(next++)); }, tolerances_);
  }
  if (c.coverage.compared == 0) throw DumpError("the engine and the reference recorded no checkpoint in common");
  engine_argmax.resize(std::min(engine_argmax.size(), static_cast<size_t>(last_step + 1)));
  reference_argmax.resize(std::min(reference_argmax.size(), static_cast<size_t>(last_step + 1)));
  finish_comparison(
      c, tolerances_, opt_,
      [&](size_t i, std::vector<float>& a, std::vector<float>& b) {
        const CheckpointResult& r = c.results[i];
        for (const std::optional<Kept>* kept : {&first_failure_, &first_nonfinite_}) {
          if (*kept && (*kept)->step == r.step && (*kept)->name == r.name) {
            a = (*kept)->a;
            b = (*kept)->b;
            return;
          }
        }
        for (const Kept& k : routing_kept_) {
          if (k.step == r.step && k.name == r.name) {
            a = k.a;
            b = k.b;
            return;
          }
        }
        throw Error(fmt::format("the values of {} at step {} were not kept for its error pattern", r.name, r.step));
      },
      steps, engine_argmax, reference_argmax);
  return c;
}

}  // namespace diffrun::diff
