// RMSNorm kernel (rows, D): one block per row, f32 sum of squares, block reduction.
#include "engine/ops/rms_norm.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <typename Out>
static __global__ void rms_norm_kernel(Out* out, const float* x, const float* w, int D, float eps) {
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;
  const float* xr = x + row * D;
  float ss = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ss += xr[d] * xr[d];
  ss = warp_sum(ss);
  __shared__ float partial[kOpThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) total += partial[i];
  const float scale = 1.0f / sqrtf(total / static_cast<float>(D) + eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) store_act(out, row * D + d, xr[d] * scale * w[d]);
}

template <typename Out>
void launch(Out* out, const float* x, const float* w, int rows, int D, float eps, cudaStream_t stream) {
  launch_pdl(rms_norm_kernel<Out>, rows, kOpThreads, 0, stream, out, x, w, D, eps);
  check_launch("rms_norm", stream);
}

}  // namespace

void rms_norm(float* out, const float* x, const float* w, int rows, int D, float eps, cudaStream_t stream) {
  launch(out, x, w, rows, D, eps, stream);
}

void rms_norm(__half* out, const float* x, const float* w, int rows, int D, float eps, cudaStream_t stream) {
  launch(out, x, w, rows, D, eps, stream);
}

}  // namespace diffrun::engine
