// Residual add + RMSNorm kernel (rows, D): one block per row, the add's elementwise sum, then the
// rms_norm kernel's f32 sum of squares and block reduction in the same order (block_sum in
// launch.cuh), the row and the weights held in registers as rms_norm holds them.
#include "engine/ops/add_rms_norm.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <typename Out, int kRegs>
static __global__ void __launch_bounds__(kOpThreads)
add_rms_norm_kernel(float* sum, Out* out, const float* a, const float* b, const float* w, int D, float eps) {
  // Rows of up to kRegs·kOpThreads elements stay in registers; the weights are constant, so they
  // are loaded before the wait for the preceding kernel (its tail hides their latency).
  const bool in_regs = D <= kRegs * kOpThreads;
  float wv[kRegs];
  norm_load_weights(wv, w, D, in_regs);
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;
  float* sr = sum + row * D;
  float ss = 0.0f;
  float sv[kRegs];
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {  // every load in flight before the first store (sum may alias a or b)
      const int d = threadIdx.x + i * kOpThreads;
      sv[i] = d < D ? a[row * D + d] + b[row * D + d] : 0.0f;
    }
    ss = norm_sum_squares<true>(sv, D, sr);
  } else {
    for (int d = threadIdx.x; d < D; d += kOpThreads) {
      const float s = a[row * D + d] + b[row * D + d];
      sr[d] = s;
      ss += s * s;
    }
  }
  const float scale = rms_scale(block_sum(ss), D, eps);
  norm_store(out + row * D, sv, sr, wv, w, D, scale, in_regs);
}

template <typename Out>
void launch(float* sum, Out* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
            cudaStream_t stream) {
  norm_dispatch(D, [&](auto regs) {
    launch_pdl(add_rms_norm_kernel<Out, decltype(regs)::value>, rows, kOpThreads, 0, stream, sum, out, a, b, w, D,
               eps);
  });
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
