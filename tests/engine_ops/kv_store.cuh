// KV cache write (T, Hkv, Dh): cache rows n_past + t ← the step's K (after RoPE) and V rows.
// Test-only (tests/test_engine_ops.cpp): the unfused op that rope_qk's cache write is checked against;
// the engine's forward runs rope_qk.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// k_cache, v_cache [max_ctx, Hkv·Dh] f32 (one layer); k, v [T, Hkv·Dh] f32; n_past [1] device;
// width = Hkv·Dh.
void kv_store(float* k_cache, float* v_cache, const float* k, const float* v, int T, const int32_t* n_past,
              int width, cudaStream_t stream);

}  // namespace diffrun::engine
