// The per-head q and k RMSNorms (qwen3, gemma3) and the RoPE with the KV cache write in one launch (T, H, Hkv, Dh):
// the fused twin of rms_norm over the T·H rows of q and the T·Hkv rows of k (D = Dh, in place), followed by rope_qk
// on the normalised q and k, every value bit-identical to those launches.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// Whether qk_norm_rope takes heads of Dh elements: a multiple of 64 (a warp a head, each lane two elements or more of
// the rotated pairs) up to 256 (rms_norm's block holds one element a thread, whose sums of squares it repeats).
bool qk_norm_rope_supported(int Dh);

// q [T, H·Dh] and k [T, Hkv·Dh] normalised in place, each head by q_w or k_w [Dh] (Qnorm, Knorm); then q_out and
// k_out (not aliasing q or k), the cache rows and v as rope_qk's arguments (rope_qk.cuh). False, launching nothing,
// where Dh is not supported: the caller runs rms_norm twice and rope_qk.
bool qk_norm_rope(float* q_out, float* k_out, float* k_cache, float* v_cache, float* q, float* k, const float* v,
                  const float* q_w, const float* k_w, float eps, int T, int H, int Hkv, int Dh, const int32_t* pos0,
                  const int32_t* write_pos, float theta, const float* freq_factors, bool neox, cudaStream_t stream);

// qk_norm_rope's rotation and cache write alone, on q and k as they are (already normalised): rope_qk's twin by the
// fused kernel's own code (the same arguments as rope_qk), so that an isolation replay, which replaces Qnorm and
// Knorm between the norms and the rotation, measures the rotation the fused kernel runs. False where Dh is not
// supported.
bool qk_norm_rope_rotation(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q, const float* k,
                           const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos,
                           float theta, const float* freq_factors, bool neox, cudaStream_t stream);

}  // namespace diffrun::engine
