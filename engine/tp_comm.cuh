// The tensor-parallel engine's communication (NCCL): one communicator per rank, and the all-reduce (sum) that ends
// each row-parallel projection. In a build without NCCL (CMake found none) every call but nccl_built() throws an
// InputError saying so.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "checkpoints/tensor_parallel.hpp"

namespace diffrun::engine {

// One rank of a tensor-parallel engine: its slice of the model and its NCCL communicator (null: one GPU).
struct TpRank {
  TpSlice slice;
  void* comm = nullptr;  // ncclComm_t
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
