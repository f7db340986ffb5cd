// Flawed variants of engine ops for fault injection (checkpoints/faults.hpp), kept out of the clean kernels.
// T tokens, S positions attended, D model width, V table rows, H/Hkv heads, Dh head width, K inputs, N outputs.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/gemm.cuh"

namespace diffrun::engine {

// embd_transposed: the token table (row-major [V, D]) indexed as if it were [D, V]:
// out[t, i] = table[i * V + tokens[t]]. out [T, D] f32; tokens [T] device ids in [0, V).
void embedding_transposed(float* out, const int32_t* tokens, const float* table, int T, int D, int V,
                          cudaStream_t stream);
void embedding_transposed(float* out, const int32_t* tokens, const __half* table, int T, int D, int V,
                          cudaStream_t stream);

// What the flawed attention gets wrong (any combination).
struct AttentionFlaws {
  bool no_causal_mask = false;  // every query attends to all S positions
  bool no_scale = false;        // scores without 1/sqrt(Dh)
  bool head_modulo = false;     // query head h reads KV head h % Hkv
  bool any() const { return no_causal_mask || no_scale || head_modulo; }
};

// The clean attention (ops/attention.cuh: same arguments, same arithmetic) with the given flaws.
void attention_flawed(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                      const int32_t* n_past, int H, int Hkv, int Dh, AttentionFlaws flaws, cudaStream_t stream);
void attention_flawed(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                      const int32_t* n_past, int H, int Hkv, int Dh, AttentionFlaws flaws, cudaStream_t stream);

// attn_out_transposed / ffn_down_transposed: y [T, N] f32 = x [T, K] · W with the weight's memory
// ([N, K] row-major, cuBLAS A = K×N, lda = K) passed as CUBLAS_OP_N with lda = N: element (n, k)
// read at k * N + n. The transpose flag flipped and the leading dimension following it; W's
// transpose when N == K, always in bounds.
void gemm_wrong_lda(float* y, const float* x, const float* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream);
void gemm_wrong_lda(float* y, const __half* x, const __half* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream);

// rms_norm_weight_twice: out[i] = w[i] · w[i] (the weight the flawed norm effectively applies), f32.
void square(float* out, const float* w, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
