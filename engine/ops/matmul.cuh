// Linear layer (T, K, N): out = x · wᵀ (+ bias), w a GGUF weight with ne = [K, N]; the GEMM is engine/gemm.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/gemm.cuh"

namespace diffrun::engine {

// out [T, N] f32; x [T, K]; w [N, K] (same type as x); bias [N] f32 or nullptr (qwen2 q/k/v).
void matmul(float* out, const float* x, const float* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream);
void matmul(float* out, const __half* x, const __half* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream);

}  // namespace diffrun::engine
