// RoPE, NORM pairing (2i, 2i+1): llama. (T, n_head, Dh)
// Each pair i in [0, Dh/2) of each head of token t is rotated by angle = pos[t] · theta^(-2i/Dh),
// computed in f32 as powf(theta, -2.0f·i/Dh) times float(pos[t]), then sincosf (no fast math):
//   y0 = x0·cos − x1·sin,  y1 = x0·sin + x1·cos.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// out [T, n_head·Dh] (may alias x); x [T, n_head·Dh]; pos [T] device positions.
void rope_norm(float* out, const float* x, const int32_t* pos, int T, int n_head, int Dh, float theta,
               cudaStream_t stream);

}  // namespace diffrun::engine
