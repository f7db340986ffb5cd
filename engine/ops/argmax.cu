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

static __global__ void __launch_bounds__(kThreads)
argmax_kernel(int32_t* out, const float* logits, int V, unsigned long long* scratch, ArgmaxTies ties) {
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
      if (argmax_better(v[k], base + k * kThreads, best, best_i, ties)) {
        best = v[k];
        best_i = base + k * kThreads;
      }
  }
  argmax_block_finish<kWarps>(best, best_i, out, scratch, ties);
}

}  // namespace

void argmax(int32_t* out, const float* logits, int V, unsigned long long* scratch, cudaStream_t stream,
            ArgmaxTies ties) {
  const int per_block = kThreads * kUnroll;
  const int blocks = std::clamp((V + per_block - 1) / per_block, 1, kMaxBlocks);
  launch_pdl(argmax_kernel, blocks, kThreads, 0, stream, out, logits, V, scratch, ties);
  check_launch("argmax", stream);
}

}  // namespace diffrun::engine
