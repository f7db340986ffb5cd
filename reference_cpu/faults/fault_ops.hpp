// Flawed variants of reference ops for fault injection, kept out of the clean ops (reference_cpu/ops/).
// T tokens, S positions attended, D model width, V table rows, H/Hkv heads, Dh head width, K inputs, N outputs.
#pragma once

#include <cstdint>

#include "model/op_variants.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

// embd_transposed: the token table (row-major [V, D]) indexed as if it were [D, V]:
// out[t, i] = table[i * V + tokens[t]]. Throws InputError for an id outside [0, V).
template <typename T>
void embedding_transposed(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const T* table /* [V,D] */,
                          int n_tokens, int D, int V);

// gqa_head_modulo: the K or V cache [rows, Hkv·Dh] expanded to H heads the wrong way round (h % Hkv instead
// of h / (H/Hkv)): out [rows, H·Dh] with out[s, h] = kv[s, h % Hkv]; the production attention then reads it
// as a cache of H KV heads (the engine's expand_kv_heads_modulo).
template <typename T>
void expand_kv_heads_modulo(T* out /* [rows,H*Dh] */, const T* kv /* [rows,Hkv*Dh] */, int rows, int H, int Hkv, int Dh);

// The clean RMSNorm's algorithm (ops/rms_norm.hpp) with the flaws off_by_one and eps_outside_sqrt
// (model/op_variants.hpp).
template <typename T>
void rms_norm_flawed(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps,
                     RmsNormFlaws flaws);

// attn_out_transposed / ffn_down_transposed: the [N, K] weight as a GEMM reads it with the wrong
// leading dimension: element (n, k) taken from W's memory at k * N + n (its memory read as [K, N]
// row-major). W's transpose when N == K; always in bounds.
template <typename T>
Matrix<T> wrong_leading_dimension(const Matrix<T>& w /* [N,K] */);

}  // namespace diffrun::ref
