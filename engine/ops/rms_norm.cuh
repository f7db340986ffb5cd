// RMSNorm (rows, D): out[r, :] = x[r, :] · (1 / sqrt(mean(x[r, :]²) + eps)) · w, computed in f32.
// rows = T for attn_norm/ffn_norm/result_norm; rows = T·H (or T·Hkv) with D = Dh for qwen3's
// per-head q/k norms. out may alias x.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// out [rows, D] (f32, or f16 when it feeds an f16 GEMM); x [rows, D] f32; w [D] f32.
void rms_norm(float* out, const float* x, const float* w, int rows, int D, float eps, cudaStream_t stream);
void rms_norm(__half* out, const float* x, const float* w, int rows, int D, float eps, cudaStream_t stream);

}  // namespace diffrun::engine
