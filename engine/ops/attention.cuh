// Causal GQA attention over the KV cache (T, S, H, Hkv, Dh), the twin of reference_cpu/ops/attention.
// Query t (at position n_past + t) of head h attends to cache rows s = 0..n_past + t of KV head
// h / (H / Hkv), and with window > 0 only to s > n_past + t − window: score = scale·(q·k) (scale
// 1/sqrt(Dh) for most models); p = exp(score − max) / Σ exp(score − max) in f32; out = Σ p·v.
// S = n_past + T positions are attended by the step. `variant` (model/op_variants.hpp) is the
// default in production; the catalog's attention faults pass another one to these same kernels.
// attention (any T): probabilities written to `probs` only when it is non-null (the kq_soft_max
// checkpoint); the kernel and the output are the same either way; with out null it writes the
// probabilities alone (the engine's prefill then takes its output from attention_tiled).
// attention_tiled (any T, the prefill's output): one block per (head, 32 queries), K/V tiles in shared
// memory, online softmax in f32; no probabilities. Same function as attention, another summation order.
// attention_split (T ≤ kAttentionSplitMaxT, decode): the keys of each (token, head) split over up to
// `splits` blocks (flash-decoding) so that a long one-token step uses every SM; the probabilities are
// always written (the split softmax keeps its scores there), so hooks only add the copy. The number
// of splits a launch uses is chosen on the device from the key count (n_past is read there): at most
// one split per `min_keys` keys, so a short step runs one block per (token, head) that writes the
// output and the probabilities itself (no partials, no ticket, no combine).
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "model/op_variants.hpp"

namespace diffrun::engine {

// out [T, H·Dh] (f32, or f16 when it feeds an f16 GEMM) or nullptr; probs [H, T, S] f32 or nullptr, zero
// above the diagonal; q [T, H·Dh] f32 (after RoPE); k_cache, v_cache [≥ S, Hkv·Dh] f32 with rows
// 0..S-1 valid; n_past [1] device (read on the device so a captured decode step replays at any
// position). Dh ≤ 256, H a multiple of Hkv.
void attention(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
               AttentionVariant variant = {});
void attention(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
               AttentionVariant variant = {});

// As attention without probabilities; Dh ≤ 256, H a multiple of Hkv.
void attention_tiled(float* out, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
               AttentionVariant variant = {});
void attention_tiled(__half* out, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
               AttentionVariant variant = {});

constexpr int kAttentionSplitMaxT = 4;         // the most tokens a step may pass to attention_split
constexpr int kAttentionSplitMaxSplits = 64;   // the most splits per (token, head)
constexpr int kAttentionSplitMinKeys = 16;     // default keys per split: fewer keys run in fewer splits

// Device scratch of attention_split, owned by the caller and reused by every launch.
struct AttentionSplitScratch {
  float* partial = nullptr;      // [T, H, splits, Dh + 2]: per split, the unnormalised output, max, exp-sum
  uint32_t* counters = nullptr;  // [T, H] zero before the first launch; each launch leaves them zero
  int splits = 1;                // blocks per (token, head), 1..kAttentionSplitMaxSplits
  // A launch uses clamp(keys / min_keys, 1, splits) of them for a query with `keys` keys (≥ 1;
  // 1 spreads every query over all splits with at least one key each).
  int min_keys = kAttentionSplitMinKeys;
};

// The number of splits that gives a one-token step of H heads two blocks per SM.
int attention_split_count(int H, int sm_count);

// The splits a query with `keys` keys (≥ 1) uses: clamp(keys / min_keys, 1, splits).
__host__ __device__ inline int attention_splits_used(int keys, int splits, int min_keys) {
  const int by_keys = keys / (min_keys > 1 ? min_keys : 1);
  return by_keys < 1 ? 1 : (by_keys < splits ? by_keys : splits);
}

// As attention, with probs [H, T, S] required; T ≤ kAttentionSplitMaxT; scratch sized for T, H, Dh
// and its splits. The result does not depend on which split finishes last (fixed combine order).
void attention_split(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                     const AttentionSplitScratch& scratch, cudaStream_t stream, AttentionVariant variant = {});
void attention_split(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                     const AttentionSplitScratch& scratch, cudaStream_t stream, AttentionVariant variant = {});

// A one-token step's q/k norms and RoPE (qwen3, gemma3: qk_norm_rope's work) done in attention_split's launch, so that
// the step has no launch for them. Every block norms and rotates its head's q from the projection's (qk_norm_rope's
// arithmetic, lane l holding elements l + 32j as there: the same bits), and a block whose keys include the cache row
// *write_pos its KV head's k, whose rotated row and v it uses for that row instead of reading the cache. Split 0 of
// each head writes its Qnorm and Qrope rows; split 0 of the first head of each KV group writes Knorm, Krope and the
// cache rows *write_pos of k_cache and v_cache (which no block of the launch reads).
struct AttentionQkPrep {
  const float* q = nullptr;  // [H·Dh] Qcur
  const float* k = nullptr;  // [Hkv·Dh] Kcur
  const float* v = nullptr;  // [Hkv·Dh] Vcur
  const float* q_w = nullptr;
  const float* k_w = nullptr;  // [Dh] the norms' weights
  float eps = 0.0f;
  float* q_norm = nullptr;  // [H·Dh] Qnorm (out)
  float* k_norm = nullptr;  // [Hkv·Dh] Knorm (out)
  float* q_out = nullptr;   // [H·Dh] Qrope (out)
  float* k_out = nullptr;   // [Hkv·Dh] Krope (out)
  float* k_cache = nullptr;
  float* v_cache = nullptr;  // the layer's cache, [max_ctx, Hkv·Dh]: row *write_pos written
  const int32_t* pos0 = nullptr;       // [1] device: the token's position
  const int32_t* write_pos = nullptr;  // [1] device: its cache row
  float theta = 0.0f;
  const float* freq_factors = nullptr;  // [Dh/2] or null
  bool neox = true;
};

// Whether attention_split_qk_norm_rope takes a step: one token, heads of 64, 128 or 256, the neox rotation.
bool attention_split_qk_norm_rope_supported(int T, int Dh, bool neox);

// attention_split over the cache as the two launches qk_norm_rope (at prep.pos0, prep.write_pos), then
// attention_split, leave it, and their outputs: bit-identical. False, launching nothing, where it is not supported.
bool attention_split_qk_norm_rope(float* out, float* probs, const AttentionQkPrep& prep, int T, const int32_t* n_past,
                                  int H, int Hkv, int Dh, float scale, int window, const AttentionSplitScratch& scratch,
                                  cudaStream_t stream, AttentionVariant variant = {});
bool attention_split_qk_norm_rope(__half* out, float* probs, const AttentionQkPrep& prep, int T,
                                  const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                                  const AttentionSplitScratch& scratch, cudaStream_t stream,
                                  AttentionVariant variant = {});

}  // namespace diffrun::engine
