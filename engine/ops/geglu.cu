// GeGLU kernel (T, F): elementwise, grid-stride.
#include "engine/ops/geglu.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <typename Out>
static __global__ void geglu_kernel(Out* out, const float* gate, const float* up, int64_t n) {
  pdl_wait();
  pdl_trigger();
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    store_act(out, i, 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i]);
  }
}

template <typename Out>
void launch(Out* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  launch_pdl(geglu_kernel<Out>, op_grid(n), kOpThreads, 0, stream, out, gate, up, n);
  check_launch("geglu", stream);
}

}  // namespace

void geglu(float* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  launch(out, gate, up, n, stream);
}

void geglu(__half* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  launch(out, gate, up, n, stream);
}

}  // namespace diffrun::engine
