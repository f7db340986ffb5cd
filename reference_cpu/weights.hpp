// The reference's weights: every tensor dequantized once at load into Eigen row-major matrices of the scalar T.
// D model width, H/Hkv heads, Dh head width, F feed-forward width, V real vocabulary, Vt table rows (>= V).
#pragma once

#include <vector>

#include <Eigen/Core>

#include "checkpoints/faults.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun::ref {

template <typename T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

template <typename T>
struct LayerWeights {
  Vector<T> attn_norm;    // [D]
  Matrix<T> wq;           // [H*Dh, D]
  Matrix<T> wk;           // [Hkv*Dh, D]
  Matrix<T> wv;           // [Hkv*Dh, D]
  Vector<T> bq;           // [H*Dh], qwen2 only (empty otherwise)
  Vector<T> bk;           // [Hkv*Dh], qwen2 only
  Vector<T> bv;           // [Hkv*Dh], qwen2 only
  Vector<T> q_norm;       // [Dh], qwen3 only
  Vector<T> k_norm;       // [Dh], qwen3 only
  Matrix<T> wo;           // [D, H*Dh]
  Vector<T> ffn_norm;     // [D]
  Matrix<T> w_gate;       // [F, D]
  Matrix<T> w_up;         // [F, D]
  Matrix<T> w_down;       // [D, F]
};

template <typename T>
struct Weights {
  Matrix<T> token_embd;   // [Vt, D]
  Vector<T> output_norm;  // [D]
  Matrix<T> output;       // [Vt, D]; empty when the model ties its lm head to token_embd
  std::vector<LayerWeights<T>> layers;

  // The lm head: output, or token_embd when tied. Only its first V rows are real vocabulary.
  const Matrix<T>& lm_head() const { return output.size() ? output : token_embd; }

  // Dequantizes every tensor the forward pass reads (validate_tensors must have passed). With the
  // fault dequant_scale_offset, tensors in the legacy block formats are decoded from
  // dequant_fault_bytes (their scale read 2 bytes late). matrices_f16: every matrix (2-D tensor) is
  // rounded to f16 after dequantization, as the f16 engine holds it (reference_cpu/storage.hpp).
  static Weights load(const GgufFile& file, const ModelConfig& cfg, const FaultSet& faults = {},
                      bool matrices_f16 = false);
};

}  // namespace diffrun::ref
