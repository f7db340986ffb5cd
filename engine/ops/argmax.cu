// Argmax kernel (V): one block of 1024 threads, 8 independent loads in flight per thread, then a
// shared-memory tree reduction that keeps the lowest index among equal values.
#include "engine/ops/argmax.cuh"

#include <climits>

#include "engine/cuda_check.cuh"

namespace diffrun::engine {

namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 8;

__device__ __forceinline__ bool better(float v, int i, float best, int best_i) {
  return v > best || (v == best && i < best_i);
}

static __global__ void __launch_bounds__(kThreads) argmax_kernel(int32_t* out, const float* logits, int V) {
  float best = -INFINITY;
  int best_i = INT_MAX;
  for (int base = threadIdx.x; base < V; base += kThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int i = base + k * kThreads;
      v[k] = i < V ? logits[i] : NAN;
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (better(v[k], base + k * kThreads, best, best_i)) {
        best = v[k];
        best_i = base + k * kThreads;
      }
  }
  __shared__ float vals[kThreads];
  __shared__ int idxs[kThreads];
  vals[threadIdx.x] = best;
  idxs[threadIdx.x] = best_i;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float v = vals[threadIdx.x + stride];
      const int i = idxs[threadIdx.x + stride];
      if (better(v, i, vals[threadIdx.x], idxs[threadIdx.x])) {
        vals[threadIdx.x] = v;
        idxs[threadIdx.x] = i;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = idxs[0] == INT_MAX ? -1 : idxs[0];
}

}  // namespace

void argmax(int32_t* out, const float* logits, int V, cudaStream_t stream) {
  argmax_kernel<<<1, kThreads, 0, stream>>>(out, logits, V);
  check_launch("argmax", stream);
}

}  // namespace diffrun::engine
