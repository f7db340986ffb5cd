// Loading the reference's weights: streamed views of the GGUF matrices (decoded row by row), or dense copies.
#include "reference_cpu/weights.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "model/dequant.hpp"
#include "model/error.hpp"
#include "reference_cpu/dequant_rows.hpp"
#include "reference_cpu/storage.hpp"

namespace diffrun::ref {

namespace {

// A tensor's values, decoded as the dequant_scale_offset fault decodes them when `faulty`.
template <typename T>
std::vector<T> tensor_values(const GgufFile& file, const TensorInfo& info, bool faulty) {
  if (!faulty || !dequant_fault_format(info.type)) return dequantize_tensor<T>(file, info);
  const std::vector<std::byte> raw = dequant_fault_bytes(info.type, file.tensor_data(info));
  std::vector<T> values(static_cast<size_t>(info.n_elements));
  dequantize(info.type, raw.data(), values.data(), info.n_elements);
  return values;
}

// A GGUF tensor as a row-major [ne1*ne2*..., ne0] matrix, streamed from the file's bytes or dequantized whole.
template <typename T>
WeightMatrix<T> load_matrix(const GgufFile& file, const std::string& name, bool faulty, bool round_to_f16,
                            WeightHolding holding) {
  const TensorInfo& info = file.tensor(name);
  const int64_t cols = info.ne.empty() ? 1 : info.ne[0];
  const int64_t rows = info.rows();
  if (rows * cols != info.n_elements) {
    throw ModelError(name + ": " + std::to_string(info.n_elements) + " values are not " + std::to_string(rows) +
                     " rows of " + std::to_string(cols));
  }
  const bool rewrite = faulty && dequant_fault_format(info.type);
  WeightMatrix<T> m = rewrite ? WeightMatrix<T>(info.type, dequant_fault_bytes(info.type, file.tensor_data(info)),
                                                rows, cols, round_to_f16)
                              : WeightMatrix<T>(info.type, file.tensor_data(info).data(), rows, cols, round_to_f16);
  if (holding == WeightHolding::dense) {
    // The whole tensor at once (dequantize_tensor's threads), as the reference always did before streaming.
    std::vector<T> values = tensor_values<T>(file, info, faulty);
    if (round_to_f16) round_f16(values.data(), static_cast<int64_t>(values.size()));
    m = WeightMatrix<T>(Matrix<T>(Eigen::Map<const Matrix<T>>(values.data(), rows, cols)));
  }
  return m;
}

template <typename T>
Vector<T> load_vector(const GgufFile& file, const std::string& name, bool faulty) {
  const TensorInfo& info = file.tensor(name);
  const std::vector<T> values = tensor_values<T>(file, info, faulty);
  return Eigen::Map<const Vector<T>>(values.data(), static_cast<int64_t>(values.size()));
}

}  // namespace

template <typename T>
WeightMatrix<T>::WeightMatrix(GgmlType type, const std::byte* bytes, int64_t rows, int64_t cols, bool round_to_f16)
    : type_(type), bytes_(bytes), rows_(rows), cols_(cols), round_f16_(round_to_f16) {
  const int64_t be = ggml_block_elements(type);
  if (be <= 0 || cols % be != 0) {
    throw ModelError(std::string("a ") + ggml_type_name(type) + " matrix row of " + std::to_string(cols) +
                     " values is not a whole number of blocks");
  }
  row_bytes_ = cols / be * ggml_block_bytes(type);
}

template <typename T>
WeightMatrix<T>::WeightMatrix(GgmlType type, std::vector<std::byte> owned, int64_t rows, int64_t cols,
                              bool round_to_f16)
    : WeightMatrix(type, nullptr, rows, cols, round_to_f16) {
  owned_ = std::move(owned);
}

template <typename T>
WeightMatrix<T>::WeightMatrix(Matrix<T> values)
    : rows_(values.rows()), cols_(values.cols()), dense_(std::move(values)) {}

template <typename T>
void WeightMatrix<T>::decode_rows(T* out /* [n,cols] */, int64_t r0, int64_t n) const {
  if (dense()) {
    std::copy_n(dense_.data() + r0 * cols_, n * cols_, out);
    return;
  }
  dequantize_rows(type_, bytes() + r0 * row_bytes_, out, n * cols_);
  // An F16 matrix's values are halves already: rounding them is the identity, skipped.
  if (round_f16_ && type_ != GgmlType::F16) round_f16(out, n * cols_);
}

template <typename T>
template <typename Out, typename Decode>
void WeightMatrix<T>::decode_pieces(Out* out, int64_t r0, int64_t n, int64_t c0, int64_t nc, Decode&& decode) const {
  const int64_t offset = c0 / ggml_block_elements(type_) * ggml_block_bytes(type_);
  if (c0 == 0 && nc == cols_) {
    decode(bytes() + r0 * row_bytes_, out, n * cols_);
  } else {
    for (int64_t r = 0; r < n; ++r) decode(bytes() + (r0 + r) * row_bytes_ + offset, out + r * nc, nc);
  }
}

template <typename T>
void WeightMatrix<T>::decode_floats(float* out /* [n,nc] */, int64_t r0, int64_t n, int64_t c0, int64_t nc) const {
  decode_pieces(out, r0, n, c0, nc, [&](const std::byte* s, float* d, int64_t m) {
    round_f16_ ? dequantize_rows_f16(type_, s, d, m) : dequantize_rows(type_, s, d, m);
  });
}

template <typename T>
void WeightMatrix<T>::decode_wide(double* out /* [n,nc] */, int64_t r0, int64_t n, int64_t c0, int64_t nc) const {
  decode_pieces(out, r0, n, c0, nc,
                [&](const std::byte* s, double* d, int64_t m) { decode_rows_wide(type_, s, d, m, round_f16_); });
}

template <typename T>
bool WeightMatrix<T>::decode_dot(T* acc /* [16] */, int64_t r, int64_t c0, int64_t nc, const T* x /* [nc] */) const {
  const int64_t offset = c0 / ggml_block_elements(type_) * ggml_block_bytes(type_);
  return ref::decode_dot(type_, bytes() + r * row_bytes_ + offset, round_f16_ && type_ != GgmlType::F16, x, nc, acc);
}

template <typename T>
bool WeightMatrix<T>::decode_dot_x2(T* acc0, T* acc1, int64_t r, int64_t c0, int64_t nc, const T* x) const {
  if constexpr (sizeof(T) != 8) {
    return false;
  } else {
    const int64_t offset = c0 / ggml_block_elements(type_) * ggml_block_bytes(type_);
    return ref::decode_dot_x2(type_, bytes() + r * row_bytes_ + offset, bytes() + (r + 1) * row_bytes_ + offset,
                              round_f16_ && type_ != GgmlType::F16, x, nc, acc0, acc1);
  }
}

template <typename T>
bool WeightMatrix<T>::decode_dot_tokens(T* acc, int64_t r, int64_t c0, int64_t nc, const T* x, int64_t ldx,
                                        int nt) const {
  const int64_t offset = c0 / ggml_block_elements(type_) * ggml_block_bytes(type_);
  return ref::decode_dot_tokens(type_, bytes() + r * row_bytes_ + offset, round_f16_ && type_ != GgmlType::F16, x, ldx,
                                nt, nc, acc);
}

template <typename T>
bool WeightMatrix<T>::dots_for_tokens() const {
  return !dense() && has_dot_tokens(type_);
}

template <typename T>
WeightMatrix<T> WeightMatrix<T>::row_block(int64_t r0, int64_t n) const {
  if (dense()) return WeightMatrix<T>(Matrix<T>(dense_.middleRows(r0, n)));
  if (owned_.empty()) return WeightMatrix<T>(type_, bytes_ + r0 * row_bytes_, n, cols_, round_f16_);
  const std::byte* from = owned_.data() + r0 * row_bytes_;
  return WeightMatrix<T>(type_, std::vector<std::byte>(from, from + n * row_bytes_), n, cols_, round_f16_);
}

template <typename T>
Matrix<T>& WeightMatrix<T>::densify() {
  if (!dense()) {
    Matrix<T> all(rows_, cols_);
    decode_rows(all.data(), 0, rows_);
    dense_ = std::move(all);
    owned_.clear();
    owned_.shrink_to_fit();
    bytes_ = nullptr;
  }
  return dense_;
}

template <typename T>
Matrix<T> WeightMatrix<T>::to_dense() const {
  Matrix<T> all(rows_, cols_);
  decode_rows(all.data(), 0, rows_);
  return all;
}

template <typename T>
Weights<T> Weights<T>::load(const GgufFile& file, const ModelConfig& cfg, const FaultSet& faults, bool matrices_f16,
                            WeightHolding holding) {
  const bool faulty = faults.has(Fault::dequant_scale_offset);
  Weights<T> w;
  w.layers.resize(cfg.n_layer);
  // Every tensor of the table into the field named as its role. Where output.weight is absent, `output` stays
  // empty and lm_head() reads token_embd (the table's fallback), one matrix for both.
  for (const ExpectedTensor& e : expected_tensors(cfg)) {
    LayerWeights<T>* lw = e.layer >= 0 ? &w.layers[e.layer] : nullptr;
    WeightMatrix<T>* m = nullptr;
    Vector<T>* v = nullptr;
    std::vector<WeightMatrix<T>>* experts = nullptr;  // a GGUF stack [E, rows, cols], one matrix per expert
    switch (e.role) {
      case TensorRole::token_embd: m = &w.token_embd; break;
      case TensorRole::output_norm: v = &w.output_norm; break;
      case TensorRole::output: m = &w.output; break;
      case TensorRole::attn_norm: v = &lw->attn_norm; break;
      case TensorRole::wq: m = &lw->wq; break;
      case TensorRole::wk: m = &lw->wk; break;
      case TensorRole::wv: m = &lw->wv; break;
      case TensorRole::bq: v = &lw->bq; break;
      case TensorRole::bk: v = &lw->bk; break;
      case TensorRole::bv: v = &lw->bv; break;
      case TensorRole::q_norm: v = &lw->q_norm; break;
      case TensorRole::k_norm: v = &lw->k_norm; break;
      case TensorRole::wo: m = &lw->wo; break;
      case TensorRole::attn_post_norm: v = &lw->attn_post_norm; break;
      case TensorRole::ffn_norm: v = &lw->ffn_norm; break;
      case TensorRole::w_gate: m = &lw->w_gate; break;
      case TensorRole::w_up: m = &lw->w_up; break;
      case TensorRole::w_down: m = &lw->w_down; break;
      case TensorRole::ffn_post_norm: v = &lw->ffn_post_norm; break;
      case TensorRole::ffn_gate_inp: m = &lw->ffn_gate_inp; break;
      case TensorRole::ffn_gate_exps: experts = &lw->ffn_gate_exps; break;
      case TensorRole::ffn_up_exps: experts = &lw->ffn_up_exps; break;
      case TensorRole::ffn_down_exps: experts = &lw->ffn_down_exps; break;
      case TensorRole::ffn_gate_inp_shexp: v = &lw->ffn_gate_inp_shexp; break;
      case TensorRole::ffn_gate_shexp: m = &lw->ffn_gate_shexp; break;
      case TensorRole::ffn_up_shexp: m = &lw->ffn_up_shexp; break;
      case TensorRole::ffn_down_shexp: m = &lw->ffn_down_shexp; break;
    }
    if (e.matrix() != (m != nullptr || experts != nullptr))
      throw Error(e.name + ": the tensor table's rank and the reference's field disagree");
    if (experts) {
      const WeightMatrix<T> stack = ref::load_matrix<T>(file, e.name, faulty, matrices_f16, holding);
      const int64_t n_experts = e.ne[2], rows = e.ne[1];
      experts->clear();
      for (int64_t x = 0; x < n_experts; ++x) experts->push_back(stack.row_block(x * rows, rows));
    } else if (m) {
      *m = ref::load_matrix<T>(file, e.name, faulty, matrices_f16, holding);
    } else {
      *v = ref::load_vector<T>(file, e.name, faulty);
    }
  }
  return w;
}

template class WeightMatrix<float>;
template class WeightMatrix<double>;
template struct Weights<float>;
template struct Weights<double>;

}  // namespace diffrun::ref
