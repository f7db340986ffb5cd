// L2 prefetch of up to kL2PrefetchRanges byte ranges (weights a later kernel of the step reads), with
// the evict_last policy, spread over many blocks so that many SMs issue the requests.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace diffrun::engine {

constexpr int kL2PrefetchRanges = 2;

struct L2Ranges {
  const void* p[kL2PrefetchRanges] = {};
  size_t bytes[kL2PrefetchRanges] = {};
};

// The kernel touches no memory the step writes: it waits on the preceding kernel only at its end (so
// the chain of waits stays whole) and lets the next kernel start at once.
void l2_prefetch(const L2Ranges& ranges, cudaStream_t stream);

}  // namespace diffrun::engine
