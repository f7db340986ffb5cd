// The reference's weights: matrices kept as their GGUF bytes (quantized, in the mmap) and decoded row by row where
// they are read; norm weights and biases dequantized once into Eigen vectors of the scalar T.
// D model width, H/Hkv heads, Dh head width, F feed-forward width, V real vocabulary, Vt table rows (>= V).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/reference.hpp"

namespace diffrun::ref {

template <typename T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

// A weight matrix [rows, cols] (a GGUF tensor [ne0 = cols, ne1 = rows]) as the reference reads it. Streamed
// (the default): the tensor's bytes stay where they are (the read-only mmap, or an owned copy when the
// dequant_scale_offset fault rewrites them) and decode_floats dequantizes the pieces of rows a matmul needs,
// exactly as dequantize_tensor would, rounded to f16 when the storage plan holds weights in f16. Dense: every value
// dequantized once (the former way, kept for the faults that edit weights and as the streamed path's oracle).
// Both give the same values bit for bit.
template <typename T>
class WeightMatrix {
 public:
  WeightMatrix() = default;
  // A streamed view of `rows` rows of `cols` values of type `type` at `bytes` (cols a multiple of the block size).
  WeightMatrix(GgmlType type, const std::byte* bytes, int64_t rows, int64_t cols, bool round_to_f16);
  // The same over bytes it owns.
  WeightMatrix(GgmlType type, std::vector<std::byte> owned, int64_t rows, int64_t cols, bool round_to_f16);
  // A dense matrix of these values.
  explicit WeightMatrix(Matrix<T> values);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  bool dense() const { return dense_.size() > 0 || rows_ == 0; }
  const T* data() const { return dense_.data(); }  // [rows, cols], dense only

  // out [n, cols] = rows r0 .. r0+n-1, decoded (streamed) or copied (dense).
  void decode_rows(T* out /* [n,cols] */, int64_t r0, int64_t n) const;
  // Streamed only: out [n, nc] = columns c0 .. c0+nc-1 of rows r0 .. r0+n-1 as floats (every decoded value, rounded
  // to f16 or not, is a float: these are decode_rows's values before their conversion to T). c0 and nc are whole
  // blocks, or nc reaches the row's end.
  void decode_floats(float* out /* [n,nc] */, int64_t r0, int64_t n, int64_t c0, int64_t nc) const;
  // Streamed only: the same values widened to doubles, in one pass where the format's decoder does it
  // (dequant_rows.hpp's decode_rows_wide): an f64 prefill's pieces.
  void decode_wide(double* out /* [n,nc] */, int64_t r0, int64_t n, int64_t c0, int64_t nc) const;
  // Streamed only: acc [16] takes the lane sums of columns c0 .. c0+nc-1 of row r against x [nc] in one pass where
  // the format has a fused decoder (dequant_rows.hpp's decode_dot), the same values as decode_floats then
  // lane_accumulate; false, touching nothing, where it has none.
  bool decode_dot(T* acc /* [16] */, int64_t r, int64_t c0, int64_t nc, const T* x /* [nc] */) const;
  // The same for rows r and r + 1 at once (acc0, acc1), where the format has a two-row decoder (f64: Q4_K); false,
  // touching nothing, where it has none.
  bool decode_dot_x2(T* acc0, T* acc1, int64_t r, int64_t c0, int64_t nc, const T* x) const;
  // Streamed only: the same for nt (1 .. kDotTokens) tokens' inputs x [nt, ldx] at once against row r, acc [nt, 16]
  // (dequant_rows.hpp's decode_dot_tokens); false, touching nothing, where the format has no such kernel
  // (dots_for_tokens()).
  bool decode_dot_tokens(T* acc, int64_t r, int64_t c0, int64_t nc, const T* x, int64_t ldx, int nt) const;
  bool dots_for_tokens() const;

  // Rows r0 .. r0+n-1 as a matrix of their own: a view of the same bytes (streamed), or a copy of them (owned bytes,
  // dense values). One expert's matrix out of a GGUF stack [E·rows, cols].
  WeightMatrix row_block(int64_t r0, int64_t n) const;

  // Decodes every row once and holds them (for the faults that edit or reinterpret a matrix); returns them.
  Matrix<T>& densify();
  Matrix<T> to_dense() const;

 private:
  GgmlType type_ = GgmlType::F32;
  const std::byte* bytes() const { return owned_.empty() ? bytes_ : owned_.data(); }
  // decode(bytes, out, count) over columns c0 .. c0+nc-1 of rows r0 .. r0+n-1: one call for whole rows, else a row
  // at a time (decode_floats, decode_wide).
  template <typename Out, typename Decode>
  void decode_pieces(Out* out, int64_t r0, int64_t n, int64_t c0, int64_t nc, Decode&& decode) const;

  const std::byte* bytes_ = nullptr;  // rows_ * row_bytes_ bytes in the mmap, when owned_ is empty
  int64_t rows_ = 0, cols_ = 0;
  int64_t row_bytes_ = 0;
  bool round_f16_ = false;
  std::vector<std::byte> owned_;  // the rewritten bytes of a fault (dequant_scale_offset), else empty
  Matrix<T> dense_;               // [rows, cols] once densified
};

template <typename T>
struct LayerWeights {
  Vector<T> attn_norm;      // [D]
  WeightMatrix<T> wq;       // [H*Dh, D]
  WeightMatrix<T> wk;       // [Hkv*Dh, D]
  WeightMatrix<T> wv;       // [Hkv*Dh, D]
  Vector<T> bq;             // [H*Dh], qwen2 only (empty otherwise)
  Vector<T> bk;             // [Hkv*Dh], qwen2 only
  Vector<T> bv;             // [Hkv*Dh], qwen2 only
  Vector<T> q_norm;         // [Dh], qwen3 and gemma3 only
  Vector<T> k_norm;         // [Dh], qwen3 and gemma3 only
  WeightMatrix<T> wo;       // [D, H*Dh]
  Vector<T> attn_post_norm; // [D], gemma3 only
  Vector<T> ffn_norm;       // [D]
  WeightMatrix<T> w_gate;   // [F, D]
  WeightMatrix<T> w_up;     // [F, D]
  WeightMatrix<T> w_down;   // [D, F]
  Vector<T> ffn_post_norm;  // [D], gemma3 only
  WeightMatrix<T> ffn_gate_inp;                // [E, D], moe only: the router
  std::vector<WeightMatrix<T>> ffn_gate_exps;  // E x [Fe, D], moe only
  std::vector<WeightMatrix<T>> ffn_up_exps;    // E x [Fe, D], moe only
  std::vector<WeightMatrix<T>> ffn_down_exps;  // E x [D, Fe], moe only
  Vector<T> ffn_gate_inp_shexp;                // [D], moe_shexp only (qwen2moe): the shared expert's gate
  WeightMatrix<T> ffn_gate_shexp;              // [Fs, D], moe_shexp only: the shared expert's FFN
  WeightMatrix<T> ffn_up_shexp;                // [Fs, D], moe_shexp only
  WeightMatrix<T> ffn_down_shexp;              // [D, Fs], moe_shexp only
};

template <typename T>
struct Weights {
  WeightMatrix<T> token_embd;  // [Vt, D]
  Vector<T> output_norm;       // [D]
  WeightMatrix<T> output;      // [Vt, D]; empty when the model ties its lm head to token_embd
  std::vector<LayerWeights<T>> layers;

  // The lm head: output, or token_embd when tied. Only its first V rows are real vocabulary.
  const WeightMatrix<T>& lm_head() const { return output.rows() ? output : token_embd; }

  // Maps every tensor the forward pass reads (validate_tensors must have passed); the file must outlive the
  // weights when streamed. With the fault dequant_scale_offset, tensors in the legacy block formats are decoded
  // from dequant_fault_bytes (their scale read 2 bytes late). matrices_f16: every matrix (2-D tensor) is rounded
  // to f16 after dequantization, as the f16 engine holds it (reference_cpu/storage.hpp).
  static Weights load(const GgufFile& file, const ModelConfig& cfg, const FaultSet& faults = {},
                      bool matrices_f16 = false, WeightHolding holding = WeightHolding::streamed);
};

}  // namespace diffrun::ref
