// RoPE of q and k and the KV cache write in one launch (T, H, Hkv, Dh): the fused twin of
// rope_norm / rope_neox applied to q (H heads) and then to k (Hkv heads), with the same angles and
// arithmetic as those kernels, followed by kv_store of the rotated k and of v.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// q_out [T, H·Dh] (may alias q); k_out [T, Hkv·Dh] (may alias k); k_cache, v_cache [max_ctx, Hkv·Dh]
// (one layer): rows write_pos + t ← k_out and v rows; v [T, Hkv·Dh]; pos0 [1] device: position of
// token 0; write_pos [1] device: cache row of token 0 (pos0, but for the kv_cache_pos0 fault).
// freq_factors [Dh/2] device or null, as rope_norm's. neox: pairs (i, i + Dh/2) as rope_neox, else (2i, 2i+1)
// as rope_norm.
void rope_qk(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q, const float* k,
             const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos, float theta,
             const float* freq_factors, bool neox, cudaStream_t stream);

}  // namespace diffrun::engine
