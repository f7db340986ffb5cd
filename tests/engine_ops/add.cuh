// Residual add (T, D): out = a + b, f32 (out may alias a or b).
// Test-only (tests/test_engine_ops.cpp): the unfused op that add_rms_norm's sum is checked against;
// the engine's forward runs add_rms_norm.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// out, a, b [T, D] f32; n = T·D.
void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
