// Linear layer: the GEMV kernel for one token (bias in its epilogue), else the row-major cuBLAS GEMM
// then the bias added in f32 (T, K, N); quantized matrices through engine/ops/qgemv.
#include "engine/ops/matmul.cuh"

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "engine/cuda_check.cuh"
#include "engine/ops/argmax.cuh"
#include "engine/ops/gemv_epilogue.cuh"
#include "engine/ops/launch.cuh"
#include "engine/ops/qgemv.cuh"
#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kMaxParts = kGemvMaxParts;
constexpr int kGemvBatch = 8;      // gemv_kernel's default: 16-byte loads issued together per lane before any is used
constexpr int kSplitRowsBelow = 4096;  // fewer rows of long K: the block's 4 warps share each row's K
constexpr int kMultiBatch = 4;         // gemv_rows_kernel: 16-byte loads of each row issued together per lane

// 16-byte loads possible: rows and x 16-byte aligned (K · sizeof(W) a multiple of 16).
template <typename W>
bool gemv_vec(const W* x, const W* w, int K) {
  return (K * sizeof(W)) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

// 4 warps a row: few rows of more chunks than one round of the rows kernel gives a lane (or no 16-byte
// loads). The same choice for every epilogue of the same N, K and alignment, so a paired launch
// computes the plain one's rows.
template <typename W>
bool gemv_split(bool vec, int K, int N) {
  return N < kSplitRowsBelow && (!vec || K / int(16 / sizeof(W)) > kMultiBatch * 32);
}

// Whether gemv_epi computes the rows with gemv_rows_kernel's sums (kVec and one warp a row; every rows-per-warp
// setting gives the same bits).
template <typename W>
bool gemv_runs_rows_kernel(const W* x, const W* w, int K, int N) {
  const bool vec = gemv_vec<W>(x, w, K);
  const GemvWarps forced = gemv_warps_per_row();
  return vec && (forced.warps == 1 || (forced.warps == 0 && !gemv_split<W>(vec, K, N)));
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

// y[row] = Σ_k w[row, k] · x[k] in f32, then + bias. kWarpsPerRow warps (1, 2, 4 or 8) share a row:
// each lane takes every (32·kWarpsPerRow)-th 16-byte chunk, a batch of kBatch loads in flight at
// once (predicated, no tail loop), then a warp reduction and, for several warps, one through shared
// memory in warp order. kVec: rows and x 16-byte aligned (K · sizeof(W) a multiple of 16). With
// prefetch, the block first asks L2 for its weight rows (before the PDL wait: the weights are not
// written by the preceding kernel), so their fetch overlaps it; the values and order are the same.
// kEpi: kGemvPlain, or a paired epilogue of engine/ops/gemv_epilogue.cuh (SwiGLU into act, RoPE).
template <typename W, bool kVec, int kWarpsPerRow, int kBatch, int kEpi>
static __global__ void __launch_bounds__(gemv_block_threads(kWarpsPerRow, kEpi))
gemv_kernel(GemvParts parts, const W* __restrict__ x, const W* __restrict__ w, int K, int N, bool prefetch,
            W* __restrict__ act, GemvRope rope) {
  constexpr int kRowsPerBlock = gemv_block_rows(kWarpsPerRow, kEpi);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp / kWarpsPerRow;
  const int sub = (warp % kWarpsPerRow) * 32 + lane;
  int pair;
  const int row = gemv_slot_row<kEpi, kRowsPerBlock>(blockIdx.x, slot, N, rope, pair);
  if (prefetch) {  // the block's rows, while the preceding kernel runs
    if constexpr (kEpi == kGemvPlain) {
      if (threadIdx.x == 0) {
        const int first = blockIdx.x * kRowsPerBlock;
        prefetch_l2(w + int64_t(first) * K, size_t(min(kRowsPerBlock, N - first)) * K * sizeof(W));
      }
    } else if (sub == 0 && row < N) {
      prefetch_l2(w + int64_t(row) * K, size_t(K) * sizeof(W));
    }
  }
  pdl_wait();
  pdl_trigger();
  const GemvRopeAt at = gemv_rope_positions<kEpi>(rope);
  constexpr int kLanes = 32 * kWarpsPerRow;
  float acc = 0.0f;
  if (row < N) {
    const W* wr = w + int64_t(row) * K;
    if constexpr (kVec) {
      const int chunks = K / (16 / sizeof(W));
      const uint4* w4 = reinterpret_cast<const uint4*>(wr);
      const uint4* x4 = reinterpret_cast<const uint4*>(x);
      for (int c = sub; c < chunks; c += kBatch * kLanes) {
        uint4 wv[kBatch], xv[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = c + u * kLanes;
          wv[u] = i < chunks ? __ldcs(w4 + i) : make_uint4(0, 0, 0, 0);
          xv[u] = i < chunks ? __ldg(x4 + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) acc += dot16(wv[u], xv[u], x);
      }
    } else {
      for (int k = sub; k < K; k += kLanes) acc = fmaf(load_act(wr, k), load_act(x, k), acc);
    }
  }
  gemv_finish<kWarpsPerRow, kEpi>(parts, act, gemv_rope_with(rope, at), acc, pair, row, row < N);
}

template <typename W, bool kVec, int kWarpsPerRow, int kEpi, int kBatch = kGemvBatch>
void launch_gemv(const GemvParts& parts, const W* x, const W* w, int K, int N, cudaStream_t stream, W* act,
                 const GemvRope& rope) {
  const unsigned blocks = static_cast<unsigned>(gemv_blocks(kWarpsPerRow, kEpi, N));
  launch_pdl(gemv_kernel<W, kVec, kWarpsPerRow, kBatch, kEpi>, blocks, gemv_block_threads(kWarpsPerRow, kEpi), 0,
             stream, parts, x, w, K, N, gemv_prefetch(uint64_t(N) * K * sizeof(W)), act, rope);
}

// A warp's sums of its kRW rows (N for none: 0) in the rows kernel's order: lane takes chunks lane,
// lane + 32, ... of each row, kMultiBatch of each a round, every load of a round issued before any is
// used; acc[j] is the lane's part of row[j] (warp_sum gives the row's value).
template <typename W, int kRW>
__device__ __forceinline__ void gemv_rows_sums(float (&acc)[kRW], const W* __restrict__ x, const W* __restrict__ w,
                                               int K, int N, const int (&row)[kRW], int lane) {
  const int chunks = K / (16 / sizeof(W));
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* w4[kRW];
#pragma unroll
  for (int j = 0; j < kRW; ++j) w4[j] = reinterpret_cast<const uint4*>(w + int64_t(row[j] < N ? row[j] : 0) * K);
#pragma unroll
  for (int j = 0; j < kRW; ++j) acc[j] = 0.0f;
  for (int c = lane; c < chunks; c += kMultiBatch * 32) {
    uint4 wv[kRW][kMultiBatch], xv[kMultiBatch];
#pragma unroll
    for (int u = 0; u < kMultiBatch; ++u) {
      const int i = c + u * 32;
      xv[u] = i < chunks ? __ldg(x4 + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < kRW; ++j) wv[j][u] = row[j] < N && i < chunks ? __ldcs(w4[j] + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kRW; ++j)
#pragma unroll
      for (int u = 0; u < kMultiBatch; ++u) acc[j] += dot16(wv[j][u], xv[u], x);
  }
}

// The one-warp-per-row GEMV with kRW rows per warp (kVec): the same rows' values as gemv_kernel
// (each lane takes chunks lane, lane + 32, ... of a row, summed in that order, then warp_sum), but a
// warp issues the loads of all its rows (kMultiBatch chunks of each per round) before using any, so
// a block of 4 warps keeps 4·kRW rows in flight instead of 4. Warp s computes the block's slots
// s, s + 4, ... (a slot is a row of gemv_slot_row with 4·kRW slots per block, so the paired
// epilogues see the same pairs as with one row per warp), then the block's pairs are combined.
template <typename W, int kRW, int kEpi>
static __global__ void __launch_bounds__(128)
gemv_rows_kernel(GemvParts parts, const W* __restrict__ x, const W* __restrict__ w, int K, int N, bool prefetch,
                 W* __restrict__ act, GemvRope rope) {
  constexpr int kWarps = 4, kSlots = kWarps * kRW, kPairs = kSlots / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int row[kRW], pair[kRW];
#pragma unroll
  for (int j = 0; j < kRW; ++j) row[j] = gemv_slot_row<kEpi, kSlots>(blockIdx.x, j * kWarps + warp, N, rope, pair[j]);
  if (prefetch) {  // the block's rows, while the preceding kernel runs
    if constexpr (kEpi == kGemvPlain) {
      if (threadIdx.x == 0) {
        const int first = blockIdx.x * kSlots;
        prefetch_l2(w + int64_t(first) * K, size_t(min(kSlots, N - first)) * K * sizeof(W));
      }
    } else if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kRW; ++j)
        if (row[j] < N) prefetch_l2(w + int64_t(row[j]) * K, size_t(K) * sizeof(W));
    }
  }
  pdl_wait();
  pdl_trigger();
  const GemvRopeAt at = gemv_rope_positions<kEpi>(rope);
  float acc[kRW];
  gemv_rows_sums<W, kRW>(acc, x, w, K, N, row, lane);
  __shared__ float value[kEpi != kGemvPlain ? kSlots : 1];
#pragma unroll
  for (int j = 0; j < kRW; ++j) {
    const float a = warp_sum(acc[j]);
    if (lane == 0 && row[j] < N) {
      float* out = nullptr;
      const float y = gemv_row_value(parts, row[j], a, out);
      if constexpr (kEpi != kGemvRope) *out = y;  // RoPE: its epilogue writes every output
      if constexpr (kEpi != kGemvPlain) value[j * kWarps + warp] = y;
    }
  }
  if constexpr (kEpi != kGemvPlain) {
    __syncthreads();
    const int p = blockIdx.x * kPairs + threadIdx.x;
    if (threadIdx.x < kPairs && p < N / 2)
      gemv_pair_epilogue<kEpi>(parts, act, gemv_rope_with(rope, at), p, value[threadIdx.x],
                               value[threadIdx.x + kPairs]);
  }
}

template <typename W, int kRW, int kEpi>
void launch_gemv_rows(const GemvParts& parts, const W* x, const W* w, int K, int N, cudaStream_t stream, W* act,
                      const GemvRope& rope) {
  launch_pdl(gemv_rows_kernel<W, kRW, kEpi>, static_cast<unsigned>(gemv_grid(4 * kRW, kEpi, N)), 128, 0, stream, parts,
             x, w, K, N, gemv_prefetch(uint64_t(N) * K * sizeof(W)), act, rope);
}

// The lm head and argmax in one launch (matmul_argmax): the rows kernel's blocks of kArgmaxRW·4 rows,
// each row computed as there (gemv_rows_sums, warp_sum) and written to y, taken by a resident grid of
// kArgmaxBlocksPerSm blocks an SM (block b: row blocks b, b + gridDim.x, ...), so that no block starts
// or ends while the weights stream. Each warp keeps the best of its rows by argmax's order
// (argmax_better), and the blocks meet as argmax's do (argmax_block_finish). The launch bound leaves
// ptxas room for all 16 weight and 4 x loads of a round in flight before the first is used (~117
// registers; at 79 it issued them a row at a time, one round trip each). On the H100 the 0.5B shape's
// lm head + argmax took 96.0 us at 3 blocks an SM, 96.8 at 4, against 104.3 + 4.5 us for the rows
// kernel and argmax (bench/NOTES.md, v29).
constexpr int kArgmaxRW = 4;
constexpr int kArgmaxBlocksPerSm = 3;
template <typename W>
static __global__ void __launch_bounds__(128, 4)
gemv_argmax_kernel(float* __restrict__ y, int32_t* token, const W* __restrict__ x, const W* __restrict__ w, int K,
                   int N, bool prefetch, unsigned long long* scratch, ArgmaxTies ties) {
  constexpr int kWarps = 4, kSlots = kWarps * kArgmaxRW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_blocks = (N + kSlots - 1) / kSlots;
  if (prefetch && threadIdx.x == 0 && int(blockIdx.x) < row_blocks) {  // first rows, while the kernel before runs
    const int first = blockIdx.x * kSlots;
    prefetch_l2(w + int64_t(first) * K, size_t(min(kSlots, N - first)) * K * sizeof(W));
  }
  pdl_wait();
  pdl_trigger();
  float best = -INFINITY;
  int best_i = INT_MAX;
  for (int b = blockIdx.x; b < row_blocks; b += gridDim.x) {
    int row[kArgmaxRW];
#pragma unroll
    for (int j = 0; j < kArgmaxRW; ++j) row[j] = b * kSlots + j * kWarps + warp;
    float acc[kArgmaxRW];
    gemv_rows_sums<W, kArgmaxRW>(acc, x, w, K, N, row, lane);
#pragma unroll
    for (int j = 0; j < kArgmaxRW; ++j) {
      const float a = warp_sum(acc[j]);  // the same bits in every lane
      if (row[j] < N) {
        if (lane == 0) y[row[j]] = a;
        if (argmax_better(a, row[j], best, best_i, ties)) {
          best = a;
          best_i = row[j];
        }
      }
    }
  }
  argmax_block_finish<kWarps>(best, best_i, token, scratch, ties);
}

template <typename W>
bool matmul_argmax_impl(float* out, int32_t* token, const W* x, const DeviceMatrix<W>& w, int K, int N,
                        unsigned long long* scratch, cudaStream_t stream, ArgmaxTies ties) {
  if (K != w.K)
    throw Error("matmul_argmax: K = " + std::to_string(K) + " against a matrix of " + std::to_string(w.K) +
                " columns");
  if (N > w.rows)
    throw Error("matmul_argmax: " + std::to_string(N) + " rows asked of a matrix of " + std::to_string(w.rows));
  if (w.quantized() || !gemv_runs_rows_kernel<W>(x, w.dense, K, N)) return false;
  static const int per_sm = [] {
    int blocks = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gemv_argmax_kernel<W>, 128, 0));
    return std::clamp(blocks, 1, kArgmaxBlocksPerSm);
  }();
  static const int sms = sm_count();
  const int row_blocks = (N + 4 * kArgmaxRW - 1) / (4 * kArgmaxRW);
  const unsigned blocks = static_cast<unsigned>(std::min(row_blocks, per_sm * sms));
  launch_pdl(gemv_argmax_kernel<W>, blocks, 128, 0, stream, out, token, x, w.dense, K, N,
             gemv_prefetch(uint64_t(N) * K * sizeof(W)),
             scratch, ties);
  check_launch("matmul_argmax", stream);
  return true;
}

// DIFFRUN_GEMV_WARPS_PER_ROW=W[xB] (W > 1): every 16-byte-aligned GEMV on gemv_kernel with W warps a row and B
// loads a round.
template <typename W, int kEpi>
void launch_gemv_forced(GemvWarps f, const GemvParts& parts, const W* x, const W* w, int K, int N,
                        cudaStream_t stream, W* act, const GemvRope& rope) {
  auto go = [&]<int kW>() {
    if (f.batch == 8) launch_gemv<W, true, kW, kEpi, 8>(parts, x, w, K, N, stream, act, rope);
    else launch_gemv<W, true, kW, kEpi, 4>(parts, x, w, K, N, stream, act, rope);
  };
  if (f.warps == 2) go.template operator()<2>();
  else if (f.warps == 4) go.template operator()<4>();
  else go.template operator()<8>();
}

template <typename W, int kEpi>
void gemv_epi(const GemvParts& parts, const W* x, const W* w, int K, const char* what, cudaStream_t stream, W* act,
              const GemvRope& rope) {
  const int N = parts.end[parts.n_parts - 1];
  const bool vec = gemv_vec<W>(x, w, K);
  const GemvWarps forced = gemv_warps_per_row();
  if (vec && forced.warps > 1) {
    launch_gemv_forced<W, kEpi>(forced, parts, x, w, K, N, stream, act, rope);
    check_launch(what, stream);
    return;
  }
  const bool split = forced.warps == 0 && gemv_split<W>(vec, K, N);
  const int rows_per_warp = vec && !split ? gemv_rows_per_warp(N) : 1;
  if (vec && split) launch_gemv<W, true, 4, kEpi>(parts, x, w, K, N, stream, act, rope);
  else if (rows_per_warp == 4) launch_gemv_rows<W, 4, kEpi>(parts, x, w, K, N, stream, act, rope);
  else if (rows_per_warp == 2) launch_gemv_rows<W, 2, kEpi>(parts, x, w, K, N, stream, act, rope);
  else if (vec) launch_gemv<W, true, 1, kEpi>(parts, x, w, K, N, stream, act, rope);
  else if (split) launch_gemv<W, false, 4, kEpi>(parts, x, w, K, N, stream, act, rope);
  else launch_gemv<W, false, 1, kEpi>(parts, x, w, K, N, stream, act, rope);
  check_launch(what, stream);
}

template <typename W>
void gemv(const GemvParts& parts, const W* x, const W* w, int K, const char* what, cudaStream_t stream) {
  gemv_epi<W, kGemvPlain>(parts, x, w, K, what, stream, nullptr, GemvRope{});
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
    gemv_epi<W, kGemvSwiglu>(GemvParts{{gate, up}, {nullptr, nullptr}, {F, 2 * F}, 2}, x, w.dense, K,
                             "matmul_gate_up_swiglu gemv", stream, act, GemvRope{});
    return true;
  }
  if (w.n_segments < 1 || w.segments[0].rows < 2 * F) return false;  // gate and up in different formats
  // Super-block formats on the SIMT kernel (f32 activations, or DIFFRUN_QGEMV_MMA=0) stay unfused: that
  // GEMV is issue-bound and the epilogue's row pairing lengthens it (TinyLlama Q5_K_M, H100: 1.503
  // ms/token fused, 1.434 unfused; bench/NOTES.md, v7). The tensor-core kernel pairs rows within a tile.
  const GgmlType t = w.segments[0].type;
  const bool mma = std::is_same_v<W, __half> && qgemv_mma_enabled();
  if (!mma && gemv_super_block(t)) return false;
  qgemv_swiglu(w.segments[0].type, gate, up, act, x, w.segments[0].raw, K, F, stream);
  return true;
}

template <typename W>
bool qkv_rope_impl(float* q, float* k, float* v, const float* bq, const float* bk, const float* bv, const W* x,
                   const DeviceMatrix<W>& w, int K, const GemvRope& rope, cudaStream_t stream) {
  const int Q = rope.H * rope.Dh, KV = rope.Hkv * rope.Dh, N = Q + 2 * KV;
  if (K != w.K)
    throw Error("matmul_qkv_rope: K = " + std::to_string(K) + " against a matrix of " + std::to_string(w.K) +
                " columns");
  if (N > w.rows)
    throw Error("matmul_qkv_rope: " + std::to_string(N) + " rows asked of a matrix of " + std::to_string(w.rows));
  if (rope.Dh % 2 != 0) return false;
  const GemvParts g{{q, k, v}, {bq, bk, bv}, {Q, Q + KV, N}, 3};
  if (!w.quantized()) {
    gemv_epi<W, kGemvRope>(g, x, w.dense, K, "matmul_qkv_rope gemv", stream, nullptr, rope);
    return true;
  }
  if (w.n_segments >= 1 && w.segments[0].rows >= N) {
    qgemv_rope(w.segments[0].type, g, rope, x, w.segments[0].raw, K, stream);
    return true;
  }
  // Wv in another format (Q5_K_M's Q6_K attn_v): the f16 tensor-core kernel takes the two segments.
  if constexpr (std::is_same_v<W, __half>) {
    if (w.n_segments == 2 && w.segments[0].rows + w.segments[1].rows >= N)
      return qgemv_rope2(w.segments[0].type, w.segments[0].raw, w.segments[0].rows, w.segments[1].type,
                         w.segments[1].raw, g, rope, x, K, stream);
  }
  return false;
}

}  // namespace

bool matmul_qkv_rope(float* q, float* k, float* v, const float* bq, const float* bk, const float* bv, const float* x,
                     const DeviceMatrix<float>& w, int K, const GemvRope& rope, cudaStream_t stream) {
  return qkv_rope_impl(q, k, v, bq, bk, bv, x, w, K, rope, stream);
}

bool matmul_qkv_rope(float* q, float* k, float* v, const float* bq, const float* bk, const float* bv, const __half* x,
                     const DeviceMatrix<__half>& w, int K, const GemvRope& rope, cudaStream_t stream) {
  return qkv_rope_impl(q, k, v, bq, bk, bv, x, w, K, rope, stream);
}

bool matmul_gate_up_swiglu(float* gate, float* up, float* act, const float* x, const DeviceMatrix<float>& w, int K,
                           int F, cudaStream_t stream) {
  return gate_up_swiglu_impl(gate, up, act, x, w, K, F, stream);
}

bool matmul_gate_up_swiglu(float* gate, float* up, __half* act, const __half* x, const DeviceMatrix<__half>& w, int K,
                           int F, cudaStream_t stream) {
  return gate_up_swiglu_impl(gate, up, act, x, w, K, F, stream);
}

bool matmul_grouped(float*, const float*, const DeviceMatrix<float>&, int, int, int, cudaStream_t) {
  return false;  // the f32 engine's GEMVs take one x
}

bool matmul_grouped(float* out, const __half* x, const DeviceMatrix<__half>& w, int G, int K, int N,
                    cudaStream_t stream) {
  if (K != w.K)
    throw Error("matmul_grouped: K = " + std::to_string(K) + " against a matrix of " + std::to_string(w.K) +
                " columns");
  if (int64_t(G) * N > w.rows)
    throw Error("matmul_grouped: " + std::to_string(int64_t(G) * N) + " rows asked of a matrix of " +
                std::to_string(w.rows));
  if (!w.quantized() || w.n_segments != 1 || w.segments[0].rows < G * N) return false;
  return qgemv_grouped(w.segments[0].type, out, x, w.segments[0].raw, G * N, N, K, stream);
}

bool matmul_experts_gate_up_swiglu(float*, float*, float*, const float*, const DeviceMatrix<float>&, const uint64_t*,
                                   const uint64_t*, const float*, int, int, int, int, cudaStream_t) {
  return false;  // the f32 engine gathers
}

bool matmul_experts_gate_up_swiglu(float* gate, float* up, __half* act, const __half* x,
                                   const DeviceMatrix<__half>& like, const uint64_t* gate_table,
                                   const uint64_t* up_table, const float* ids, int E, int n_slots, int K, int F,
                                   cudaStream_t stream) {
  if (K != like.K)
    throw Error("matmul_experts_gate_up_swiglu: K = " + std::to_string(K) + " against experts of " +
                std::to_string(like.K) + " columns");
  if (!like.quantized() || like.n_segments != 1 || like.segments[0].rows != F) return false;
  return qgemv_experts_swiglu(like.segments[0].type, gate, up, act, x, gate_table, up_table, ids, E, n_slots, F, K,
                              stream);
}

bool matmul_experts_grouped(float*, const float*, const DeviceMatrix<float>&, const uint64_t*, const float*, int, int,
                            int, int, cudaStream_t) {
  return false;
}

bool matmul_experts_grouped(float* out, const __half* x, const DeviceMatrix<__half>& like, const uint64_t* table,
                            const float* ids, int E, int n_slots, int K, int N, cudaStream_t stream) {
  if (K != like.K)
    throw Error("matmul_experts_grouped: K = " + std::to_string(K) + " against experts of " + std::to_string(like.K) +
                " columns");
  if (!like.quantized() || like.n_segments != 1 || like.segments[0].rows != N) return false;
  return qgemv_experts_grouped(like.segments[0].type, out, x, table, ids, E, n_slots, N, K, stream);
}

bool matmul_experts_down_combine(float*, float*, const float*, const DeviceMatrix<float>&, const uint64_t*,
                                 const float*, const float*, int, int, int, int, cudaStream_t) {
  return false;  // the f32 engine gathers
}

bool matmul_experts_down_combine(float* down, float* out, const __half* x, const DeviceMatrix<__half>& like,
                                 const uint64_t* table, const float* ids, const float* weights, int E, int n_slots,
                                 int K, int N, cudaStream_t stream) {
  if (K != like.K)
    throw Error("matmul_experts_down_combine: K = " + std::to_string(K) + " against experts of " +
                std::to_string(like.K) + " columns");
  if (!like.quantized() || like.n_segments != 1 || like.segments[0].rows != N) return false;
  return qgemv_experts_down_combine(like.segments[0].type, down, out, x, table, ids, weights, E, n_slots, N, K,
                                    stream);
}

bool matmul_experts_rows(float*, const float*, int, const int32_t*, const DeviceMatrix<float>&, const uint64_t*,
                         const ExpertRows*, int, int, int, cudaStream_t) {
  return false;  // the f32 engine's GEMVs take one x
}

bool matmul_experts_rows(float* out, const __half* x, int div, const int32_t* rows, const DeviceMatrix<__half>& like,
                         const uint64_t* table, const ExpertRows* groups, int n_groups, int K, int N,
                         cudaStream_t stream) {
  if (K != like.K)
    throw Error("matmul_experts_rows: K = " + std::to_string(K) + " against experts of " + std::to_string(like.K) +
                " columns");
  if (!like.quantized() || like.n_segments != 1 || like.segments[0].rows != N) return false;
  return qgemm_experts(like.segments[0].type, out, x, rows, div, table, groups, n_groups, N, K, stream);
}

bool matmul_argmax(float* out, int32_t* token, const float* x, const DeviceMatrix<float>& w, int K, int N,
                   unsigned long long* scratch, cudaStream_t stream, ArgmaxTies ties) {
  return matmul_argmax_impl(out, token, x, w, K, N, scratch, stream, ties);
}

bool matmul_argmax(float* out, int32_t* token, const __half* x, const DeviceMatrix<__half>& w, int K, int N,
                   unsigned long long* scratch, cudaStream_t stream, ArgmaxTies ties) {
  return matmul_argmax_impl(out, token, x, w, K, N, scratch, stream, ties);
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
