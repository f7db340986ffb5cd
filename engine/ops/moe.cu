// Mixture-of-experts kernels: routing (one warp a token), the weighted combination, the shared
// expert's gate, and the row moves around each expert's matmul. Elementwise ones grid-stride.
#include "engine/ops/moe.cuh"

#include <algorithm>
#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr float kMinWeightSum = 6.103515625e-5f;  // 2^-14, llama.cpp's clamp of the top-k sum (smallest normal f16)

// One warp a token (kRouteWarps tokens a block), its E probabilities and K selected weights in shared memory; lane i
// owns experts i, i + 32, ... The softmax: the max, then each lane's exps summed in id order and the lanes' sums by a
// butterfly (every lane gets the same sum), each probability its exp / that sum. The top K by K rounds of a warp
// arg-max over the experts not yet taken: the larger probability first, the lower id on ties (the order of a stable
// sort by descending probability), a NaN after every number. The order is a key of two words compared as numbers
// (route_key_hi, then the complemented id), so a round is two warp-wide max reductions. (One thread a token
// scanned E·K·K entries serially: 0.3 ms a layer at E = 128, K = 8; a butterfly of shuffles and comparisons a round
// took 9.5 µs a call at E = 128, K = 8, the reductions 4.9.)
constexpr int kRouteWarps = 4;
constexpr int kRouteMaxExperts = 32 * 32;  // a lane's taken experts are one 32-bit mask

// Expert e's place in the top-k order as two words, the larger (hi, then lo) first: hi 0 for a NaN probability
// (after every number), else its bits + 1 (a probability is >= +0, and non-negative floats order as their bits);
// lo ~e (the lower id first on ties). No expert is (0, 0), after every expert.
__device__ __forceinline__ uint32_t route_key_hi(float p) { return isnan(p) ? 0u : __float_as_uint(p) + 1u; }

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

static __global__ void moe_route_kernel(float* probs, int32_t* topk, float* id_values, float* weights,
                                        float* weights_norm, const float* logits, int n_tokens, int E, int K,
                                        bool renormalise) {
  extern __shared__ float route_probs[];
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= n_tokens) return;  // the whole warp: no block-wide barrier follows
  const float* l = logits + size_t(t) * E;
  float* ps = route_probs + size_t(warp) * E;
  float max = -INFINITY;
  for (int e = lane; e < E; e += 32) max = fmaxf(max, l[e]);
  for (int o = 16; o > 0; o /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, o));
  float sum = 0.0f;
  for (int e = lane; e < E; e += 32) sum += (ps[e] = expf(l[e] - max));
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  float* p = probs + size_t(t) * E;  // may alias l: each lane reads and writes its own experts only
  for (int e = lane; e < E; e += 32) p[e] = ps[e] = ps[e] / sum;
  __syncwarp();  // every lane reads the winner's probability below
  float* ws = route_probs + size_t(kRouteWarps) * E + size_t(warp) * K;  // the selected weights
  int32_t* ids = topk + size_t(t) * K;
  uint32_t taken = 0;  // bit i: expert lane + 32 i
  float w_sum = 0.0f;
  for (int j = 0; j < K; ++j) {
    uint32_t bh = 0, bl = 0;  // this lane's best expert not yet taken, as route_key_hi and ~id
    for (int e = lane, i = 0; e < E; e += 32, ++i) {
      const uint32_t h = route_key_hi(ps[e]), lo = ~static_cast<uint32_t>(e);
      if (!(taken >> i & 1u) && (h > bh || (h == bh && lo > bl))) bh = h, bl = lo;
    }
    const uint32_t h = warp_max(bh);
    const int best = static_cast<int>(~warp_max(bh == h ? bl : 0u));
    const float bp = ps[best];
    if (best % 32 == lane) taken |= 1u << (best / 32);
    if (lane == 0) {
      ids[j] = best, ws[j] = bp;
      if (id_values) id_values[size_t(t) * K + j] = static_cast<float>(best);  // ffn_moe_topk holds the ids as values
    }
    w_sum += bp;
  }
  __syncwarp();
  const float divisor = fmaxf(w_sum, kMinWeightSum);
  float* w = weights + size_t(t) * K;
  float* wn = weights_norm + size_t(t) * K;
  for (int j = lane; j < K; j += 32) {
    w[j] = ws[j];
    wn[j] = renormalise ? ws[j] / divisor : ws[j];
  }
}

static __global__ void moe_combine_kernel(float* out, const float* down, const float* weights, int n_tokens, int K,
                                          int D) {
  pdl_wait();
  pdl_trigger();
  const int64_t n = int64_t(n_tokens) * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, d = i % D;
    float o = 0.0f;
    for (int j = 0; j < K; ++j) {
      const float v = __fmul_rn(down[(t * K + j) * D + d], weights[t * K + j]);
      o = j == 0 ? v : __fadd_rn(o, v);
    }
    out[i] = o;
  }
}

// One block a token: the dot product in block_sum's order.
template <typename X>
static __global__ void shexp_gate_logits_kernel(float* gate_inp, const X* x, const float* w, int D) {
  pdl_wait();
  pdl_trigger();
  const X* row = x + size_t(blockIdx.x) * D;
  float s = 0.0f;
  for (int d = threadIdx.x; d < D; d += kOpThreads) s += load_act(row, d) * w[d];
  s = block_sum(s);
  if (threadIdx.x == 0) gate_inp[blockIdx.x] = s;
}

static __global__ void sigmoid_kernel(float* out, const float* x, int64_t n) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = 1.0f / (1.0f + expf(-x[i]));
}

static __global__ void scale_rows_kernel(float* out, const float* shexp, const float* gate, int n_tokens, int D) {
  pdl_wait();
  pdl_trigger();
  const int64_t n = int64_t(n_tokens) * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = shexp[i] * gate[i / D];
}

template <typename X>
static __global__ void gather_rows_kernel(X* dst, const X* src, const int32_t* rows, int div, int n, int cols) {
  pdl_wait();
  pdl_trigger();
  const int64_t total = int64_t(n) * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[int64_t(rows[i / cols] / div) * cols + i % cols];
}

static __global__ void scatter_rows_kernel(float* dst, const float* src, const int32_t* rows, int n, int cols) {
  pdl_wait();
  pdl_trigger();
  const int64_t total = int64_t(n) * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    dst[int64_t(rows[i / cols]) * cols + i % cols] = src[i];
}

// grid (blocks, K, stacks): block x of slot y copies its share of stack z's expert.
static __global__ void gather_experts_kernel(ExpertStacks s, const float* ids, int E) {
  pdl_wait();
  const int k = blockIdx.y, i = blockIdx.z;
  const float v = ids[k];
  const int e = v >= 0.0f ? min(static_cast<int>(v), E - 1) : 0;
  const uint64_t bytes = s.bytes[i];
  const unsigned char* src = reinterpret_cast<const unsigned char*>(s.table[i][e]);
  unsigned char* dst = s.dst[i] + uint64_t(k) * bytes;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (uint64_t j = first; j < bytes / 16; j += stride)
      reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
  } else {
    for (uint64_t j = first; j < bytes; j += stride) dst[j] = src[j];
  }
}

template <typename X>
void launch_shexp_gate_logits(float* gate_inp, const X* x, const float* w, int n_tokens, int D, cudaStream_t stream) {
  if (n_tokens == 0) return;
  launch_pdl(shexp_gate_logits_kernel<X>, dim3(n_tokens), kOpThreads, 0, stream, gate_inp, x, w, D);
  check_launch("shexp_gate_logits", stream);
}

template <typename X>
void launch_gather_rows(X* dst, const X* src, const int32_t* rows, int div, int n, int cols, cudaStream_t stream) {
  const int64_t total = int64_t(n) * cols;
  if (total == 0) return;
  launch_pdl(gather_rows_kernel<X>, op_grid(total), kOpThreads, 0, stream, dst, src, rows, div, n, cols);
  check_launch("gather_rows", stream);
}

void launch_moe_route(float* probs, int32_t* topk, float* id_values, float* weights, float* weights_norm,
                      const float* logits, int n_tokens, int E, int K, bool renormalise, cudaStream_t stream) {
  if (n_tokens == 0) return;
  if (E > kRouteMaxExperts || K > E)
    throw Error("moe_route: " + std::to_string(E) + " experts, " + std::to_string(K) + " used: the kernel takes at most " +
                std::to_string(kRouteMaxExperts) + " experts and K <= E");
  launch_pdl(moe_route_kernel, dim3((n_tokens + kRouteWarps - 1) / kRouteWarps), kRouteWarps * 32,
             kRouteWarps * (E + K) * sizeof(float), stream, probs, topk, id_values, weights, weights_norm, logits,
             n_tokens, E, K, renormalise);
  check_launch("moe_route", stream);
}

}  // namespace

void moe_route(float* probs, int32_t* topk, float* weights, float* weights_norm, const float* logits, int n_tokens,
               int E, int K, bool renormalise, cudaStream_t stream) {
  launch_moe_route(probs, topk, nullptr, weights, weights_norm, logits, n_tokens, E, K, renormalise, stream);
}

void moe_route_ids(float* probs, int32_t* topk, float* id_values, float* weights, float* weights_norm,
                   const float* logits, int n_tokens, int E, int K, bool renormalise, cudaStream_t stream) {
  launch_moe_route(probs, topk, id_values, weights, weights_norm, logits, n_tokens, E, K, renormalise, stream);
}

void moe_combine(float* out, const float* down, const float* weights, int n_tokens, int K, int D,
                 cudaStream_t stream) {
  const int64_t n = int64_t(n_tokens) * D;
  if (n == 0) return;
  launch_pdl(moe_combine_kernel, op_grid(n), kOpThreads, 0, stream, out, down, weights, n_tokens, K, D);
  check_launch("moe_combine", stream);
}

void shexp_gate_logits(float* gate_inp, const float* x, const float* w, int n_tokens, int D, cudaStream_t stream) {
  launch_shexp_gate_logits(gate_inp, x, w, n_tokens, D, stream);
}

void shexp_gate_logits(float* gate_inp, const __half* x, const float* w, int n_tokens, int D, cudaStream_t stream) {
  launch_shexp_gate_logits(gate_inp, x, w, n_tokens, D, stream);
}

void sigmoid(float* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch_pdl(sigmoid_kernel, op_grid(n), kOpThreads, 0, stream, out, x, n);
  check_launch("sigmoid", stream);
}

void scale_rows(float* out, const float* shexp, const float* gate, int n_tokens, int D, cudaStream_t stream) {
  const int64_t n = int64_t(n_tokens) * D;
  if (n == 0) return;
  launch_pdl(scale_rows_kernel, op_grid(n), kOpThreads, 0, stream, out, shexp, gate, n_tokens, D);
  check_launch("scale_rows", stream);
}

void gather_rows(float* dst, const float* src, const int32_t* rows, int div, int n, int cols, cudaStream_t stream) {
  launch_gather_rows(dst, src, rows, div, n, cols, stream);
}

void gather_rows(__half* dst, const __half* src, const int32_t* rows, int div, int n, int cols,
                 cudaStream_t stream) {
  launch_gather_rows(dst, src, rows, div, n, cols, stream);
}

void scatter_rows(float* dst, const float* src, const int32_t* rows, int n, int cols, cudaStream_t stream) {
  const int64_t total = int64_t(n) * cols;
  if (total == 0) return;
  launch_pdl(scatter_rows_kernel, op_grid(total), kOpThreads, 0, stream, dst, src, rows, n, cols);
  check_launch("scatter_rows", stream);
}

void gather_experts(const ExpertStacks& stacks, const float* ids, int K, int E, cudaStream_t stream) {
  if (stacks.n == 0 || K == 0) return;
  uint64_t largest = 0;
  for (int i = 0; i < stacks.n; ++i) largest = std::max(largest, stacks.bytes[i]);
  // About 64 KiB a block: the largest stack's expert in that many blocks, every slot and stack alike.
  const unsigned blocks = static_cast<unsigned>(std::clamp<uint64_t>((largest + 65535) / 65536, 1, 1024));
  launch_pdl(gather_experts_kernel, dim3(blocks, static_cast<unsigned>(K), static_cast<unsigned>(stacks.n)), 256, 0,
             stream, stacks, ids, E);
  check_launch("gather_experts", stream);
}

}  // namespace diffrun::engine
