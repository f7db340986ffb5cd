// The tensor-parallel engine's communication (NCCL): one communicator per rank, and the all-reduce (sum) that ends
// each row-parallel projection. In a build without NCCL (CMake found none) every call but nccl_built() throws an
// InputError saying so.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "checkpoints/tensor_parallel.hpp"
#include "engine/weights.cuh"

namespace diffrun::engine {

// One rank of a tensor-parallel engine: its cut of the weights (cut.slice: its slice of the model), its NCCL
// communicator (null: one GPU), and what the tensor-parallel faults (faults/tp_faults.hpp) change in its forward.
struct TpRank {
  WeightCut cut;
  void* comm = nullptr;  // ncclComm_t
  bool skip_attn_allreduce = false;  // tp_attn_allreduce_skipped
  bool ffn_allreduce_twice = false;  // tp_ffn_allreduce_twice
  bool no_all_reduce = false;        // DIFFRUN_TP_ALLREDUCE=none: no sums at all (wrong values; timing only)
};

bool nccl_built();
// NCCL's version as "2.28.9" (or "none").
std::string nccl_version();
// Communicators for ranks 0..world-1 on devices 0..world-1 (ncclCommInitAll), in rank order.
std::vector<void*> nccl_comms(int world);
void nccl_destroy(void* comm);
// Ends the communicator at once, from any thread: the ranks' NCCL kernels waiting on it return (ncclCommAbort).
void nccl_abort(void* comm);
// In place: buf's `count` floats become their sum over the ranks, on `stream` (capturable into a CUDA graph).
void all_reduce_sum(float* buf, size_t count, void* comm, cudaStream_t stream);

}  // namespace diffrun::engine
