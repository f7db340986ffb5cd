// Device and pinned allocation with errors that give the sizes involved; releases deferred past stream captures.
#include "engine/device_buffer.cuh"

#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "engine/cuda_check.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

void* device_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear the sticky-free allocation error before asking for figures
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    throw Error(std::string("not enough device memory for ") + what + ": need " + mib(bytes) + ", " +
                mib(free_b) + " free of " + mib(total_b));
  }
  CUDA_CHECK(err);
  return p;
}

void* pinned_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocMapped);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw CudaError(std::string("cannot allocate ") + mib(bytes) + " of pinned host memory for " + what + ": " +
                    cudaGetErrorString(err));
  }
  return p;
}

namespace {

// One device's captures in flight and the releases waiting for them. Releases run under the lock, so no capture on
// the device begins while one runs; a device's lock is only ever taken by threads working on that device (so a rank
// of a tensor-parallel engine never waits on another rank's). Never destroyed: buffers with static storage may be
// freed at exit after it.
struct Releases {
  std::mutex lock;
  int captures = 0;
  std::vector<std::function<void()>> deferred;
};

constexpr int kMaxDevices = 64;

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) (void)cudaGetLastError();
  return device >= 0 && device < kMaxDevices ? device : 0;
}

Releases& releases(int device) {
  static Releases* r = new Releases[kMaxDevices];
  return r[device];
}

}  // namespace

CaptureInFlight::CaptureInFlight() : device_(current_device()) {
  Releases& r = releases(device_);
  std::lock_guard<std::mutex> g(r.lock);
  ++r.captures;
}

CaptureInFlight::~CaptureInFlight() {
  Releases& r = releases(device_);
  std::lock_guard<std::mutex> g(r.lock);
  if (--r.captures > 0) return;
  for (const std::function<void()>& release : r.deferred) release();
  r.deferred.clear();
}

void after_captures(std::function<void()> release) {
  Releases& r = releases(current_device());
  std::lock_guard<std::mutex> g(r.lock);
  if (r.captures > 0) r.deferred.push_back(std::move(release));
  else release();
}

void device_free(void* p) {
  if (p) after_captures([p] { cudaFree(p); });
}

void pinned_free(void* p) {
  if (p) after_captures([p] { cudaFreeHost(p); });
}

void* pinned_device_address(void* host) {
  void* d = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&d, host, 0));
  return d;
}

}  // namespace diffrun::engine
