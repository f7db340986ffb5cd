// KV cache write kernel (T, Hkv·Dh): one thread per element of K and of V.
#include "tests/engine_ops/kv_store.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

static __global__ void kv_store_kernel(float* k_cache, float* v_cache, const float* k, const float* v,
                                       int64_t total, const int32_t* n_past, int width) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / width;
    const int64_t dst = (*n_past + t) * width + i % width;
    k_cache[dst] = k[i];
    v_cache[dst] = v[i];
  }
}

}  // namespace

void kv_store(float* k_cache, float* v_cache, const float* k, const float* v, int T, const int32_t* n_past,
              int width, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * width;
  launch_pdl(kv_store_kernel, op_grid(total), kOpThreads, 0, stream, k_cache, v_cache, k, v, total, n_past, width);
  check_launch("kv_store", stream);
}

}  // namespace diffrun::engine
