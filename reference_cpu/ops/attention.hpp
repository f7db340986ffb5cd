// Causal self-attention over the KV cache with grouped-query heads, optionally within a sliding window.
// T new tokens at positions n_past..n_past+T-1, S = n_past + T positions attended, H query heads,
// Hkv key/value heads (query head h reads kv head h / (H/Hkv)), Dh head width.
#pragma once

#include "model/op_variants.hpp"

namespace diffrun::ref {

// probs[h, t, s] = softmax_s(scale · q[t,h]·k[s,kv(h)]) over the visible s (max subtracted), 0 elsewhere;
// out[t, h] = sum_s probs[h, t, s] * v[s, kv(h)]. Visible: s <= n_past + t and, when window > 0,
// n_past + t - s < window (the query and the window - 1 positions before it, as llama.cpp's
// LLAMA_SWA_TYPE_STANDARD). scale is 1/sqrt(Dh) for most models (ModelConfig::attention_scale).
// `variant` (model/op_variants.hpp) is the default in production; the attention faults pass another.
template <typename T>
void attention(T* out /* [T,H*Dh] */, T* probs /* [H,T,S] */, const T* q /* [T,H*Dh] */,
               const T* k_cache /* [S,Hkv*Dh] */, const T* v_cache /* [S,Hkv*Dh] */, int n_tokens, int n_past,
               int H, int Hkv, int Dh, T scale, int window, AttentionVariant variant = {});

}  // namespace diffrun::ref
