// Add (T, D): out = a + b, f32 (out may alias a or b). The forward's residual adds run fused with the
// next norm (add_rms_norm); this one adds qwen2moe's shared expert to the routed experts' sum (ffn_out),
// and is what add_rms_norm's sum is checked against (tests/test_engine_ops.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// out, a, b [T, D] f32; n = T·D.
void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
