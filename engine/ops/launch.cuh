// Shared launch helpers for the op kernels: grid sizes, warp reductions, Programmatic Dependent Launch.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/cuda_check.cuh"

namespace diffrun::engine {

constexpr int kOpThreads = 256;

// Blocks for a grid-stride loop over n elements (capped; the kernels loop).
inline unsigned op_grid(int64_t n) {
  const int64_t blocks = (n + kOpThreads - 1) / kOpThreads;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum of v over a block of kOpThreads threads: each warp's warp_sum, then the warps' sums in warp
// order (every thread gets the same bits). The order rms_norm and add_rms_norm share.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kOpThreads / 32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kOpThreads / 32; ++i) total += partial[i];
  return total;
}

// An RMSNorm's scale from its row's sum of squares over D elements: 1 / sqrt(mean + eps), the expression rms_norm,
// add_rms_norm, embedding_rms_norm and qk_norm_rope share (so that their norms have the same bits).
__device__ __forceinline__ float rms_scale(float sum_squares, int D, float eps) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(D) + eps);
}

// One warp's RMSNorm of a row held kPer values a lane (element lane + 32 j in x[j]): the squares' warp sums in j order,
// rms_scale, then x · scale · w. qk_norm_rope and attention_split_qk_norm_rope both norm a head's q and k by it, so
// their Qnorm and Knorm have the same bits.
template <int kPer>
__device__ __forceinline__ void warp_rms_norm_row(const float (&x)[kPer], const float (&w)[kPer], int D, float eps,
                                                  float (&y)[kPer]) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) ss += warp_sum(x[j] * x[j]);
  const float scale = rms_scale(ss, D, eps);
#pragma unroll
  for (int j = 0; j < kPer; ++j) y[j] = x[j] * scale * w[j];
}

// Row elements per thread that rms_norm, add_rms_norm and embedding_rms_norm keep in registers: the fewest of 8,
// 16 and 32 that hold the row at 256 threads (D up to 2048, 4096 and 8192); 0 for a wider row, which they read from
// memory. A thread's elements are d = threadIdx.x + i·kOpThreads in every case, summed in that order, so the count
// never changes a value: it only keeps a 4096-wide row (7B) out of the memory loop, whose stores (the sum may
// alias its inputs) serialize its loads (an add_rms_norm of one 4096-wide row took 14.7 us there on the H200).
constexpr int kNormRegs = 8;
constexpr int kNormRegsMax = 32;
constexpr int norm_regs(int D) {
  return D <= 8 * kOpThreads ? 8 : D <= 16 * kOpThreads ? 16 : D <= kNormRegsMax * kOpThreads ? kNormRegsMax : 0;
}

// Calls launch_with(std::integral_constant<int, kRegs>) with kRegs = norm_regs(D), or kNormRegs for a row wider than
// registers hold (the kernels' memory path): the launchers instantiate their kernel for it.
template <typename Launch>
void norm_dispatch(int D, Launch&& launch_with) {
  switch (norm_regs(D)) {
    case 16: launch_with(std::integral_constant<int, 16>{}); break;
    case kNormRegsMax: launch_with(std::integral_constant<int, kNormRegsMax>{}); break;
    default: launch_with(std::integral_constant<int, kNormRegs>{}); break;
  }
}

// This thread's part of a row's sum of squares from its elements in registers (v[i] is element
// threadIdx.x + i·kOpThreads), in the order rms_norm, add_rms_norm and embedding_rms_norm share (so
// their norms have the same bits); kStore: each element is also stored to row_out (the residual sum,
// the gathered embedding row) in the same branch, as the kernels did before this was shared (with a
// run-time choice the compiler split the loop, and the 0.5B decode step took 0.01 ms longer on the H100).
template <bool kStore = false, int kRegs>
__device__ __forceinline__ float norm_sum_squares(const float (&v)[kRegs], int D, float* row_out = nullptr) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const int d = threadIdx.x + i * kOpThreads;
    if (d < D) {
      if constexpr (kStore) row_out[d] = v[i];
      ss += v[i] * v[i];
    }
  }
  return ss;
}

// Programmatic Dependent Launch (sm_90+): a kernel launched by launch_pdl may start while the
// kernel before it in the stream (or graph) finishes. Such a kernel calls pdl_wait() before its
// first global read or write (it returns once the preceding grid has completed and its memory is
// visible), then pdl_trigger() to let the next kernel be scheduled. No-ops before sm_90, and when
// the kernel was not launched with the attribute.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Starts bringing the bytes [p, p + n) into L2 (sm_90+: one bulk prefetch of the 16-byte granules
// inside the range; a hint, nothing before sm_90). L2 is coherent for the whole device, so this is
// correct on any memory; a kernel calls it before pdl_wait() for data the preceding kernel does not
// write (weights), so their fetch overlaps that kernel.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~uintptr_t(15);
  if (end > begin)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(begin), "r"(static_cast<uint32_t>(end - begin))
                 : "memory");
#endif
}

// Launches a kernel that calls pdl_wait() first thing, with programmatic stream serialization
// allowed unless pdl_enabled() is false (a plain launch then).
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// SwiGLU of one element, silu(g)·u = g / (1 + exp(−g)) · u in f32: the swiglu kernel's value and the
// one the gate|up GEMV's SwiGLU epilogue writes (the same expression, so the same bits).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// RoPE of one pair (x0, x1) at position pos, pair index i of a head of Dh: the angle pos·θ^(−2i/Dh)
// (divided by freq_factors[i] when given) and the rotation in f32; rope_qk's arithmetic and the
// qkv GEMV's RoPE epilogue's (the same expression, so the same bits).
__device__ __forceinline__ void rope_pair(float x0, float x1, int pos, int i, int Dh, float theta,
                                          const float* freq_factors, float& y0, float& y1) {
  const float inv_freq = powf(theta, -2.0f * static_cast<float>(i) / static_cast<float>(Dh));
  const float angle = freq_factors ? static_cast<float>(pos) * inv_freq / freq_factors[i]
                                   : static_cast<float>(pos) * inv_freq;
  float s, c;
  sincosf(angle, &s, &c);
  y0 = x0 * c - x1 * s;
  y1 = x0 * s + x1 * c;
}

__device__ __forceinline__ void store_act(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_act(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ float load_act(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_act(const __half* p, int64_t i) { return __half2float(p[i]); }

// A norm's weights for this thread's elements d = threadIdx.x + i·kOpThreads, held in registers when
// the row fits (in_regs); constant, so loaded before pdl_wait (the preceding kernel hides them).
template <int kRegs>
__device__ __forceinline__ void norm_load_weights(float (&wv)[kRegs], const float* w, int D, bool in_regs) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const int d = threadIdx.x + i * kOpThreads;
    wv[i] = in_regs && d < D ? w[d] : 0.0f;
  }
}

// A norm's output row: x·scale·w, from the registers (v, wv) when the row fits, else from memory.
template <typename Out, int kRegs>
__device__ __forceinline__ void norm_store(Out* out_row, const float (&v)[kRegs], const float* x_row,
                                           const float (&wv)[kRegs], const float* w, int D, float scale,
                                           bool in_regs) {
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int d = threadIdx.x + i * kOpThreads;
      if (d < D) store_act(out_row, d, v[i] * scale * wv[i]);
    }
  } else {
    for (int d = threadIdx.x; d < D; d += kOpThreads) store_act(out_row, d, x_row[d] * scale * w[d]);
  }
}

}  // namespace diffrun::engine
