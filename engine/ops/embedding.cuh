// Embedding gather (T, D, V): out[t, :] = table[tokens[t], :], from the dequantized token_embd table.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

// out [T, D] f32; tokens [T] (device, each in [0, V), checked by the caller); table [V, D].
void embedding(float* out, const int32_t* tokens, const float* table, int T, int D, cudaStream_t stream);
void embedding(float* out, const int32_t* tokens, const __half* table, int T, int D, cudaStream_t stream);

}  // namespace diffrun::engine
