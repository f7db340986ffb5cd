// The tensor-parallel CUDA engine (--tp N): N ranks, one per GPU of this host, in the Megatron layout of
// checkpoints/tensor_parallel.hpp, joined by NCCL all-reduces. Plain C++ (no CUDA types).
//
// Decisions:
// - One process, one thread per rank. Each rank is the one-GPU engine (engine/cuda_engine.cu) run on its slice:
//   the same kernels, fused ones and the captured decode graph included (the all-reduce is captured with the
//   step), so recording still runs the production path at every N.
// - Recording: given RankSinks (checkpoints/sink.hpp) each rank records into its own sink (rank dumps, with
//   their shard attributes); given any other sink, the ranks' checkpoints are merged into whole tensors after
//   the step (split pieces placed at their offsets, partial sums added in float64 in rank order, replicated
//   ones rank 0's), which the top-level job compares like a one-GPU engine's.
// - Logits, argmax, n_past and the step's path are rank 0's: every rank holds the whole lm head and the same
//   all-reduced residual stream, so every rank computes the same logits.
#pragma once

#include <memory>
#include <string>

#include "checkpoints/tensor_parallel.hpp"
#include "engine/engine.hpp"
#include "faults/tp_faults.hpp"

namespace diffrun {

// CUDA devices this process sees (0 where none).
int cuda_device_count();

class TpCudaEngine : public CudaEngine {
 public:
  virtual int world_size() const = 0;
  // Rank r's engine (its facts name its slice).
  virtual const CudaEngine& rank(int r) const = 0;
  // Rank r's slice of the model (what its checkpoints hold: megatron_shard).
  virtual TpSlice slice(int r) const = 0;
};

// What make_tp_cuda_engine refuses, checked before anything loads (InputError; see below).
void check_tp(const GgufFile& file, const ModelConfig& cfg, int world, bool with_faults,
              const std::vector<TpFault>& tp_faults = {});

// N ranks on devices 0..N-1 (N >= 1). InputError (exit 2) when this host has fewer GPUs than N (both counts
// named), when the model cannot be split over N ranks (checkpoints/tensor_parallel.hpp says why), when one-GPU
// faults are asked for at N > 1, a tensor-parallel fault at N = 1 or where it does not apply
// (faults/tp_faults.hpp), or when diffrun was built without NCCL.
std::unique_ptr<TpCudaEngine> make_tp_cuda_engine(const GgufFile& file, const ModelConfig& cfg,
                                                  const std::string& precision, int max_ctx, int world,
                                                  const FaultSet& faults = {},
                                                  const std::vector<TpFault>& tp_faults = {});

namespace engine {
struct TpRank;
// One rank's engine (engine/cuda_engine.cu): the whole model where tp's world is 1.
std::unique_ptr<CudaEngine> make_cuda_engine_rank(const GgufFile& file, const ModelConfig& cfg,
                                                  const std::string& precision, int max_ctx, const FaultSet& faults,
                                                  const TpRank& tp);
}  // namespace engine

}  // namespace diffrun
