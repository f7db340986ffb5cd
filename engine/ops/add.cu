// Residual add kernel: elementwise, grid-stride.
#include "engine/ops/add.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

static __global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

}  // namespace

void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  launch_pdl(add_kernel, op_grid(n), kOpThreads, 0, stream, out, a, b, n);
  check_launch("add", stream);
}

}  // namespace diffrun::engine
