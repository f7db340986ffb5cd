// Flawed variants of engine ops for fault injection (checkpoints/faults.hpp), kept out of the clean kernels.
// T tokens, S positions attended, D model width, V table rows, H/Hkv heads, Dh head width, K inputs, N outputs.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/gemm.cuh"
#include "model/op_variants.hpp"

namespace diffrun::engine {

// embd_transposed: the token table (row-major [V, D]) indexed as if it were [D, V]:
// out[t, i] = table[i * V + tokens[t]]. out [T, D] f32; tokens [T] device ids in [0, V).
void embedding_transposed(float* out, const int32_t* tokens, const float* table, int T, int D, int V,
                          cudaStream_t stream);
void embedding_transposed(float* out, const int32_t* tokens, const __half* table, int T, int D, int V,
                          cudaStream_t stream);

// attn_out_transposed / ffn_down_transposed: y [T, N] f32 = x [T, K] · W with the weight's memory
// ([N, K] row-major, cuBLAS A = K×N, lda = K) passed as CUBLAS_OP_N with lda = N: element (n, k)
// read at k * N + n. The transpose flag flipped and the leading dimension following it; W's
// transpose when N == K, always in bounds.
void gemm_wrong_lda(float* y, const float* x, const float* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream);
void gemm_wrong_lda(float* y, const __half* x, const __half* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream);

// The clean rms_norm (ops/rms_norm.cuh: same arguments, same reduction) with the flaws off_by_one and
// eps_outside_sqrt (model/op_variants.hpp).
void rms_norm_flawed(float* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                     cudaStream_t stream);
void rms_norm_flawed(__half* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                     cudaStream_t stream);

// The clean add_rms_norm (ops/add_rms_norm.cuh) with the given flaws in its norm; the sum is right.
void add_rms_norm_flawed(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D,
                         float eps, RmsNormFlaws flaws, cudaStream_t stream);
void add_rms_norm_flawed(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D,
                         float eps, RmsNormFlaws flaws, cudaStream_t stream);

// rope_cache_unrotated: the clean rope_qk (ops/rope_qk.cuh: same arguments) whose cache write stores
// each K pair as read, before the rotation; q_out, k_out and the V rows are right.
void rope_qk_cache_unrotated(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q,
                             const float* k, const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0,
                             const int32_t* write_pos, float theta, const float* freq_factors, bool neox,
                             cudaStream_t stream);

// weight_row_nan: n elements from p set to NaN (a weight row in device memory).
void fill_nan(float* p, int64_t n, cudaStream_t stream);
void fill_nan(__half* p, int64_t n, cudaStream_t stream);

// rms_norm_weight_twice: out[i] = w[i] · w[i] (the weight the flawed norm effectively applies), f32.
void square(float* out, const float* w, int64_t n, cudaStream_t stream);

// gqa_head_modulo: a K or V cache of Hkv heads expanded to H heads the wrong way round (repeat instead
// of repeat_interleave), out [rows, H·Dh] with out[s, h] = kv[s, h % Hkv] for rows s < *rows_from + add
// (read on the device, so a captured step expands every position); the production attention kernels
// then read it as a cache of H KV heads.
void expand_kv_heads_modulo(float* out, const float* kv, const int32_t* rows_from, int add, int max_rows, int H,
                            int Hkv, int Dh, cudaStream_t stream);

// rope_fused_position_off: *out = *pos + add, on the device (the wrong position the fused RoPE reads).
void position_plus(int32_t* out, const int32_t* pos, int add, cudaStream_t stream);

}  // namespace diffrun::engine
