// Causal GQA attention over the KV cache (T, S, H, Hkv, Dh).
// Query t (at position n_past + t) of head h attends to cache rows s = 0..n_past + t of KV head
// h / (H / Hkv): score = (q·k) / sqrt(Dh); p = exp(score − max) / Σ exp(score − max) in f32;
// out = Σ p·v. S = n_past + T positions are attended by the step. The probabilities are written to `probs` only when it is non-null (the
// kq_soft_max checkpoint); the kernel and the output are the same either way.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// out [T, H·Dh] (f32, or f16 when it feeds an f16 GEMM); probs [H, T, S] f32 or nullptr, zero
// above the diagonal; q [T, H·Dh] f32 (after RoPE); k_cache, v_cache [≥ S, Hkv·Dh] f32 with rows
// 0..S-1 valid; n_past [1] device (read on the device so a captured decode step replays at any
// position). Dh ≤ 256, H a multiple of Hkv.
void attention(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, cudaStream_t stream);
void attention(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, cudaStream_t stream);

}  // namespace diffrun::engine
