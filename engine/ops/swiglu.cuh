// SwiGLU (T, F): out = silu(gate) · up, silu(g) = g / (1 + exp(−g)), in f32.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// out [T, F] (f32, or f16 when it feeds an f16 GEMM); gate, up [T, F] f32; n = T·F.
void swiglu(float* out, const float* gate, const float* up, int64_t n, cudaStream_t stream);
void swiglu(__half* out, const float* gate, const float* up, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
