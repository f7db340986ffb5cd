// KV cache write (T, Hkv, Dh): cache rows pos[t] ← the step's K (after RoPE) and V rows.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// k_cache, v_cache [max_ctx, Hkv·Dh] f32 (one layer); k, v [T, Hkv·Dh] f32; pos [T] device;
// width = Hkv·Dh.
void kv_store(float* k_cache, float* v_cache, const float* k, const float* v, const int32_t* pos, int T,
              int width, cudaStream_t stream);

}  // namespace diffrun::engine
