// Shared pieces of the CUDA engine's GPU tests: the device check, an in-memory Sink, device arrays, rel L2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "checkpoints/sink.hpp"
#include "checkpoints/vocabulary.hpp"
#include "engine/engine.hpp"

// First line of every GPU test: skips with the reason when no CUDA device can be used.
#define DIFFRUN_REQUIRE_CUDA()                                       \
  do {                                                               \
    std::string diffrun_why_;                                        \
    if (!::diffrun::cuda_device_available(&diffrun_why_))            \
      GTEST_SKIP() << "no CUDA device: " << diffrun_why_;            \
  } while (0)

#define TEST_CUDA_CHECK(call) ASSERT_EQ((call), cudaSuccess) << #call

namespace diffrun::test {

struct Recorded {
  int layer = -1;
  std::string layout;
  std::vector<int64_t> shape;
  NativeDType native = NativeDType::f32;
  std::vector<float> data;
};

// Keeps every recorded checkpoint in memory, by step and name, in recording order.
class MemorySink final : public Sink {
 public:
  explicit MemorySink(CheckpointFilter filter = {}) : filter_(std::move(filter)) {}
  bool wants(std::string_view name) const override { return filter_.matches(name); }
  void record(int step, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override {
    Recorded r{layer, std::string(layout), {shape.begin(), shape.end()}, native, {data.begin(), data.end()}};
    tensors[step][std::string(name)] = std::move(r);
    order[step].emplace_back(name);
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> values) override {
    ids[step][std::string(name)] = {values.begin(), values.end()};
  }
  void clear() {
    tensors.clear();
    order.clear();
    ids.clear();
  }

  std::map<int, std::map<std::string, Recorded>> tensors;
  std::map<int, std::vector<std::string>> order;
  std::map<int, std::map<std::string, std::vector<int32_t>>> ids;

 private:
  CheckpointFilter filter_;
};

// A prompt of n token ids spread over the vocabulary (7, 138, 269, ... mod n_vocab).
inline std::vector<int32_t> prompt_ids(int n_vocab, int n) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((7 + 131 * i) % n_vocab));
  return ids;
}

// ‖a − b‖ / ‖b‖ in f64 (0 when both are zero, infinity when only b is).
inline double rel_l2(std::span<const float> a, std::span<const float> b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (a.size() != b.size() || !std::isfinite(num)) return INFINITY;
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// A device copy of a host vector, freed at scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (p_) cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return p_; }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

}  // namespace diffrun::test
