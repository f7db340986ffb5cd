// RoPE of one tensor, the two pairings: rope_norm (2i, 2i+1; llama) and rope_neox (i, i + Dh/2; qwen2,
// qwen3, gemma3). (T, n_head, Dh)
// Each pair i in [0, Dh/2) of each head of token t is rotated by angle = pos[t] · theta^(-2i/Dh),
// with pos[t] = *pos0 + t, computed in f32 as float(pos) · powf(theta, -2.0f·i/Dh), then sincosf
// (no fast math), as the reference computes it in its scalar type:
//   y0 = x0·cos − x1·sin,  y1 = x0·sin + x1·cos.
// Test-only (tests/test_engine_ops.cpp): the unfused ops that rope_qk is checked against; the engine's
// forward runs rope_qk.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// out [T, n_head·Dh] (may alias x); x [T, n_head·Dh]; pos0 [1] device: the position of token 0
// (read on the device so a captured decode step replays at any position); freq_factors [Dh/2] device or
// null: pair i's angle is divided by freq_factors[i] (Llama 3's rope_freqs, as the reference's twins).
void rope_norm(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0, float theta,
               const float* freq_factors, cudaStream_t stream);
void rope_neox(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0, float theta,
               const float* freq_factors, cudaStream_t stream);

}  // namespace diffrun::engine
