// Embedding gather (T, D, V): out[t, :] = table[tokens[t], :], from the token_embd table (dense or quantized).
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/device_matrix.cuh"

namespace diffrun::engine {

// out [T, D] f32; tokens [T] device ids (the caller checks them against V on the host; a row for an
// id outside [0, V) is written as NaN rather than read out of bounds); table [V, D].
void embedding(float* out, const int32_t* tokens, const float* table, int T, int D, int V, cudaStream_t stream);
void embedding(float* out, const int32_t* tokens, const __half* table, int T, int D, int V, cudaStream_t stream);
// The same from a DeviceMatrix: dense, or its GGUF blocks decoded per row (each value as the expanded
// table of type W holds it, so embd does not depend on how the table is stored).
void embedding(float* out, const int32_t* tokens, const DeviceMatrix<float>& table, int T, int D, int V,
               cudaStream_t stream);
void embedding(float* out, const int32_t* tokens, const DeviceMatrix<__half>& table, int T, int D, int V,
               cudaStream_t stream);

}  // namespace diffrun::engine
