// Flawed variants of reference ops for fault injection, kept out of the clean ops (reference_cpu/ops/), and the
// entry points that take the fault plan's op arguments (faults/fault_plan.hpp): each runs the clean op for
// production's argument, its flawed variant otherwise. The attention faults run the clean attention with another
// AttentionVariant.
// T tokens, S positions attended, D model width, H/Hkv heads, Dh head width, K inputs, N outputs, Np padded outputs.
#pragma once

#include <cstdint>
#include <vector>

#include "model/op_variants.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

// gqa_head_modulo: the K or V cache [rows, Hkv·Dh] expanded to H heads the wrong way round (h % Hkv instead
// of h / (H/Hkv)): out [rows, H·Dh] with out[s, h] = kv[s, h % Hkv]; the production attention then reads it
// as a cache of H KV heads (the engine's expand_kv_heads_modulo).
template <typename T>
void expand_kv_heads_modulo(T* out /* [rows,H*Dh] */, const T* kv /* [rows,Hkv*Dh] */, int rows, int H, int Hkv, int Dh);

// The clean RMSNorm's algorithm (ops/rms_norm.hpp) with the flaws off_by_one and eps_outside_sqrt.
template <typename T>
void rms_norm_flawed(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps,
                     RmsNormFlaws flaws);

// rms_norm with its flaws (model/op_variants.hpp): the clean op without any; nothing but a copy (when out is
// not x) when skipped; handed ones for w when unweighted; rms_norm_flawed for the others.
template <typename T>
void rms_norm(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps,
              RmsNormFlaws flaws);

// moe_route with its flaws (model/op_variants.hpp): the clean op without any; with them, the clean op and then its
// outputs redone as the flaws say: each id one higher (mod E) with that expert's probability as its weight, the
// weights a softmax over the selected logits, the normalised weights left unnormalised. probs must not alias logits.
template <typename T>
void moe_route(T* probs /* [T,E] */, int32_t* topk /* [T,K] */, T* weights /* [T,K] */, T* weights_norm /* [T,K] */,
               const T* logits /* [T,E] */, int n_tokens, int E, int K, bool renormalise, MoeRoutingFlaws flaws);

// scale_rows with moe_shared_expert_gate_skipped: the clean op without it; out = shexp unscaled (the shared
// expert's output added without its sigmoid gate) with it. out may alias shexp.
template <typename T>
void scale_rows(T* out /* [T,D] */, const T* shexp /* [T,D] */, const T* gate /* [T] */, int n_tokens, int D,
                bool gate_skipped);

// attn_out_transposed / ffn_down_transposed / embd_transposed: the [N, K] weight as a GEMM reads it with the wrong
// leading dimension: element (n, k) taken from W's memory at k * N + n (its memory read as [K, N] row-major). W's
// transpose when N == K; always in bounds. For the token table [V, D] it is the table indexed as [D, V]:
// row id holds table[i * V + id].
template <typename T>
Matrix<T> wrong_leading_dimension(const Matrix<T>& w /* [N,K] */);

// matmul into rows Np >= N wide (lm_head_padded_vocab's logits over a padded vocabulary): out[t, 0..N-1] =
// x[t] · Wᵀ, out[t, N..Np-1] the stale value kFaultUninitialisedLogit that no op writes. Np == N: matmul.
template <typename T>
void matmul_padded(T* out /* [T,Np] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */, int n_tokens,
                   int K, int N, int Np);

// The K/V heads attention reads: the given K and V [rows, Hkv·Dh] as they are, or under gqa_head_modulo both
// expanded to H heads the wrong way round (held here).
template <typename T>
class AttentionKv {
 public:
  AttentionKv(const T* k /* [rows,Hkv*Dh] */, const T* v /* [rows,Hkv*Dh] */, int rows, int H, int Hkv, int Dh,
              bool gqa_head_modulo);
  const T* k() const { return k_; }  // [rows, heads()·Dh]
  const T* v() const { return v_; }
  int heads() const { return heads_; }

 private:
  std::vector<T> k_held_, v_held_;  // [rows, H·Dh] under gqa_head_modulo, else empty
  const T* k_;
  const T* v_;
  int heads_;
};

// The K rows the cache write stores: K after RoPE, or under rope_cache_unrotated K as it was before (a copy held
// from construction, before the rotation).
template <typename T>
class CachedKeys {
 public:
  CachedKeys(const std::vector<T>& k_before_rope /* [T,Hkv*Dh] */, bool unrotated)
      : held_(unrotated ? k_before_rope : std::vector<T>()) {}
  const T* rows(const std::vector<T>& k_rotated /* [T,Hkv*Dh] */) const {
    return held_.empty() ? k_rotated.data() : held_.data();
  }

 private:
  std::vector<T> held_;
};

}  // namespace diffrun::ref
