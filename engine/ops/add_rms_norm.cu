// Residual add + RMSNorm kernel (rows, D): one block per row, the add's elementwise sum, then the
// rms_norm kernel's f32 sum of squares and block reduction in the same order.
#include "engine/ops/add_rms_norm.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <typename Out>
static __global__ void add_rms_norm_kernel(float* sum, Out* out, const float* a, const float* b, const float* w,
                                           int D, float eps) {
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;
  float* sr = sum + row * D;
  float ss = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float s = a[row * D + d] + b[row * D + d];
    sr[d] = s;
    ss += s * s;
  }
  ss = warp_sum(ss);
  __shared__ float partial[kOpThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) total += partial[i];
  const float scale = 1.0f / sqrtf(total / static_cast<float>(D) + eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) store_act(out, row * D + d, sr[d] * scale * w[d]);
}

template <typename Out>
void launch(float* sum, Out* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
            cudaStream_t stream) {
  launch_pdl(add_rms_norm_kernel<Out>, rows, kOpThreads, 0, stream, sum, out, a, b, w, D, eps);
  check_launch("add_rms_norm", stream);
}

}  // namespace

void add_rms_norm(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                  cudaStream_t stream) {
  launch(sum, out, a, b, w, rows, D, eps, stream);
}

void add_rms_norm(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D,
                  float eps, cudaStream_t stream) {
  launch(sum, out, a, b, w, rows, D, eps, stream);
}

}  // namespace diffrun::engine
