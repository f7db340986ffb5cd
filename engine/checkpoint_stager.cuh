// Checkpoint hooks, the recording side: copies of the recorded device tensors into pinned host memory
// (allocated in chunks on first use and reused every step), handed to the sink after the step's
// synchronization as f32 with their native dtype; and isolation-replay uploads of replacements.
//
// Two ways to copy (DIFFRUN_CHECKPOINT_COPY):
// - "gather" (the default where the device addresses pinned host memory directly): stage() only notes
//   the tensor; flush() copies every tensor noted since the last flush into a device arena (f32, f16
//   widened on the device), one kernel launch per up to kGatherBatch tensors, then a second stream
//   copies that part of the arena to pinned memory while the compute goes on. The engine calls
//   flush() before an op overwrites a buffer it staged (an in-place op, a buffer reused later in the
//   step) and finish() at the end of the step. A decode step records ~20 tensors a layer with ~3
//   flushes, where one cudaMemcpyAsync each on the compute stream costs a copy-engine round trip
//   (~6 µs) between two kernels. A tensor larger than half the arena (32 MiB;
//   DIFFRUN_CHECKPOINT_ARENA_KIB) is written by the gather kernel straight into the pinned memory
//   through the device's mapping of it; a full arena waits for its copies out before it is reused.
// - "memcpy": one cudaMemcpyAsync per tensor at stage() (f16 widened on the host); flush() does
//   nothing. The path before gather, kept for A/B and as the fallback.
// - flush_beside() (gather mode): every gather of the flush on the second stream, each writing straight
//   into the pinned memory through its device mapping, after the compute stream's work so far; the
//   compute stream waits on its ticket only before it overwrites one of the tensors. The engine's
//   one-token steps flush each layer this way (their activation sets alternate, so a layer's tensors
//   live until the end of the next one): no gather kernel or copy sits between two of their ops. The
//   copy engine's copies out of the arena did not overlap the compute inside the decode graph (they
//   cost about their transfer time, 0.09 of the 0.5B shape's 0.17 ms a step); the mapped writes do.
// Both modes record the same values, in the same order (EngineModel.CheckpointCopyModesRecordTheSameValues).
//
// Recording inside a captured CUDA graph (gather mode): the engine stages, flushes and finishes while
// its decode step is captured, so the gather kernels and the copies out become nodes of the step's
// graph. take_staged() then moves out what the capture noted (names, shapes, pinned destinations),
// and each replay of the graph hands it back with restage(), for that replay's step. A tensor whose
// length follows the position (the cache, a decode step's probabilities: S rows) is staged with
// DeviceRows: the gather kernel reads S from the device when it runs, its pinned destination holds
// max_rows, and the gather writes it there directly (no copy node of a fixed size).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "checkpoints/sink.hpp"
#include "engine/device_buffer.cuh"

namespace diffrun::engine {

// A staged tensor whose dimension s_dim is S = *n_past + add, read on the device when the copy runs
// (so one captured graph records every position); max_rows bounds S.
struct DeviceRows {
  const int32_t* n_past = nullptr;  // [1] device; null: the shape as given
  int add = 0;
  int s_dim = 0;
  int64_t max_rows = 0;
  // The tensor keeps its values until the step ends (the KV cache): gathered on the copy stream,
  // beside the compute, instead of on the compute stream before the next op.
  bool until_step_end = false;
};

class CheckpointStager {
  struct Pending;

 public:
  // What a captured step staged, handed back at each replay of its graph.
  using Staged = std::vector<Pending>;

  CheckpointStager();
  ~CheckpointStager();
  CheckpointStager(const CheckpointStager&) = delete;
  CheckpointStager& operator=(const CheckpointStager&) = delete;

  // Notes (gather) or enqueues the copy (memcpy) of the row-major tensor `dev` of `shape` (f32 or f16
  // device memory). In gather mode `dev` must keep its values until the next flush() on `stream`.
  // With rows.n_past set (gather mode only), the S dimension is read on the device as described above.
  void stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
             const float* dev, cudaStream_t stream, DeviceRows rows = {});
  void stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
             const __half* dev, cudaStream_t stream, DeviceRows rows = {});

  // After a step enqueued under stream capture (and finish()): what it staged, for restage(); the
  // stager is then empty, as after deliver().
  Staged take_staged();
  // Before a replay's synchronization and deliver(): the captured tensors again, as step `step`
  // whose S (DeviceRows tensors) is `S`. `staged` must outlive the deliver() or discard() that follows.
  void restage(const Staged& staged, int step, int64_t S);

  // Enqueues the copies of everything staged since the last flush (gather mode; else nothing).
  void flush(cudaStream_t stream);
  // flush() when a tensor staged since the last flush lies in the device bytes [dev, dev + bytes): before
  // an op writes over them in place. Nothing otherwise, and nothing in memcpy mode (copied at stage()).
  void before_overwrite(const void* dev, size_t bytes, cudaStream_t stream);
  // flush(), then makes `stream` wait for the copies to pinned memory: the step's end, before the
  // synchronization that precedes deliver().
  void finish(cudaStream_t stream);
  // Like flush(), but every copy (the gather kernels too) runs on the copy stream, after the work
  // enqueued on `stream` so far: nothing lands on `stream`, so the compute goes on at once. For tensors
  // that keep their values for a while after (a one-token step's alternating activation sets, see
  // engine/cuda_engine.cu). Returns a ticket for wait_flushed(), or -1 when nothing was staged.
  int flush_beside(cudaStream_t stream);
  // Makes `stream` wait until the copies of flush_beside()'s ticket have read their tensors: before an
  // op overwrites one of them. Tickets alternate between two events: a ticket is good until the
  // second flush_beside() after it. -1: nothing to wait for.
  void wait_flushed(int ticket, cudaStream_t stream);
  // After the step's synchronization, before deliver(): the pinned f32 copy of the last staged tensor
  // when it is named `name` (the logits, which a step stages last), else null.
  const float* last_staged_f32(std::string_view name) const;

  // Enqueues the upload of n replacement values (host f32) over `dev`, converted to dev's type,
  // after flushing what was staged (a staged copy of `dev` records the values before replacement).
  void replace(const float* host, float* dev, int64_t n, cudaStream_t stream);
  void replace(const float* host, __half* dev, int64_t n, cudaStream_t stream);

  // After a flush() and the stream's synchronization: records every staged checkpoint, in staging
  // order, then starts the next step on the same pinned memory.
  void deliver(Sink& sink);
  // Drops what was staged (a step that failed).
  void discard();

  bool gathers() const { return gather_; }
  // The copy mode, for the engine's facts.
  const char* mode() const;

 private:
  struct Pending {
    int step;
    int s_dim;  // DeviceRows: the dimension that is S (restage sets it), else -1
    std::string name;
    int layer;
    const char* layout;
    std::vector<int64_t> shape;
    bool native_f16;  // the device tensor's dtype
    bool host_f16;    // the pinned copy holds halves, widened at delivery (memcpy mode)
    const void* host;  // pinned
    int64_t n;
  };
  struct Copy {
    const void* src;  // device
    float* dst;       // the arena, or pinned host memory as the device addresses it
    int64_t n;        // DeviceRows: the most elements (max_rows)
    const int32_t* n_past;  // DeviceRows: n = (*n_past + add) * per_row, read by the gather kernel
    int add;
    int64_t per_row;
    bool f16;
    void* host;       // pinned: where the values end up
    bool in_arena;    // then copied from dst to host after the gather
    size_t chunk;     // the pinned chunk holding host
    bool beside;      // gathered on the copy stream (DeviceRows::until_step_end)
  };
  struct Chunk {
    PinnedBuffer<unsigned char> mem;
    unsigned char* mapped = nullptr;  // gather: mem as the device addresses it
    size_t used = 0;
  };

  void* reserve(size_t bytes);
  void launch_gathers(const std::vector<Copy>& copies, cudaStream_t stream, bool pdl);
  // The copies of what was staged since the last flush: gathers on `stream` (PDL) unless beside or
  // `all_beside`, the rest on the copy stream after `stream`'s work so far. Whether it enqueued anything
  // on the copy stream.
  bool enqueue_copies(cudaStream_t stream, bool all_beside);
  void note(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape, const void* dev,
            bool f16, cudaStream_t stream, DeviceRows rows);

  bool gather_;
  // gather: the device arena, its bytes in use this step, the stream that copies it to pinned memory,
  // and the events between the two streams (gathered → copy; copied → compute stream's next reuse).
  DeviceBuffer<unsigned char> arena_;  // allocated at the first use
  size_t arena_bytes_ = 0;
  size_t arena_used_ = 0;
  cudaStream_t copier_ = nullptr;
  cudaEvent_t gathered_ = nullptr;
  cudaEvent_t copied_ = nullptr;
  bool copying_ = false;  // copies to pinned memory enqueued since the compute stream last waited
  cudaEvent_t tickets_[2] = {nullptr, nullptr};  // flush_beside(): the copy stream after its gathers
  int next_ticket_ = 0;
  std::vector<Chunk> chunks_;
  size_t current_ = 0;
  std::vector<Pending> pending_;
  const Staged* restaged_ = nullptr;  // restage(): a captured step's tensors, delivered instead of pending_
  int restaged_step_ = 0;
  int64_t restaged_S_ = 0;
  std::vector<Copy> copies_;    // gather: staged, not yet flushed
  std::vector<float> widened_;  // memcpy: f16 → f32 conversion scratch
};

}  // namespace diffrun::engine
