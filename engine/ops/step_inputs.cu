// Step inputs kernel (T): one block copies the ids and n_past from mapped host memory.
#include "engine/ops/step_inputs.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

static __global__ void step_inputs_kernel(int32_t* tokens, int32_t* n_past, const int32_t* host_tokens,
                                          const int32_t* host_n_past, int T) {
  pdl_wait();
  pdl_trigger();
  if (threadIdx.x == 0) *n_past = *host_n_past;
  for (int t = threadIdx.x; t < T; t += blockDim.x) tokens[t] = host_tokens[t];
}

}  // namespace

void step_inputs(int32_t* tokens, int32_t* n_past, const int32_t* host_tokens, const int32_t* host_n_past, int T,
                 cudaStream_t stream) {
  launch_pdl(step_inputs_kernel, 1, kOpThreads, 0, stream, tokens, n_past, host_tokens, host_n_past, T);
  check_launch("step_inputs", stream);
}

}  // namespace diffrun::engine
