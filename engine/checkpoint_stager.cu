// Pinned staging of checkpoint copies: chunked pinned memory reused across steps; batched copy kernels
// into a device arena copied out on a second stream (gather), or one cudaMemcpyAsync per tensor (memcpy).
#include "engine/checkpoint_stager.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr size_t kMinChunk = size_t(16) << 20;
constexpr size_t kAlign = 256;
constexpr int kGatherBatch = 32;      // tensors per gather launch (its parameters: 32 × 40 bytes)
constexpr int kGatherThreads = 256;
constexpr unsigned kGatherBlocks = 64;  // blocks per tensor, at most (each loops over its share)
constexpr size_t kArenaKiB = 32 << 10;  // DIFFRUN_CHECKPOINT_ARENA_KIB overrides (tests: a small one)

size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct GatherCopy {
  const void* src;
  float* dst;
  long long n;              // n_past null: the element count
  const int32_t* n_past;    // else (*n_past + add) · n elements
  int add;
  int f16;
};

struct GatherBatch {
  GatherCopy copy[kGatherBatch];
};

// Tensor blockIdx.y of the batch, f32 (f16 widened) into the arena or pinned host memory; blocks
// stride over the tensor. Launched with PDL: the kernel after it waits for its completion before
// touching memory (pdl_wait), so the trigger only lets that kernel's launch overlap this one.
__global__ void gather_kernel(const GatherBatch batch) {
  pdl_wait();
  pdl_trigger();
  const GatherCopy c = batch.copy[blockIdx.y];
  const long long count = c.n_past ? (static_cast<long long>(*c.n_past) + c.add) * c.n : c.n;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c.f16) {
    const __half* src = static_cast<const __half*>(c.src);
    for (; i < count; i += stride) c.dst[i] = __half2float(src[i]);
  } else {
    const float* src = static_cast<const float*>(c.src);
    for (; i < count; i += stride) c.dst[i] = src[i];
  }
}

// DIFFRUN_CHECKPOINT_COPY=memcpy forces the memcpy mode; gather needs unified addressing (the pinned
// memory's host pointer valid on the device).
bool gather_wanted() {
  const char* v = std::getenv("DIFFRUN_CHECKPOINT_COPY");
  if (v != nullptr && *v != '\0') {
    if (std::strcmp(v, "memcpy") == 0) return false;
    if (std::strcmp(v, "gather") != 0)
      throw InputError(std::string("DIFFRUN_CHECKPOINT_COPY is '") + v + "': expected gather or memcpy");
  }
  int device = 0, unified = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device));
  return unified != 0;
}

size_t arena_bytes() {
  const char* v = std::getenv("DIFFRUN_CHECKPOINT_ARENA_KIB");
  if (v == nullptr || *v == '\0') return size_t(kArenaKiB) << 10;
  char* end = nullptr;
  const long kib = std::strtol(v, &end, 10);
  if (*end != '\0' || kib < 1 || kib > (1 << 22))
    throw InputError(std::string("DIFFRUN_CHECKPOINT_ARENA_KIB is '") + v + "': expected 1 to 4194304");
  return size_t(kib) << 10;
}

}  // namespace

CheckpointStager::CheckpointStager() : gather_(gather_wanted()) {
  if (!gather_) return;
  arena_bytes_ = arena_bytes();
  CUDA_CHECK(cudaStreamCreateWithFlags(&copier_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&gathered_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  for (cudaEvent_t& e : tickets_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

CheckpointStager::~CheckpointStager() {
  if (copier_) cudaStreamSynchronize(copier_);
  if (gathered_) cudaEventDestroy(gathered_);
  if (copied_) cudaEventDestroy(copied_);
  for (cudaEvent_t e : tickets_)
    if (e) cudaEventDestroy(e);
  if (copier_) cudaStreamDestroy(copier_);
}

const char* CheckpointStager::mode() const {
  return gather_ ? "gather (batched copy kernels: a one-token step's beside the next layer, into mapped pinned "
                   "memory; longer steps' into a device arena, copied out beside the compute)"
                 : "memcpy (one cudaMemcpyAsync per tensor)";
}

void* CheckpointStager::reserve(size_t bytes) {
  bytes = aligned(bytes);
  while (current_ < chunks_.size()) {
    Chunk& c = chunks_[current_];
    if (c.mem.size() - c.used >= bytes) {
      void* p = c.mem.get() + c.used;
      c.used += bytes;
      return p;
    }
    ++current_;
  }
  Chunk c;
  c.mem = PinnedBuffer<unsigned char>(std::max(bytes, kMinChunk), "checkpoint staging");
  c.used = bytes;
  if (gather_) {  // the same address under unified addressing; asked, not assumed
    void* mapped = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&mapped, c.mem.get(), 0));
    c.mapped = static_cast<unsigned char*>(mapped);
  }
  chunks_.push_back(std::move(c));
  current_ = chunks_.size() - 1;
  return chunks_.back().mem.get();
}

void CheckpointStager::note(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                            const void* dev, bool f16, cudaStream_t stream, DeviceRows rows) {
  const int64_t n = elements(shape);
  if (rows.n_past != nullptr && (!gather_ || rows.s_dim < 0 || rows.s_dim >= static_cast<int>(shape.size()) ||
                                 shape[rows.s_dim] < 1 || shape[rows.s_dim] > rows.max_rows))
    throw Error("checkpoint stager: " + name + ": rows read on the device need gather mode and S within max_rows");
  const int64_t per_row = rows.n_past ? n / shape[rows.s_dim] : 0;
  const int64_t most = rows.n_past ? per_row * rows.max_rows : n;  // what the destination must hold
  if (gather_) {
    const size_t bytes = aligned(most * sizeof(float));
    // A DeviceRows tensor is written straight to pinned memory: a copy out of the arena has a fixed size.
    const bool in_arena = bytes <= arena_bytes_ / 2 && rows.n_past == nullptr;
    if (in_arena && arena_used_ + bytes > arena_.size() && arena_used_ > 0) {
      finish(stream);  // the arena is full: its copies out must end before it is reused
      arena_used_ = 0;
    }
    void* host = reserve(bytes);
    if (in_arena) {
      if (arena_.size() == 0) arena_ = DeviceBuffer<unsigned char>(arena_bytes_, "checkpoint staging");
      copies_.push_back({dev, reinterpret_cast<float*>(arena_.get() + arena_used_), n, nullptr, 0, 0, f16, host, true,
                         current_, false});
      arena_used_ += bytes;
    } else {
      const Chunk& c = chunks_[current_];  // the chunk reserve() took it from
      float* mapped = reinterpret_cast<float*>(c.mapped + (static_cast<unsigned char*>(host) - c.mem.get()));
      copies_.push_back({dev, mapped, rows.n_past ? most : n, rows.n_past, rows.add, per_row, f16, host, false,
                         current_, rows.n_past != nullptr && rows.until_step_end});
    }
    pending_.push_back(
        {step, rows.n_past ? rows.s_dim : -1, std::move(name), layer, layout, std::move(shape), f16, false, host, n});
  } else {
    const size_t bytes = n * (f16 ? sizeof(__half) : sizeof(float));
    void* host = reserve(bytes);
    CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream));
    pending_.push_back({step, -1, std::move(name), layer, layout, std::move(shape), f16, f16, host, n});
  }
}

CheckpointStager::Staged CheckpointStager::take_staged() {
  if (!copies_.empty()) throw Error("checkpoint stager: " + std::to_string(copies_.size()) + " copies never flushed");
  Staged staged = std::move(pending_);
  pending_.clear();
  copying_ = false;
  arena_used_ = 0;
  for (Chunk& c : chunks_) c.used = 0;
  current_ = 0;
  return staged;
}

void CheckpointStager::restage(const Staged& staged, int step, int64_t S) {
  if (!pending_.empty() || !copies_.empty() || restaged_)
    throw Error("checkpoint stager: restage() over a step already staged");
  restaged_ = &staged;
  restaged_step_ = step;
  restaged_S_ = S;
}

void CheckpointStager::stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                             const float* dev, cudaStream_t stream, DeviceRows rows) {
  note(step, std::move(name), layer, layout, std::move(shape), dev, false, stream, rows);
}

void CheckpointStager::stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                             const __half* dev, cudaStream_t stream, DeviceRows rows) {
  note(step, std::move(name), layer, layout, std::move(shape), dev, true, stream, rows);
}

// Gather launches for `copies` on `stream`, kGatherBatch tensors each (PDL on the compute stream).
void CheckpointStager::launch_gathers(const std::vector<Copy>& copies, cudaStream_t stream, bool pdl) {
  for (size_t first = 0; first < copies.size(); first += kGatherBatch) {
    const size_t count = std::min<size_t>(kGatherBatch, copies.size() - first);
    GatherBatch batch{};
    int64_t longest = 0;
    for (size_t i = 0; i < count; ++i) {
      const Copy& c = copies[first + i];
      batch.copy[i] = c.n_past ? GatherCopy{c.src, c.dst, static_cast<long long>(c.per_row), c.n_past, c.add, c.f16 ? 1 : 0}
                               : GatherCopy{c.src, c.dst, static_cast<long long>(c.n), nullptr, 0, c.f16 ? 1 : 0};
      longest = std::max(longest, c.n);
    }
    const int64_t blocks = (longest + kGatherThreads - 1) / kGatherThreads;
    const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kGatherBlocks)), static_cast<unsigned>(count));
    if (pdl)
      launch_pdl(gather_kernel, grid, dim3(kGatherThreads), 0, stream, batch);
    else
      gather_kernel<<<grid, kGatherThreads, 0, stream>>>(batch);
    check_launch("checkpoint gather", stream);
  }
}

void CheckpointStager::flush(cudaStream_t stream) { enqueue_copies(stream, false); }

void CheckpointStager::before_overwrite(const void* dev, size_t bytes, cudaStream_t stream) {
  const auto* lo = static_cast<const unsigned char*>(dev);
  const auto* hi = lo + bytes;
  for (const Copy& c : copies_) {
    const auto* begin = static_cast<const unsigned char*>(c.src);
    const auto* end = begin + c.n * (c.f16 ? sizeof(__half) : sizeof(float));  // DeviceRows: the most rows
    if (begin < hi && lo < end) {
      flush(stream);
      return;
    }
  }
}

bool CheckpointStager::enqueue_copies(cudaStream_t stream, bool all_beside) {
  // Tensors that stay unchanged until the step ends (DeviceRows::until_step_end: the cache), or all of
  // them (all_beside), are gathered on the copy stream, beside the compute; the others on the compute
  // stream, before it moves on.
  // All beside: the gathers write straight into the pinned memory through its device mapping, as the
  // cache's do. Those writes overlap the compute; the copy engine's copies out of the arena, in a
  // graph beside it, did not (bench/NOTES.md: 0.09 ms of the 0.5B shape's 0.13 ms hook cost).
  if (all_beside)
    for (Copy& c : copies_)
      if (c.in_arena) {
        const Chunk& chunk = chunks_[c.chunk];
        c.dst = reinterpret_cast<float*>(chunk.mapped + (static_cast<unsigned char*>(c.host) - chunk.mem.get()));
        c.in_arena = false;
      }
  std::vector<Copy> beside;
  std::vector<Copy> here;
  for (const Copy& c : copies_) (c.beside || all_beside ? beside : here).push_back(c);
  launch_gathers(here, stream, true);
  const bool arena = std::any_of(copies_.begin(), copies_.end(), [](const Copy& c) { return c.in_arena; });
  if (beside.empty() && !arena) {
    copies_.clear();
    return false;
  }
  CUDA_CHECK(cudaEventRecord(gathered_, stream));
  CUDA_CHECK(cudaStreamWaitEvent(copier_, gathered_, 0));
  launch_gathers(beside, copier_, false);  // before the copies out of the arena, which may read what they wrote
  // The arena's new part to pinned memory on the copy stream, in runs contiguous on both sides and
  // inside one pinned chunk (two chunks may be adjacent in memory; one copy may not span both).
  for (size_t i = 0; i < copies_.size();) {
    if (!copies_[i].in_arena) {
      ++i;
      continue;
    }
    const unsigned char* from = reinterpret_cast<const unsigned char*>(copies_[i].dst);
    unsigned char* to = static_cast<unsigned char*>(copies_[i].host);
    const size_t chunk = copies_[i].chunk;
    size_t bytes = aligned(copies_[i].n * sizeof(float));
    for (++i; i < copies_.size() && copies_[i].in_arena && copies_[i].chunk == chunk &&
              reinterpret_cast<const unsigned char*>(copies_[i].dst) == from + bytes &&
              static_cast<unsigned char*>(copies_[i].host) == to + bytes;
         ++i)
      bytes += aligned(copies_[i].n * sizeof(float));
    CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToHost, copier_));
  }
  CUDA_CHECK(cudaEventRecord(copied_, copier_));
  copying_ = true;
  copies_.clear();
  return true;
}

int CheckpointStager::flush_beside(cudaStream_t stream) {
  if (!gather_) return -1;  // memcpy mode: each copy was enqueued at stage()
  if (!enqueue_copies(stream, true)) return -1;
  const int ticket = next_ticket_;
  next_ticket_ ^= 1;
  CUDA_CHECK(cudaEventRecord(tickets_[ticket], copier_));
  return ticket;
}

void CheckpointStager::wait_flushed(int ticket, cudaStream_t stream) {
  if (ticket < 0) return;
  if (ticket > 1) throw Error("checkpoint stager: no flush ticket " + std::to_string(ticket));
  CUDA_CHECK(cudaStreamWaitEvent(stream, tickets_[ticket], 0));
}

const float* CheckpointStager::last_staged_f32(std::string_view name) const {
  const std::vector<Pending>& staged = restaged_ ? *restaged_ : pending_;
  if (staged.empty() || staged.back().name != name || staged.back().host_f16) return nullptr;
  return static_cast<const float*>(staged.back().host);
}

void CheckpointStager::finish(cudaStream_t stream) {
  flush(stream);
  if (copying_) CUDA_CHECK(cudaStreamWaitEvent(stream, copied_, 0));
  copying_ = false;
}

void CheckpointStager::replace(const float* host, float* dev, int64_t n, cudaStream_t stream) {
  flush(stream);
  auto* staged = static_cast<float*>(reserve(n * sizeof(float)));
  std::copy_n(host, n, staged);
  CUDA_CHECK(cudaMemcpyAsync(dev, staged, n * sizeof(float), cudaMemcpyHostToDevice, stream));
}

void CheckpointStager::replace(const float* host, __half* dev, int64_t n, cudaStream_t stream) {
  flush(stream);
  auto* staged = static_cast<uint16_t*>(reserve(n * sizeof(uint16_t)));
  for (int64_t i = 0; i < n; ++i) staged[i] = f32_to_f16(host[i]);
  CUDA_CHECK(cudaMemcpyAsync(dev, staged, n * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
}

void CheckpointStager::deliver(Sink& sink) {
  if (!copies_.empty()) throw Error("checkpoint stager: " + std::to_string(copies_.size()) + " copies never flushed");
  for (const Pending& staged : restaged_ ? *restaged_ : pending_) {
    const Pending* q = &staged;
    Pending patched;
    if (restaged_) {  // a replay of a captured step: its step number, and S where the shape has it
      if (staged.s_dim >= 0) {
        patched = staged;
        patched.n = staged.n / staged.shape[staged.s_dim] * restaged_S_;
        patched.shape[staged.s_dim] = restaged_S_;
        q = &patched;
      }
    }
    const Pending& p = *q;
    const int step = restaged_ ? restaged_step_ : p.step;
    std::span<const float> values;
    if (p.host_f16) {
      widened_.resize(p.n);
      const auto* h = static_cast<const uint16_t*>(p.host);
      for (int64_t i = 0; i < p.n; ++i) widened_[i] = f16_to_f32(h[i]);
      values = std::span<const float>(widened_.data(), p.n);
    } else {
      values = std::span<const float>(static_cast<const float*>(p.host), p.n);
    }
    sink.record(step, p.name, p.layer, p.layout, p.shape, p.native_f16 ? NativeDType::f16 : NativeDType::f32, values);
  }
  discard();
}

void CheckpointStager::discard() {
  if (copier_) cudaStreamSynchronize(copier_);  // a failed step's copies may still be running
  copying_ = false;
  arena_used_ = 0;
  pending_.clear();
  copies_.clear();
  restaged_ = nullptr;
  for (Chunk& c : chunks_) c.used = 0;
  current_ = 0;
}

}  // namespace diffrun::engine
