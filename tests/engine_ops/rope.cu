// RoPE kernels (T, n_head, Dh), both pairings from one kernel: one thread per rotated pair.
#include "tests/engine_ops/rope.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

// Pair i of a head: elements (i, i + Dh/2) when Neox, else (2i, 2i+1).
template <bool Neox>
__global__ void rope_kernel(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0, float theta,
                            const float* freq_factors) {
  pdl_wait();
  pdl_trigger();
  const int half = Dh / 2;
  const int64_t total = static_cast<int64_t>(T) * n_head * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int64_t head_row = idx / half;  // t · n_head + h
    const int t = static_cast<int>(head_row / n_head);
    const int64_t i0 = head_row * Dh + (Neox ? i : 2 * i);
    const int64_t i1 = i0 + (Neox ? half : 1);
    float y0, y1;
    rope_pair(x[i0], x[i1], *pos0 + t, i, Dh, theta, freq_factors, y0, y1);
    out[i0] = y0;
    out[i1] = y1;
  }
}

template <bool Neox>
void launch_rope(const char* name, float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0,
                 float theta, const float* freq_factors, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * n_head * (Dh / 2);
  launch_pdl(rope_kernel<Neox>, op_grid(total), kOpThreads, 0, stream, out, x, T, n_head, Dh, pos0, theta,
             freq_factors);
  check_launch(name, stream);
}

}  // namespace

void rope_norm(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0, float theta,
               const float* freq_factors, cudaStream_t stream) {
  launch_rope<false>("rope_norm", out, x, T, n_head, Dh, pos0, theta, freq_factors, stream);
}

void rope_neox(float* out, const float* x, int T, int n_head, int Dh, const int32_t* pos0, float theta,
               const float* freq_factors, cudaStream_t stream) {
  launch_rope<true>("rope_neox", out, x, T, n_head, Dh, pos0, theta, freq_factors, stream);
}

}  // namespace diffrun::engine
