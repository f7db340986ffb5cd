// Shared launch helpers for the op kernels (grid sizes, warp reductions); device code only, no launchers.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

constexpr int kOpThreads = 256;

// Blocks for a grid-stride loop over n elements (capped; the kernels loop).
inline unsigned op_grid(int64_t n) {
  const int64_t blocks = (n + kOpThreads - 1) / kOpThreads;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ void store_act(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_act(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ float load_act(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_act(const __half* p, int64_t i) { return __half2float(p[i]); }

}  // namespace diffrun::engine
