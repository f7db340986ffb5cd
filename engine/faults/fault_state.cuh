// What the fault plan (faults/fault_plan.hpp) needs of the engine, made once when it is constructed: the
// weight edits, the weight embedding_rms_norm is handed, the positions the position-dependent kernels read (the
// production path's position faults are which position a kernel is handed), the scratch of gqa_head_modulo, and
// which fused kernels can take the plan's op arguments. Without faults it edits nothing and hands every kernel
// production's weights and positions, so the engine enqueues what it would without it.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include <cuda_runtime.h>

#include "engine/device_buffer.cuh"
#include "engine/weights.cuh"
#include "faults/fault_plan.hpp"
#include "model/config.hpp"

namespace diffrun::engine {

template <typename W>
class FaultState {
 public:
  // Edits `weights` (plan.weights, and the stored order of Wgate|Wup for swiglu_fused_gate_up_swapped); n_past is
  // the engine's [1] device position (step_inputs writes it). Synchronizes.
  FaultState(const FaultPlan& plan, DeviceWeights<W>& weights, const ModelConfig& cfg, int max_ctx,
             const int32_t* n_past, cudaStream_t stream);

  // The [1] positions a step's kernels read, each device-readable.
  struct Positions {
    const int32_t* rope;        // rope_qk rotates token 0 at it: n_past; in a captured decode step under
                                // graph_position_frozen the capture's position
    const int32_t* fused_rope;  // matmul_qkv_rope: rope's, or n_past + 1 under rope_fused_position_off
    const int32_t* write;       // the step's first cache row: n_past, or 0 under kv_cache_pos0
  };
  // For a step launched kernel by kernel (captured false) or the decode step being captured as a graph.
  const Positions& positions(bool captured) const { return captured ? captured_ : eager_; }
  const int32_t* zero() const { return zero_.get(); }  // [1] position 0

  // The host side of the positions kernels read from mapped memory: before each step is enqueued or replayed
  // (n_past its first position), and before a decode step is captured.
  void at_step(int n_past) { *fused_rope_pos_.get() = n_past + fused_rope_offset_; }
  void at_capture(int n_past) { *capture_pos_.get() = n_past; }

  // The weight embedding_rms_norm is handed: layer 0's attn_norm, or ones under embd_norm_fused_no_weight.
  const float* embd_norm_weight() const { return embd_norm_weight_; }
  // [max_ctx, H·Dh] each under gqa_head_modulo (attention_kv's expanded caches), else null.
  float* kv_scratch_k() const { return gqa_k_.get(); }
  float* kv_scratch_v() const { return gqa_v_.get(); }

  // The fused kernels that can run under the plan's op arguments (each has no variant of the op it fuses: under
  // such an argument one-token steps run the unfused twins, as prefill steps do).
  struct Fusable {
    bool embedding_rms_norm = true;     // no RMSNorm flaw on layer 0's attn_norm
    bool matmul_qkv_rope = true;        // not rope_cache_unrotated
    bool matmul_gate_up_swiglu = true;  // not swiglu_gate_up_swapped
    bool matmul_argmax = true;          // logits over V columns, not the padded vocabulary
    bool qk_norm_rope = true;           // no RMSNorm flaw, not rope_cache_unrotated
  };
  const Fusable& fusable() const { return fusable_; }

 private:
  // m's first N rows [N, K] read with the wrong leading dimension, as a dense matrix held here.
  DeviceMatrix<W> wrong_leading_dimension_of(const DeviceMatrix<W>& m, int N, cudaStream_t stream);

  std::vector<DeviceBuffer<W>> matrices_;                  // edited matrices
  std::map<const float*, DeviceBuffer<float>> squared_;    // norm weight -> its square (rms_norm_weight_twice)
  DeviceBuffer<float> ones_;                               // [D] (embd_norm_fused_no_weight)
  DeviceBuffer<float> gqa_k_, gqa_v_;                      // [max_ctx, H·Dh] (gqa_head_modulo)
  DeviceBuffer<int32_t> zero_{1, "step state"};            // [1] 0
  PinnedBuffer<int32_t> fused_rope_pos_{1, "step state"};  // [1] n_past + offset (rope_fused_position_off)
  PinnedBuffer<int32_t> capture_pos_{1, "step state"};     // [1] n_past at capture (graph_position_frozen)
  int fused_rope_offset_ = 0;
  const float* embd_norm_weight_ = nullptr;
  Positions eager_{}, captured_{};
  Fusable fusable_;
};

}  // namespace diffrun::engine
