// The tensor-parallel engine's communication (NCCL): one communicator per rank, and the all-reduce (sum) that ends
// each row-parallel projection. In a build without NCCL (CMake found none) every call but nccl_built() throws an
// InputError saying so.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "checkpoints/tensor_parallel.hpp"
#include "engine/weights.cuh"

namespace diffrun::engine {

// One rank's view of the one-shot all-reduce through peer memory (a kernel parameter): every rank pushes its
// values into slot `rank` of every rank's receive buffer, raises its flag there, waits for every rank's flag in
// its own, then sums the slots in rank order (so every rank gets the same bits). Two buffers alternate by the
// parity of the all-reduce's count (`epoch`): a rank cannot start the one after next before every rank has
// finished reading this one. For the small sums of decode steps, where NCCL's latency dominates.
struct PeerAllReduce {
  static constexpr int kMaxRanks = 8;
  float* peer_buf[kMaxRanks] = {};                 // rank q's receive buffers [2][world][max_floats]
  unsigned long long* peer_flags[kMaxRanks] = {};  // rank q's flags [world]: the epoch each rank last pushed
  unsigned long long* epoch = nullptr;             // this rank's all-reduces so far [1], on its device
  int rank = 0, world = 0, max_floats = 0;
};

// The buffers of a PeerAllReduce on every device (0..world-1) and peer access between them.
class PeerAllReduceSet {
 public:
  // Null unless DIFFRUN_TP_ALLREDUCE=peer, and where a pair of devices has no peer access or world > kMaxRanks.
  static std::unique_ptr<PeerAllReduceSet> make(int world, int max_floats);
  ~PeerAllReduceSet();
  PeerAllReduceSet(const PeerAllReduceSet&) = delete;
  PeerAllReduceSet& operator=(const PeerAllReduceSet&) = delete;
  PeerAllReduce rank(int r) const;
  int max_floats() const { return max_floats_; }

 private:
  PeerAllReduceSet() = default;
  int world_ = 0, max_floats_ = 0;
  std::vector<float*> bufs_;
  std::vector<unsigned long long*> flags_;  // [world] flags then [1] epoch, per device
};

// In place, like all_reduce_sum, through peer memory (count <= p.max_floats). A rank that waits more than 10 s
// for the others traps (the step fails with a CUDA error instead of hanging).
void peer_all_reduce_sum(float* buf, int count, const PeerAllReduce& p, cudaStream_t stream);

// One rank of a tensor-parallel engine: its cut of the weights (cut.slice: its slice of the model), its NCCL
// communicator (null: one GPU), its one-shot all-reduce (where the devices have peer access), and what the
// tensor-parallel faults (faults/tp_faults.hpp) change in its forward.
struct TpRank {
  WeightCut cut;
  void* comm = nullptr;  // ncclComm_t
  std::optional<PeerAllReduce> peer;
  bool skip_attn_allreduce = false;  // tp_attn_allreduce_skipped
  bool ffn_allreduce_twice = false;  // tp_ffn_allreduce_twice
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
