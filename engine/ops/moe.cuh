// Mixture-of-experts ops (T tokens, E experts, K experts used per token, D model width), the twins of
// reference_cpu/ops/moe.hpp with the same names and arguments, in f32: llama.cpp's build_moe_ffn routing and
// combination, and qwen2moe's shared expert gate. Slot s = t·K + j is token t's j-th expert. gather_rows and
// scatter_rows move a group of slots' rows in and out of one expert's matmul (the reference copies them on the
// host, reference.cpp expert_matmul).
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// Per token: probs = softmax(logits) over all E experts (max subtracted); topk = the K most probable experts, most
// probable first, ties to the lower id; weights = their probabilities; weights_norm = weights / max(sum of weights,
// 2^-14) when renormalise, else weights; a NaN probability after every number. One warp a token, at most 1,024
// experts. probs may alias logits.
void moe_route(float* probs /* [T,E] */, int32_t* topk /* [T,K] */, float* weights /* [T,K] */,
               float* weights_norm /* [T,K] */, const float* logits /* [T,E] */, int n_tokens, int E, int K,
               bool renormalise, cudaStream_t stream);

// moe_route that also writes the ids as values, as the ffn_moe_topk checkpoint holds them (id_values [T,K] = topk as
// floats), in the same launch.
void moe_route_ids(float* probs /* [T,E] */, int32_t* topk /* [T,K] */, float* id_values /* [T,K] */,
                   float* weights /* [T,K] */, float* weights_norm /* [T,K] */, const float* logits /* [T,E] */,
                   int n_tokens, int E, int K, bool renormalise, cudaStream_t stream);

// out[t] = the sum over j = 0..K-1, in that order, of weights[t, j] · down[t, j].
void moe_combine(float* out /* [T,D] */, const float* down /* [T,K,D] */, const float* weights /* [T,K] */,
                 int n_tokens, int K, int D, cudaStream_t stream);

// gate_inp[t] = x[t] · w (one logit a token; x f32 or the f16 engine's GEMM input).
void shexp_gate_logits(float* gate_inp /* [T] */, const float* x /* [T,D] */, const float* w /* [D] */,
                       int n_tokens, int D, cudaStream_t stream);
void shexp_gate_logits(float* gate_inp /* [T] */, const __half* x /* [T,D] */, const float* w /* [D] */,
                       int n_tokens, int D, cudaStream_t stream);

// out[i] = 1 / (1 + exp(-x[i])).
void sigmoid(float* out /* [n] */, const float* x /* [n] */, int64_t n, cudaStream_t stream);

// out[t, i] = shexp[t, i] · gate[t]. out may alias shexp.
void scale_rows(float* out /* [T,D] */, const float* shexp /* [T,D] */, const float* gate /* [T] */, int n_tokens,
                int D, cudaStream_t stream);

// A one-token step's experts gathered by their ids on the device: for each slot k < K and each of the n stacks
// (gate, up, down), the `bytes[i]` bytes of expert ids[k]'s matrix (at address table[i][e], a device array of E
// addresses: the experts' views, as fault edits leave them) copied to dst[i] + k·bytes[i]. ids as ffn_moe_topk holds
// them (values), clamped to 0..E-1.
// So a decode step needs no read-back of its ids: the GEMVs after it read fixed addresses, and the step stays one
// captured graph. It moves weights, not activations: no reference twin.
struct ExpertStacks {
  static constexpr int kMax = 3;
  unsigned char* dst[kMax];
  const uint64_t* table[kMax];
  uint64_t bytes[kMax];
  int n = 0;
};
void gather_experts(const ExpertStacks& stacks, const float* ids /* [K] */, int K, int E, cudaStream_t stream);

// dst row i = src row rows[i] / div (div 1: the slot's own row; K: its token's row), for i < n; width cols.
void gather_rows(float* dst, const float* src, const int32_t* rows, int div, int n, int cols, cudaStream_t stream);
void gather_rows(__half* dst, const __half* src, const int32_t* rows, int div, int n, int cols, cudaStream_t stream);

// dst row rows[i] = src row i, for i < n; width cols.
void scatter_rows(float* dst, const float* src, const int32_t* rows, int n, int cols, cudaStream_t stream);

}  // namespace diffrun::engine
