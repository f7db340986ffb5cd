// Linear layer: the GEMV kernel for one token (bias in its epilogue), else the row-major cuBLAS GEMM
// then the bias added in f32 (T, K, N); quantized matrices through engine/ops/qgemv.
#include "engine/ops/matmul.cuh"

#include <algorithm>
#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "engine/ops/qgemv.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kMaxParts = kGemvMaxParts;
constexpr int kGemvThreads = 128;  // 4 warps
constexpr int kGemvBatch = 8;      // 16-byte loads issued together per lane before any is used
constexpr int kSplitRowsBelow = 4096;  // fewer rows: the block's 4 warps share each row's K

// Threads of a GEMV block: 4 warps, twice that when a SwiGLU block of 4-warp rows holds a gate row
// and its up row.
__host__ __device__ constexpr int gemv_threads(int warps_per_row, bool swiglu) {
  return swiglu && warps_per_row > 1 ? 2 * kGemvThreads : kGemvThreads;
}

__device__ __forceinline__ float dot16(uint4 w, uint4 x, const __half*) {
  const __half2* wh = reinterpret_cast<const __half2*>(&w);
  const __half2* xh = reinterpret_cast<const __half2*>(&x);
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 wf = __half22float2(wh[i]), xf = __half22float2(xh[i]);
    acc = fmaf(wf.x, xf.x, acc);
    acc = fmaf(wf.y, xf.y, acc);
  }
  return acc;
}

__device__ __forceinline__ float dot16(uint4 w, uint4 x, const float*) {
  const float4 wf = *reinterpret_cast<const float4*>(&w), xf = *reinterpret_cast<const float4*>(&x);
  return fmaf(wf.x, xf.x, fmaf(wf.y, xf.y, fmaf(wf.z, xf.z, wf.w * xf.w)));
}

// y[row] = Σ_k w[row, k] · x[k] in f32, then + bias. kWarpsPerRow warps (1 or 4) share a row: each
// lane takes every (32·kWarpsPerRow)-th 16-byte chunk, a batch of kGemvBatch loads in flight at
// once (predicated, no tail loop), then a warp reduction and, for 4 warps, one through shared
// memory in warp order. kVec: rows and x 16-byte aligned (K · sizeof(W) a multiple of 16). With
// prefetch, thread 0 first asks L2 for the block's weight rows (before the PDL wait: the weights are
// not written by the preceding kernel), so their fetch overlaps it; the values and order are the same.
// kSwiglu (w = Wgate|Wup, N = 2F, parts gate and up): a block computes gate rows i.. and the up rows
// F + i.. of the same i (twice the threads when 4 warps share a row), each row exactly as above, then
// writes act[i] = silu_mul(gate_i, up_i) as the swiglu kernel does.
template <typename W, bool kVec, int kWarpsPerRow, bool kSwiglu>
static __global__ void __launch_bounds__(gemv_threads(kWarpsPerRow, kSwiglu))
gemv_kernel(GemvParts parts, const W* __restrict__ x, const W* __restrict__ w, int K, int N, bool prefetch,
            W* __restrict__ act) {
  constexpr int kThreads = gemv_threads(kWarpsPerRow, kSwiglu);
  constexpr int kRowsPerBlock = kThreads / 32 / kWarpsPerRow;
  constexpr int kPairs = kRowsPerBlock / 2;  // kSwiglu: gate rows, then as many up rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp / kWarpsPerRow;
  int row, pair = 0;
  if constexpr (kSwiglu) {
    const int F = N / 2;
    pair = blockIdx.x * kPairs + slot % kPairs;
    row = pair < F ? pair + (slot < kPairs ? 0 : F) : N;  // N: no row
    if (prefetch && threadIdx.x % (kThreads / 2) == 0) {  // the gate rows, the up rows
      const int first = blockIdx.x * kPairs + (threadIdx.x == 0 ? 0 : F);
      prefetch_l2(w + int64_t(first) * K, size_t(min(kPairs, F - int(blockIdx.x) * kPairs)) * K * sizeof(W));
    }
  } else {
    row = blockIdx.x * kRowsPerBlock + slot;
    if (prefetch && threadIdx.x == 0) {  // the block's rows (contiguous), while the preceding kernel runs
      const int first = blockIdx.x * kRowsPerBlock;
      prefetch_l2(w + int64_t(first) * K, size_t(min(kRowsPerBlock, N - first)) * K * sizeof(W));
    }
  }
  pdl_wait();
  pdl_trigger();
  constexpr int kLanes = 32 * kWarpsPerRow;
  const int sub = (warp % kWarpsPerRow) * 32 + lane;
  float acc = 0.0f;
  if (row < N) {
    const W* wr = w + int64_t(row) * K;
    if constexpr (kVec) {
      const int chunks = K / (16 / sizeof(W));
      const uint4* w4 = reinterpret_cast<const uint4*>(wr);
      const uint4* x4 = reinterpret_cast<const uint4*>(x);
      for (int c = sub; c < chunks; c += kGemvBatch * kLanes) {
        uint4 wv[kGemvBatch], xv[kGemvBatch];
#pragma unroll
        for (int u = 0; u < kGemvBatch; ++u) {
          const int i = c + u * kLanes;
          wv[u] = i < chunks ? __ldcs(w4 + i) : make_uint4(0, 0, 0, 0);
          xv[u] = i < chunks ? __ldg(x4 + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kGemvBatch; ++u) acc += dot16(wv[u], xv[u], x);
      }
    } else {
      for (int k = sub; k < K; k += kLanes) acc = fmaf(load_act(wr, k), load_act(x, k), acc);
    }
  }
  acc = warp_sum(acc);
  if constexpr (kWarpsPerRow > 1) {
    __shared__ float partial[kThreads / 32];
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    acc = 0.0f;
    for (int i = 0; i < kWarpsPerRow; ++i) acc += partial[warp - warp % kWarpsPerRow + i];
  }
  if (row < N && sub == 0) {
    int p = 0, begin = 0;
    while (row >= parts.end[p]) begin = parts.end[p++];
    const float* bias = parts.bias[p];
    parts.out[p][row - begin] = bias ? acc + bias[row - begin] : acc;
  }
  if constexpr (kSwiglu) {
    __shared__ float value[kRowsPerBlock];
    if (sub == 0) value[slot] = acc;
    __syncthreads();
    if (slot < kPairs && sub == 0 && row < N) store_act(act, pair, silu_mul(value[slot], value[slot + kPairs]));
  }
}

template <typename W, bool kVec, int kWarpsPerRow, bool kSwiglu = false>
void launch_gemv(const GemvParts& parts, const W* x, const W* w, int K, int N, cudaStream_t stream,
                 W* act = nullptr) {
  constexpr int kThreads = gemv_threads(kWarpsPerRow, kSwiglu);
  constexpr int kRowsPerBlock = kThreads / 32 / kWarpsPerRow;
  constexpr int kBlockRows = kSwiglu ? kRowsPerBlock / 2 : kRowsPerBlock;  // gate rows for kSwiglu
  const int rows = kSwiglu ? N / 2 : N;
  const unsigned blocks = static_cast<unsigned>((rows + kBlockRows - 1) / kBlockRows);
  launch_pdl(gemv_kernel<W, kVec, kWarpsPerRow, kSwiglu>, blocks, kThreads, 0, stream, parts, x, w, K, N,
             gemv_prefetch_enabled(), act);
}

// With act (parts gate and up of F rows each): the kSwiglu kernel, the same launch choice by N = 2F.
template <typename W>
void gemv(const GemvParts& parts, const W* x, const W* w, int K, const char* what, cudaStream_t stream,
          W* act = nullptr) {
  const int N = parts.end[parts.n_parts - 1];
  const bool vec = (K * sizeof(W)) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w) % 16 == 0;
  const bool split = N < kSplitRowsBelow;
  if (act) {
    if (vec && split) launch_gemv<W, true, 4, true>(parts, x, w, K, N, stream, act);
    else if (vec) launch_gemv<W, true, 1, true>(parts, x, w, K, N, stream, act);
    else if (split) launch_gemv<W, false, 4, true>(parts, x, w, K, N, stream, act);
    else launch_gemv<W, false, 1, true>(parts, x, w, K, N, stream, act);
  } else {
    if (vec && split) launch_gemv<W, true, 4>(parts, x, w, K, N, stream);
    else if (vec) launch_gemv<W, true, 1>(parts, x, w, K, N, stream);
    else if (split) launch_gemv<W, false, 4>(parts, x, w, K, N, stream);
    else launch_gemv<W, false, 1>(parts, x, w, K, N, stream);
  }
  check_launch(what, stream);
}

static __global__ void add_bias_kernel(float* y, const float* bias, int64_t total, int N) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += bias[i % N];
}

void add_bias(float* y, const float* bias, int T, int N, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * N;
  launch_pdl(add_bias_kernel, op_grid(total), kOpThreads, 0, stream, y, bias, total, N);
  check_launch("matmul bias", stream);
}

template <typename W>
void linear(float* out, const W* x, const W* w, const float* bias, int T, int K, int N, const CublasHandle& cublas,
            cudaStream_t stream) {
  if (T == 1) {
    gemv(GemvParts{{out}, {bias}, {N}, 1}, x, w, K, "matmul gemv", stream);
    return;
  }
  gemm(out, x, w, T, K, N, cublas, stream);
  if (bias) add_bias(out, bias, T, N, stream);
}

template <typename W>
void linear_cat(std::initializer_list<MatmulPart> parts, const W* x, const W* w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream) {
  if (parts.size() == 0 || parts.size() > kMaxParts)
    throw Error("matmul_cat takes 1 to 3 parts");
  if (T == 1) {
    GemvParts g{};
    int end = 0;
    for (const MatmulPart& p : parts) {
      g.out[g.n_parts] = p.out;
      g.bias[g.n_parts] = p.bias;
      g.end[g.n_parts++] = end += p.N;
    }
    gemv(g, x, w, K, "matmul_cat gemv", stream);
    return;
  }
  int64_t row = 0;
  for (const MatmulPart& p : parts) {
    linear(p.out, x, w + row * K, p.bias, T, K, p.N, cublas, stream);
    row += p.N;
  }
}

template <typename W>
const W* dense_rows_impl(const DeviceMatrix<W>& w, int rows, cudaStream_t stream) {
  if (rows > w.rows) throw Error("matmul: " + std::to_string(rows) + " rows asked of a matrix of " + std::to_string(w.rows));
  if (!w.quantized()) return w.dense;
  int64_t row0 = 0;
  for (int s = 0; s < w.n_segments && row0 < rows; ++s) {
    const int n = std::min<int64_t>(w.segments[s].rows, rows - row0);
    dequant_rows(w.segments[s].type, w.segments[s].raw, n, w.K, w.scratch + row0 * w.K, stream);
    row0 += w.segments[s].rows;
  }
  return w.scratch;
}

template <typename W>
void linear_matrix(std::initializer_list<MatmulPart> parts, const W* x, const DeviceMatrix<W>& w, int T, int K,
                   const CublasHandle& cublas, cudaStream_t stream) {
  if (parts.size() == 0 || parts.size() > kMaxParts) throw Error("matmul_cat takes 1 to 3 parts");
  if (K != w.K) throw Error("matmul: K = " + std::to_string(K) + " against a matrix of " + std::to_string(w.K) + " columns");
  int total = 0;
  for (const MatmulPart& p : parts) total += p.N;
  if (w.quantized() && T == 1) {
    GemvParts g{};
    int end = 0;
    for (const MatmulPart& p : parts) {
      g.out[g.n_parts] = p.out;
      g.bias[g.n_parts] = p.bias;
      g.end[g.n_parts++] = end += p.N;
    }
    if (total > w.rows) throw Error("matmul: " + std::to_string(total) + " rows asked of a matrix of " + std::to_string(w.rows));
    int row0 = 0;
    for (int s = 0; s < w.n_segments && row0 < total; ++s) {
      qgemv(w.segments[s].type, g, row0, std::min(w.segments[s].rows, total - row0), x, w.segments[s].raw, K, stream);
      row0 += w.segments[s].rows;
    }
    return;
  }
  const W* dense = dense_rows_impl(w, total, stream);
  if (parts.size() == 1)
    linear(parts.begin()->out, x, dense, parts.begin()->bias, T, K, parts.begin()->N, cublas, stream);
  else
    linear_cat(parts, x, dense, T, K, cublas, stream);
}

template <typename W>
bool gate_up_swiglu_impl(float* gate, float* up, W* act, const W* x, const DeviceMatrix<W>& w, int K, int F,
                         cudaStream_t stream) {
  if (K != w.K)
    throw Error("matmul_gate_up_swiglu: K = " + std::to_string(K) + " against a matrix of " + std::to_string(w.K) +
                " columns");
  if (2 * F > w.rows)
    throw Error("matmul_gate_up_swiglu: " + std::to_string(2 * F) + " rows asked of a matrix of " +
                std::to_string(w.rows));
  if (!w.quantized()) {
    gemv(GemvParts{{gate, up}, {nullptr, nullptr}, {F, 2 * F}, 2}, x, w.dense, K, "matmul_gate_up_swiglu gemv", stream,
         act);
    return true;
  }
  if (w.n_segments < 1 || w.segments[0].rows < 2 * F) return false;  // gate and up in different formats
  qgemv_swiglu(w.segments[0].type, gate, up, act, x, w.segments[0].raw, K, F, stream);
  return true;
}

}  // namespace

bool matmul_gate_up_swiglu(float* gate, float* up, float* act, const float* x, const DeviceMatrix<float>& w, int K,
                           int F, cudaStream_t stream) {
  return gate_up_swiglu_impl(gate, up, act, x, w, K, F, stream);
}

bool matmul_gate_up_swiglu(float* gate, float* up, __half* act, const __half* x, const DeviceMatrix<__half>& w, int K,
                           int F, cudaStream_t stream) {
  return gate_up_swiglu_impl(gate, up, act, x, w, K, F, stream);
}

const float* dense_rows(const DeviceMatrix<float>& w, int rows, cudaStream_t stream) {
  return dense_rows_impl(w, rows, stream);
}

const __half* dense_rows(const DeviceMatrix<__half>& w, int rows, cudaStream_t stream) {
  return dense_rows_impl(w, rows, stream);
}

void matmul(float* out, const float* x, const DeviceMatrix<float>& w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream) {
  linear_matrix({{out, bias, N}}, x, w, T, K, cublas, stream);
}

void matmul(float* out, const __half* x, const DeviceMatrix<__half>& w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream) {
  linear_matrix({{out, bias, N}}, x, w, T, K, cublas, stream);
}

void matmul_cat(std::initializer_list<MatmulPart> parts, const float* x, const DeviceMatrix<float>& w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream) {
  linear_matrix(parts, x, w, T, K, cublas, stream);
}

void matmul_cat(std::initializer_list<MatmulPart> parts, const __half* x, const DeviceMatrix<__half>& w, int T,
                int K, const CublasHandle& cublas, cudaStream_t stream) {
  linear_matrix(parts, x, w, T, K, cublas, stream);
}

void matmul(float* out, const float* x, const float* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream) {
  linear(out, x, w, bias, T, K, N, cublas, stream);
}

void matmul(float* out, const __half* x, const __half* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream) {
  linear(out, x, w, bias, T, K, N, cublas, stream);
}

void matmul_cat(std::initializer_list<MatmulPart> parts, const float* x, const float* w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream) {
  linear_cat(parts, x, w, T, K, cublas, stream);
}

void matmul_cat(std::initializer_list<MatmulPart> parts, const __half* x, const __half* w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream) {
  linear_cat(parts, x, w, T, K, cublas, stream);
}

}  // namespace diffrun::engine
