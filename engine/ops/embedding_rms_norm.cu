// Embedding gather + RMSNorm kernel (T, D): one block per token row, the embedding kernel's gather
// (load_act of the table row) and the rms_norm kernel's sum of squares, block reduction and store in
// its order (block_sum, norm_store in launch.cuh), the row held in registers.
#include "engine/ops/embedding_rms_norm.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "faults/faults.hpp"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

template <typename W, typename Out, int kRegs>
static __global__ void __launch_bounds__(kOpThreads)
embedding_rms_norm_kernel(float* x, Out* out, const int32_t* tokens, const W* table, const float* w, int D, int V,
                          float eps) {
  // No global write or read of what the step's earlier kernels write until the end: the ids (host
  // memory written before the launch), the table and the weights are constant for the step, and x and
  // out are first written here. The wait before the exit keeps the chain: the next kernel's wait then
  // covers the kernel before this one too.
  pdl_trigger();
  float wv[kRegs];
  norm_load_weights(wv, w, D, true);
  const int64_t t = blockIdx.x;
  const int32_t id = tokens[t];
  const bool valid = id >= 0 && id < V;
  const W* row = table + static_cast<int64_t>(valid ? id : 0) * D;
  float xv[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const int d = threadIdx.x + i * kOpThreads;
    xv[i] = d < D ? (valid ? load_act(row, d) : NAN) : 0.0f;
  }
  float* xr = x + t * D;
  const float ss = norm_sum_squares<true>(xv, D, xr);
  const float scale = rms_scale(block_sum(ss), D, eps);
  norm_store(out + t * D, xv, xr, wv, w, D, scale, true);
  pdl_wait();
}

template <typename W, typename Out>
void launch(float* x, Out* out, const int32_t* tokens, const W* table, const float* w, int T, int D, int V, float eps,
            cudaStream_t stream) {
  if (D > embedding_rms_norm_max_width())
    throw Error("embedding_rms_norm: rows of " + std::to_string(D) + ", at most " +
                std::to_string(embedding_rms_norm_max_width()));
  norm_dispatch(D, [&](auto regs) {
    launch_pdl(embedding_rms_norm_kernel<W, Out, decltype(regs)::value>, T, kOpThreads, 0, stream, x, out, tokens,
               table, w, D, V, eps);
  });
  check_launch("embedding_rms_norm", stream);
}

}  // namespace

static_assert(kNormRegsMax * kOpThreads == kFusedEmbeddingNormMaxWidth,
              "the fault catalog's rule for embd_norm_fused_no_weight (faults/faults.hpp) is this kernel's width");
int embedding_rms_norm_max_width() { return kFusedEmbeddingNormMaxWidth; }

void embedding_rms_norm(float* x, float* out, const int32_t* tokens, const float* table, const float* w, int T, int D,
                        int V, float eps, cudaStream_t stream) {
  launch(x, out, tokens, table, w, T, D, V, eps, stream);
}

void embedding_rms_norm(float* x, __half* out, const int32_t* tokens, const __half* table, const float* w, int T,
                        int D, int V, float eps, cudaStream_t stream) {
  launch(x, out, tokens, table, w, T, D, V, eps, stream);
}

}  // namespace diffrun::engine
