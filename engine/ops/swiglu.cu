// SwiGLU kernel (T, F): elementwise, grid-stride.
#include "engine/ops/swiglu.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <typename Out>
static __global__ void swiglu_kernel(Out* out, const float* gate, const float* up, int64_t n) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    store_act(out, i, silu_mul(gate[i], up[i]));
  }
}

template <typename Out>
void launch(Out* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  launch_pdl(swiglu_kernel<Out>, op_grid(n), kOpThreads, 0, stream, out, gate, up, n);
  check_launch("swiglu", stream);
}

}  // namespace

void swiglu(float* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  launch(out, gate, up, n, stream);
}

void swiglu(__half* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  launch(out, gate, up, n, stream);
}

}  // namespace diffrun::engine
