// RoPE of q and k in one launch (T, H, Hkv, Dh): the fused twin of rope_norm / rope_neox applied to
// q (H heads) and then to k (Hkv heads), with the same angles and arithmetic as those kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// q_out [T, H·Dh] (may alias q); k_out [T, Hkv·Dh] (may alias k); pos0 [1] device: position of
// token 0. neox: pairs (i, i + Dh/2) as rope_neox, else (2i, 2i+1) as rope_norm.
void rope_qk(float* q_out, float* k_out, const float* q, const float* k, int T, int H, int Hkv, int Dh,
             const int32_t* pos0, float theta, bool neox, cudaStream_t stream);

}  // namespace diffrun::engine
