// Argmax over the real vocabulary (V): the index of the largest logit, the lowest index on ties (the
// highest with ArgmaxTies::highest, fault argmax_ties_highest); NaNs never win; -1 when no logit is
// comparable (all NaN).
#pragma once

#include <climits>
#include <cstdint>

#include <cuda_runtime.h>

#include "model/op_variants.hpp"

namespace diffrun::engine {

// out [1] int32, in device memory or mapped host memory (PinnedBuffer::device()); logits [V] f32
// (one row; padded rows beyond V are never read); scratch [2] device, zero before the first launch
// and left zero by each launch (one scratch per stream).
void argmax(int32_t* out, const float* logits, int V, unsigned long long* scratch, cudaStream_t stream,
            ArgmaxTies ties = ArgmaxTies::lowest);

#ifdef __CUDACC__
// The order argmax and matmul_argmax share: a larger value wins, then the lower index (ties highest: the
// higher one); NaN never wins. best_i INT_MAX: no candidate yet.
__device__ __forceinline__ bool argmax_better(float v, int i, float best, int best_i, ArgmaxTies ties) {
  return v > best || (v == best && (ties == ArgmaxTies::lowest || best_i == INT_MAX ? i < best_i : i > best_i));
}

// The same order as one 64-bit key: larger key <=> larger value, then the index as `ties` orders it; 0 is
// below every key of a comparable value.
__device__ __forceinline__ unsigned long long argmax_key(float v, int i, ArgmaxTies ties) {
  const uint32_t bits = v == 0.0f ? 0u : __float_as_uint(v);  // -0 ties with +0
  const uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  const uint32_t index = ties == ArgmaxTies::lowest ? 0xFFFFFFFFu - static_cast<uint32_t>(i) : static_cast<uint32_t>(i);
  return (static_cast<unsigned long long>(key) << 32) | index;
}

// The end of a kernel whose threads each hold a candidate (best, best_i; INT_MAX when none), called by
// every thread of the block (kWarps warps): the block's best, one atomicMax of its key on scratch[0],
// and the last block to arrive (a ticket on scratch[1]) writes the winner's index to *out (-1 when no
// value was comparable) and leaves the scratch zero.
template <int kWarps>
__device__ __forceinline__ void argmax_block_finish(float best, int best_i, int32_t* out,
                                                    unsigned long long* scratch, ArgmaxTies ties) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int i = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (argmax_better(v, i, best, best_i, ties)) {
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
    if (argmax_better(vals[w], idxs[w], best, best_i, ties)) {
      best = vals[w];
      best_i = idxs[w];
    }
  if (best_i != INT_MAX) atomicMax(&scratch[0], argmax_key(best, best_i, ties));
  __threadfence();
  if (atomicAdd(&scratch[1], 1ull) != gridDim.x - 1) return;
  const unsigned long long winner = atomicExch(&scratch[0], 0ull);
  scratch[1] = 0;
  const uint32_t index = static_cast<uint32_t>(winner);
  *out = winner == 0 ? -1 : static_cast<int32_t>(ties == ArgmaxTies::lowest ? 0xFFFFFFFFu - index : index);
}
#endif

}  // namespace diffrun::engine
