// Upload of the GGUF tensors into one device arena: raw bytes through a staging buffer, then the
// device dequantization kernel of their format.
#include "engine/weights.cuh"

#include <map>
#include <string>

#include <cuda_fp16.h>

#include "engine/cuda_check.cuh"
#include "checkpoints/faults.hpp"
#include "engine/dequant.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr uint64_t kAlign = 256;

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Tensors placed right after the one before them (no alignment gap), so that Wq|Wk|Wv, bq|bk|bv and
// Wgate|Wup are each one concatenated tensor for the fused projections (matmul_cat).
bool continues_previous(const std::string& name) {
  for (const char* suffix : {".attn_k.weight", ".attn_v.weight", ".attn_k.bias", ".attn_v.bias", ".ffn_up.weight"})
    if (name.ends_with(suffix)) return true;
  return false;
}

// One tensor to upload: `rows` rows of ne[0] values (fewer than the file holds for padded vocab).
struct Planned {
  const TensorInfo* info;
  int64_t n_elements;  // uploaded elements
  uint64_t raw_bytes;  // their bytes in the file
  bool is_matrix;      // stored in W; vectors in f32
  uint64_t offset;     // in the arena
};

std::vector<Planned> plan(const GgufFile& file, const ModelConfig& cfg, uint64_t matrix_elem_bytes,
                          uint64_t* arena_bytes) {
  std::vector<Planned> out;
  uint64_t offset = 0;
  for (const ExpectedTensor& e : expected_tensors(cfg)) {
    const TensorInfo& t = file.tensor(e.name);
    if (!device_dequant_supported(t.type))
      throw ModelError(file.path() + ": tensor '" + e.name + "' has dtype " + ggml_type_name(t.type) +
                       ", which the CUDA engine cannot dequantize");
    const int64_t cols = t.ne.empty() ? 1 : t.ne[0];
    const bool vocab = e.name == "token_embd.weight" || e.name == "output.weight";
    const int64_t rows = vocab ? cfg.n_vocab : t.rows();
    const int64_t n = rows * cols;
    const uint64_t raw = static_cast<uint64_t>(n / ggml_block_elements(t.type)) * ggml_block_bytes(t.type);
    const bool is_matrix = e.ne.size() == 2;
    if (!continues_previous(e.name)) offset = align_up(offset);
    out.push_back({&t, n, raw, is_matrix, offset});
    offset += static_cast<uint64_t>(n) * (is_matrix ? matrix_elem_bytes : sizeof(float));
  }
  *arena_bytes = align_up(offset);
  return out;
}

}  // namespace

template <typename W>
WeightFootprint DeviceWeights<W>::footprint(const GgufFile& file, const ModelConfig& cfg) {
  WeightFootprint f;
  for (const Planned& p : plan(file, cfg, sizeof(W), &f.weight_bytes))
    f.staging_bytes = std::max(f.staging_bytes, p.raw_bytes);
  return f;
}

template <typename W>
DeviceWeights<W>::DeviceWeights(const GgufFile& file, const ModelConfig& cfg, cudaStream_t stream,
                                 bool dequant_scale_offset) {
  const std::vector<Planned> tensors = plan(file, cfg, sizeof(W), &bytes_);
  uint64_t staging_bytes = 0;
  for (const Planned& p : tensors) staging_bytes = std::max(staging_bytes, p.raw_bytes);
  arena_ = DeviceBuffer<unsigned char>(bytes_, "the model weights");
  DeviceBuffer<unsigned char> staging(staging_bytes, "the weight upload staging buffer");

  std::map<std::string, const void*> by_name;
  for (const Planned& p : tensors) {
    void* dst = arena_.get() + p.offset;
    // Stream-ordered: the next tensor's upload into `staging` waits for this dequantization.
    std::span<const std::byte> raw = file.tensor_data(*p.info).first(p.raw_bytes);
    std::vector<std::byte> faulty;  // pageable: the copy below returns once it has been staged
    if (dequant_scale_offset && dequant_fault_format(p.info->type)) {
      faulty = dequant_fault_bytes(p.info->type, raw);
      raw = faulty;
    }
    CUDA_CHECK(cudaMemcpyAsync(staging.get(), raw.data(), p.raw_bytes, cudaMemcpyHostToDevice,
                               stream));
    if (p.is_matrix)
      dequantize_device(p.info->type, staging.get(), static_cast<W*>(dst), p.n_elements, stream);
    else
      dequantize_device(p.info->type, staging.get(), static_cast<float*>(dst), p.n_elements, stream);
    by_name[p.info->name] = dst;
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before `staging` is freed

  auto matrix = [&](const std::string& name) { return static_cast<const W*>(by_name.at(name)); };
  auto vector = [&](const std::string& name) { return static_cast<const float*>(by_name.at(name)); };
  token_embd = matrix("token_embd.weight");
  output_norm = vector("output_norm.weight");
  lm_head = cfg.tied_output ? token_embd : matrix("output.weight");
  layers.resize(cfg.n_layer);
  for (int l = 0; l < cfg.n_layer; ++l) {
    DeviceLayerWeights<W>& w = layers[l];
    w.attn_norm = vector(layer_tensor(l, "attn_norm.weight"));
    w.wq = matrix(layer_tensor(l, "attn_q.weight"));
    w.wk = matrix(layer_tensor(l, "attn_k.weight"));
    w.wv = matrix(layer_tensor(l, "attn_v.weight"));
    if (cfg.qkv_bias) {
      w.bq = vector(layer_tensor(l, "attn_q.bias"));
      w.bk = vector(layer_tensor(l, "attn_k.bias"));
      w.bv = vector(layer_tensor(l, "attn_v.bias"));
    }
    if (cfg.qk_norm) {
      w.q_norm = vector(layer_tensor(l, "attn_q_norm.weight"));
      w.k_norm = vector(layer_tensor(l, "attn_k_norm.weight"));
    }
    w.wo = matrix(layer_tensor(l, "attn_output.weight"));
    w.ffn_norm = vector(layer_tensor(l, "ffn_norm.weight"));
    w.w_gate = matrix(layer_tensor(l, "ffn_gate.weight"));
    w.w_up = matrix(layer_tensor(l, "ffn_up.weight"));
    w.w_down = matrix(layer_tensor(l, "ffn_down.weight"));
  }
}

template class DeviceWeights<float>;
template class DeviceWeights<__half>;

}  // namespace diffrun::engine
