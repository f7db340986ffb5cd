// Residual add then RMSNorm in one launch (rows, D): the fused twin of add followed by rms_norm on
// its result, writing both (ffn_inp and ffn_norm; l_out and the next layer's attn_norm or
// result_norm), bit-identical to the two kernels.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// sum [rows, D] f32 = a + b (may alias a or b); out [rows, D] = rms_norm(sum) · w (f32, or f16 when it
// feeds an f16 GEMM); a, b [rows, D] f32; w [D] f32.
void add_rms_norm(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                  cudaStream_t stream);
void add_rms_norm(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D,
                  float eps, cudaStream_t stream);

}  // namespace diffrun::engine
