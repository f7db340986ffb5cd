// Flawed variants of engine ops for fault injection (flawed RMSNorm, the unrotated cache write, NaN fill, the
// modulo KV-head expansion, a weight read with the wrong leading dimension), and the entry points that take the
// fault plan's op arguments. Each flawed kernel is its clean kernel (engine/ops/) with the flaws as its only
// changes. The attention faults need no copy: they run the production attention kernels with another
// AttentionVariant (engine/ops/attention.cuh).
#include "engine/faults/fault_ops.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/add_rms_norm.cuh"
#include "engine/ops/launch.cuh"
#include "engine/ops/matmul.cuh"
#include "engine/ops/moe.cuh"
#include "engine/ops/rms_norm.cuh"
#include "engine/ops/rope_qk.cuh"
#include "faults/faults.hpp"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

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

// out [N, K]: element (r, c) = w[c * N + r].
template <typename W>
static __global__ void wrong_leading_dimension_kernel(W* out, const W* w, int N, int K) {
  const int64_t total = static_cast<int64_t>(N) * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / K, c = i % K;
    out[i] = w[c * N + r];
  }
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

template <typename W>
void launch_wrong_leading_dimension(W* out, const W* w, int N, int K, cudaStream_t stream) {
  wrong_leading_dimension_kernel<W><<<op_grid(int64_t(N) * K), kOpThreads, 0, stream>>>(out, w, N, K);
  check_launch("wrong_leading_dimension", stream);
}

// The flaws a flawed norm kernel has; the others are the entry points' (or no engine path's).
void check_kernel_flaws(RmsNormFlaws flaws, bool in_place_skip_allowed, const char* op) {
  if (flaws.unweighted)
    throw Error(std::string(op) + ": the engine takes an unweighted norm through embedding_rms_norm's weight only");
  if (flaws.skipped && !in_place_skip_allowed) throw Error(std::string(op) + ": a skipped norm has no add to keep");
}

template <typename Out>
void rms_norm_entry(Out* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
                    cudaStream_t stream) {
  if (!flaws.any()) {
    rms_norm(out, x, w, rows, D, eps, stream);
    return;
  }
  check_kernel_flaws(flaws, true, "rms_norm");
  if (flaws.skipped) {  // the op not run: the tensor stays as it is
    if (static_cast<const void*>(out) != static_cast<const void*>(x))
      throw Error("rms_norm: a skipped norm runs in place only");
    return;
  }
  rms_norm_flawed(out, x, w, rows, D, eps, flaws, stream);
}

template <typename Out>
void add_rms_norm_entry(float* sum, Out* out, const float* a, const float* b, const float* w, int rows, int D,
                        float eps, RmsNormFlaws flaws, cudaStream_t stream) {
  if (!flaws.any()) {
    add_rms_norm(sum, out, a, b, w, rows, D, eps, stream);
    return;
  }
  check_kernel_flaws(flaws, false, "add_rms_norm");
  add_rms_norm_flawed(sum, out, a, b, w, rows, D, eps, flaws, stream);
}

template <typename W>
void matmul_padded_impl(float* out, const W* x, const DeviceMatrix<W>& w, int T, int K, int N, int Np,
                        const CublasHandle& cublas, cudaStream_t stream) {
  if (Np == N) {
    matmul(out, x, w, nullptr, T, K, N, cublas, stream);
    return;
  }
  CUDA_CHECK(cudaMemsetAsync(out, kFaultUninitialisedByte, size_t(T) * Np * sizeof(float), stream));
  for (int t = 0; t < T; ++t) matmul(out + size_t(t) * Np, x + size_t(t) * K, w, nullptr, 1, K, N, cublas, stream);
}

}  // namespace

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

void square(float* out, const float* w, int64_t n, cudaStream_t stream) {
  square_kernel<<<op_grid(n), kOpThreads, 0, stream>>>(out, w, n);
  check_launch("square", stream);
}

void rms_norm(float* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
              cudaStream_t stream) {
  rms_norm_entry(out, x, w, rows, D, eps, flaws, stream);
}

void rms_norm(__half* out, const float* x, const float* w, int rows, int D, float eps, RmsNormFlaws flaws,
              cudaStream_t stream) {
  rms_norm_entry(out, x, w, rows, D, eps, flaws, stream);
}

void add_rms_norm(float* sum, float* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                  RmsNormFlaws flaws, cudaStream_t stream) {
  add_rms_norm_entry(sum, out, a, b, w, rows, D, eps, flaws, stream);
}

void add_rms_norm(float* sum, __half* out, const float* a, const float* b, const float* w, int rows, int D, float eps,
                  RmsNormFlaws flaws, cudaStream_t stream) {
  add_rms_norm_entry(sum, out, a, b, w, rows, D, eps, flaws, stream);
}

void rope_qk(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q, const float* k,
             const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos, float theta,
             const float* freq_factors, bool neox, bool cache_unrotated, cudaStream_t stream) {
  if (cache_unrotated)
    rope_qk_cache_unrotated(q_out, k_out, k_cache, v_cache, q, k, v, T, H, Hkv, Dh, pos0, write_pos, theta,
                            freq_factors, neox, stream);
  else
    rope_qk(q_out, k_out, k_cache, v_cache, q, k, v, T, H, Hkv, Dh, pos0, write_pos, theta, freq_factors, neox,
            stream);
}

AttentionKv attention_kv(const float* k, const float* v, const int32_t* rows_from, int add, int max_rows, int H,
                         int Hkv, int Dh, bool gqa_head_modulo, float* k_scratch, float* v_scratch,
                         cudaStream_t stream) {
  if (!gqa_head_modulo) return {k, v, Hkv};
  expand_kv_heads_modulo(k_scratch, k, rows_from, add, max_rows, H, Hkv, Dh, stream);
  expand_kv_heads_modulo(v_scratch, v, rows_from, add, max_rows, H, Hkv, Dh, stream);
  return {k_scratch, v_scratch, H};
}

void matmul_padded(float* out, const float* x, const DeviceMatrix<float>& w, int T, int K, int N, int Np,
                   const CublasHandle& cublas, cudaStream_t stream) {
  matmul_padded_impl(out, x, w, T, K, N, Np, cublas, stream);
}

void matmul_padded(float* out, const __half* x, const DeviceMatrix<__half>& w, int T, int K, int N, int Np,
                   const CublasHandle& cublas, cudaStream_t stream) {
  matmul_padded_impl(out, x, w, T, K, N, Np, cublas, stream);
}

void wrong_leading_dimension(float* out, const float* w, int N, int K, cudaStream_t stream) {
  launch_wrong_leading_dimension(out, w, N, K, stream);
}

void wrong_leading_dimension(__half* out, const __half* w, int N, int K, cudaStream_t stream) {
  launch_wrong_leading_dimension(out, w, N, K, stream);
}

namespace {

// After the clean moe_route: token t's choice edited by the flaws, as reference_cpu/faults/fault_ops.cpp does.
static __global__ void moe_route_flaws_kernel(int32_t* topk, float* id_values, float* weights, float* weights_norm,
                                              const float* logits, const float* probs, int n_tokens, int E, int K,
                                              bool renormalise, MoeRoutingFlaws flaws) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_tokens) return;
  const float* l = logits + size_t(t) * E;
  const float* p = probs + size_t(t) * E;
  int32_t* ids = topk + size_t(t) * K;
  float* w = weights + size_t(t) * K;
  float* wn = weights_norm + size_t(t) * K;
  if (flaws.id_off_by_one)
    for (int j = 0; j < K; ++j) w[j] = p[ids[j] = (ids[j] + 1) % E];
  if (flaws.softmax_over_topk) {
    float max = l[ids[0]], sum = 0.0f;
    for (int j = 1; j < K; ++j) max = fmaxf(max, l[ids[j]]);
    for (int j = 0; j < K; ++j) sum += (w[j] = expf(l[ids[j]] - max));
    for (int j = 0; j < K; ++j) w[j] /= sum;
  }
  float w_sum = 0.0f;
  for (int j = 0; j < K; ++j) w_sum += w[j];
  const bool norm = renormalise && !flaws.not_renormalised;
  for (int j = 0; j < K; ++j) wn[j] = norm ? w[j] / fmaxf(w_sum, 6.103515625e-5f) : w[j];
  for (int j = 0; j < K; ++j) id_values[size_t(t) * K + j] = static_cast<float>(ids[j]);  // as edited
}

}  // namespace

void moe_route_ids(float* probs, int32_t* topk, float* id_values, float* weights, float* weights_norm,
                   const float* logits, int n_tokens, int E, int K, bool renormalise, MoeRoutingFlaws flaws,
                   cudaStream_t stream) {
  moe_route_ids(probs, topk, id_values, weights, weights_norm, logits, n_tokens, E, K, renormalise, stream);
  if (!flaws.any() || n_tokens == 0) return;
  constexpr int kThreads = 64;
  moe_route_flaws_kernel<<<(n_tokens + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      topk, id_values, weights, weights_norm, logits, probs, n_tokens, E, K, renormalise, flaws);
  check_launch("moe_route (flawed)", stream);
}

void scale_rows(float* out, const float* shexp, const float* gate, int n_tokens, int D, bool gate_skipped,
                cudaStream_t stream) {
  if (!gate_skipped) return scale_rows(out, shexp, gate, n_tokens, D, stream);
  if (out != shexp)
    CUDA_CHECK(cudaMemcpyAsync(out, shexp, size_t(n_tokens) * D * sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace diffrun::engine
