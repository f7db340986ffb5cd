// The top-level job's pipeline: backend threads, a comparator thread per pair, dumps by --dump (see pipeline.hpp).
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

#include "checkpoints/dump_format.hpp"
#include "checkpoints/replay_sink.hpp"
#include "checkpoints/rows.hpp"
#include "checkpoints/vocabulary.hpp"
#include "cli/interrupt.hpp"
#include "diff/stream.hpp"
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

namespace {

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
void name_thread(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

// Cores enough for the work beside the backends to run on threads of its own (the dump writes, a
// side running ahead, parallel comparisons). On fewer, every core already runs a backend, and that
// work costs more than it overlaps (the README's CPU-only job on 2 cores: up to 0.25 s longer with it).
// DIFFRUN_SPARE_CORES=0|1 decides instead (the tests run both ways on any machine).
bool spare_cores() {
  if (const char* v = std::getenv("DIFFRUN_SPARE_CORES"); v && *v) return std::strcmp(v, "0") != 0;
  return available_cores() >= 8;
}

// With spare cores and a CUDA engine beside it, a CPU reference's threads (this one and the OpenMP
// threads it starts, which inherit it) run at nice kReferenceNice, so that the engines' kernel launches
// and the comparisons are not queued behind the references' threads. Since the engines' weights load
// through pinned pieces, the references' decode steps end the GPU job; nice 0 measured the same there
// (bench/NOTES.md). DIFFRUN_REFERENCE_NICE=N sets N (0: as the rest).
constexpr int kReferenceNice = 5;

void lower_reference_priority() {
  int nice = kReferenceNice;
  if (const char* v = std::getenv("DIFFRUN_REFERENCE_NICE"); v && *v) nice = std::clamp(std::atoi(v), 0, 19);
  if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), getpriority(PRIO_PROCESS, 0) + nice);
}

// The dump writers' options for this run: with spare cores each dump is written from a process of its
// own (DumpWriterOptions::child_process), so that the run's dumps (up to five) do not queue for HDF5's
// one lock. DIFFRUN_DUMP_PROCESSES=0|1 decides instead.
DumpWriterOptions writer_options(const DumpWriterOptions& writer) {
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
std::pair<int, int64_t> writer_rows(std::string_view name, std::string_view layout, std::span<const int64_t> shape,
                                    const DumpWriterOptions& w) {
  const int rd = row_dim(layout);
  if (rd < 0 || is_cache_layout(layout) || rd >= static_cast<int>(shape.size())) return {-1, 0};
  const int64_t keep = kept_rows(parse_checkpoint_name(name).base, shape[rd], {w.softmax_rows, w.logits_rows, w.token_rows});
  if (keep >= shape[rd]) return {-1, 0};
  return {rd, shape[rd] - keep};
}

// Row-major `shape` along dimension rd: rows from..end of every outer index (from > 0), or all rows
// of `values` with zero rows 0..from-1 put back in front (from < 0: -from rows added).
std::vector<float> rows_from(std::span<const float> values, std::span<const int64_t> shape, int rd, int64_t from) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < rd; ++i) outer *= shape[i];
  for (size_t i = rd + 1; i < shape.size(); ++i) inner *= shape[i];
  const int64_t rows = shape[rd];  // rows of `values`
  const int64_t out_rows = rows - from;
  std::vector<float> out(static_cast<size_t>(outer * out_rows * inner), 0.0f);
  for (int64_t i = 0; i < outer; ++i) {
    if (from >= 0) {
      std::copy_n(values.data() + (i * rows + from) * inner, out_rows * inner, out.data() + i * out_rows * inner);
    } else {
      std::copy_n(values.data() + i * rows * inner, rows * inner, out.data() + (i * out_rows - from) * inner);
    }
  }
  return out;
}

// A recorded checkpoint as DumpReader presents it from the dump (its rows as the writer keeps them:
// rows 0..row_offset-1 of dimension row_dim cut away). `who` names the side in an error.
DatasetInfo dataset_info(const ModelConfig& cfg, const char* who, int step, const std::string& name, int layer,
                         const std::string& layout, const std::vector<int64_t>& shape, NativeDType native,
                         int row_dim, int64_t row_offset) {
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

int64_t message_bytes(const Message& m) {
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

}  // namespace

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

namespace {

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
  cx.sh.timing("{}: loaded", who);
  Message meta(Message::meta);
  meta.dump_meta = dump_meta(cx.file, *backend, cx.opt.prompt, cx.ids);
  meta.dump_meta.facts["run_id"] = cx.opt.run_id;
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
    end.path = backend->last_step_path();
    if (check_recording) recorded_logits.push_back(logits);
    if (source) {
      std::lock_guard lock(cx.sh.m);
      cx.sh.feed.push_back(end.argmax);
      cx.sh.cv.notify_all();  // the other backends wait for the token
    }
    cx.sh.push(side, p, std::move(end));
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
  cx.sh.push(side, p, Message(Message::done));
  cx.sh.side_done(side, p);
  if (side == kEngine && pair.keep_engine && cx.kept) (*cx.kept)[p] = std::move(backend);
}

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
        writes_.post(
            [w, fed, facts = metas[side].facts, argmax = argmax_[side], paths = paths_[side]] {
              set_run_attributes(*w, facts, fed, argmax, paths);
              w->finish();
            },
            0);
      }
    }
    writes_.drain();
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
    if (writes_.threaded()) write_to(w, Message(m), checkpoints);
    else record_to(w, m, checkpoints);
  }

  void write_to(DumpWriter& w, Message&& m, bool checkpoints) {
    if (m.kind != Message::ids && !checkpoints) return;
    if (!writes_.threaded()) {
      record_to(w, m, checkpoints);
      return;
    }
    const auto bytes = message_bytes(m);
    writes_.post([&w, m = std::move(m), checkpoints] { record_to(w, m, checkpoints); }, bytes);
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
            // copies it in its parallel loop only while another still holds it).
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
  WriteQueue writes_;                    // after the writers: its thread stops before they are destroyed
  const size_t batch_bytes_ = spare_cores() ? kBatchBytes : 0;  // one checkpoint at a time without
  HeldReference* held_ref_ = nullptr;    // the reference's checkpoints kept for the isolation replay
  std::vector<int32_t> argmax_[2];
  StepPaths paths_[2];  // per step: StepPath (root attributes step_graph, step_fused)
  std::optional<HeldStep> held_;
  int first_nonfinite_ = -1;
};

// OpenMP threads of a comparator's or a replay's batch of comparisons (StreamComparison::add_all):
// a share of the cores where there are many (the backends mostly wait on the comparators once the
// prefill is done), else one.
int comparison_threads(const Context& cx) {
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
    sc_.add(diff::StreamSide::engine,
            dataset_info(cfg_, "engine", step, std::string(name), layer, std::string(layout),
                         std::vector<int64_t>(shape.begin(), shape.end()), native, rd, offset),
            offset > 0 ? std::make_shared<std::vector<float>>(rows_from(data, shape, rd, offset)) : std::move(all));
  }

  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    if (name != kTokensCheckpoint) return;
    if (writer_) {
      writes_.post([w = writer_, step, tokens = std::vector<int32_t>(ids.begin(), ids.end())] {
        w->record_ids(step, kTokensCheckpoint, tokens);
      }, 0);
    }
    sc_.add_tokens(diff::StreamSide::engine, step, std::vector<int32_t>(ids.begin(), ids.end()));
  }

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
    // The reference's side of the step, once the engine no longer needs its values.
    sc_.add_tokens(diff::StreamSide::reference, step, std::move(held.tokens));
    std::vector<std::pair<DatasetInfo, diff::StreamComparison::Values>> batch;
    batch.reserve(held.tensors.size());
    for (HeldReference::Tensor& t : held.tensors) batch.emplace_back(std::move(t.info), std::move(t.values));
    held.tensors.clear();
    held.tensors.shrink_to_fit();
    sc_.add_all(diff::StreamSide::reference, std::move(batch));  // the step's comparisons, in parallel
    sc_.end_step(step);
    return forward_s;
  }

  // Attaches the replay's local errors to `c` (diff::add_isolation) and writes the isolated dump.
  void attach(diff::Comparison& c, const std::string& engine_name, const std::string& reference_name,
              const std::vector<int32_t>& reference_argmax) {
    if (writer_) {
      writes_.post([this, facts = engine_.facts()] {
        set_run_attributes(*writer_, facts, fed_, argmax_, paths_);
        writer_->finish();
      }, 0);
      writes_.drain();
    }
    diff::Comparison isolated = sc_.finish(engine_name, reference_name, argmax_, reference_argmax);
    isolated.step_fused = paths_.fused;
    isolated.step_graph = paths_.graph;
    diff::add_isolation(c, isolated, rules_.copt);
  }

 private:
  static DumpMeta meta_of(const GgufFile& file, const Backend& engine, const std::vector<int32_t>& ids,
                          const PipelineOptions& opt) {
    DumpMeta meta = dump_meta(file, engine, opt.prompt, ids);
    meta.facts["run_id"] = opt.run_id;
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
  std::optional<HeldReplaySink> sink_;
  std::vector<int32_t> fed_, argmax_;
  StepPaths paths_;  // the engine's StepPath per replayed step
};

// What the isolated comparison calls its dumps: the isolated dump and the reference's, or "not written".
std::pair<std::string, std::string> isolated_names(const PipelinePair& pair, DumpMode mode) {
  return {pair.isolated_path.empty() ? not_written(mode) : pair.isolated_path,
          mode == DumpMode::full ? pair.reference_path : not_written(mode)};
}

// The isolation replay beside the pipeline (PipelinePair::replay_beside): a second engine replays
// each held step once the pair's comparator has taken the reference's side of it.
struct BesideReplay {
  std::unique_ptr<Backend> engine;  // declared first: the replay refers to it
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
    if (step > 0) {
      const double forward_s = out.replay->step(step, *st);
      cx.sh.timing("pair {} isolation replay: step {} done (forward {:.3f} s)", p + 1, step, forward_s);
      continue;
    }
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
  }
}

}  // namespace

std::vector<diff::Comparison> run_pipeline(const GgufFile& file, const ModelConfig& cfg,
                                           const std::vector<PipelinePair>& pairs, const std::vector<int32_t>& ids,
                                           const PipelineOptions& opt, Progress& progress,
                                           std::vector<std::unique_ptr<Backend>>* kept,
                                           std::vector<HeldReference>* held) {
  Shared sh;
  sh.ended.assign(pairs.size(), -1);
  sh.queue[kEngine].resize(pairs.size());
  sh.queue[kReference].resize(pairs.size());
  sh.queued.assign(pairs.size(), 0);
  sh.position[kEngine].resize(pairs.size());
  sh.position[kReference].resize(pairs.size());
  sh.progress = &progress;
  sh.lead_bytes = spare_cores() ? kLeadBytes : 0;
  sh.queue_cv = std::make_unique<std::condition_variable[]>(pairs.size());
  sh.lock_cv = std::make_unique<std::condition_variable[]>(pairs.size());
  if (kept) kept->resize(pairs.size());
  sh.compared_all.assign(pairs.size(), 0);
  sh.prefilled.assign(pairs.size(), 0);
  sh.recording.assign(pairs.size(), std::nullopt);
  if (held) held->assign(pairs.size(), HeldReference{});
  std::vector<BesideReplay> beside(pairs.size());
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
      threads.emplace_back(guarded([&cx, p, &beside] { replay_thread(cx, p, beside[p]); }));
  }
  for (std::thread& t : threads) t.join();
  progress.timing("pipeline threads joined");
  progress.finish();
  if (sh.error) std::rethrow_exception(sh.error);
  for (size_t p = 0; p < pairs.size(); ++p) out[p].recording = sh.recording[p];
  for (size_t p = 0; p < pairs.size(); ++p) {
    if (!beside[p].replay) continue;
    const auto [engine_name, reference_name] = isolated_names(pairs[p], opt.dump);
    beside[p].replay->attach(out[p], engine_name, reference_name, (*held)[p].argmax);
    progress.timing(fmt::format("pair {} isolation replay: its dump finished, its comparison attached", p + 1));
    beside[p].replay.reset();
    beside[p].engine.reset();
    progress.timing(fmt::format("pair {} isolation replay attached", p + 1));
  }
  return out;
}


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
