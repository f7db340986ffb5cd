// Causal self-attention over the KV cache with grouped-query heads.
// T new tokens at positions n_past..n_past+T-1, S = n_past + T positions attended, H query heads,
// Hkv key/value heads (query head h reads kv head h / (H/Hkv)), Dh head width.
#pragma once

namespace diffrun::ref {

// probs[h, t, s] = softmax_s(q[t,h]·k[s,kv(h)] / sqrt(Dh)) over s <= n_past + t (max subtracted), 0 above
// the diagonal; out[t, h] = sum_s probs[h, t, s] * v[s, kv(h)].
template <typename T>
void attention(T* out /* [T,H*Dh] */, T* probs /* [H,T,S] */, const T* q /* [T,H*Dh] */,
               const T* k_cache /* [S,Hkv*Dh] */, const T* v_cache /* [S,Hkv*Dh] */, int n_tokens, int n_past,
               int H, int Hkv, int Dh);

}  // namespace diffrun::ref
