// Scale and softcap kernels (N): elementwise, grid-stride.
#include "engine/ops/scale.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

static __global__ void scale_kernel(float* out, const float* x, float s, int64_t n) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = x[i] * s;
}

static __global__ void softcap_kernel(float* out, const float* x, float cap, int64_t n) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = cap * tanhf(x[i] / cap);
}

}  // namespace

void scale(float* out, const float* x, float s, int64_t n, cudaStream_t stream) {
  launch_pdl(scale_kernel, op_grid(n), kOpThreads, 0, stream, out, x, s, n);
  check_launch("scale", stream);
}

void softcap(float* out, const float* x, float cap, int64_t n, cudaStream_t stream) {
  launch_pdl(softcap_kernel, op_grid(n), kOpThreads, 0, stream, out, x, cap, n);
  check_launch("softcap", stream);
}

}  // namespace diffrun::engine
