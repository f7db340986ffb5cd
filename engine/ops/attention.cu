// Attention kernel (T, S, H, Hkv, Dh): one block per (token, head), one warp per key at a time.
// Pass 1 finds the row max of the scores; pass 2 sums exp(score − max) and accumulates the
// weighted V rows per lane (lane owns dims lane, lane+32, ...); warps combine in fixed order.
// When probs is requested, a third pass recomputes each score (bit-identical) to write p.
#include "engine/ops/attention.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kWarps = 8;
constexpr int kMaxDhPerLane = 8;  // Dh ≤ 256

template <typename Out>
static __global__ void __launch_bounds__(kWarps * 32)
attention_kernel(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                 const int32_t* n_past, int H, int Hkv, int Dh, float scale) {
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const int n_keys = *n_past + t + 1;  // causal: positions 0..n_past+t
  const int S = *n_past + T;

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

template <typename Out>
void launch(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
            const int32_t* n_past, int H, int Hkv, int Dh, cudaStream_t stream) {
  if (Dh > 32 * kMaxDhPerLane || Dh <= 0)
    throw ModelError("attention: head dim " + std::to_string(Dh) + " is not supported (at most " +
                     std::to_string(32 * kMaxDhPerLane) + ")");
  if (Hkv <= 0 || H % Hkv != 0)
    throw ModelError("attention: n_head " + std::to_string(H) + " is not a multiple of n_head_kv " +
                     std::to_string(Hkv));
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(H));
  attention_kernel<<<grid, kWarps * 32, 0, stream>>>(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh,
                                                      1.0f / sqrtf(static_cast<float>(Dh)));
  check_launch("attention", stream);
}

}  // namespace

void attention(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, cudaStream_t stream) {
  launch(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, stream);
}

void attention(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, cudaStream_t stream) {
  launch(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, stream);
}

}  // namespace diffrun::engine
