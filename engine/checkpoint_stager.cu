// Pinned staging of checkpoint copies: chunked arena reused across steps, f16 widened on the host.
#include "engine/checkpoint_stager.cuh"

#include <algorithm>
#include <span>

#include "engine/cuda_check.cuh"
#include "model/dequant.hpp"

namespace diffrun::engine {

namespace {

constexpr size_t kMinChunk = size_t(16) << 20;
constexpr size_t kAlign = 256;

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

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
  chunks_.push_back(std::move(c));
  current_ = chunks_.size() - 1;
  return chunks_.back().mem.get();
}

void CheckpointStager::stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                             const float* dev, cudaStream_t stream) {
  const int64_t n = elements(shape);
  void* host = reserve(n * sizeof(float));
  CUDA_CHECK(cudaMemcpyAsync(host, dev, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
  pending_.push_back({step, std::move(name), layer, layout, std::move(shape), false, host, n});
}

void CheckpointStager::stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
                             const __half* dev, cudaStream_t stream) {
  const int64_t n = elements(shape);
  void* host = reserve(n * sizeof(__half));
  CUDA_CHECK(cudaMemcpyAsync(host, dev, n * sizeof(__half), cudaMemcpyDeviceToHost, stream));
  pending_.push_back({step, std::move(name), layer, layout, std::move(shape), true, host, n});
}

void CheckpointStager::replace(const float* host, float* dev, int64_t n, cudaStream_t stream) {
  auto* staged = static_cast<float*>(reserve(n * sizeof(float)));
  std::copy_n(host, n, staged);
  CUDA_CHECK(cudaMemcpyAsync(dev, staged, n * sizeof(float), cudaMemcpyHostToDevice, stream));
}

void CheckpointStager::replace(const float* host, __half* dev, int64_t n, cudaStream_t stream) {
  auto* staged = static_cast<uint16_t*>(reserve(n * sizeof(uint16_t)));
  for (int64_t i = 0; i < n; ++i) staged[i] = f32_to_f16(host[i]);
  CUDA_CHECK(cudaMemcpyAsync(dev, staged, n * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
}

void CheckpointStager::deliver(Sink& sink) {
  for (const Pending& p : pending_) {
    std::span<const float> values;
    if (p.is_f16) {
      widened_.resize(p.n);
      const auto* h = static_cast<const uint16_t*>(p.host);
      for (int64_t i = 0; i < p.n; ++i) widened_[i] = f16_to_f32(h[i]);
      values = std::span<const float>(widened_.data(), p.n);
    } else {
      values = std::span<const float>(static_cast<const float*>(p.host), p.n);
    }
    sink.record(p.step, p.name, p.layer, p.layout, p.shape, p.is_f16 ? NativeDType::f16 : NativeDType::f32, values);
  }
  discard();
}

void CheckpointStager::discard() {
  pending_.clear();
  for (Chunk& c : chunks_) c.used = 0;
  current_ = 0;
}

}  // namespace diffrun::engine
