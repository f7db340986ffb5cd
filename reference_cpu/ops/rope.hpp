// Rotary position embedding, both pairings. T tokens, nh heads (H or Hkv), Dh head width.
// rope_norm (llama): pairs (2i, 2i+1). rope_neox (qwen2, qwen3, gemma3): pairs (i, i + Dh/2).
// Pair i rotates by angle pos * theta^(-2i/Dh) / freq_factors[i] (factor 1 when freq_factors is null: Llama 3's
// rope_freqs, as ggml_rope_ext divides by its freq_factors), computed in the scalar type; token t sits at pos0 + t.
#pragma once

namespace diffrun::ref {

// out may alias x.
template <typename T>
void rope_norm(T* out /* [T,nh*Dh] */, const T* x /* [T,nh*Dh] */, int n_tokens, int n_head, int Dh, int pos0,
               T theta, const T* freq_factors /* [Dh/2] or null */ = nullptr);

template <typename T>
void rope_neox(T* out /* [T,nh*Dh] */, const T* x /* [T,nh*Dh] */, int n_tokens, int n_head, int Dh, int pos0,
               T theta, const T* freq_factors /* [Dh/2] or null */ = nullptr);

}  // namespace diffrun::ref
