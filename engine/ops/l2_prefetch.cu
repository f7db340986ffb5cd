// L2 prefetch kernel: block b, thread 0, asks L2 for the b-th kL2Piece bytes of the ranges laid end to end.
#include "engine/ops/l2_prefetch.cuh"

#include <cstdint>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

constexpr size_t kL2Piece = size_t(64) << 10;

static __global__ void l2_prefetch_kernel(L2Ranges ranges) {
  pdl_trigger();
  if (threadIdx.x == 0) {
    size_t at = size_t(blockIdx.x) * kL2Piece;
#pragma unroll
    for (int r = 0; r < kL2PrefetchRanges; ++r) {
      if (at < ranges.bytes[r]) {
        const size_t n = ranges.bytes[r] - at < kL2Piece ? ranges.bytes[r] - at : kL2Piece;
        prefetch_l2_keep(static_cast<const char*>(ranges.p[r]) + at, n);
        break;
      }
      at -= (ranges.bytes[r] + kL2Piece - 1) / kL2Piece * kL2Piece;
    }
  }
  pdl_wait();
}

}  // namespace

void l2_prefetch(const L2Ranges& ranges, cudaStream_t stream) {
  size_t pieces = 0;
  for (int r = 0; r < kL2PrefetchRanges; ++r) pieces += (ranges.bytes[r] + kL2Piece - 1) / kL2Piece;
  if (pieces == 0) return;
  launch_pdl(l2_prefetch_kernel, static_cast<unsigned>(pieces), 32, 0, stream, ranges);
  check_launch("l2_prefetch", stream);
}

}  // namespace diffrun::engine
