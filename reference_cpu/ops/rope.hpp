// Rotary position embedding, both pairings. T tokens, nh heads (H or Hkv), Dh head width.
// rope_norm (llama): pairs (2i, 2i+1). rope_neox (qwen2, qwen3): pairs (i, i + Dh/2).
// Pair i rotates by angle pos * theta^(-2i/Dh), computed in the scalar type; token t sits at pos0 + t.
#pragma once

namespace diffrun::ref {

// out may alias x.
template <typename T>
void rope_norm(T* out /* [T,nh*Dh] */, const T* x /* [T,nh*Dh] */, int n_tokens, int n_head, int Dh, int pos0,
               T theta);

template <typename T>
void rope_neox(T* out /* [T,nh*Dh] */, const T* x /* [T,nh*Dh] */, int n_tokens, int n_head, int Dh, int pos0,
               T theta);

}  // namespace diffrun::ref
