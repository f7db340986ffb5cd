// Argmax over the real vocabulary (V): the index of the largest logit, the lowest index on ties;
// NaNs never win; -1 when no logit is comparable (all NaN).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// out [1] int32, in device memory or mapped host memory (PinnedBuffer::device()); logits [V] f32
// (one row; padded rows beyond V are never read); scratch [2] device, zero before the first launch
// and left zero by each launch (one scratch per stream).
void argmax(int32_t* out, const float* logits, int V, unsigned long long* scratch, cudaStream_t stream);

}  // namespace diffrun::engine
