// Device weights (D, H, Hkv, Dh, F, V): raw GGUF bytes uploaded, dequantized on the device, raw freed.
// Matrices are kept in the engine's type W: f32, or f16 rounded (nearest even) from the exact f32
// value. Vectors (norm weights, biases) stay f32 in both precisions: they are not GEMM inputs.
// token_embd and output keep only their first V rows (padded vocabulary rows are never read).
// Concatenated at load: wq, wk, wv are consecutive rows of one [H*Dh + 2*Hkv*Dh, D] matrix (wk = wq +
// H*Dh*D, wv = wk + Hkv*Dh*D), bq|bk|bv likewise one vector, and w_gate, w_up one [2F, D] matrix.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "engine/device_buffer.cuh"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun::engine {

template <typename W>
struct DeviceLayerWeights {
  const float* attn_norm = nullptr;  // [D]
  const W* wq = nullptr;             // [H*Dh, D]
  const W* wk = nullptr;             // [Hkv*Dh, D]
  const W* wv = nullptr;             // [Hkv*Dh, D]
  const float* bq = nullptr;         // [H*Dh], qwen2 only (else null)
  const float* bk = nullptr;         // [Hkv*Dh], qwen2 only
  const float* bv = nullptr;         // [Hkv*Dh], qwen2 only
  const float* q_norm = nullptr;     // [Dh], qwen3 only
  const float* k_norm = nullptr;     // [Dh], qwen3 only
  const W* wo = nullptr;             // [D, H*Dh]
  const float* ffn_norm = nullptr;   // [D]
  const W* w_gate = nullptr;         // [F, D]
  const W* w_up = nullptr;           // [F, D]
  const W* w_down = nullptr;         // [D, F]
};

// Device bytes the weights take in type W, and the largest raw tensor (the upload staging buffer).
struct WeightFootprint {
  uint64_t weight_bytes = 0;
  uint64_t staging_bytes = 0;
};

template <typename W>
class DeviceWeights {
 public:
  static WeightFootprint footprint(const GgufFile& file, const ModelConfig& cfg);

  // Uploads and dequantizes every tensor the forward pass reads (validate_tensors must have passed).
  // dequant_scale_offset: tensors in the legacy block formats are uploaded as dequant_fault_bytes
  // (their scale read 2 bytes late) and decoded by the clean kernels.
  DeviceWeights(const GgufFile& file, const ModelConfig& cfg, cudaStream_t stream, bool dequant_scale_offset = false);

  const W* token_embd = nullptr;   // [V, D]
  const float* output_norm = nullptr;  // [D]
  const W* lm_head = nullptr;      // [V, D]: output, or token_embd when tied
  std::vector<DeviceLayerWeights<W>> layers;

  // Bytes of weights one forward step reads (all of them: the roofline's bytes per token).
  uint64_t bytes() const { return bytes_; }

 private:
  DeviceBuffer<unsigned char> arena_;
  uint64_t bytes_ = 0;
};

}  // namespace diffrun::engine
