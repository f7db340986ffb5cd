// Flawed variants of engine ops for fault injection: transposed embedding read, flawed attention, wrong-lda GEMM.
// The attention kernel is the clean one-block-per-head attention (engine/ops/attention.cu) with the
// flaws as its only changes; the engine runs it at every T when an attention fault is injected.
#include "engine/faults/fault_ops.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kWarps = 8;
constexpr int kMaxDhPerLane = 8;  // Dh ≤ 256

template <typename W>
static __global__ void embedding_transposed_kernel(float* out, const int32_t* tokens, const W* table, int D, int V) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int32_t id = tokens[t];
  float* out_row = out + static_cast<int64_t>(t) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x)
    out_row[d] = (id < 0 || id >= V) ? NAN : load_act(table, static_cast<int64_t>(d) * V + id);
}

template <typename Out>
static __global__ void __launch_bounds__(kWarps * 32)
attention_flawed_kernel(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                        const int32_t* n_past, int H, int Hkv, int Dh, float scale, bool causal, bool head_modulo) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int kvh = head_modulo ? h % Hkv : h / (H / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const int S = *n_past + T;
  const int n_keys = causal ? *n_past + t + 1 : S;

  float qr[kMaxDhPerLane];
  const float* qh = q + (static_cast<int64_t>(t) * H + h) * Dh;
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) {
    const int d = lane + 32 * j;
    qr[j] = d < Dh ? qh[d] : 0.0f;
  }
  auto score = [&](int s) {
    const float* kr = k_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxDhPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) acc += qr[j] * kr[d];
    }
    return warp_sum(acc) * scale;
  };

  __shared__ float red[kWarps];
  float m = -INFINITY;
  for (int s = warp; s < n_keys; s += kWarps) m = fmaxf(m, score(s));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);

  float sum = 0.0f;
  float acc[kMaxDhPerLane];
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) acc[j] = 0.0f;
  for (int s = warp; s < n_keys; s += kWarps) {
    const float p = expf(score(s) - m);
    sum += p;
    const float* vr = v_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
#pragma unroll
    for (int j = 0; j < kMaxDhPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) acc[j] += p * vr[d];
    }
  }

  __shared__ float acc_sh[kWarps][kMaxDhPerLane * 32];
  __shared__ float sum_sh[kWarps];
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) acc_sh[warp][lane + 32 * j] = acc[j];
  if (lane == 0) sum_sh[warp] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += sum_sh[w];
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w) o += acc_sh[w][d];
    store_act(out, (static_cast<int64_t>(t) * H + h) * Dh + d, o / total);
  }

  if (probs != nullptr) {
    float* prow = probs + (static_cast<int64_t>(h) * T + t) * S;
    for (int s = warp; s < S; s += kWarps) {
      const float p = s < n_keys ? expf(score(s) - m) / total : 0.0f;
      if (lane == 0) prow[s] = p;
    }
  }
}

static __global__ void square_kernel(float* out, const float* w, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = w[i] * w[i];
}

template <typename W>
void launch_embedding(float* out, const int32_t* tokens, const W* table, int T, int D, int V, cudaStream_t stream) {
  launch_pdl(embedding_transposed_kernel<W>, T, kOpThreads, 0, stream, out, tokens, table, D, V);
  check_launch("embedding_transposed", stream);
}

template <typename Out>
void launch_attention(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                      const int32_t* n_past, int H, int Hkv, int Dh, AttentionFlaws flaws, cudaStream_t stream) {
  if (Dh > 32 * kMaxDhPerLane || Dh <= 0)
    throw ModelError("attention: head dim " + std::to_string(Dh) + " is not supported (at most " +
                     std::to_string(32 * kMaxDhPerLane) + ")");
  if (Hkv <= 0 || H % Hkv != 0)
    throw ModelError("attention: n_head " + std::to_string(H) + " is not a multiple of n_head_kv " +
                     std::to_string(Hkv));
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(H));
  const float scale = flaws.no_scale ? 1.0f : 1.0f / sqrtf(static_cast<float>(Dh));
  launch_pdl(attention_flawed_kernel<Out>, grid, kWarps * 32, 0, stream, out, probs, q, k_cache, v_cache, T, n_past, H,
             Hkv, Dh, scale, !flaws.no_causal_mask, flaws.head_modulo);
  check_launch("attention_flawed", stream);
}

void gemm_wrong_lda_ex(float* y, const void* x, const void* w, cudaDataType_t in_type, int T, int K, int N,
                       const CublasHandle& handle, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasSetStream(handle.get(), stream));
  CUBLAS_CHECK(cublasGemmEx(handle.get(), CUBLAS_OP_N, CUBLAS_OP_N, N, T, K, &alpha,
                            w, in_type, /*lda=*/N,
                            x, in_type, /*ldb=*/K, &beta,
                            y, CUDA_R_32F, /*ldc=*/N,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  check_launch("gemm_wrong_lda", stream);
}

}  // namespace

void embedding_transposed(float* out, const int32_t* tokens, const float* table, int T, int D, int V,
                          cudaStream_t stream) {
  launch_embedding(out, tokens, table, T, D, V, stream);
}

void embedding_transposed(float* out, const int32_t* tokens, const __half* table, int T, int D, int V,
                          cudaStream_t stream) {
  launch_embedding(out, tokens, table, T, D, V, stream);
}

void attention_flawed(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                      const int32_t* n_past, int H, int Hkv, int Dh, AttentionFlaws flaws, cudaStream_t stream) {
  launch_attention(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, flaws, stream);
}

void attention_flawed(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                      const int32_t* n_past, int H, int Hkv, int Dh, AttentionFlaws flaws, cudaStream_t stream) {
  launch_attention(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, flaws, stream);
}

void gemm_wrong_lda(float* y, const float* x, const float* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream) {
  gemm_wrong_lda_ex(y, x, w, CUDA_R_32F, T, K, N, handle, stream);
}

void gemm_wrong_lda(float* y, const __half* x, const __half* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream) {
  gemm_wrong_lda_ex(y, x, w, CUDA_R_16F, T, K, N, handle, stream);
}

void square(float* out, const float* w, int64_t n, cudaStream_t stream) {
  square_kernel<<<op_grid(n), kOpThreads, 0, stream>>>(out, w, n);
  check_launch("square", stream);
}

}  // namespace diffrun::engine
