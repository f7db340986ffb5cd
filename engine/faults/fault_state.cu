// The engine's side of the fault plan, made at construction: weight edits, the fused norm's weight, positions,
// scratch, and the fused kernels the plan's op arguments allow.
#include "engine/faults/fault_state.cuh"

#include <utility>

#include "engine/cuda_check.cuh"
#include "engine/faults/fault_ops.cuh"
#include "engine/ops/matmul.cuh"

namespace diffrun::engine {

template <typename W>
FaultState<W>::FaultState(const FaultPlan& plan, DeviceWeights<W>& weights, const ModelConfig& cfg, int max_ctx,
                          const int32_t* n_past, cudaStream_t stream) {
  const WeightEdits& e = plan.weights;
  const int D = cfg.n_embd, Q = cfg.n_head * cfg.head_dim;
  CUDA_CHECK(cudaMemsetAsync(zero_.get(), 0, sizeof(int32_t), stream));

  // Weight edits (dequant_scale_offset is DeviceWeights' own, at load). The lm head is a matrix of its own, so a
  // tied one keeps reading the real table under embd_transposed.
  if (e.embd_transposed) weights.token_embd = wrong_leading_dimension_of(weights.token_embd, cfg.n_vocab, stream);
  for (DeviceLayerWeights<W>& w : weights.layers) {
    if (e.qkv_bias_missing) w.bq = w.bk = w.bv = nullptr;
    if (e.attn_out_transposed) w.wo = wrong_leading_dimension_of(w.wo, D, stream);
    if (e.ffn_down_transposed) w.w_down = wrong_leading_dimension_of(w.w_down, D, stream);
    if (e.expert_gate_up_swapped)  // the two views of the file's bytes trade places, as the reference's do
      std::swap(w.ffn_gate_exps.at(kFaultSwappedExpert), w.ffn_up_exps.at(kFaultSwappedExpert));
  }
  if (e.weight_row_nan)  // the weights are ours once uploaded: one row of layer 0's W_q
    weights.fill_row_nan(weights.layers.at(0).wq, kFaultNanWeightRow, stream);
  if (plan.fused.gate_up_swapped)  // Wup|Wgate: the forward puts the GEMMs' outputs back (OpArgs::gate_up order)
    for (const DeviceLayerWeights<W>& w : weights.layers) weights.swap_row_halves(w.w_gate, cfg.n_ff, stream);
  if (e.rms_norm_weight_twice) {  // every norm weight replaced by its square
    auto twice = [&](const float*& w, int64_t n) {
      if (w == nullptr) return;
      auto it = squared_.find(w);
      if (it == squared_.end()) {
        DeviceBuffer<float> sq(size_t(n), "squared norm weights");
        square(sq.get(), w, n, stream);
        it = squared_.emplace(w, std::move(sq)).first;
      }
      w = it->second.get();
    };
    twice(weights.output_norm, D);
    for (DeviceLayerWeights<W>& w : weights.layers) {
      twice(w.attn_norm, D);
      twice(w.ffn_norm, D);
      twice(w.attn_post_norm, D);
      twice(w.ffn_post_norm, D);
      twice(w.q_norm, cfg.head_dim);
      twice(w.k_norm, cfg.head_dim);
    }
  }
  embd_norm_weight_ = weights.layers.empty() ? nullptr : weights.layers[0].attn_norm;
  if (plan.fused.embd_norm_unweighted) {
    const std::vector<float> ones(size_t(D), 1.0f);
    ones_ = DeviceBuffer<float>(ones.size(), "fault constants");
    CUDA_CHECK(cudaMemcpyAsync(ones_.get(), ones.data(), ones_.bytes(), cudaMemcpyHostToDevice, stream));
    embd_norm_weight_ = ones_.get();
  }
  if (plan.ops.gqa_head_modulo) {  // the expanded caches (layer by layer, the same buffers)
    gqa_k_ = DeviceBuffer<float>(size_t(max_ctx) * Q, "fault scratch");
    gqa_v_ = DeviceBuffer<float>(size_t(max_ctx) * Q, "fault scratch");
  }

  // Positions. Mapped host memory for the ones the host knows at launch: a captured graph reads them again at
  // every replay.
  fused_rope_offset_ = plan.fused.rope_position_offset;
  at_step(0);
  at_capture(0);
  eager_.rope = n_past;
  eager_.fused_rope = fused_rope_offset_ != 0 ? fused_rope_pos_.device() : n_past;
  eager_.write = plan.hooks.kv_cache_pos0 ? zero_.get() : n_past;
  captured_ = eager_;
  if (plan.fused.graph_position_frozen) captured_.rope = capture_pos_.device();
  if (fused_rope_offset_ == 0) captured_.fused_rope = captured_.rope;

  fusable_.embedding_rms_norm = !plan.ops.first_norm.any();
  fusable_.matmul_qkv_rope = !plan.ops.rope_cache_unrotated;
  fusable_.matmul_gate_up_swiglu = !plan.ops.act_swapped;
  fusable_.matmul_argmax = plan.ops.logit_columns == cfg.n_vocab;
  fusable_.qk_norm_rope = !plan.ops.norm.any() && !plan.ops.rope_cache_unrotated;
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before `ones` goes
}

template <typename W>
DeviceMatrix<W> FaultState<W>::wrong_leading_dimension_of(const DeviceMatrix<W>& m, int N, cudaStream_t stream) {
  const W* rows = dense_rows(m, N, stream);  // dense, or dequantized into the shared scratch on `stream`
  DeviceBuffer<W> out(size_t(N) * m.K, "fault weights");
  wrong_leading_dimension(out.get(), rows, N, m.K, stream);
  DeviceMatrix<W> edited;
  edited.dense = out.get();
  edited.K = m.K;
  edited.rows = N;
  matrices_.push_back(std::move(out));
  return edited;
}

template class FaultState<float>;
template class FaultState<__half>;

}  // namespace diffrun::engine
