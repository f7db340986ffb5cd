// CPU dequantization of GGUF tensor data to float32 or float64, exact (matches ggml and the gguf package).
#pragma once

#include <cstdint>
#include <vector>

#include "model/gguf.hpp"

namespace diffrun {

// F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
bool dequant_supported(GgmlType t);

// Q4_K, Q5_K, Q6_K: the super-block formats of the CUDA engine's quantized GEMV. On its SIMT kernel (f32 activations,
// or DIFFRUN_QGEMV_MMA=0) a Wgate|Wup in one of them stays out of the fused gate|up SwiGLU GEMV
// (engine/ops/matmul.cu); the fault catalog's fault_dormant reads the same rule.
bool gemv_super_block(GgmlType t);

// n must be a multiple of ggml_block_elements(t); src holds n / block_elements blocks.
// Throws ModelError for an unsupported type. The f64 path produces the same values widened
// (every dequantized value is exactly representable in f32).
void dequantize(GgmlType t, const void* src, float* dst, int64_t n);
void dequantize(GgmlType t, const void* src, double* dst, int64_t n);

// Dequantize a whole tensor of `file` into a row-major array of n_elements values.
template <typename T>
std::vector<T> dequantize_tensor(const GgufFile& file, const TensorInfo& t);

// IEEE half and bfloat16 conversions used by the dequantizers (exact, subnormals and -0 kept).
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even

}  // namespace diffrun
