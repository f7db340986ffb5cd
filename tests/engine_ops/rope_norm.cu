// RoPE NORM kernel (T, n_head, Dh): one thread per rotated pair.
#include "tests/engine_ops/rope_norm.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

static __global__ void rope_norm_kernel(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0,
                                        float theta, const float* freq_factors) {
  pdl_wait();
  pdl_trigger();
  const int half = Dh / 2;
  const int64_t total = static_cast<int64_t>(T) * n_head * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int64_t head_row = idx / half;  // t · n_head + h
    const int t = static_cast<int>(head_row / n_head);
    const int64_t base = head_row * Dh;
    float y0, y1;
    rope_pair(x[base + 2 * i], x[base + 2 * i + 1], *pos0 + t, i, Dh, theta, freq_factors, y0, y1);
    out[base + 2 * i] = y0;
    out[base + 2 * i + 1] = y1;
  }
}

}  // namespace

void rope_norm(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0, float theta,
               const float* freq_factors, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * n_head * (Dh / 2);
  launch_pdl(rope_norm_kernel, op_grid(total), kOpThreads, 0, stream, out, x, T, n_head, Dh, pos0, theta, freq_factors);
  check_launch("rope_norm", stream);
}

}  // namespace diffrun::engine
