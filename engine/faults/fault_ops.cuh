// Flawed variants of engine ops for fault injection (faults/faults.hpp), kept out of the clean kernels, and
// the entry points that take the fault plan's op arguments (faults/fault_plan.hpp): each enqueues exactly the
// clean op for production's argument, its flawed variant otherwise.
// T tokens, S positions attended, D model width, V table rows, H/Hkv heads, Dh head width, K inputs, N outputs,
// Np padded outputs.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/device_matrix.cuh"
#include "engine/gemm.cuh"
#include "model/op_variants.hpp"

namespace diffrun::engine {

// The clean rms_norm (ops/rms_norm.cuh: same arguments, same reduction) with the flaws off_by_one and
// eps_outside_sqrt.
void rms_norm_flawed(float* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                     cudaStream_t stream);
void rms_norm_flawed(__half* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                     cudaStream_t stream);

// The clean add_rms_norm (ops/add_rms_norm.cuh) with the same flaws in its norm; the sum is right.
void add_rms_norm_flawed(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D,
                         float eps, RmsNormFlaws flaws, cudaStream_t stream);
void add_rms_norm_flawed(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D,
                         float eps, RmsNormFlaws flaws, cudaStream_t stream);

// rms_norm with its flaws (model/op_variants.hpp): the clean kernel without any; nothing at all when skipped (in
// place only: out must be x); rms_norm_flawed for off_by_one and eps_outside_sqrt. The engine takes `unweighted`
// through embedding_rms_norm's weight (engine/faults/fault_state.cuh), never here: it throws.
void rms_norm(float* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
              cudaStream_t stream);
void rms_norm(__half* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
              cudaStream_t stream);
// add_rms_norm with the flaws of its norm: the clean kernel without any, add_rms_norm_flawed for off_by_one and
// eps_outside_sqrt (skipped and unweighted throw: no add is planned with them).
void add_rms_norm(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                  RmsNormFlaws flaws, cudaStream_t stream);
void add_rms_norm(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                  RmsNormFlaws flaws, cudaStream_t stream);

// rope_cache_unrotated: the clean rope_qk (ops/rope_qk.cuh: same arguments) whose cache write stores
// each K pair as read, before the rotation; q_out, k_out and the V rows are right.
void rope_qk_cache_unrotated(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q,
                             const float* k, const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0,
                             const int32_t* write_pos, float theta, const float* freq_factors, bool neox,
                             cudaStream_t stream);
// rope_qk with the plan's cache write: the clean kernel, or rope_qk_cache_unrotated when `cache_unrotated`.
void rope_qk(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q, const float* k,
             const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos, float theta,
             const float* freq_factors, bool neox, bool cache_unrotated, cudaStream_t stream);

// gqa_head_modulo: a K or V cache of Hkv heads expanded to H heads the wrong way round (repeat instead
// of repeat_interleave), out [rows, H·Dh] with out[s, h] = kv[s, h % Hkv] for rows s < *rows_from + add
// (read on the device, so a captured step expands every position); the production attention kernels
// then read it as a cache of H KV heads.
void expand_kv_heads_modulo(float* out, const float* kv, const int32_t* rows_from, int add, int max_rows, int H,
                            int Hkv, int Dh, cudaStream_t stream);

// The K/V the attention kernels read, and how many heads they hold.
struct AttentionKv {
  const float* k;  // [rows, heads·Dh]
  const float* v;
  int heads;
};
// k and v [rows, Hkv·Dh] as they are (nothing enqueued), or under gqa_head_modulo both expanded into k_scratch and
// v_scratch [max_rows, H·Dh] (expand_kv_heads_modulo, rows *rows_from + add).
AttentionKv attention_kv(const float* k, const float* v, const int32_t* rows_from, int add, int max_rows, int H,
                         int Hkv, int Dh, bool gqa_head_modulo, float* k_scratch, float* v_scratch,
                         cudaStream_t stream);

// lm_head_padded_vocab: out [T, Np] f32 whose columns 0..N-1 are matmul's (x [T, K] · the first N rows of w) and
// N..Np-1 bytes kFaultUninitialisedByte, as a buffer no op wrote (one matmul a row). Np == N: matmul alone.
void matmul_padded(float* out, const float* x, const DeviceMatrix<float>& w, int T, int K, int N, int Np,
                   const CublasHandle& cublas, cudaStream_t stream);
void matmul_padded(float* out, const __half* x, const DeviceMatrix<__half>& w, int T, int K, int N, int Np,
                   const CublasHandle& cublas, cudaStream_t stream);

// weight_row_nan: n elements from p set to NaN (a weight row in device memory).
void fill_nan(float* p, int64_t n, cudaStream_t stream);
void fill_nan(__half* p, int64_t n, cudaStream_t stream);

// rms_norm_weight_twice: out[i] = w[i] · w[i] (the weight the flawed norm effectively applies), f32.
void square(float* out, const float* w, int64_t n, cudaStream_t stream);

// embd_transposed / attn_out_transposed / ffn_down_transposed: out [N, K] = the [N, K] weight w as a GEMM reads it
// with the wrong leading dimension, element (n, k) from w's memory at k * N + n (w's transpose when N == K; the
// token table [V, D] indexed as [D, V]). The reference's wrong_leading_dimension.
void wrong_leading_dimension(float* out, const float* w, int N, int K, cudaStream_t stream);
void wrong_leading_dimension(__half* out, const __half* w, int N, int K, cudaStream_t stream);

// moe_route_ids (moe_route and the ids as values) with moe_route's flaws (model/op_variants.hpp): the clean op
// without any; with them, the clean op and then its choice edited per token as the reference's moe_route entry point
// edits it (reference_cpu/faults/fault_ops.hpp), the values rewritten from the edited ids: id_off_by_one takes
// expert id + 1 (mod E) and its probability, softmax_over_topk reweighs the K selected by a softmax of their logits,
// not_renormalised leaves weights_norm the weights.
void moe_route_ids(float* probs, int32_t* topk, float* id_values, float* weights, float* weights_norm,
                   const float* logits, int n_tokens, int E, int K, bool renormalise, MoeRoutingFlaws flaws,
                   cudaStream_t stream);

// scale_rows with moe_shared_expert_gate_skipped: the clean op without it; out = shexp unscaled with it.
void scale_rows(float* out, const float* shexp, const float* gate, int n_tokens, int D, bool gate_skipped,
                cudaStream_t stream);

}  // namespace diffrun::engine
