// Upload of the GGUF tensors into one device arena: quantized matrices as their raw blocks, the rest
// as raw bytes through a staging buffer, then the device dequantization kernel of their format. The
// bytes go from the file's mapping through two pinned pieces of host memory (HostPieces).
#include "engine/weights.cuh"

#include "engine/weight_cut.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <cuda_fp16.h>

#include "engine/cuda_check.cuh"
#include "faults/faults.hpp"
#include "engine/dequant.cuh"
#include "engine/device_buffer.cuh"
#include "engine/faults/fault_ops.cuh"
#include "engine/ops/qgemv.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr uint64_t kAlign = 256;

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Tensors placed right after the one before them in the table's order (no alignment gap), so that
// Wq|Wk|Wv, bq|bk|bv and Wgate|Wup are each one concatenated tensor for the fused projections (matmul_cat).
bool continues_previous(TensorRole r) {
  using R = TensorRole;
  return r == R::wk || r == R::wv || r == R::bk || r == R::bv || r == R::w_up;
}

// The members of the concatenation group of a role, in the table's order (itself alone outside a group).
std::vector<TensorRole> group_of(TensorRole r) {
  using R = TensorRole;
  if (r == R::wq || r == R::wk || r == R::wv) return {R::wq, R::wk, R::wv};
  if (r == R::w_gate || r == R::w_up) return {R::w_gate, R::w_up};
  return {r};
}

bool quantized_weights_enabled() {
  const char* v = std::getenv("DIFFRUN_QUANT_WEIGHTS");
  return !(v != nullptr && std::strcmp(v, "0") == 0);
}

// One tensor of the table to upload: `rows` rows of `cols` values (fewer than the file holds for padded vocab, or
// a tensor-parallel rank's cut).
struct Planned {
  const TensorInfo* info;
  int64_t n_elements;  // uploaded elements
  uint64_t raw_bytes;  // their bytes in the file
  bool is_matrix;      // stored in W (or quantized); vectors in f32
  bool quantized;      // kept as GGUF blocks
  uint64_t offset;     // in the arena
  TensorRole role;
  int layer;                                // -1 for a global tensor
  std::optional<TensorRole> stands_in_for;  // token_embd as the lm head where output.weight is absent
  int64_t cols;                             // uploaded columns (ne[0], or the cut's)
  Cut cut;                                  // resolved: r1, c1 >= 0
};



std::vector<Planned> plan(const GgufFile& file, const ModelConfig& cfg, uint64_t matrix_elem_bytes,
                          uint64_t* arena_bytes, uint64_t* scratch_elements, const WeightCut* slice) {
  const bool keep_quantized = quantized_weights_enabled();
  auto quantizable = [&](TensorRole role, int layer) {
    const TensorInfo& t = file.tensor(tensor_name(role, layer));
    return keep_quantized && (t.ne.size() == 2 || t.ne.size() == 3) && qgemv_supported(t.type);
  };
  std::vector<Planned> out;
  uint64_t offset = 0, group_elements = 0;
  *scratch_elements = 0;
  for (const ExpectedTensor& e : expected_tensors(cfg)) {
    const TensorInfo& t = file.tensor(e.name);
    if (!device_dequant_supported(t.type))
      throw ModelError(file.path() + ": tensor '" + e.name + "' has dtype " + ggml_type_name(t.type) +
                       ", which the CUDA engine cannot dequantize");
    const int64_t file_cols = t.ne.empty() ? 1 : t.ne[0];
    Cut cut = cut_of(e.role, cfg, slice);
    if (cut.r1 < 0) cut.r1 = e.vocab_rows ? cfg.n_vocab : t.rows();
    if (cut.c1 < 0) cut.c1 = file_cols;
    const int64_t bs = ggml_block_elements(t.type);
    if (cut.c0 % bs != 0 || cut.c1 % bs != 0)
      throw ModelError(file.path() + ": tensor '" + e.name + "' (" + ggml_type_name(t.type) + ", blocks of " +
                       std::to_string(bs) + ") cannot be cut at columns " + std::to_string(cut.c0) + ".." +
                       std::to_string(cut.c1) + " for tensor-parallel rank " + std::to_string(slice ? slice->slice.rank : 0) +
                       ": the cut must fall on block boundaries");
    const int64_t cols = cut.c1 - cut.c0, rows = cut.r1 - cut.r0;
    const int64_t n = rows * cols;
    const uint64_t raw = static_cast<uint64_t>(n / bs) * ggml_block_bytes(t.type);
    const bool is_matrix = e.matrix();
    bool quantized = is_matrix;
    for (TensorRole member : group_of(e.role)) quantized = quantized && quantizable(member, e.layer);
    // A quantized member continues its group only in the same format (else its own aligned segment).
    const bool continues = continues_previous(e.role) &&
                           (!quantized || (!out.empty() && out.back().info->type == t.type));
    if (!continues) offset = align_up(offset);
    if (quantized) {
      const int64_t one = t.ne.size() == 3 ? n / t.ne[2] : n;  // a stack of experts: one expert's matrix at a time
      group_elements = continues_previous(e.role) ? group_elements + one : one;
      *scratch_elements = std::max<uint64_t>(*scratch_elements, group_elements);
    }
    out.push_back({&t, n, raw, is_matrix, quantized, offset, e.role, e.layer, e.stands_in_for, cols, cut});
    offset += quantized ? raw : static_cast<uint64_t>(n) * (is_matrix ? matrix_elem_bytes : sizeof(float));
  }
  *arena_bytes = align_up(offset);
  return out;
}

// Host-to-device copies through two pinned pieces: the CPU copies one piece from the file's mapping
// while the copy engine takes the other. cudaMemcpyAsync from pageable memory does the same through the
// driver's own staging, which the engines of one process share: three engines loading at once took
// three times as long as one (0.41-0.47 s for 0.5B F16 weights on an H100 host, 0.13-0.15 s alone;
// through these pieces 0.16-0.21 s for the three).
class HostPieces {
 public:
  // `largest`: the largest copy to come (small models take smaller pieces).
  HostPieces(cudaStream_t stream, uint64_t largest) : stream_(stream), piece_bytes_(std::min(kPieceBytes, largest)) {
    try {
      for (Piece& p : pieces_) {
        CUDA_CHECK(cudaEventCreateWithFlags(&p.copied, cudaEventDisableTiming));
        p.mem = PinnedBuffer<unsigned char>(piece_bytes_, "the weight upload");
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~HostPieces() { release(); }
  HostPieces(const HostPieces&) = delete;
  HostPieces& operator=(const HostPieces&) = delete;

  // Enqueues the copy of `bytes` host bytes to `dst` on the stream; `src` may be freed once it returns.
  void copy(void* dst, const void* src, size_t bytes) {
    for (size_t done = 0; done < bytes;) {
      Piece& p = pieces_[next_];
      next_ ^= 1;
      if (p.used) CUDA_CHECK(cudaEventSynchronize(p.copied));
      const size_t n = std::min(piece_bytes_, bytes - done);
      std::memcpy(p.mem.get(), static_cast<const unsigned char*>(src) + done, n);
      CUDA_CHECK(cudaMemcpyAsync(static_cast<unsigned char*>(dst) + done, p.mem.get(), n, cudaMemcpyHostToDevice,
                                 stream_));
      CUDA_CHECK(cudaEventRecord(p.copied, stream_));
      p.used = true;
      done += n;
    }
  }

 private:
  static constexpr size_t kPieceBytes = size_t(8) << 20;
  struct Piece {
    PinnedBuffer<unsigned char> mem;
    cudaEvent_t copied = nullptr;
    bool used = false;
  };
  void release() {
    for (Piece& p : pieces_) {
      if (!p.copied) continue;
      if (p.used) cudaEventSynchronize(p.copied);  // the copy engine may still read the piece
      cudaEventDestroy(p.copied);
      p.copied = nullptr;
    }
  }
  cudaStream_t stream_;
  size_t piece_bytes_;
  Piece pieces_[2];
  int next_ = 0;
};

}  // namespace

template <typename W>
WeightFootprint DeviceWeights<W>::footprint(const GgufFile& file, const ModelConfig& cfg, const WeightCut* slice) {
  WeightFootprint f;
  uint64_t scratch = 0;
  for (const Planned& p : plan(file, cfg, sizeof(W), &f.weight_bytes, &scratch, slice))
    if (!p.quantized) f.staging_bytes = std::max(f.staging_bytes, p.raw_bytes);
  f.scratch_bytes = scratch * sizeof(W);
  return f;
}

template <typename W>
DeviceWeights<W>::DeviceWeights(const GgufFile& file, const ModelConfig& cfg, cudaStream_t stream,
                                 bool dequant_scale_offset, const WeightCut* slice) {
  uint64_t scratch_elements = 0;
  const std::vector<Planned> tensors = plan(file, cfg, sizeof(W), &bytes_, &scratch_elements, slice);
  uint64_t staging_bytes = 0, largest_raw = 1;
  std::map<std::string, int> quantized_counts;
  for (const Planned& p : tensors) {
    largest_raw = std::max(largest_raw, p.raw_bytes);
    if (!p.quantized) staging_bytes = std::max(staging_bytes, p.raw_bytes);
    else ++quantized_counts[ggml_type_name(p.info->type)];
  }
  arena_ = DeviceBuffer<unsigned char>(bytes_, "the model weights");
  DeviceBuffer<unsigned char> staging(staging_bytes, "the weight upload staging buffer");
  if (scratch_elements > 0) scratch_ = DeviceBuffer<W>(scratch_elements, "the quantized weights' dequantization scratch");
  if (!quantized_counts.empty()) {
    quantized_summary_.clear();
    for (const auto& [type, count] : quantized_counts)
      quantized_summary_ += (quantized_summary_.empty() ? "" : ", ") + type + " x" + std::to_string(count);
  }

  std::map<std::string, const Planned*> planned;
  std::map<std::string, const void*> by_name;
  HostPieces host(stream, largest_raw);
  for (const Planned& p : tensors) {
    planned[p.info->name] = &p;
    void* dst = arena_.get() + p.offset;
    // Stream-ordered: the next tensor's upload into `staging` waits for this dequantization.
    std::vector<std::byte> gathered;  // a tensor-parallel rank's columns
    std::span<const std::byte> raw = cut_bytes(file, *p.info, p.cut, gathered);
    std::vector<std::byte> faulty;  // host.copy returns once it has taken the bytes
    if (dequant_scale_offset && dequant_fault_format(p.info->type)) {
      faulty = dequant_fault_bytes(p.info->type, raw);
      raw = faulty;
    }
    by_name[p.info->name] = dst;
    if (p.quantized) {  // the blocks as they are in the file
      host.copy(dst, raw.data(), p.raw_bytes);
      continue;
    }
    host.copy(staging.get(), raw.data(), p.raw_bytes);
    if (p.is_matrix)
      dequantize_device(p.info->type, staging.get(), static_cast<W*>(dst), p.n_elements, stream);
    else
      dequantize_device(p.info->type, staging.get(), static_cast<float*>(dst), p.n_elements, stream);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before `staging` is freed

  // A matrix from `from` to the end of its concatenation group: dense rows, or quantized segments
  // (consecutive members of one format merged, as the arena holds them back to back).
  auto matrix = [&](const Planned& from) {
    DeviceMatrix<W> m;
    bool from_here = false;
    for (TensorRole role : group_of(from.role)) {
      from_here = from_here || role == from.role;
      if (!from_here) continue;
      const std::string member = tensor_name(role, from.layer);
      const Planned& p = *planned.at(member);
      m.K = static_cast<int>(p.cols);
      const int rows = static_cast<int>(p.n_elements / m.K);
      if (!p.quantized) {
        if (m.rows == 0) m.dense = static_cast<const W*>(by_name.at(member));
      } else {
        using Segment = typename DeviceMatrix<W>::Segment;
        Segment* last = m.n_segments > 0 ? &m.segments[m.n_segments - 1] : nullptr;
        const auto* raw = static_cast<const unsigned char*>(by_name.at(member));
        const uint64_t last_bytes =
            last ? uint64_t(last->rows) * (m.K / ggml_block_elements(last->type)) * ggml_block_bytes(last->type) : 0;
        if (last && last->type == p.info->type && static_cast<const unsigned char*>(last->raw) + last_bytes == raw)
          last->rows += rows;
        else
          m.segments[m.n_segments++] = Segment{p.info->type, raw, rows};
        m.scratch = scratch_.get();
      }
      m.rows += rows;
    }
    return m;
  };
  auto vector = [&](const Planned& p) { return static_cast<const float*>(by_name.at(p.info->name)); };
  // A stack of expert matrices [E, N, K] as E matrices, each N rows of the stacked tensor.
  auto experts = [&](const Planned& p) {
    const int K = static_cast<int>(p.info->ne[0]), N = static_cast<int>(p.info->ne[1]);
    const int E = static_cast<int>(p.info->ne[2]);
    const auto* base = static_cast<const unsigned char*>(by_name.at(p.info->name));
    std::vector<DeviceMatrix<W>> out(E);
    for (int e = 0; e < E; ++e) {
      DeviceMatrix<W>& m = out[e];
      m.K = K;
      m.rows = N;
      if (!p.quantized) {
        m.dense = reinterpret_cast<const W*>(base) + size_t(e) * N * K;
        continue;
      }
      const uint64_t expert_bytes =
          uint64_t(N) * (K / ggml_block_elements(p.info->type)) * ggml_block_bytes(p.info->type);
      m.n_segments = 1;
      m.segments[0] = typename DeviceMatrix<W>::Segment{p.info->type, base + e * expert_bytes, N};
      m.scratch = scratch_.get();
    }
    return out;
  };
  layers.resize(cfg.n_layer);
  // Every tensor of the table into the field named as its role, and token_embd also into lm_head where it
  // stands in for an absent output.weight (the table's fallback).
  auto assign = [&](TensorRole role, const Planned& p) {
    DeviceLayerWeights<W>* w = p.layer >= 0 ? &layers[p.layer] : nullptr;
    switch (role) {
      case TensorRole::token_embd: token_embd = matrix(p); break;
      case TensorRole::output_norm: output_norm = vector(p); break;
      case TensorRole::output: lm_head = matrix(p); break;
      case TensorRole::attn_norm: w->attn_norm = vector(p); break;
      case TensorRole::wq: w->wq = matrix(p); break;
      case TensorRole::wk: w->wk = matrix(p); break;
      case TensorRole::wv: w->wv = matrix(p); break;
      case TensorRole::bq: w->bq = vector(p); break;
      case TensorRole::bk: w->bk = vector(p); break;
      case TensorRole::bv: w->bv = vector(p); break;
      case TensorRole::q_norm: w->q_norm = vector(p); break;
      case TensorRole::k_norm: w->k_norm = vector(p); break;
      case TensorRole::wo: w->wo = matrix(p); break;
      case TensorRole::attn_post_norm: w->attn_post_norm = vector(p); break;
      case TensorRole::ffn_norm: w->ffn_norm = vector(p); break;
      case TensorRole::w_gate: w->w_gate = matrix(p); break;
      case TensorRole::w_up: w->w_up = matrix(p); break;
      case TensorRole::w_down: w->w_down = matrix(p); break;
      case TensorRole::ffn_post_norm: w->ffn_post_norm = vector(p); break;
      case TensorRole::ffn_gate_inp: w->ffn_gate_inp = matrix(p); break;
      case TensorRole::ffn_gate_exps: w->ffn_gate_exps = experts(p); break;
      case TensorRole::ffn_up_exps: w->ffn_up_exps = experts(p); break;
      case TensorRole::ffn_down_exps: w->ffn_down_exps = experts(p); break;
      case TensorRole::ffn_gate_inp_shexp: w->ffn_gate_inp_shexp = vector(p); break;
      case TensorRole::ffn_gate_shexp: w->ffn_gate_shexp = matrix(p); break;
      case TensorRole::ffn_up_shexp: w->ffn_up_shexp = matrix(p); break;
      case TensorRole::ffn_down_shexp: w->ffn_down_shexp = matrix(p); break;
    }
  };
  for (const Planned& p : tensors) {
    assign(p.role, p);
    if (p.stands_in_for) assign(*p.stands_in_for, p);
  }
}

template <typename W>
void DeviceWeights<W>::fill_row_nan(const DeviceMatrix<W>& m, int64_t row, cudaStream_t stream) {
  if (row < 0 || row >= m.rows) throw Error("fill_row_nan: row " + std::to_string(row) + " is outside the matrix");
  if (!m.quantized()) {
    fill_nan(const_cast<W*>(m.dense) + row * m.K, m.K, stream);
    return;
  }
  int64_t r = row;
  int s = 0;
  while (r >= m.segments[s].rows) r -= m.segments[s++].rows;
  const GgmlType t = m.segments[s].type;
  const int64_t nb = m.K / ggml_block_elements(t), bb = static_cast<int64_t>(ggml_block_bytes(t));
  const int64_t d_offset = t == GgmlType::Q6_K ? 208 : 0;  // the block's f16 scale d (last in Q6_K, first elsewhere)
  auto* dst = static_cast<unsigned char*>(const_cast<void*>(m.segments[s].raw)) + r * nb * bb + d_offset;
  const std::vector<uint16_t> nan_halves(size_t(nb), uint16_t(0x7E00));
  CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(bb), nan_halves.data(), sizeof(uint16_t), sizeof(uint16_t), size_t(nb),
                               cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before nan_halves goes
}

template <typename W>
void DeviceWeights<W>::swap_row_halves(const DeviceMatrix<W>& m, int half, cudaStream_t stream) {
  if (2 * half > m.rows) throw Error("swap_row_halves: " + std::to_string(2 * half) + " rows of a matrix of " +
                                     std::to_string(m.rows));
  unsigned char* base = nullptr;
  size_t row_bytes = 0;
  if (!m.quantized()) {
    base = reinterpret_cast<unsigned char*>(const_cast<W*>(m.dense));
    row_bytes = size_t(m.K) * sizeof(W);
  } else {
    if (m.n_segments < 1 || m.segments[0].rows < 2 * half)
      throw Error("swap_row_halves: the two halves are in different formats");
    const GgmlType t = m.segments[0].type;
    base = static_cast<unsigned char*>(const_cast<void*>(m.segments[0].raw));
    row_bytes = size_t(m.K / ggml_block_elements(t)) * ggml_block_bytes(t);
  }
  const size_t bytes = row_bytes * size_t(half);
  DeviceBuffer<unsigned char> tmp(bytes, "a swapped weight half");
  CUDA_CHECK(cudaMemcpyAsync(tmp.get(), base, bytes, cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(base, base + bytes, bytes, cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(base + bytes, tmp.get(), bytes, cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before tmp goes
}

template class DeviceWeights<float>;
template class DeviceWeights<__half>;

}  // namespace diffrun::engine
