// Mixture-of-experts routing and combination, as llama.cpp's build_moe_ffn, and qwen2moe's shared expert gate.
// T tokens, E experts, K experts used per token, D model width.
#pragma once

#include <cstdint>

namespace diffrun::ref {

// Per token: probs = softmax(logits) over all E experts (max subtracted); topk = the K most probable experts,
// most probable first, ties to the lower id (ggml_argsort_top_k's order); weights = their probabilities;
// weights_norm = weights / max(sum of weights, 2^-14) when renormalise (llama.cpp clamps the sum to the smallest
// normal f16), else weights. probs may alias logits.
template <typename T>
void moe_route(T* probs /* [T,E] */, int32_t* topk /* [T,K] */, T* weights /* [T,K] */, T* weights_norm /* [T,K] */,
               const T* logits /* [T,E] */, int n_tokens, int E, int K, bool renormalise);

// One token's weights of the K experts `ids` (most probable first): weights[j] = probs[ids[j]], and weights_norm as
// moe_route makes them. moe_route's own weighting, and the reference's alone (no engine twin): it weighs the experts
// of a routing the reference is told to follow (make_cpu_backend's ForcedRouting) by its own probabilities.
template <typename T>
void moe_weigh(T* weights /* [K] */, T* weights_norm /* [K] */, const T* probs /* [E] */, const int32_t* ids /* [K] */,
               int K, bool renormalise);

// out[t] = sum over slots j = 0..K-1, in that order, of weights[t, j] · down[t, j] (llama.cpp multiplies each
// expert's output by its weight, then adds the slots' views one after another).
template <typename T>
void moe_combine(T* out /* [T,D] */, const T* down /* [T,K,D] */, const T* weights /* [T,K] */, int n_tokens, int K,
                 int D);

// qwen2moe's shared expert gate, as llama.cpp's qwen2moe graph: gate_inp[t] = x[t] · w (ffn_gate_inp_shexp, one
// logit per token), then gate = sigmoid(gate_inp) (llama.cpp: silu(x) / x).
template <typename T>
void shexp_gate_logits(T* gate_inp /* [T] */, const T* x /* [T,D] */, const T* w /* [D] */, int n_tokens, int D);
template <typename T>
void sigmoid(T* out /* [n] */, const T* x /* [n] */, int64_t n);

// out[t, i] = shexp[t, i] · gate[t]: the shared expert's output times its gate (ffn_shexp_out). out may alias shexp.
template <typename T>
void scale_rows(T* out /* [T,D] */, const T* shexp /* [T,D] */, const T* gate /* [T] */, int n_tokens, int D);

}  // namespace diffrun::ref
