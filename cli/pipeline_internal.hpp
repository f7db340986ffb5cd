// The pipeline's parts shared by its three files (cli/pipeline.cpp: the backends and run_pipeline;
// cli/pipeline_compare.cpp: the comparator; cli/pipeline_replay.cpp: the isolation replay from memory):
// the messages a backend sends its comparator, the run's shared state and its locks, the sink that
// queues a backend's checkpoints, and the dump write queue. Internal to cli/ (see pipeline.hpp).
#pragma once

#include "cli/pipeline.hpp"

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include <fmt/core.h>

#include "checkpoints/vocabulary.hpp"
#include "cli/interrupt.hpp"
#include "diff/stream.hpp"
#include "dump/dump_format.hpp"
#include "dump/replay_sink.hpp"
#include "dump/rows.hpp"
#include "model/error.hpp"

namespace diffrun::cli::pipeline_detail {

constexpr int kEngine = 0, kReference = 1;
// A backend starts step s once its comparator has finished step s - kLookahead or, with many cores
// (spare_cores), while its pair's queues hold under kLeadBytes of values: the references' decode
// steps then go on while the CUDA engines make their context and prefill, and the comparison of the
// prefill follows them instead of holding them.
constexpr int kLookahead = 2;
// One side of a pair may record ahead of the other in a step by kLead checkpoints or, with many
// cores (spare_cores), kLeadBytes of values, whichever allows more: a reference's prefill goes on
// while its CUDA engine loads.
constexpr int64_t kLead = 32;
constexpr int64_t kLeadBytes = int64_t{256} << 20;

// Names the calling thread (at most 15 characters shown), for profilers and debuggers.
inline void name_thread(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

// Cores enough for the work beside the backends to run on threads of its own (the dump writes, a
// side running ahead, parallel comparisons). On fewer, every core already runs a backend, and that
// work costs more than it overlaps (the README's CPU-only job on 2 cores: up to 0.25 s longer with it).
// DIFFRUN_SPARE_CORES=0|1 decides instead (the tests run both ways on any machine).
inline bool spare_cores() {
  if (const char* v = std::getenv("DIFFRUN_SPARE_CORES"); v && *v) return std::strcmp(v, "0") != 0;
  return available_cores() >= 8;
}

// With spare cores and a CUDA engine beside it, a CPU reference's threads (this one and the OpenMP
// threads it starts, which inherit it) run at nice kReferenceNice, so that the engines' kernel launches
// and the comparisons are not queued behind the references' threads. Since the engines' weights load
// through pinned pieces, the references' decode steps end the GPU job; nice 0 measured the same there
// (bench/NOTES.md). DIFFRUN_REFERENCE_NICE=N sets N (0: as the rest).
constexpr int kReferenceNice = 5;

inline void lower_reference_priority() {
  int nice = kReferenceNice;
  if (const char* v = std::getenv("DIFFRUN_REFERENCE_NICE"); v && *v) nice = std::clamp(std::atoi(v), 0, 19);
  if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), getpriority(PRIO_PROCESS, 0) + nice);
}

// The dump writers' options for this run: with spare cores each dump is written from a process of its
// own (DumpWriterOptions::child_process), so that the run's dumps (up to five) do not queue for HDF5's
// one lock. DIFFRUN_DUMP_PROCESSES=0|1 decides instead.
inline DumpWriterOptions writer_options(const DumpWriterOptions& writer) {
  DumpWriterOptions w = writer;
  const char* v = std::getenv("DIFFRUN_DUMP_PROCESSES");
  w.child_process = v && *v ? std::strcmp(v, "0") != 0 : spare_cores();
  return w;
}
constexpr size_t kBatchBytes = size_t{64} << 20;  // of checkpoints a comparator takes from a queue at once

// The rows of a checkpoint the dump writer stores (DumpWriterOptions: the last rows of kq_soft_max,
// result_output, every per-token checkpoint), along the layout's token dimension T: the dimension
// and the first row kept (0: every row). The cache travels whole: readers put the rows each step
// stored back together.
inline std::pair<int, int64_t> writer_rows(std::string_view name, std::string_view layout,
                                           std::span<const int64_t> shape, const DumpWriterOptions& w) {
  const int rd = row_dim(layout);
  if (rd < 0 || is_cache_layout(layout) || rd >= static_cast<int>(shape.size())) return {-1, 0};
  const int64_t keep = kept_rows(parse_checkpoint_name(name).base, shape[rd], {w.softmax_rows, w.logits_rows, w.token_rows});
  if (keep >= shape[rd]) return {-1, 0};
  return {rd, shape[rd] - keep};
}

// A recorded checkpoint as DumpReader presents it from the dump (its rows as the writer keeps them:
// rows 0..row_offset-1 of dimension row_dim cut away). `who` names the side in an error.
inline DatasetInfo dataset_info(const ModelConfig& cfg, const char* who, int step, const std::string& name,
                                int layer, const std::string& layout, const std::vector<int64_t>& shape,
                                NativeDType native, int row_dim, int64_t row_offset) {
  DatasetInfo info;
  info.step = step;
  info.name = name;
  const ParsedCheckpointName parsed = parse_checkpoint_name(name);
  try {
    info.order = checkpoint_order(cfg, parsed.base, parsed.layer);
  } catch (const InputError& e) {
    throw DumpError(fmt::format("the {} recorded '{}' at step {}: {}", who, name, step, e.what()));
  }
  info.layer = layer;
  info.layout = layout;
  info.native_dtype = native_dtype_name(native);
  info.shape = shape;
  if (row_offset > 0) info.shape[row_dim] -= row_offset;
  info.row_offset = row_offset;
  info.is_int = false;
  info.stored_dtype = "float32";
  info.stored_shape = info.shape;
  return info;
}

// What a backend thread hands its comparator, in its recording order.
struct Message {
  enum Kind { meta, checkpoint, ids, step_end, done };
  Message() = default;
  explicit Message(Kind k) : kind(k) {}
  Kind kind = done;
  int step = -1;
  DumpMeta dump_meta;                        // meta
  std::string name;                          // checkpoint
  int layer = -1;                            // checkpoint
  std::string layout;                        // checkpoint
  std::vector<int64_t> shape;                // checkpoint, as recorded
  NativeDType native = NativeDType::f32;     // checkpoint
  int row_dim = -1;                          // checkpoint: the dimension cut to its last rows
  int64_t row_offset = 0;                    // checkpoint: rows 0..row_offset-1 of row_dim are not in values
  // checkpoint, as the dump stores it; one buffer for every reader (the comparison, the dump writes, the
  // held step), made as a (non-const) std::vector<float> (diff::StreamComparison::Values)
  diff::StreamComparison::Values values;
  std::vector<int32_t> tokens;               // ids
  int32_t argmax = -1;                       // step_end
  StepPath path;                             // step_end: how the backend ran the step
};

inline int64_t message_bytes(const Message& m) {
  return static_cast<int64_t>((m.values ? m.values->size() : 0) * sizeof(float) + m.tokens.size() * sizeof(int32_t));
}

// State shared by every thread of the run; one mutex guards it all.
struct Shared {
  std::mutex m;
  // Under m: cv for the rare events (a step compared, a token fed, a prefill done, the end); per pair,
  // queue_cv for its comparator's messages and lock_cv for its two sides' lockstep, so that each of
  // the thousands of checkpoints a step records wakes the one thread that waits for it.
  std::condition_variable cv;
  std::unique_ptr<std::condition_variable[]> queue_cv, lock_cv;
  std::vector<int32_t> feed;  // the first pair's reference's argmax after each step
  int stop_step = INT_MAX;    // the last step the run computes
  std::vector<int> ended;     // per pair: the last step its comparator finished
  std::vector<char> compared_all;  // per pair: its comparator is done (no step beyond `ended`)
  std::vector<char> prefilled;     // per pair: its engine finished step 0 (its largest allocations)
  std::vector<std::optional<diff::RecordingCheck>> recording;  // per pair: the engine's recording check
  std::vector<std::deque<Message>> queue[2];  // per side, per pair
  std::vector<int64_t> queued;                // per pair: bytes of values in its two queues
  std::exception_ptr error;
  bool aborted = false;
  Progress* progress = nullptr;
  // The draft the cpu references compute ahead with (draft_source), null for none; engine_drafts: the first pair's
  // engine publishes its own greedy tokens into it after its prefill (draft_from_engine).
  std::shared_ptr<Draft> draft;
  bool engine_drafts = false;
  int64_t lead_bytes = 0;  // kLeadBytes with spare_cores(), else 0

  // A timing() line of the progress (DIFFRUN_PROGRESS_TIMES), under the lock; formatted only then.
  template <typename... Args>
  void timing(fmt::format_string<Args...> format, Args&&... args) {
    if (!progress || !progress->times()) return;
    const std::string text = fmt::format(format, std::forward<Args>(args)...);
    std::lock_guard lock(m);
    progress->timing(text);
  }

  // Lockstep of the two sides of a pair: where each has recorded up to (step, count in the step).
  struct Position {
    int step = 0;
    int64_t count = 0;
    int64_t bytes = 0;  // of the values recorded in the step
    bool step_done = false;  // the side finished `step`
    bool done = false;       // the side records nothing more
  };
  std::vector<Position> position[2];  // per side, per pair

  int min_ended() const { return *std::min_element(ended.begin(), ended.end()); }

  // Called before a side records a checkpoint of `step` (`bytes` of values): waits while it is both
  // kLead checkpoints and lead_bytes ahead of the other side in the same step (which then is never
  // waiting for it), so that what waits for its counterpart in memory stays bounded. A side that
  // finished the step (or the run) holds no one back, so sides recording different sets cannot wait
  // for each other; across steps the comparator bounds them (kLookahead).
  // Returns the seconds it waited.
  double lockstep(int side, size_t pair, int step, int64_t bytes) {
    std::unique_lock lock(m);
    Position& me = position[side][pair];
    const Position& other = position[1 - side][pair];
    if (me.step != step) me = Position{step};
    const auto t0 = std::chrono::steady_clock::now();
    lock_cv[pair].wait(lock, [&] {
      return aborted || other.done || other.step != step || other.step_done || me.count < other.count + kLead ||
             me.bytes + bytes <= other.bytes + lead_bytes;
    });
    if (aborted) throw Error("stopped: another part of the run failed");
    ++me.count;
    me.bytes += bytes;
    lock_cv[pair].notify_all();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void step_done(int side, size_t pair, int step) {
    std::lock_guard lock(m);
    Position& me = position[side][pair];
    if (me.step != step) me = Position{step};
    me.step_done = true;
    lock_cv[pair].notify_all();
  }
  void side_done(int side, size_t pair) {
    std::lock_guard lock(m);
    position[side][pair].done = true;
    lock_cv[pair].notify_all();
  }

  void fail(std::exception_ptr e) {
    std::lock_guard lock(m);
    if (!error) error = e;
    aborted = true;
    cv.notify_all();
    for (size_t p = 0; p < ended.size(); ++p) {
      queue_cv[p].notify_all();
      lock_cv[p].notify_all();
    }
  }
  // The comparator of `pair` took `bytes` of its queues (under m): backends waiting for room to start
  // a step (kLookahead) may go on once they hold under lead_bytes.
  void unqueue(size_t pair, int64_t bytes) {
    if (queued[pair] >= lead_bytes && queued[pair] - bytes < lead_bytes) cv.notify_all();
    queued[pair] -= bytes;
  }
  void push(int side, size_t pair, Message msg) {
    std::lock_guard lock(m);
    queued[pair] += message_bytes(msg);
    queue[side][pair].push_back(std::move(msg));
    queue_cv[pair].notify_all();
  }
};

// The backend's sink: copies each checkpoint the filter keeps (and every step's tokens) to the comparator.
class QueueSink final : public Sink {
 public:
  QueueSink(Shared& sh, int side, size_t pair, const CheckpointFilter& filter, const DumpWriterOptions& writer)
      : sh_(sh), side_(side), pair_(pair), filter_(filter), writer_(writer) {}
  // Seconds in record() and, of them, waiting in lockstep for the other side (DIFFRUN_PROGRESS_TIMES).
  struct Times {
    double recording = 0, waiting = 0;
  };
  Times& times() { return times_; }

  bool wants(std::string_view name) const override { return filter_.records(name); }
  void record(int step, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override {
    if (!wants(name)) return;
    const auto t0 = std::chrono::steady_clock::now();
    times_.waiting += sh_.lockstep(side_, pair_, step, static_cast<int64_t>(data.size_bytes()));
    Message msg(Message::checkpoint);
    msg.step = step;
    msg.name = std::string(name);
    msg.layer = layer;
    msg.layout = std::string(layout);
    msg.shape.assign(shape.begin(), shape.end());
    msg.native = native;
    // Only the rows the dump keeps travel (a long prompt's kq_soft_max is mostly cut away).
    std::tie(msg.row_dim, msg.row_offset) = writer_rows(name, layout, shape, writer_);
    msg.values = std::make_shared<std::vector<float>>(msg.row_offset > 0 ? rows_from(data, shape, msg.row_dim, msg.row_offset)
                                                                         : std::vector<float>(data.begin(), data.end()));
    sh_.push(side_, pair_, std::move(msg));
    times_.recording += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    if (name != kTokensCheckpoint) return;
    times_.waiting += sh_.lockstep(side_, pair_, step, static_cast<int64_t>(ids.size_bytes()));
    Message msg(Message::ids);
    msg.step = step;
    msg.tokens.assign(ids.begin(), ids.end());
    sh_.push(side_, pair_, std::move(msg));
  }

 private:
  Shared& sh_;
  int side_;
  size_t pair_;
  const CheckpointFilter& filter_;
  const DumpWriterOptions& writer_;
  Times times_;
};

struct Context {
  const GgufFile& file;
  const ModelConfig& cfg;
  const std::vector<PipelinePair>& pairs;
  const std::vector<int32_t>& ids;
  const PipelineOptions& opt;
  Shared& sh;
  std::vector<std::unique_ptr<Backend>>* kept = nullptr;  // engines handed back (PipelinePair::keep_engine)
  std::vector<HeldReference>* held = nullptr;             // references held (PipelinePair::hold_reference)
};


// A comparator's dump writes, on a thread of their own and in the order posted: HDF5's calls are
// serialized process-wide and cost ~50 us a dataset, which the comparison (and through kLookahead
// the backends) would otherwise wait for. post() waits while kBacklogBytes of values are queued;
// the first error a task throws is rethrown by the next post() or drain(). Without spare_cores()
// post() runs the task at once, on the caller's thread.
class WriteQueue {
 public:
  static constexpr int64_t kBacklogBytes = int64_t{256} << 20;

  WriteQueue() {
    if (spare_cores()) thread_ = std::thread([this] { loop(); });
  }
  ~WriteQueue() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(m_);
      stop_ = true;
      tasks_.clear();
    }
    cv_.notify_all();
    thread_.join();
  }
  WriteQueue(const WriteQueue&) = delete;
  WriteQueue& operator=(const WriteQueue&) = delete;

  void post(std::function<void()> task, int64_t bytes) {
    if (!thread_.joinable()) {
      task();
      return;
    }
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return error_ || queued_ + bytes <= kBacklogBytes || tasks_.empty(); });
    if (error_) std::rethrow_exception(error_);
    tasks_.push_back({std::move(task), bytes});
    queued_ += bytes;
    cv_.notify_all();
  }

  bool threaded() const { return thread_.joinable(); }

  // Waits until every task posted has run.
  void drain() {
    if (!thread_.joinable()) return;
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return error_ || (tasks_.empty() && !busy_); });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  struct Task {
    std::function<void()> fn;
    int64_t bytes;
  };

  void loop() {
    name_thread("dump writes");
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (stop_) return;
      Task t = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      std::exception_ptr e;
      try {
        t.fn();
      } catch (...) {
        e = std::current_exception();
      }
      t.fn = nullptr;  // its values freed outside the lock
      lock.lock();
      busy_ = false;
      queued_ -= t.bytes;
      if (e && !error_) {
        error_ = e;
        tasks_.clear();
      }
      cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  int64_t queued_ = 0;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once the rest is made; not started without spare_cores()
};


// One backend: steps 0..opt.steps unless the run stops earlier; the first pair's reference feeds the tokens
// (cli/pipeline.cpp).
void backend_thread(const Context& cx, size_t p, int side);

// Where the references' draft comes from (Backend::set_draft): the fed tokens where they cover every step; else,
// when no backend has faults injected, the first pair's engine's own greedy tokens, from a CUDA engine only
// (a CPU engine's steps cost what the reference's do). DIFFRUN_DRAFT=0: no draft; =1: from an engine of either
// backend. `engine` is set when the first pair's engine is to publish it.
std::shared_ptr<Draft> draft_source(const std::vector<PipelinePair>& pairs, const PipelineOptions& opt, bool& engine);
// The first pair's engine after its recorded prefill: runs the later steps unrecorded on its own greedy tokens
// (from `first`, its choice after the prefill), publishes them as the draft (every 16 tokens as it grows, then
// whole), then empties its cache and runs the prefill again unrecorded, so that its recorded steps go on from the
// same state.
void draft_from_engine(const Context& cx, Backend& engine, int32_t first);

// OpenMP threads of a comparator's or a replay's batch of comparisons (cli/pipeline_compare.cpp).
int comparison_threads(const Context& cx);
// The comparator of pair p: its comparison into `out` (cli/pipeline_compare.cpp).
void comparator_thread(const Context& cx, size_t p, diff::Comparison& out);

// The isolation replay beside the pipeline (PipelinePair::replay_beside; cli/pipeline_replay.cpp).
struct BesideReplay;
struct BesideReplayDeleter {
  void operator()(BesideReplay* r) const;
};
using BesideReplayPtr = std::unique_ptr<BesideReplay, BesideReplayDeleter>;
BesideReplayPtr make_beside_replay();
// A second engine replays each held step of pair p once its comparator has taken the reference's side of it.
void replay_thread(const Context& cx, size_t p, BesideReplay& out);
// Attaches the replay's comparison to `c` and frees the replay and its engine; false when it did not run.
bool attach_beside_replay(BesideReplay& r, diff::Comparison& c, const PipelinePair& pair, DumpMode mode,
                          const std::vector<int32_t>& argmax);

}  // namespace diffrun::cli::pipeline_detail
