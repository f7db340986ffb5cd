// Flawed variants of engine ops for fault injection: transposed embedding read, flawed RMSNorm, wrong-lda
// GEMM, NaN fill, the modulo KV-head expansion. Each flawed kernel is its clean kernel (engine/ops/) with
// the flaws as its only changes. The attention faults need no copy: they run the production attention
// kernels with another AttentionVariant (engine/ops/attention.cuh).
#include "engine/faults/fault_ops.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

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

// rms_norm_kernel (b null: out = norm(a)) or add_rms_norm_kernel (sum = a + b, out = norm(sum)) with flaws.
template <typename Out>
static __global__ void rms_norm_flawed_kernel(float* sum, Out* out, const float* a, const float* b, const float* w,
                                              int D, float eps, bool off_by_one, bool eps_outside_sqrt) {
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;
  const float* xr = b == nullptr ? a + row * D : sum + row * D;
  const int summed = off_by_one ? D - 1 : D;  // rms_norm_off_by_one: the loop bound one short
  float ss = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float x;
    if (b == nullptr) {
      x = xr[d];
    } else {
      x = a[row * D + d] + b[row * D + d];
      sum[row * D + d] = x;
    }
    if (d < summed) ss += x * x;
  }
  ss = warp_sum(ss);
  __shared__ float partial[kOpThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) total += partial[i];
  const float mean = total / static_cast<float>(D);
  const float scale = eps_outside_sqrt ? 1.0f / (sqrtf(mean) + eps) : 1.0f / sqrtf(mean + eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) store_act(out, row * D + d, xr[d] * scale * w[d]);
}

// rope_qk_kernel with the cache write of K taking the pair as read instead of as rotated.
template <bool kNeox>
static __global__ void rope_qk_cache_unrotated_kernel(float* q_out, float* k_out, float* k_cache, float* v_cache,
                                                      const float* q, const float* k, const float* v, int T, int H,
                                                      int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos,
                                                      float theta, const float* freq_factors) {
  pdl_wait();
  pdl_trigger();
  const int half = Dh / 2;
  const int64_t q_pairs = static_cast<int64_t>(T) * H * half;
  const int64_t total = q_pairs + static_cast<int64_t>(T) * Hkv * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const bool is_q = idx < q_pairs;
    const int64_t j = is_q ? idx : idx - q_pairs;
    const int n_head = is_q ? H : Hkv;
    const float* x = is_q ? q : k;
    float* out = is_q ? q_out : k_out;
    const int i = static_cast<int>(j % half);
    const int64_t head_row = j / half;  // t · n_head + h
    const int t = static_cast<int>(head_row / n_head);
    const float inv_freq = powf(theta, -2.0f * static_cast<float>(i) / static_cast<float>(Dh));
    const float angle = freq_factors ? static_cast<float>(*pos0 + t) * inv_freq / freq_factors[i]
                                     : static_cast<float>(*pos0 + t) * inv_freq;
    float s, c;
    sincosf(angle, &s, &c);
    const int64_t i0 = head_row * Dh + (kNeox ? i : 2 * i);
    const int64_t i1 = kNeox ? i0 + half : i0 + 1;
    const float x0 = x[i0];
    const float x1 = x[i1];
    out[i0] = x0 * c - x1 * s;
    out[i1] = x0 * s + x1 * c;
    if (!is_q) {
      const int64_t row0 = static_cast<int64_t>(*write_pos) * Hkv * Dh;
      k_cache[row0 + i0] = x0;  // the flaw: the pair before rotation
      k_cache[row0 + i1] = x1;
      v_cache[row0 + i0] = v[i0];
      v_cache[row0 + i1] = v[i1];
    }
  }
}

template <typename W>
static __global__ void fill_nan_kernel(W* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<W>(NAN);
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
void launch_rms_norm(float* sum, Out* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                     RmsNormFlaws flaws, cudaStream_t stream) {
  launch_pdl(rms_norm_flawed_kernel<Out>, rows, kOpThreads, 0, stream, sum, out, a, b, w, D, eps, flaws.off_by_one,
             flaws.eps_outside_sqrt);
  check_launch("rms_norm_flawed", stream);
}

template <typename W>
void launch_fill_nan(W* p, int64_t n, cudaStream_t stream) {
  fill_nan_kernel<W><<<op_grid(n), kOpThreads, 0, stream>>>(p, n);
  check_launch("fill_nan", stream);
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

void gemm_wrong_lda(float* y, const float* x, const float* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream) {
  gemm_wrong_lda_ex(y, x, w, CUDA_R_32F, T, K, N, handle, stream);
}

void gemm_wrong_lda(float* y, const __half* x, const __half* w, int T, int K, int N, const CublasHandle& handle,
                    cudaStream_t stream) {
  gemm_wrong_lda_ex(y, x, w, CUDA_R_16F, T, K, N, handle, stream);
}

void rms_norm_flawed(float* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                     cudaStream_t stream) {
  launch_rms_norm(nullptr, out, x, nullptr, w, rows, D, eps, flaws, stream);
}

void rms_norm_flawed(__half* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                     cudaStream_t stream) {
  launch_rms_norm(nullptr, out, x, nullptr, w, rows, D, eps, flaws, stream);
}

void add_rms_norm_flawed(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D,
                         float eps, RmsNormFlaws flaws, cudaStream_t stream) {
  launch_rms_norm(sum, out, a, b, w, rows, D, eps, flaws, stream);
}

void add_rms_norm_flawed(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D,
                         float eps, RmsNormFlaws flaws, cudaStream_t stream) {
  launch_rms_norm(sum, out, a, b, w, rows, D, eps, flaws, stream);
}

void rope_qk_cache_unrotated(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q,
                             const float* k, const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0,
                             const int32_t* write_pos, float theta, const float* freq_factors, bool neox,
                             cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * (H + Hkv) * (Dh / 2);
  if (neox)
    launch_pdl(rope_qk_cache_unrotated_kernel<true>, op_grid(total), kOpThreads, 0, stream, q_out, k_out, k_cache,
               v_cache, q, k, v, T, H, Hkv, Dh, pos0, write_pos, theta, freq_factors);
  else
    launch_pdl(rope_qk_cache_unrotated_kernel<false>, op_grid(total), kOpThreads, 0, stream, q_out, k_out, k_cache,
               v_cache, q, k, v, T, H, Hkv, Dh, pos0, write_pos, theta, freq_factors);
  check_launch("rope_qk_cache_unrotated", stream);
}

void fill_nan(float* p, int64_t n, cudaStream_t stream) { launch_fill_nan(p, n, stream); }

void fill_nan(__half* p, int64_t n, cudaStream_t stream) { launch_fill_nan(p, n, stream); }

__global__ void expand_kv_heads_modulo_kernel(float* out, const float* kv, const int32_t* rows_from, int add, int H,
                                              int Hkv, int Dh) {
  pdl_wait();
  pdl_trigger();
  const int64_t width = static_cast<int64_t>(H) * Dh;
  const int64_t total = (static_cast<int64_t>(*rows_from) + add) * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t s = i / width;
    const int r = static_cast<int>(i % width), h = r / Dh, d = r % Dh;
    out[i] = kv[(s * Hkv + h % Hkv) * Dh + d];
  }
}

void expand_kv_heads_modulo(float* out, const float* kv, const int32_t* rows_from, int add, int max_rows, int H,
                            int Hkv, int Dh, cudaStream_t stream) {
  launch_pdl(expand_kv_heads_modulo_kernel, op_grid(int64_t(max_rows) * H * Dh), kOpThreads, 0, stream, out, kv,
             rows_from, add, H, Hkv, Dh);
  check_launch("expand_kv_heads_modulo", stream);
}

__global__ void position_plus_kernel(int32_t* out, const int32_t* pos, int add) {
  pdl_wait();
  pdl_trigger();
  *out = *pos + add;
}

void position_plus(int32_t* out, const int32_t* pos, int add, cudaStream_t stream) {
  launch_pdl(position_plus_kernel, dim3(1), dim3(1), 0, stream, out, pos, add);
  check_launch("position_plus", stream);
}

void square(float* out, const float* w, int64_t n, cudaStream_t stream) {
  square_kernel<<<op_grid(n), kOpThreads, 0, stream>>>(out, w, n);
  check_launch("square", stream);
}

}  // namespace diffrun::engine
