// Linear layer: the row-major GEMM wrapper, then the bias added in f32 (T, N).
#include "engine/ops/matmul.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

static __global__ void add_bias_kernel(float* y, const float* bias, int64_t total, int N) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += bias[i % N];
}

void add_bias(float* y, const float* bias, int T, int N, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * N;
  add_bias_kernel<<<op_grid(total), kOpThreads, 0, stream>>>(y, bias, total, N);
  check_launch("matmul bias", stream);
}

}  // namespace

void matmul(float* out, const float* x, const float* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream) {
  gemm(out, x, w, T, K, N, cublas, stream);
  if (bias) add_bias(out, bias, T, N, stream);
}

void matmul(float* out, const __half* x, const __half* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream) {
  gemm(out, x, w, T, K, N, cublas, stream);
  if (bias) add_bias(out, bias, T, N, stream);
}

}  // namespace diffrun::engine
