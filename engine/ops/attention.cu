// Attention kernels (T, S, H, Hkv, Dh), causal, optionally within a sliding window of keys.
// attention: one block per (token, head), one warp per key at a time. Pass 1 finds the row max of
// the scores; pass 2 sums exp(score − max) and accumulates the weighted V rows per lane (lane owns
// dims lane, lane+32, ...); warps combine in fixed order. When probs is requested, a third pass
// recomputes each score (bit-identical) to write p. out may be null (probabilities only).
// attention_tiled (the prefill's output) is in attention_tiled.cu.
// attention_split (flash-decoding): one block per (split, head, token), each over a contiguous chunk
// of the causal keys, writing its scores into probs and its chunk max, exp-sum and unnormalised
// output into the scratch; the last block of a (token, head) to finish (an atomic ticket) combines
// the splits in fixed order, normalises the probabilities in place and resets the ticket.
#include "engine/ops/attention.cuh"

#include <algorithm>
#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kWarps = 8;
constexpr int kMaxDhPerLane = 8;  // Dh ≤ 256
constexpr int kMaxSplits = kAttentionSplitMaxSplits;

template <typename Out>
static __global__ void __launch_bounds__(kWarps * 32)
attention_kernel(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                 const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const int n_keys = *n_past + t + 1;  // causal: positions 0..n_past+t
  const int first = window > 0 ? max(0, n_keys - window) : 0;  // sliding window: the last `window` of them
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
  for (int s = first + warp; s < n_keys; s += kWarps) m = fmaxf(m, score(s));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);

  float sum = 0.0f;
  float acc[kMaxDhPerLane];
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) acc[j] = 0.0f;
  for (int s = first + warp; s < n_keys; s += kWarps) {
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
  if (out != nullptr) {
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
      float o = 0.0f;
      for (int w = 0; w < kWarps; ++w) o += acc_sh[w][d];
      store_act(out, (static_cast<int64_t>(t) * H + h) * Dh + d, o / total);
    }
  }

  if (probs != nullptr) {
    float* prow = probs + (static_cast<int64_t>(h) * T + t) * S;
    for (int s = warp; s < S; s += kWarps) {
      const float p = s >= first && s < n_keys ? expf(score(s) - m) / total : 0.0f;
      if (lane == 0) prow[s] = p;
    }
  }
}

constexpr int kSplitWarps = 4;

template <typename Out>
static __global__ void __launch_bounds__(kSplitWarps * 32)
attention_split_kernel(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                       const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, float* partial,
                       uint32_t* counters) {
  pdl_wait();
  pdl_trigger();
  const int split = blockIdx.x;
  const int n_splits = gridDim.x;
  const int h = blockIdx.y;
  const int t = blockIdx.z;
  const int kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const int n_keys = *n_past + t + 1;  // causal: positions 0..n_past+t
  const int first = window > 0 ? max(0, n_keys - window) : 0;  // sliding window: keys first..n_keys-1
  const int S = *n_past + T;
  const int chunk = (n_keys - first + n_splits - 1) / n_splits;
  const int s_begin = min(first + split * chunk, n_keys);
  const int s_end = min(s_begin + chunk, n_keys);
  float* prow = probs + (static_cast<int64_t>(h) * T + t) * S;  // scores first, probabilities after the combine
  const int part_stride = Dh + 2;  // per split: Dh unnormalised outputs, the chunk max, the chunk exp-sum
  float* part = partial + (static_cast<int64_t>(t) * H + h) * n_splits * part_stride;

  float qr[kMaxDhPerLane];
  const float* qh = q + (static_cast<int64_t>(t) * H + h) * Dh;
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) {
    const int d = lane + 32 * j;
    qr[j] = d < Dh ? qh[d] : 0.0f;
  }

  __shared__ float red[kSplitWarps];
  float m = -INFINITY;
  for (int s = s_begin + warp; s < s_end; s += kSplitWarps) {
    const float* kr = k_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxDhPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) dot += qr[j] * kr[d];
    }
    const float x = warp_sum(dot) * scale;
    if (lane == 0) prow[s] = x;
    m = fmaxf(m, x);
  }
  if (lane == 0) red[warp] = m;
  __syncthreads();  // also makes lane 0's score writes visible to the block
  m = red[0];
  for (int w = 1; w < kSplitWarps; ++w) m = fmaxf(m, red[w]);

  float sum = 0.0f;
  float acc[kMaxDhPerLane];
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) acc[j] = 0.0f;
  for (int s = s_begin + warp; s < s_end; s += kSplitWarps) {
    const float p = expf(prow[s] - m);
    sum += p;
    const float* vr = v_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
#pragma unroll
    for (int j = 0; j < kMaxDhPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) acc[j] += p * vr[d];
    }
  }

  __shared__ float acc_sh[kSplitWarps][kMaxDhPerLane * 32];
  __shared__ float sum_sh[kSplitWarps];
#pragma unroll
  for (int j = 0; j < kMaxDhPerLane; ++j) acc_sh[warp][lane + 32 * j] = acc[j];
  if (lane == 0) sum_sh[warp] = sum;
  __syncthreads();
  float* mine = part + split * part_stride;
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w) o += acc_sh[w][d];
    mine[d] = o;
  }
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w) total += sum_sh[w];
    mine[Dh] = m;  // -inf for an empty chunk, whose sum and outputs are 0
    mine[Dh + 1] = total;
  }

  // The last block of this (token, head) to arrive combines; the others are done.
  __shared__ bool is_last;
  __threadfence();  // this block's scores and partials are visible device-wide before its ticket
  __syncthreads();
  uint32_t* ticket = counters + static_cast<int64_t>(t) * H + h;
  if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1u) == static_cast<uint32_t>(n_splits - 1);
  __syncthreads();
  if (!is_last) return;

  __shared__ float weight[kMaxSplits];  // exp(m_split − M)
  __shared__ float stats[2];            // M, L
  if (threadIdx.x == 0) {
    float M = -INFINITY;
    for (int i = 0; i < n_splits; ++i) M = fmaxf(M, __ldcg(part + i * part_stride + Dh));
    float L = 0.0f;
    for (int i = 0; i < n_splits; ++i) {
      const float mi = __ldcg(part + i * part_stride + Dh);
      const float wi = mi == -INFINITY ? 0.0f : expf(mi - M);  // chunk 0 is never empty: M is finite
      weight[i] = wi;
      L += wi * __ldcg(part + i * part_stride + Dh + 1);
    }
    stats[0] = M;
    stats[1] = L;
    *ticket = 0;  // ready for the next launch
  }
  __syncthreads();
  const float M = stats[0], L = stats[1];
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.0f;
    for (int i = 0; i < n_splits; ++i) o += weight[i] * __ldcg(part + i * part_stride + d);
    store_act(out, (static_cast<int64_t>(t) * H + h) * Dh + d, o / L);
  }
  for (int s = threadIdx.x; s < S; s += blockDim.x)
    prow[s] = s >= first && s < n_keys ? expf(__ldcg(prow + s) - M) / L : 0.0f;
}

void check_shape(int H, int Hkv, int Dh) {
  if (Dh > 32 * kMaxDhPerLane || Dh <= 0)
    throw ModelError("attention: head dim " + std::to_string(Dh) + " is not supported (at most " +
                     std::to_string(32 * kMaxDhPerLane) + ")");
  if (Hkv <= 0 || H % Hkv != 0)
    throw ModelError("attention: n_head " + std::to_string(H) + " is not a multiple of n_head_kv " +
                     std::to_string(Hkv));
}

template <typename Out>
void launch_split(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                  const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                  const AttentionSplitScratch& scratch, cudaStream_t stream) {
  check_shape(H, Hkv, Dh);
  if (T < 1 || T > kAttentionSplitMaxT)
    throw Error("attention_split: " + std::to_string(T) + " tokens, the split kernel takes 1.." +
                std::to_string(kAttentionSplitMaxT));
  if (scratch.splits < 1 || scratch.splits > kMaxSplits)
    throw Error("attention_split: " + std::to_string(scratch.splits) + " splits, at most " +
                std::to_string(kMaxSplits));
  if (probs == nullptr || scratch.partial == nullptr || scratch.counters == nullptr)
    throw Error("attention_split: probs and the scratch buffers are required");
  const dim3 grid(static_cast<unsigned>(scratch.splits), static_cast<unsigned>(H), static_cast<unsigned>(T));
  launch_pdl(attention_split_kernel<Out>, grid, kSplitWarps * 32, 0, stream, out, probs, q, k_cache, v_cache, T, n_past,
             H, Hkv, Dh, scale, window, scratch.partial, scratch.counters);
  check_launch("attention_split", stream);
}

template <typename Out>
void launch(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
            const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  check_shape(H, Hkv, Dh);
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(H));
  launch_pdl(attention_kernel<Out>, grid, kWarps * 32, 0, stream, out, probs, q, k_cache, v_cache, T, n_past, H, Hkv,
             Dh, scale, window);
  check_launch("attention", stream);
}

}  // namespace

void attention(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  launch(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream);
}

void attention(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  launch(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream);
}

int attention_split_count(int H, int sm_count) {
  const int blocks_wanted = 2 * sm_count;  // two blocks per SM for a one-token step
  return std::clamp((blocks_wanted + H - 1) / H, 1, kAttentionSplitMaxSplits);
}

void attention_split(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                     const AttentionSplitScratch& scratch, cudaStream_t stream) {
  launch_split(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, scratch, stream);
}

void attention_split(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                     const AttentionSplitScratch& scratch, cudaStream_t stream) {
  launch_split(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, scratch, stream);
}

}  // namespace diffrun::engine
