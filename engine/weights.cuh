// Device weights (D, H, Hkv, Dh, F, V): raw GGUF bytes uploaded, then either kept as GGUF blocks or
// dequantized on the device.
// - Matrices in a format with quantized kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K;
//   engine/ops/qgemv.cuh) stay quantized: the decode GEMV reads the blocks, a step of several tokens
//   dequantizes a matrix into the shared scratch (W, bit-identical to the expanded matrix) for cuBLAS.
//   DIFFRUN_QUANT_WEIGHTS=0 expands them at load instead (the path before quantized kernels).
// - Other matrices (F32, F16, BF16, Q2_K, Q3_K) are kept in the engine's type W: f32, or f16 rounded
//   (nearest even) from the exact f32 value.
// Vectors (norm weights, biases) stay f32 in both precisions: they are not GEMM inputs.
// token_embd and output keep only their first V rows (padded vocabulary rows are never read).
// Concatenated at load: wq, wk, wv are consecutive rows of one [H*Dh + 2*Hkv*Dh, D] matrix (wq's
// DeviceMatrix covers all three; wk covers wk|wv), bq|bk|bv likewise one vector, and w_gate, w_up one
// [2F, D] matrix. A group is quantized only when every member's format has kernels (else expanded).
// A mixture of experts' stacked expert tensors [E, N, K] stay one tensor, viewed as E matrices; the
// dequantization scratch holds one expert's matrix.
// A tensor-parallel rank (TpSlice, checkpoints/tensor_parallel.hpp) uploads its slice alone: Wq|bq rows of its
// query heads, Wk|Wv|bk|bv of its KV heads, Wgate|Wup of its channels (column parallel), and Wo, Wdown the columns
// of its heads and channels (row parallel; quantized rows cut on block boundaries, each row's blocks gathered on
// the host). Everything else whole.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "checkpoints/tensor_parallel.hpp"
#include "engine/device_buffer.cuh"
#include "engine/device_matrix.cuh"
#include "engine/weight_cut.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun::engine {

template <typename W>
struct DeviceLayerWeights {
  const float* attn_norm = nullptr;  // [D]
  DeviceMatrix<W> wq;            // [H*Dh, D]
  DeviceMatrix<W> wk;            // [Hkv*Dh, D]
  DeviceMatrix<W> wv;            // [Hkv*Dh, D]
  const float* bq = nullptr;         // [H*Dh], qwen2 only (else null)
  const float* bk = nullptr;         // [Hkv*Dh], qwen2 only
  const float* bv = nullptr;         // [Hkv*Dh], qwen2 only
  const float* q_norm = nullptr;     // [Dh], qwen3 and gemma3 only
  const float* k_norm = nullptr;     // [Dh], qwen3 and gemma3 only
  DeviceMatrix<W> wo;            // [D, H*Dh]
  const float* attn_post_norm = nullptr;  // [D], gemma3 only
  const float* ffn_norm = nullptr;   // [D]
  DeviceMatrix<W> w_gate;        // [F, D]
  DeviceMatrix<W> w_up;          // [F, D]
  DeviceMatrix<W> w_down;        // [D, F]
  const float* ffn_post_norm = nullptr;  // [D], gemma3 only
  // Mixture of experts (qwen3moe, qwen2moe, Mixtral): the router and each expert's matrices, views into the
  // stacked [E, ...] tensors of the file (GGUF blocks, or dense rows of W).
  DeviceMatrix<W> ffn_gate_inp;               // [E, D]
  std::vector<DeviceMatrix<W>> ffn_gate_exps;  // E x [Fe, D]
  std::vector<DeviceMatrix<W>> ffn_up_exps;    // E x [Fe, D]
  std::vector<DeviceMatrix<W>> ffn_down_exps;  // E x [D, Fe]
  const float* ffn_gate_inp_shexp = nullptr;  // [D], qwen2moe's shared expert gate
  DeviceMatrix<W> ffn_gate_shexp;             // [Fs, D]
  DeviceMatrix<W> ffn_up_shexp;               // [Fs, D]
  DeviceMatrix<W> ffn_down_shexp;             // [D, Fs]
};

// Device bytes the weights take in type W, and the largest raw tensor (the upload staging buffer).
struct WeightFootprint {
  uint64_t weight_bytes = 0;
  uint64_t staging_bytes = 0;
  uint64_t scratch_bytes = 0;  // dense rows of the largest quantized matrix (group)
};

template <typename W>
class DeviceWeights {
 public:
  static WeightFootprint footprint(const GgufFile& file, const ModelConfig& cfg, const WeightCut* cut = nullptr);

  // Uploads and dequantizes every tensor the forward pass reads (validate_tensors must have passed).
  // dequant_scale_offset: tensors in the legacy block formats are uploaded as dequant_fault_bytes
  // (their scale read 2 bytes late) and decoded by the clean kernels.
  // cut: a tensor-parallel rank's (null: the whole model).
  DeviceWeights(const GgufFile& file, const ModelConfig& cfg, cudaStream_t stream, bool dequant_scale_offset = false,
                const WeightCut* cut = nullptr);

  DeviceMatrix<W> token_embd;          // [V, D]
  const float* output_norm = nullptr;  // [D]
  DeviceMatrix<W> lm_head;             // [V, D]: output, or token_embd when tied
  std::vector<DeviceLayerWeights<W>> layers;

  // Bytes of weights one forward step reads (all of them: the roofline's bytes per token).
  uint64_t bytes() const { return bytes_; }
  // The formats kept quantized on the device with their tensor counts ("Q4_1 x210, Q8_0 x1"), or "none".
  const std::string& quantized_summary() const { return quantized_summary_; }

  // weight_row_nan: every value of row `row` of m becomes NaN (a quantized row: its blocks' scale d).
  void fill_row_nan(const DeviceMatrix<W>& m, int64_t row, cudaStream_t stream);
  // swiglu_fused_gate_up_swapped: rows [0, half) and [half, 2·half) of m trade places (Wgate|Wup becomes
  // Wup|Wgate), dense or quantized (the two halves in one format). Synchronizes.
  void swap_row_halves(const DeviceMatrix<W>& m, int half, cudaStream_t stream);

 private:
  DeviceBuffer<unsigned char> arena_;
  DeviceBuffer<W> scratch_;
  uint64_t bytes_ = 0;
  std::string quantized_summary_ = "none";
};

}  // namespace diffrun::engine
