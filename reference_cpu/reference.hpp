// The CPU reference backend: an Eigen forward pass in f32 or f64 for llama, qwen2 and qwen3.
#pragma once

#include <memory>
#include <string>

#include "checkpoints/backend.hpp"
#include "checkpoints/faults.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun {

// Validates the tensors and dequantizes every weight once into `precision`: "f32" | "f64", the arithmetic,
// optionally with emulated storage "-f16store" (the f16 engine's f16 weights and GEMM inputs) or
// "-f16residual" (the residual stream in f16); reference_cpu/storage.hpp lists the rounding points.
// The KV cache holds max_ctx positions. `faults` (checkpoints/faults.hpp) are injected into the forward pass.
// Throws InputError for another precision, max_ctx < 1 or a fault that does not apply to the model,
// ModelError for a missing or malformed tensor.
std::unique_ptr<Backend> make_cpu_backend(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                                          int max_ctx, const FaultSet& faults = {});

}  // namespace diffrun
