// What the CUDA benchmark programs share: their CUDA error check and the device's copy bandwidth.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>

#include <cuda_runtime.h>

#include "model/error.hpp"

#define BENCH_CUDA(call)                                                                             \
  do {                                                                                               \
    const cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) throw diffrun::Error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)

namespace diffrun::bench_util {

// Device-to-device copy bandwidth in bytes/s (read + write), best of several 1 GiB copies.
inline double copy_bandwidth() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  BENCH_CUDA(cudaMalloc(&a, bytes));
  BENCH_CUDA(cudaMalloc(&b, bytes));
  BENCH_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  float best_ms = 1e30f;
  for (int i = 0; i < 6; ++i) {
    BENCH_CUDA(cudaEventRecord(e0));
    BENCH_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    BENCH_CUDA(cudaEventRecord(e1));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (best_ms * 1e-3);
}

}  // namespace diffrun::bench_util
