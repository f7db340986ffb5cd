// Embedding gather kernel (T, D): one block per token row.
#include "engine/ops/embedding.cuh"

#include <type_traits>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "engine/ops/qgemv.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

template <typename W>
static __global__ void embedding_kernel(float* out, const int32_t* tokens, const W* table, int D, int V) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int32_t id = tokens[t];
  float* out_row = out + static_cast<int64_t>(t) * D;
  if (id < 0 || id >= V) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) out_row[d] = NAN;
    return;
  }
  const W* row = table + static_cast<int64_t>(id) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) out_row[d] = load_act(row, d);
}

template <typename W>
void launch(float* out, const int32_t* tokens, const W* table, int T, int D, int V, cudaStream_t stream) {
  launch_pdl(embedding_kernel<W>, T, kOpThreads, 0, stream, out, tokens, table, D, V);
  check_launch("embedding", stream);
}

template <typename W>
void launch(float* out, const int32_t* tokens, const DeviceMatrix<W>& table, int T, int D, int V, cudaStream_t stream) {
  if (!table.quantized()) {
    launch(out, tokens, table.dense, T, D, V, stream);
    return;
  }
  if (table.n_segments != 1) throw Error("embedding: a quantized table must be one segment");
  embedding_quantized(out, tokens, table.segments[0].type, table.segments[0].raw, T, D, V,
                      std::is_same_v<W, __half>, stream);
}

}  // namespace

void embedding(float* out, const int32_t* tokens, const float* table, int T, int D, int V, cudaStream_t stream) {
  launch(out, tokens, table, T, D, V, stream);
}

void embedding(float* out, const int32_t* tokens, const __half* table, int T, int D, int V, cudaStream_t stream) {
  launch(out, tokens, table, T, D, V, stream);
}

}  // namespace diffrun::engine

namespace diffrun::engine {

void embedding(float* out, const int32_t* tokens, const DeviceMatrix<float>& table, int T, int D, int V,
               cudaStream_t stream) {
  launch(out, tokens, table, T, D, V, stream);
}

void embedding(float* out, const int32_t* tokens, const DeviceMatrix<__half>& table, int T, int D, int V,
               cudaStream_t stream) {
  launch(out, tokens, table, T, D, V, stream);
}

}  // namespace diffrun::engine
