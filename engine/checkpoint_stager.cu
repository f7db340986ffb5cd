// Pinned staging of checkpoint copies: chunked arena reused across steps; batched copy kernels into the
// pinned memory (gather) or one cudaMemcpyAsync per tensor (memcpy).
#include "engine/checkpoint_stager.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>

#include "engine/cuda_check.cuh"
#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr size_t kMinChunk = size_t(16) << 20;
constexpr size_t kAlign = 256;
constexpr int kGatherBatch = 32;      // tensors per gather launch (its parameters: 32 × 32 bytes)
constexpr int kGatherThreads = 256;
constexpr unsigned kGatherBlocks = 64;  // blocks per tensor, at most (each loops over its share)

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct GatherCopy {
  const void* src;
  float* dst;
  long long n;
  int f16;
};

struct GatherBatch {
  GatherCopy copy[kGatherBatch];
};

// Tensor blockIdx.y of the batch, f32 (f16 widened) into pinned host memory through the device's
// mapping of it; blocks stride over the tensor.
__global__ void gather_kernel(const GatherBatch batch) {
  const GatherCopy c = batch.copy[blockIdx.y];
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c.f16) {
    const __half* src = static_cast<const __half*>(c.src);
    for (; i < c.n; i += stride) c.dst[i] = __half2float(src[i]);
  } else {
    const float* src = static_cast<const float*>(c.src);
    for (; i < c.n; i += stride) c.dst[i] = src[i];
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

}  // namespace

CheckpointStager::CheckpointStager() : gather_(gather_wanted()) {}

const char* CheckpointStager::mode() const {
  return gather_ ? "gather (batched copy kernels into pinned memory)" : "memcpy (one cudaMemcpyAsync per tensor)";
}

void* CheckpointStager::reserve(size_t bytes) {
  bytes = (bytes + kAlign - 1) / kAlign * kAlign;
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
                            const void* dev, bool f16, cudaStream_t stream) {
  const int64_t n = elements(shape);
  if (gather_) {
    void* host = reserve(n * sizeof(float));
    const Chunk& c = chunks_[current_];  // the chunk reserve() took it from
    float* mapped = reinterpret_cast<float*>(c.mapped + (static_cast<unsigned char*>(host) - c.mem.get()));
    copies_.push_back({dev, mapped, n, f16});
    pending_.push_back({step, std::move(name), layer, layout, std::move(shape), f16, false, host, n});
  } else {
    const size_t bytes = n * (f16 ? sizeof(__half) : sizeof(float));
    void* host = reserve(bytes);
    CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream));
    pending_.push_back({step, std::move(name), layer, layout, std::move(shape), f16, f16, host, n});
  }
}

void CheckpointStager::stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                             const float* dev, cudaStream_t stream) {
  note(step, std::move(name), layer, layout, std::move(shape), dev, false, stream);
}

void CheckpointStager::stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                             const __half* dev, cudaStream_t stream) {
  note(step, std::move(name), layer, layout, std::move(shape), dev, true, stream);
}

void CheckpointStager::flush(cudaStream_t stream) {
  for (size_t first = 0; first < copies_.size(); first += kGatherBatch) {
    const size_t count = std::min<size_t>(kGatherBatch, copies_.size() - first);
    GatherBatch batch{};
    int64_t longest = 0;
    for (size_t i = 0; i < count; ++i) {
      const Copy& c = copies_[first + i];
      batch.copy[i] = {c.src, c.dst, static_cast<long long>(c.n), c.f16 ? 1 : 0};
      longest = std::max(longest, c.n);
    }
    const int64_t blocks = (longest + kGatherThreads - 1) / kGatherThreads;
    const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kGatherBlocks)), static_cast<unsigned>(count));
    gather_kernel<<<grid, kGatherThreads, 0, stream>>>(batch);
    check_launch("checkpoint gather", stream);
  }
  copies_.clear();
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
  for (const Pending& p : pending_) {
    std::span<const float> values;
    if (p.host_f16) {
      widened_.resize(p.n);
      const auto* h = static_cast<const uint16_t*>(p.host);
      for (int64_t i = 0; i < p.n; ++i) widened_[i] = f16_to_f32(h[i]);
      values = std::span<const float>(widened_.data(), p.n);
    } else {
      values = std::span<const float>(static_cast<const float*>(p.host), p.n);
    }
    sink.record(p.step, p.name, p.layer, p.layout, p.shape, p.native_f16 ? NativeDType::f16 : NativeDType::f32,
                values);
  }
  discard();
}

void CheckpointStager::discard() {
  pending_.clear();
  copies_.clear();
  for (Chunk& c : chunks_) c.used = 0;
  current_ = 0;
}

}  // namespace diffrun::engine
