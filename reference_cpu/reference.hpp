// The CPU reference backend: an Eigen forward pass in f32 or f64 for every architecture of model/config_names.cpp.
#pragma once

#include <memory>
#include <string>

#include "checkpoints/backend.hpp"
#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun {

// How the reference holds its weight matrices. streamed: as the GGUF's bytes (quantized, in the mmap), each
// matmul decoding the rows it reads; memory is a few MB of decoded rows a thread on top of the
// mapped file. dense: every matrix dequantized once at load (4 or 8 bytes per weight). Both compute the same
// values bit for bit (tests/test_reference_weights.cpp); dense is the oracle and the benchmark's baseline.
enum class WeightHolding { streamed, dense };

// Validates the tensors and maps the weights for `precision`: "f32" | "f64", the arithmetic,
// optionally with emulated storage "-f16store" (the f16 engine's f16 weights and GEMM inputs) or
// "-f16residual" (the residual stream in f16); reference_cpu/storage.hpp lists the rounding points.
// The KV cache holds max_ctx positions. `faults` (faults/faults.hpp) are resolved into the backend's fault
// plan at construction (faults/fault_plan.hpp) and so injected into the forward pass.
// Throws InputError for another precision, max_ctx < 1 or a fault that does not apply to the model,
// ModelError for a missing or malformed tensor.
// The file must outlive the backend.
std::unique_ptr<Backend> make_cpu_backend(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                                          int max_ctx, const FaultSet& faults = {},
                                          WeightHolding holding = WeightHolding::streamed);

}  // namespace diffrun
