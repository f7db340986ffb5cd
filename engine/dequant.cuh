// Device dequantization of raw GGUF tensor bytes, one kernel per format, bit-exact vs model/dequant.cpp.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "model/gguf.hpp"

namespace diffrun::engine {

// Formats with a device kernel: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
bool device_dequant_supported(GgmlType t);

// dst[n] = the exact f32 value of each of the n elements of type `t` in `src` (raw GGUF blocks,
// device memory); the f16 overload rounds that exact value to nearest even. n must be a multiple
// of ggml_block_elements(t). Every multiply and add is rounded separately (no FMA contraction), as
// ggml's and the gguf package's reference code computes them. Throws ModelError for other formats.
void dequantize_device(GgmlType t, const void* src, float* dst, int64_t n, cudaStream_t stream);
void dequantize_device(GgmlType t, const void* src, __half* dst, int64_t n, cudaStream_t stream);

}  // namespace diffrun::engine
