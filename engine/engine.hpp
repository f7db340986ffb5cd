// The CUDA engine's public API: the Backend factory, a device probe, and the engine's extra surface.
// Plain C++ (no CUDA types), so the CLI and tests include it with the host compiler.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "checkpoints/backend.hpp"
#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun {

// True when a CUDA device can be used; otherwise false and *why (when non-null) says why.
bool cuda_device_available(std::string* why);

// The Backend interface plus what the engine alone offers (the benchmark and the GPU tests use it).
class CudaEngine : public Backend {
 public:
  // Like forward() but returns only the device argmax of the last token's logits over the real
  // vocabulary (-1 if all are NaN), without copying the logits to the host.
  virtual int32_t forward_argmax(int step, std::span<const int32_t> tokens, Sink& sink) = 0;
  // Device argmax of the last step's last-token logits (Backend::last_argmax).
  int32_t last_argmax() const override = 0;
  // Bytes of weights one forward step reads from device memory.
  virtual uint64_t weight_bytes() const = 0;
};

// precision "f16": f16 weights and GEMM inputs, f32 accumulation, f32 residual stream, norms,
// softmax and KV cache. precision "f32": everything f32, TF32 off. The KV cache holds max_ctx
// positions. Throws Error when there is no CUDA device or not enough device memory (saying how
// much was needed and how much is free), InputError for another precision or max_ctx < 1,
// ModelError for a missing or malformed tensor. `faults` (faults/faults.hpp) are resolved into
// the engine's fault plan at construction (faults/fault_plan.hpp; InputError for one that does
// not apply to the model).
std::unique_ptr<CudaEngine> make_cuda_engine(const GgufFile& file, const ModelConfig& cfg,
                                             const std::string& precision, int max_ctx, const FaultSet& faults = {});
// Device bytes an engine of `precision` needs for a max_ctx-position KV cache and steps of up to
// `tokens` tokens (make_cuda_engine checks the one-token figure), and the device's free bytes now
// (0 when there is no device).
uint64_t cuda_engine_device_bytes(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                                  int max_ctx, int tokens);
uint64_t cuda_free_device_bytes();

// Makes the device's primary context (cudaFree(0); errors are left to the engines to report), so
// that a caller can have it made on a thread of its own while it does other work (~0.3 s on an H100).
void cuda_warm_up();
// Opens the libraries the engines call at run time (cuBLAS: engine/cublas_api.cuh) so that a caller can have it
// done on a thread of its own while it does other work (60-100 ms of their static initialisers). Never throws: a
// library that cannot be opened is reported by the first engine made.
void cuda_preload_libraries();

// Runs, once, the cuBLAS GEMMs a `tokens`-token step of a one-GPU engine of `precision` makes (on zeros, a handle and
// stream of its own), so that a caller can have cuBLAS's first use at those shapes (its kernels loaded, its choices
// made: 0.1-0.2 s at SmolLM2's shapes on an H200, most of an engine's first step) done on a thread of its own while
// the engines load. Operands over 128 MiB are left out, and so is all of it where the device's free memory is less
// than reserve_bytes (what the run's engines need) plus its own. Never throws: the engines report what fails.
void cuda_warm_up_gemms(const ModelConfig& cfg, const std::string& precision, int tokens, uint64_t reserve_bytes);

std::unique_ptr<Backend> make_cuda_backend(const GgufFile& file, const ModelConfig& cfg,
                                           const std::string& precision, int max_ctx, const FaultSet& faults = {});

}  // namespace diffrun
