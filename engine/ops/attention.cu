// Attention kernels (T, S, H, Hkv, Dh), causal, optionally within a sliding window of keys.
// attention: one block per (token, head), one warp per key at a time. Pass 1 finds the row max of
// the scores; pass 2 sums exp(score − max) and accumulates the weighted V rows per lane (lane owns
// dims lane, lane+32, ...); warps combine in fixed order. When probs is requested, a third pass
// recomputes each score (bit-identical) to write p. out may be null (probabilities only).
// attention_tiled (the prefill's output) is in attention_tiled.cu.
// attention_split (flash-decoding): one block per (split, head, token), each over a contiguous chunk
// of the causal keys, writing its scores into probs and its chunk max, exp-sum and unnormalised
// output into the scratch; the last block of a (token, head) to finish (an atomic ticket) combines
// the splits in fixed order, normalises the probabilities in place and resets the ticket. The grid
// has the most splits; a query uses one per min_keys keys (read on the device, so a captured graph
// adapts to the position), and a query of one split normalises in its block without the scratch.
// Each warp keeps kKeyBatch keys' loads in flight; the combine reads the splits' statistics in one
// round (warp 0, two splits per lane) instead of one split after another.
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

// A key's score from its dot product q·k: scale·dot; AttentionVariant::f16_exp keeps the raw dot.
__device__ __forceinline__ float score_of(float dot, float scale, AttentionVariant v) {
  return v.f16_exp ? dot : dot * scale;
}

// A key's unnormalised probability from its score and the row max m: exp(score − m); f16_exp:
// f16(exp(dot))^scale, no max subtracted (Inf past dot ≈ 11.09, and the row's sum with it).
__device__ __forceinline__ float weight_of(float score, float m, float scale, AttentionVariant v) {
  return v.f16_exp ? powf(__half2float(__float2half_rn(expf(score))), scale) : expf(score - m);
}

template <typename Out>
static __global__ void __launch_bounds__(kWarps * 32)
attention_kernel(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                 const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, AttentionVariant v) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const int S = *n_past + T;
  const int n_keys = v.causal ? *n_past + t + 1 : S;  // causal: positions 0..n_past+t
  const int first = v.causal && window > 0 ? max(0, n_keys - window) : 0;  // sliding window: the last `window`

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
    return score_of(warp_sum(acc), scale, v);
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
    const float p = weight_of(score(s), m, scale, v);
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
      const float p = s >= first && s < n_keys ? weight_of(score(s), m, scale, v) / total : 0.0f;
      if (lane == 0) prow[s] = p;
    }
  }
}

constexpr int kSplitWarps = 8;
constexpr int kKeyBatch = 4;  // keys per warp whose loads are in flight together

// A head's row x of Dh = 32·kDpl (lane l holding elements l + 32j) normed with the weights w as qk_norm_rope norms it
// (warp_rms_norm_row) into n, then rotated at pos as it rotates it
// (neox pairs: elements j and j + kDpl/2 of a lane, rope_pair) into y. The same bits as qk_norm_rope's row.
template <int kDpl>
__device__ __forceinline__ void norm_rope_row(const float* x, const float (&w)[kDpl], float eps, int Dh, int pos,
                                              float theta, const float* freq_factors, float (&n)[kDpl],
                                              float (&y)[kDpl]) {
  const int lane = threadIdx.x % 32;
  float xv[kDpl];
#pragma unroll
  for (int j = 0; j < kDpl; ++j) xv[j] = x[lane + 32 * j];
  warp_rms_norm_row<kDpl>(xv, w, Dh, eps, n);
#pragma unroll
  for (int j = 0; j < kDpl / 2; ++j)
    rope_pair(n[j], n[j + kDpl / 2], pos, lane + 32 * j, Dh, theta, freq_factors, y[j], y[j + kDpl / 2]);
}

// kDpl: head dims per lane (Dh ≤ 32·kDpl). The loops skip the dims past Dh, so every kDpl gives the
// same bits; a kDpl fitted to the head keeps the registers down (Dh = 64: 64 instead of 126). kPrep (T = 1,
// Dh = 32·kDpl, neox): q and the current key's k normed and rotated here (attention_split_qk_norm_rope); q is then
// unused.
template <typename Out, int kDpl, bool kPrep = false>
static __global__ void __launch_bounds__(kSplitWarps * 32)
attention_split_kernel(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                       const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, float* partial,
                       uint32_t* counters, int min_keys, AttentionVariant v, AttentionQkPrep prep) {
  float qw[kPrep ? kDpl : 1], kw[kPrep ? kDpl : 1];  // the norms' weights are constant: loaded before the wait
  if constexpr (kPrep) {
#pragma unroll
    for (int j = 0; j < kDpl; ++j) {
      qw[j] = prep.q_w[threadIdx.x % 32 + 32 * j];
      kw[j] = prep.k_w[threadIdx.x % 32 + 32 * j];
    }
  }
  pdl_wait();
  pdl_trigger();
  const int split = blockIdx.x;
  const int h = blockIdx.y;
  const int t = blockIdx.z;
  const int kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const int S = *n_past + T;
  const int n_keys = v.causal ? *n_past + t + 1 : S;  // causal: positions 0..n_past+t
  const int first = v.causal && window > 0 ? max(0, n_keys - window) : 0;  // sliding window: keys first..n_keys-1
  const int n_splits = attention_splits_used(n_keys - first, static_cast<int>(gridDim.x), min_keys);
  if (split >= n_splits) return;  // a short query leaves the spare splits of the grid idle
  const int chunk = (n_keys - first + n_splits - 1) / n_splits;
  const int s_begin = min(first + split * chunk, n_keys);
  const int s_end = min(s_begin + chunk, n_keys);
  float* prow = probs + (static_cast<int64_t>(h) * T + t) * S;  // scores first, probabilities after the combine
  const int part_stride = Dh + 2;  // per split: Dh unnormalised outputs, the chunk max, the chunk exp-sum
  float* part = partial + (static_cast<int64_t>(t) * H + h) * gridDim.x * part_stride;
  const float* k_head = k_cache + static_cast<int64_t>(kvh) * Dh;
  const float* v_head = v_cache + static_cast<int64_t>(kvh) * Dh;

  float qr[kDpl];
  // kPrep: the current key's cache row (cur), its rotated k and its v in registers (kc, vc), used for that row.
  int cur = -1;
  float kc[kPrep ? kDpl : 1], vc[kPrep ? kDpl : 1];
  if constexpr (kPrep) {
    const int pos = *prep.pos0;
    const int64_t qrow = static_cast<int64_t>(h) * Dh, krow = static_cast<int64_t>(kvh) * Dh;
    float qn[kDpl];
    norm_rope_row<kDpl>(prep.q + qrow, qw, prep.eps, Dh, pos, prep.theta, prep.freq_factors, qn, qr);
    if (split == 0 && warp == 0) {
#pragma unroll
      for (int j = 0; j < kDpl; ++j) {
        prep.q_norm[qrow + lane + 32 * j] = qn[j];
        prep.q_out[qrow + lane + 32 * j] = qr[j];
      }
    }
    const int wrow = *prep.write_pos;
    const bool writer = split == 0 && h % (H / Hkv) == 0;
    if (writer || (wrow >= s_begin && wrow < s_end)) {
      float kn[kDpl];
      norm_rope_row<kDpl>(prep.k + krow, kw, prep.eps, Dh, pos, prep.theta, prep.freq_factors, kn, kc);
#pragma unroll
      for (int j = 0; j < kDpl; ++j) vc[j] = prep.v[krow + lane + 32 * j];
      cur = wrow;
      if (writer && warp == 0) {
        const int64_t cache_row = static_cast<int64_t>(wrow) * kv_stride + krow;
#pragma unroll
        for (int j = 0; j < kDpl; ++j) {
          const int d = lane + 32 * j;
          prep.k_norm[krow + d] = kn[j];
          prep.k_out[krow + d] = kc[j];
          prep.k_cache[cache_row + d] = kc[j];
          prep.v_cache[cache_row + d] = vc[j];
        }
      }
    }
  } else {
    const float* qh = q + (static_cast<int64_t>(t) * H + h) * Dh;
#pragma unroll
    for (int j = 0; j < kDpl; ++j) {
      const int d = lane + 32 * j;
      qr[j] = d < Dh ? qh[d] : 0.0f;
    }
  }

  // Warp w takes keys s_begin + w, + kSplitWarps, ...; kKeyBatch of them at a time, every load issued
  // before any is used (a key past the chunk loads the chunk's last row and is then ignored). A chunk
  // of at most kStep keys is one round for every warp: its V rows are then loaded with its K rows and
  // its scores kept in registers, so the second pass waits on no load (the same values, in the same
  // order, as reading them back).
  constexpr int kStep = kSplitWarps * kKeyBatch;
  const bool one_round = s_end - s_begin <= kStep;
  float vv1[kKeyBatch][kDpl], x1[kKeyBatch];
  __shared__ float red[kSplitWarps];
  float m = -INFINITY;
  for (int s0 = s_begin + warp; s0 < s_end; s0 += kStep) {
    float kv[kKeyBatch][kDpl];
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) {
      const int s = min(s0 + u * kSplitWarps, s_end - 1);
      const int64_t r = s * kv_stride;
      if (kPrep && s == cur) {  // the current key: normed and rotated here, not yet in the cache
#pragma unroll
        for (int j = 0; j < kDpl; ++j) {
          kv[u][j] = kc[kPrep ? j : 0];
          if (one_round) vv1[u][j] = vc[kPrep ? j : 0];
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < kDpl; ++j) {
        const int d = lane + 32 * j;
        kv[u][j] = d < Dh ? k_head[r + d] : 0.0f;
        if (one_round) vv1[u][j] = d < Dh ? v_head[r + d] : 0.0f;
      }
    }
    float dot[kKeyBatch];
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) {
      dot[u] = 0.0f;
#pragma unroll
      for (int j = 0; j < kDpl; ++j)
        if (lane + 32 * j < Dh) dot[u] += qr[j] * kv[u][j];
    }
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) dot[u] = warp_sum(dot[u]);
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) {
      const int s = s0 + u * kSplitWarps;
      if (s < s_end) {
        const float x = score_of(dot[u], scale, v);
        if (lane == 0) prow[s] = x;
        x1[u] = x;
        m = fmaxf(m, x);
      }
    }
  }
  if (lane == 0) red[warp] = m;
  __syncthreads();  // also makes lane 0's score writes visible to the block
  m = red[0];
  for (int w = 1; w < kSplitWarps; ++w) m = fmaxf(m, red[w]);

  float sum = 0.0f;
  float acc[kDpl];
#pragma unroll
  for (int j = 0; j < kDpl; ++j) acc[j] = 0.0f;
  if (one_round && s_begin + warp < s_end) {
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) {
      if (s_begin + warp + u * kSplitWarps < s_end) {  // in key order within the warp
        const float p = weight_of(x1[u], m, scale, v);
        sum += p;
#pragma unroll
        for (int j = 0; j < kDpl; ++j) acc[j] += p * vv1[u][j];
      }
    }
  }
  for (int s0 = s_begin + warp; !one_round && s0 < s_end; s0 += kStep) {
    float sc[kKeyBatch];
    float vv[kKeyBatch][kDpl];
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) {
      const int s = min(s0 + u * kSplitWarps, s_end - 1);
      sc[u] = prow[s];
      const float* vr = v_head + s * kv_stride;
      if (kPrep && s == cur) {  // the current key's v: not read from the cache, which this launch writes
#pragma unroll
        for (int j = 0; j < kDpl; ++j) vv[u][j] = vc[kPrep ? j : 0];
        continue;
      }
#pragma unroll
      for (int j = 0; j < kDpl; ++j) {
        const int d = lane + 32 * j;
        vv[u][j] = d < Dh ? vr[d] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kKeyBatch; ++u) {
      if (s0 + u * kSplitWarps < s_end) {  // in key order within the warp
        const float p = weight_of(sc[u], m, scale, v);
        sum += p;
#pragma unroll
        for (int j = 0; j < kDpl; ++j) acc[j] += p * vv[u][j];
      }
    }
  }

  __shared__ float acc_sh[kSplitWarps][kDpl * 32];
  __shared__ float sum_sh[kSplitWarps];
#pragma unroll
  for (int j = 0; j < kDpl; ++j) acc_sh[warp][lane + 32 * j] = acc[j];
  if (lane == 0) sum_sh[warp] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kSplitWarps; ++w) total += sum_sh[w];
  const int64_t out_row = (static_cast<int64_t>(t) * H + h) * Dh;

  if (n_splits == 1) {  // the whole row in this block: normalise here
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
      float o = 0.0f;
      for (int w = 0; w < kSplitWarps; ++w) o += acc_sh[w][d];
      store_act(out, out_row + d, o / total);
    }
    for (int s = threadIdx.x; s < S; s += blockDim.x)
      prow[s] = s >= first && s < n_keys ? weight_of(prow[s], m, scale, v) / total : 0.0f;
    return;
  }

  float* mine = part + split * part_stride;
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w) o += acc_sh[w][d];
    mine[d] = o;
  }
  if (threadIdx.x == 0) {
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

  // Warp 0 reads every split's max and exp-sum at once (lane i: splits i and i + 32).
  static_assert(kMaxSplits <= 64, "two splits per lane");
  __shared__ float weight[kMaxSplits];  // exp(m_split − M)
  __shared__ float stats[2];            // M, L
  if (warp == 0) {
    const bool has0 = lane < n_splits, has1 = lane + 32 < n_splits;
    const float m0 = has0 ? __ldcg(part + lane * part_stride + Dh) : -INFINITY;
    const float m1 = has1 ? __ldcg(part + (lane + 32) * part_stride + Dh) : -INFINITY;
    const float l0 = has0 ? __ldcg(part + lane * part_stride + Dh + 1) : 0.0f;
    const float l1 = has1 ? __ldcg(part + (lane + 32) * part_stride + Dh + 1) : 0.0f;
    const float M = warp_max(fmaxf(m0, m1));  // chunk 0 is never empty: M is finite
    // f16_exp: the splits' weights carry no max, so they add as they are.
    const float w0 = m0 == -INFINITY ? 0.0f : (v.f16_exp ? 1.0f : expf(m0 - M));
    const float w1 = m1 == -INFINITY ? 0.0f : (v.f16_exp ? 1.0f : expf(m1 - M));
    weight[lane] = w0;
    weight[lane + 32] = w1;
    const float L = warp_sum(w0 * l0 + w1 * l1);
    if (lane == 0) {
      stats[0] = M;
      stats[1] = L;
      *ticket = 0;  // ready for the next launch
    }
  }
  __syncthreads();
  const float M = stats[0], L = stats[1];
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll 8
    for (int i = 0; i < n_splits; ++i) o += weight[i] * __ldcg(part + i * part_stride + d);
    store_act(out, out_row + d, o / L);
  }
  for (int s = threadIdx.x; s < S; s += blockDim.x)
    prow[s] = s >= first && s < n_keys ? weight_of(__ldcg(prow + s), M, scale, v) / L : 0.0f;
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
                  const AttentionSplitScratch& scratch, cudaStream_t stream, AttentionVariant v) {
  check_shape(H, Hkv, Dh);
  if (T < 1 || T > kAttentionSplitMaxT)
    throw Error("attention_split: " + std::to_string(T) + " tokens, the split kernel takes 1.." +
                std::to_string(kAttentionSplitMaxT));
  if (scratch.splits < 1 || scratch.splits > kMaxSplits)
    throw Error("attention_split: " + std::to_string(scratch.splits) + " splits, at most " +
                std::to_string(kMaxSplits));
  if (probs == nullptr || scratch.partial == nullptr || scratch.counters == nullptr)
    throw Error("attention_split: probs and the scratch buffers are required");
  if (scratch.min_keys < 1)
    throw Error("attention_split: min_keys " + std::to_string(scratch.min_keys) + ", at least 1");
  const dim3 grid(static_cast<unsigned>(scratch.splits), static_cast<unsigned>(H), static_cast<unsigned>(T));
  auto* kernel = Dh <= 64    ? attention_split_kernel<Out, 2>
                 : Dh <= 128 ? attention_split_kernel<Out, 4>
                             : attention_split_kernel<Out, kMaxDhPerLane>;
  launch_pdl(kernel, grid, kSplitWarps * 32, 0, stream, out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale,
             window, scratch.partial, scratch.counters, scratch.min_keys, v, AttentionQkPrep{});
  check_launch("attention_split", stream);
}

template <typename Out>
bool launch_split_prep(Out* out, float* probs, const AttentionQkPrep& prep, int T, const int32_t* n_past, int H,
                       int Hkv, int Dh, float scale, int window, const AttentionSplitScratch& scratch,
                       cudaStream_t stream, AttentionVariant v) {
  if (!attention_split_qk_norm_rope_supported(T, Dh, prep.neox)) return false;
  check_shape(H, Hkv, Dh);
  if (scratch.splits < 1 || scratch.splits > kMaxSplits || probs == nullptr || scratch.partial == nullptr ||
      scratch.counters == nullptr || scratch.min_keys < 1)
    throw Error("attention_split_qk_norm_rope: probs and the scratch buffers are required");
  const dim3 grid(static_cast<unsigned>(scratch.splits), static_cast<unsigned>(H), 1u);
  auto* kernel = Dh == 64    ? attention_split_kernel<Out, 2, true>
                 : Dh == 128 ? attention_split_kernel<Out, 4, true>
                             : attention_split_kernel<Out, kMaxDhPerLane, true>;
  launch_pdl(kernel, grid, kSplitWarps * 32, 0, stream, out, probs, static_cast<const float*>(nullptr), prep.k_cache,
             prep.v_cache, T, n_past, H, Hkv, Dh, scale, window, scratch.partial, scratch.counters, scratch.min_keys, v,
             prep);
  check_launch("attention_split_qk_norm_rope", stream);
  return true;
}

template <typename Out>
void launch(Out* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
            const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
            AttentionVariant v) {
  check_shape(H, Hkv, Dh);
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(H));
  launch_pdl(attention_kernel<Out>, grid, kWarps * 32, 0, stream, out, probs, q, k_cache, v_cache, T, n_past, H, Hkv,
             Dh, scale, window, v);
  check_launch("attention", stream);
}

}  // namespace

void attention(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
               AttentionVariant variant) {
  launch(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, variant);
}

void attention(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
               const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
               AttentionVariant variant) {
  launch(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, variant);
}

bool attention_split_qk_norm_rope_supported(int T, int Dh, bool neox) {
  return T == 1 && neox && (Dh == 64 || Dh == 128 || Dh == 32 * kMaxDhPerLane);
}

bool attention_split_qk_norm_rope(float* out, float* probs, const AttentionQkPrep& prep, int T, const int32_t* n_past,
                                  int H, int Hkv, int Dh, float scale, int window, const AttentionSplitScratch& scratch,
                                  cudaStream_t stream, AttentionVariant variant) {
  return launch_split_prep(out, probs, prep, T, n_past, H, Hkv, Dh, scale, window, scratch, stream, variant);
}

bool attention_split_qk_norm_rope(__half* out, float* probs, const AttentionQkPrep& prep, int T,
                                  const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                                  const AttentionSplitScratch& scratch, cudaStream_t stream, AttentionVariant variant) {
  return launch_split_prep(out, probs, prep, T, n_past, H, Hkv, Dh, scale, window, scratch, stream, variant);
}

int attention_split_count(int H, int sm_count) {
  const int blocks_wanted = 2 * sm_count;  // two blocks per SM for a one-token step
  return std::clamp((blocks_wanted + H - 1) / H, 1, kAttentionSplitMaxSplits);
}

void attention_split(float* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                     const AttentionSplitScratch& scratch, cudaStream_t stream, AttentionVariant variant) {
  launch_split(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, scratch, stream, variant);
}

void attention_split(__half* out, float* probs, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window,
                     const AttentionSplitScratch& scratch, cudaStream_t stream, AttentionVariant variant) {
  launch_split(out, probs, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, scratch, stream, variant);
}

}  // namespace diffrun::engine
