// RMSNorm kernel (rows, D): one block per row of kOpThreads threads, f32 sum of squares (thread i
// over elements i, i + kOpThreads, ...), block reduction (block_sum in launch.cuh); rows of up to
// 8192 elements and their weights are held in registers (norm_regs in launch.cuh).
#include "engine/ops/rms_norm.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <typename Out, int kRegs>
static __global__ void __launch_bounds__(kOpThreads)
rms_norm_kernel(Out* out, const float* x, const float* w, int D, float eps) {
  // Rows of up to kRegs·kOpThreads elements stay in registers; the weights are constant, so they
  // are loaded before the wait for the preceding kernel (its tail hides their latency).
  const bool in_regs = D <= kRegs * kOpThreads;
  float wv[kRegs];
  norm_load_weights(wv, w, D, in_regs);
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;
  const float* xr = x + row * D;
  float ss = 0.0f;
  float xv[kRegs];
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int d = threadIdx.x + i * kOpThreads;
      xv[i] = d < D ? xr[d] : 0.0f;
    }
    ss = norm_sum_squares(xv, D);
  } else {
    for (int d = threadIdx.x; d < D; d += kOpThreads) ss += xr[d] * xr[d];
  }
  const float scale = rms_scale(block_sum(ss), D, eps);
  norm_store(out + row * D, xv, xr, wv, w, D, scale, in_regs);  // out may alias x: read before
}

template <typename Out>
void launch(Out* out, const float* x, const float* w, int rows, int D, float eps, cudaStream_t stream) {
  norm_dispatch(D, [&](auto regs) {
    launch_pdl(rms_norm_kernel<Out, decltype(regs)::value>, rows, kOpThreads, 0, stream, out, x, w, D, eps);
  });
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
