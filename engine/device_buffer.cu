// Device and pinned allocation with errors that give the sizes involved.
#include "engine/device_buffer.cuh"

#include <cstdio>
#include <string>

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

void* pinned_device_address(void* host) {
  void* d = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&d, host, 0));
  return d;
}

}  // namespace diffrun::engine
