// Embedding gather then RMSNorm in one launch (T, D, V), for the decode graph: the fused twin of
// embedding followed by rms_norm on its rows (embd, and layer 0's attn_norm), writing both,
// bit-identical to the two kernels. Dense tables of rows D ≤ embedding_rms_norm_max_width().
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// The widest row embedding_rms_norm takes (the norm's row in registers).
int embedding_rms_norm_max_width();

// x [T, D] f32 = table[tokens[t]] (as embedding writes it: NaN for an id outside [0, V)); out [T, D] =
// rms_norm(x) · w (f32, or f16 when it feeds an f16 GEMM); table [V, D] dense; w [D] f32.
// tokens may be mapped pinned host memory (PinnedBuffer::device()). The kernel reads only tokens, the
// table and w before it waits on the preceding kernel (at its end), so it runs beside a preceding
// kernel that writes none of x, out and what it reads (step_inputs).
void embedding_rms_norm(float* x, float* out, const int32_t* tokens, const float* table, const float* w, int T, int D,
                        int V, float eps, cudaStream_t stream);
void embedding_rms_norm(float* x, __half* out, const int32_t* tokens, const __half* table, const float* w, int T,
                        int D, int V, float eps, cudaStream_t stream);

}  // namespace diffrun::engine
