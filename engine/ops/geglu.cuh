// GeGLU (T, F), gemma3's FFN activation: out = gelu_tanh(gate) · up in f32, the twin of reference_cpu/ops/geglu.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// out [T, F] (f32, or f16 when it feeds an f16 GEMM); gate, up [T, F] f32; n = T·F.
// gelu_tanh(g) = 0.5·g·(1 + tanh(sqrt(2/π)·(g + 0.044715·g³))).
void geglu(float* out, const float* gate, const float* up, int64_t n, cudaStream_t stream);
void geglu(__half* out, const float* gate, const float* up, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
