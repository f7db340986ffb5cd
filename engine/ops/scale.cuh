// Elementwise scalings (N), the twins of reference_cpu/ops/scale: a constant factor (gemma3's embedding
// times sqrt(D)) and the logit softcap cap·tanh(x/cap).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// out [N] = x [N]·s in f32; out may alias x.
void scale(float* out, const float* x, float s, int64_t n, cudaStream_t stream);

// out [N] = cap·tanh(x [N]/cap) in f32 (cap > 0); out may alias x.
void softcap(float* out, const float* x, float cap, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
