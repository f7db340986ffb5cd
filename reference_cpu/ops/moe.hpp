// Mixture-of-experts routing and combination, as llama.cpp's build_moe_ffn. T tokens, E experts, K experts used
// per token, D model width.
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

// out[t] = sum over slots j = 0..K-1, in that order, of weights[t, j] · down[t, j] (llama.cpp multiplies each
// expert's output by its weight, then adds the slots' views one after another).
template <typename T>
void moe_combine(T* out /* [T,D] */, const T* down /* [T,K,D] */, const T* weights /* [T,K] */, int n_tokens, int K,
                 int D);

}  // namespace diffrun::ref
