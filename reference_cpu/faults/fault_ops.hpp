// Flawed variants of reference ops for fault injection, kept out of the clean ops (reference_cpu/ops/).
// T tokens, S positions attended, D model width, V table rows, H/Hkv heads, Dh head width, K inputs, N outputs.
#pragma once

#include <cstdint>

#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

// embd_transposed: the token table (row-major [V, D]) indexed as if it were [D, V]:
// out[t, i] = table[i * V + tokens[t]]. Throws InputError for an id outside [0, V).
template <typename T>
void embedding_transposed(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const T* table /* [V,D] */,
                          int n_tokens, int D, int V);

// What the flawed attention gets wrong (any combination).
struct AttentionFlaws {
  bool no_causal_mask = false;  // every query attends to all S positions
  bool head_modulo = false;     // query head h reads KV head h % Hkv
  bool f16_exp = false;         // softmax_f16_overflow: weights f16(exp(q·k))^scale, no max subtracted
  bool any() const { return no_causal_mask || head_modulo || f16_exp; }
};

// The clean attention's algorithm (ops/attention.hpp) with the given flaws (no_causal_mask also drops the window).
template <typename T>
void attention_flawed(T* out /* [T,H*Dh] */, T* probs /* [H,T,S] */, const T* q /* [T,H*Dh] */,
                      const T* k_cache /* [S,Hkv*Dh] */, const T* v_cache /* [S,Hkv*Dh] */, int n_tokens, int n_past,
                      int H, int Hkv, int Dh, T scale, int window, AttentionFlaws flaws);

// What the flawed RMSNorm gets wrong (either or both).
struct RmsNormFlaws {
  bool off_by_one = false;        // rms_norm_off_by_one: the sum of squares misses x[D-1]
  bool eps_outside_sqrt = false;  // rms_eps_outside_sqrt: 1 / (sqrt(mean) + eps)
  bool any() const { return off_by_one || eps_outside_sqrt; }
};

// The clean RMSNorm's algorithm (ops/rms_norm.hpp) with the given flaws.
template <typename T>
void rms_norm_flawed(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps,
                     RmsNormFlaws flaws);

// attn_out_transposed / ffn_down_transposed: the [N, K] weight as a GEMM reads it with the wrong
// leading dimension: element (n, k) taken from W's memory at k * N + n (its memory read as [K, N]
// row-major). W's transpose when N == K; always in bounds.
template <typename T>
Matrix<T> wrong_leading_dimension(const Matrix<T>& w /* [N,K] */);

}  // namespace diffrun::ref
