// Loading the reference's weights: dequantize_tensor<T> per tensor, copied into Eigen row-major storage.
#include "reference_cpu/weights.hpp"

#include <string>

#include "model/dequant.hpp"
#include "model/error.hpp"
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

// A GGUF tensor as a row-major [ne1*ne2*..., ne0] matrix.
template <typename T>
Matrix<T> load_matrix(const GgufFile& file, const std::string& name, bool faulty, bool round_to_f16) {
  const TensorInfo& info = file.tensor(name);
  std::vector<T> values = tensor_values<T>(file, info, faulty);
  if (round_to_f16) round_f16(values.data(), static_cast<int64_t>(values.size()));
  const int64_t cols = info.ne.empty() ? 1 : info.ne[0];
  const int64_t rows = info.rows();
  if (static_cast<int64_t>(values.size()) != rows * cols) {
    throw ModelError(name + ": dequantized " + std::to_string(values.size()) + " values, expected " +
                     std::to_string(rows * cols));
  }
  return Eigen::Map<const Matrix<T>>(values.data(), rows, cols);
}

template <typename T>
Vector<T> load_vector(const GgufFile& file, const std::string& name, bool faulty) {
  const TensorInfo& info = file.tensor(name);
  const std::vector<T> values = tensor_values<T>(file, info, faulty);
  return Eigen::Map<const Vector<T>>(values.data(), static_cast<int64_t>(values.size()));
}

}  // namespace

template <typename T>
Weights<T> Weights<T>::load(const GgufFile& file, const ModelConfig& cfg, const FaultSet& faults, bool matrices_f16) {
  const bool faulty = faults.has(Fault::dequant_scale_offset);
  auto load_matrix = [&](const std::string& name) { return ref::load_matrix<T>(file, name, faulty, matrices_f16); };
  auto load_vector = [&](const std::string& name) { return ref::load_vector<T>(file, name, faulty); };
  Weights<T> w;
  w.token_embd = load_matrix("token_embd.weight");
  w.output_norm = load_vector("output_norm.weight");
  if (!cfg.tied_output) w.output = load_matrix("output.weight");
  w.layers.resize(cfg.n_layer);
  for (int l = 0; l < cfg.n_layer; ++l) {
    LayerWeights<T>& lw = w.layers[l];
    lw.attn_norm = load_vector(layer_tensor(l, "attn_norm.weight"));
    lw.wq = load_matrix(layer_tensor(l, "attn_q.weight"));
    lw.wk = load_matrix(layer_tensor(l, "attn_k.weight"));
    lw.wv = load_matrix(layer_tensor(l, "attn_v.weight"));
    if (cfg.qkv_bias) {
      lw.bq = load_vector(layer_tensor(l, "attn_q.bias"));
      lw.bk = load_vector(layer_tensor(l, "attn_k.bias"));
      lw.bv = load_vector(layer_tensor(l, "attn_v.bias"));
    }
    if (cfg.qk_norm) {
      lw.q_norm = load_vector(layer_tensor(l, "attn_q_norm.weight"));
      lw.k_norm = load_vector(layer_tensor(l, "attn_k_norm.weight"));
    }
    lw.wo = load_matrix(layer_tensor(l, "attn_output.weight"));
    lw.ffn_norm = load_vector(layer_tensor(l, "ffn_norm.weight"));
    lw.w_gate = load_matrix(layer_tensor(l, "ffn_gate.weight"));
    lw.w_up = load_matrix(layer_tensor(l, "ffn_up.weight"));
    lw.w_down = load_matrix(layer_tensor(l, "ffn_down.weight"));
  }
  return w;
}

template struct Weights<float>;
template struct Weights<double>;

}  // namespace diffrun::ref
