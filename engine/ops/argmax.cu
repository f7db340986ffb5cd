// Argmax kernel (V): a grid of blocks, 8 independent loads in flight per thread, a warp-shuffle and
// shared-memory reduction per block (lowest index among equal values), then one 64-bit atomicMax
// per block on a packed (orderable value, inverted index) key; the last block to arrive (an atomic
// ticket) unpacks the winner and resets the scratch.
#include "engine/ops/argmax.cuh"

#include <algorithm>
#include <climits>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ bool better(float v, int i, float best, int best_i) {
  return v > best || (v == best && i < best_i);
}

// Larger key ⇔ larger value, then lower index; 0 is below every key of a comparable value.
__device__ __forceinline__ unsigned long long pack(float v, int i) {
  const uint32_t bits = v == 0.0f ? 0u : __float_as_uint(v);  // -0 ties with +0
  const uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

static __global__ void __launch_bounds__(kThreads)
argmax_kernel(int32_t* out, const float* logits, int V, unsigned long long* scratch) {
  pdl_wait();
  pdl_trigger();
  float best = -INFINITY;
  int best_i = INT_MAX;
  const int stride = gridDim.x * kThreads * kUnroll;
  for (int base = blockIdx.x * kThreads * kUnroll + threadIdx.x; base < V; base += stride) {
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
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int i = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (better(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
  }
  __shared__ float vals[kWarps];
  __shared__ int idxs[kWarps];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    vals[warp] = best;
    idxs[warp] = best_i;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w)
    if (better(vals[w], idxs[w], best, best_i)) {
      best = vals[w];
      best_i = idxs[w];
    }
  if (best_i != INT_MAX) atomicMax(&scratch[0], pack(best, best_i));
  __threadfence();
  if (atomicAdd(&scratch[1], 1ull) != gridDim.x - 1) return;
  const unsigned long long winner = atomicExch(&scratch[0], 0ull);
  scratch[1] = 0;
  *out = winner == 0 ? -1 : static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(winner));
}

}  // namespace

void argmax(int32_t* out, const float* logits, int V, unsigned long long* scratch, cudaStream_t stream) {
  const int per_block = kThreads * kUnroll;
  const int blocks = std::clamp((V + per_block - 1) / per_block, 1, kMaxBlocks);
  launch_pdl(argmax_kernel, blocks, kThreads, 0, stream, out, logits, V, scratch);
  check_launch("argmax", stream);
}

}  // namespace diffrun::engine
