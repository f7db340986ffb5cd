// attention_tiled: the prefill attention, one block per (head, tile of 32 queries) with 64-key K/V tiles in shared memory.
// Each of the 128 threads owns 4 queries × 4 keys of a tile's scores (register tiling over Dh) and 4 queries ×
// Dh/16 output columns. Online softmax in f32: per tile the row max is taken over the 16 threads of a row,
// the running output and exp-sum are rescaled by exp(m_old − m_new), and p = exp(score − m_new) goes through
// shared memory into P·V. The keys a block reads are the union of its queries' causal (and windowed) ranges;
// each score is masked per (query, key) as in attention. Blocks run heaviest first (last query tile first).
#include <atomic>
#include "engine/ops/attention.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kBQ = 32;              // queries per block
constexpr int kBK = 64;              // keys per tile
constexpr int kThreads = 128;        // 8 rows of 16 threads: row ty holds queries 4·ty..4·ty+3
constexpr int kQStride = kBQ + 4;    // Qt[d][i]: transposed, padded
constexpr int kKStride = kBK + 4;    // Kt[d][j]: transposed, padded
constexpr int kPStride = kBK + 4;    // P[i][j]

// Shared floats of a block for head width DH (the K tile and the V tile share one buffer).
template <int DH>
constexpr size_t smem_floats() {
  return size_t(DH) * kQStride + (size_t(DH) * kKStride > size_t(kBK) * DH ? size_t(DH) * kKStride : size_t(kBK) * DH) +
         size_t(kBQ) * kPStride;
}

// A K or V tile as float4 loads (Dh a multiple of 4, so every row and column group is 16-byte aligned and a
// group is wholly inside or outside [0, Dh)): float4 number f = threadIdx.x + r·kThreads of the tile is key
// j = f / (DH/4), columns 4·(f % (DH/4)) .. + 3. A thread holds kTileVec<DH> of them; they are loaded in
// batches of at most kTileBatch, each batch's loads all in flight before the first is stored.
template <int DH>
constexpr int kTileVec = kBK * DH / 4 / kThreads;
constexpr int kTileBatch = 8;

// Calls f(u, j, d) for each float4 u of batch `batch` that this thread holds: key j of the tile, columns
// d .. d + 3.
template <int DH, typename F>
__device__ __forceinline__ void for_tile_groups(int batch, F&& f) {
#pragma unroll
  for (int u = 0; u < kTileBatch; ++u) {
    const int i = batch * kTileBatch + u;
    if (i >= kTileVec<DH>) break;
    const int g = threadIdx.x + i * kThreads;
    f(u, g / (DH / 4), 4 * (g % (DH / 4)));
  }
}

// Batch `batch` of a tile's float4s into registers: rows kb + j of `base` (one head's column 0, rows kv_stride
// floats apart), zeros past key_end or Dh.
template <int DH>
__device__ __forceinline__ void tile_load(float4 (&r)[kTileBatch], const float* base, int batch, int kb, int key_end,
                                          int Dh, int64_t kv_stride) {
  for_tile_groups<DH>(batch, [&](int u, int j, int d) {
    const int s = kb + j;
    r[u] = s < key_end && d < Dh ? *reinterpret_cast<const float4*>(base + s * kv_stride + d)
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  });
}

// The batch's K float4s into Kt [DH][kKStride] (transposed).
template <int DH>
__device__ __forceinline__ void tile_store_k(float* Kt, const float4 (&r)[kTileBatch], int batch) {
  for_tile_groups<DH>(batch, [&](int u, int j, int d) {
    Kt[(d + 0) * kKStride + j] = r[u].x;
    Kt[(d + 1) * kKStride + j] = r[u].y;
    Kt[(d + 2) * kKStride + j] = r[u].z;
    Kt[(d + 3) * kKStride + j] = r[u].w;
  });
}

// The batch's V float4s into V [kBK][DH].
template <int DH>
__device__ __forceinline__ void tile_store_v(float* V, const float4 (&r)[kTileBatch], int batch) {
  for_tile_groups<DH>(batch, [&](int u, int j, int d) { *reinterpret_cast<float4*>(V + j * DH + d) = r[u]; });
}

template <int DH, typename Out>
static __global__ void __launch_bounds__(kThreads)
attention_tiled_kernel(Out* out, const float* q, const float* k_cache, const float* v_cache, int T,
                       const int32_t* n_past_ptr, int H, int Hkv, int Dh, float scale, int window,
                       AttentionVariant v) {
  constexpr int kCols = DH / 16;  // output columns per thread: 4 at tx·4 in each 64-wide chunk
  extern __shared__ float4 smem4[];
  float* Qt = reinterpret_cast<float*>(smem4);  // [DH][kQStride]
  float* KV = Qt + DH * kQStride;               // Kt [DH][kKStride], then V [kBK][DH]
  float* P = KV + (DH * kKStride > kBK * DH ? DH * kKStride : kBK * DH);  // [kBQ][kPStride]

  pdl_wait();
  pdl_trigger();
  const int tile = gridDim.x - 1 - blockIdx.x;  // heaviest (latest queries) first
  const int h = blockIdx.y;
  const int kvh = h / (H / Hkv);
  const int tid = threadIdx.x;
  const int ty = tid / 16, tx = tid % 16;
  const int n_past = *n_past_ptr;
  const int t0 = tile * kBQ;
  const int t_last = min(t0 + kBQ, T) - 1;
  const int64_t q_stride = static_cast<int64_t>(H) * Dh;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
  const float* kh = k_cache + static_cast<int64_t>(kvh) * Dh;
  const float* vh = v_cache + static_cast<int64_t>(kvh) * Dh;

  // The block's keys: from the first query's window start to the last query's position (not causal: all S).
  const int key_end = v.causal ? n_past + t_last + 1 : n_past + T;
  const int key_begin = v.causal && window > 0 ? max(0, n_past + t0 + 1 - window) : 0;

  for (int idx = tid; idx < kBQ * DH; idx += kThreads) {  // consecutive threads: consecutive d of one query
    const int i = idx / DH, d = idx % DH;
    const int t = t0 + i;
    Qt[d * kQStride + i] = t < T && d < Dh ? q[t * q_stride + static_cast<int64_t>(h) * Dh + d] : 0.0f;
  }

  float acc[4][kCols];
  float m[4], l[4];  // running max and this thread's part of the exp-sum, per query
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    m[a] = -INFINITY;
    l[a] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[a][c] = 0.0f;
  }

  // Dh a multiple of 4 and both caches 16-byte aligned (so is every row then): the tiles move as float4s
  // with every load of a batch in flight, and where a tile is one batch (DH 64) the V tile's loads are
  // issued before the scores, so their latency hides behind them. Else one scalar load and store at a
  // time. Either way the shared tiles hold the same values.
  const bool vec = Dh % 4 == 0 && reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(v_cache) % 16 == 0;
  constexpr bool kEarlyV = kTileVec<DH> <= kTileBatch;
  float4 vr[kTileBatch];
  for (int kb = key_begin; kb < key_end; kb += kBK) {
    __syncthreads();  // the previous tile's P·V is done with V and P (and Qt is written, first time)
    if (vec) {
#pragma unroll 1
      for (int b = 0; b * kTileBatch < kTileVec<DH>; ++b) {
        float4 kr[kTileBatch];
        tile_load<DH>(kr, kh, b, kb, key_end, Dh, kv_stride);
        tile_store_k<DH>(KV, kr, b);
      }
      if constexpr (kEarlyV) tile_load<DH>(vr, vh, 0, kb, key_end, Dh, kv_stride);
    } else {
      for (int idx = tid; idx < kBK * DH; idx += kThreads) {
        const int j = idx / DH, d = idx % DH;
        const int s = kb + j;
        KV[d * kKStride + j] = s < key_end && d < Dh ? kh[s * kv_stride + d] : 0.0f;
      }
    }
    __syncthreads();

    float sc[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) sc[a][b] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < DH; ++d) {
      const float4 qv = *reinterpret_cast<const float4*>(Qt + d * kQStride + 4 * ty);
      const float4 kv = *reinterpret_cast<const float4*>(KV + d * kKStride + 4 * tx);
      const float qa[4] = {qv.x, qv.y, qv.z, qv.w}, kb4[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) sc[a][b] += qa[a] * kb4[b];
    }

    float p[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int pos = n_past + t0 + 4 * ty + a;  // the query's position
      const bool row_valid = t0 + 4 * ty + a < T;
      float mt = -INFINITY;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int s = kb + 4 * tx + b;
        const bool valid = row_valid && s < key_end && (!v.causal || (s <= pos && (window <= 0 || s > pos - window)));
        sc[a][b] = valid ? (v.f16_exp ? sc[a][b] : sc[a][b] * scale) : -INFINITY;
        mt = fmaxf(mt, sc[a][b]);
      }
      for (int o = 8; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));  // the row's 16 threads
      const float m_new = fmaxf(m[a], mt);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: everything stays 0
      // f16_exp: f16(exp(q·k))^scale with no max (as attention's weights), so nothing is rescaled.
      const float alpha = v.f16_exp ? 1.0f : expf(m[a] - m_use);
      m[a] = m_new;
      float ps = 0.0f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        p[a][b] = v.f16_exp ? powf(__half2float(__float2half_rn(expf(sc[a][b]))), scale) : expf(sc[a][b] - m_use);
        ps += p[a][b];
      }
      l[a] = l[a] * alpha + ps;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[a][c] *= alpha;
    }
    __syncthreads();  // every thread is done reading the K tile
#pragma unroll
    for (int a = 0; a < 4; ++a)
      *reinterpret_cast<float4*>(P + (4 * ty + a) * kPStride + 4 * tx) = make_float4(p[a][0], p[a][1], p[a][2], p[a][3]);
    if (vec) {
      if constexpr (kEarlyV) {
        tile_store_v<DH>(KV, vr, 0);
      } else {
#pragma unroll 1
        for (int b = 0; b * kTileBatch < kTileVec<DH>; ++b) {
          tile_load<DH>(vr, vh, b, kb, key_end, Dh, kv_stride);
          tile_store_v<DH>(KV, vr, b);
        }
      }
    } else {
      for (int idx = tid; idx < kBK * DH; idx += kThreads) {
        const int j = idx / DH, d = idx % DH;
        const int s = kb + j;
        KV[j * DH + d] = s < key_end && d < Dh ? vh[s * kv_stride + d] : 0.0f;
      }
    }
    __syncthreads();

#pragma unroll 2
    for (int j = 0; j < kBK; j += 4) {
      float pa[4][4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const float4 pv = *reinterpret_cast<const float4*>(P + (4 * ty + a) * kPStride + j);
        pa[a][0] = pv.x, pa[a][1] = pv.y, pa[a][2] = pv.z, pa[a][3] = pv.w;
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int c4 = 0; c4 < kCols / 4; ++c4) {
          const float4 vv = *reinterpret_cast<const float4*>(KV + (j + jj) * DH + 64 * c4 + 4 * tx);
#pragma unroll
          for (int a = 0; a < 4; ++a) {
            acc[a][4 * c4 + 0] += pa[a][jj] * vv.x;
            acc[a][4 * c4 + 1] += pa[a][jj] * vv.y;
            acc[a][4 * c4 + 2] += pa[a][jj] * vv.z;
            acc[a][4 * c4 + 3] += pa[a][jj] * vv.w;
          }
        }
    }
  }

#pragma unroll
  for (int a = 0; a < 4; ++a) {
    float total = l[a];
    for (int o = 8; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const int t = t0 + 4 * ty + a;
    if (t >= T) continue;
    Out* orow = out + t * q_stride + static_cast<int64_t>(h) * Dh;
#pragma unroll
    for (int c4 = 0; c4 < kCols / 4; ++c4)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = 64 * c4 + 4 * tx + e;
        if (d < Dh) store_act(orow, d, acc[a][4 * c4 + e] / total);
      }
  }
}

template <int DH, typename Out>
void launch_dh(Out* out, const float* q, const float* k_cache, const float* v_cache, int T, const int32_t* n_past,
               int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream, AttentionVariant v) {
  const size_t smem = smem_floats<DH>() * sizeof(float);
  // Above 48 KiB a kernel must opt in, once per instantiation and device (a tensor-parallel engine's ranks each
  // launch it on their own).
  static std::atomic<uint64_t> set_on_devices{0};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(set_on_devices.load() & bit)) {
    CUDA_CHECK(cudaFuncSetAttribute(attention_tiled_kernel<DH, Out>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    set_on_devices.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>((T + kBQ - 1) / kBQ), static_cast<unsigned>(H));
  launch_pdl(attention_tiled_kernel<DH, Out>, grid, kThreads, smem, stream, out, q, k_cache, v_cache, T, n_past, H,
             Hkv, Dh, scale, window, v);
}

template <typename Out>
void launch(Out* out, const float* q, const float* k_cache, const float* v_cache, int T, const int32_t* n_past, int H,
            int Hkv, int Dh, float scale, int window, cudaStream_t stream, AttentionVariant v) {
  if (Dh > 256 || Dh <= 0)
    throw ModelError("attention_tiled: head dim " + std::to_string(Dh) + " is not supported (at most 256)");
  if (Hkv <= 0 || H % Hkv != 0)
    throw ModelError("attention_tiled: n_head " + std::to_string(H) + " is not a multiple of n_head_kv " +
                     std::to_string(Hkv));
  if (T < 1) throw Error("attention_tiled: " + std::to_string(T) + " tokens");
  if (Dh <= 64)
    launch_dh<64>(out, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, v);
  else if (Dh <= 128)
    launch_dh<128>(out, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, v);
  else
    launch_dh<256>(out, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, v);
  check_launch("attention_tiled", stream);
}

}  // namespace

void attention_tiled(float* out, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
                     AttentionVariant variant) {
  launch(out, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, variant);
}

void attention_tiled(__half* out, const float* q, const float* k_cache, const float* v_cache, int T,
                     const int32_t* n_past, int H, int Hkv, int Dh, float scale, int window, cudaStream_t stream,
                     AttentionVariant variant) {
  launch(out, q, k_cache, v_cache, T, n_past, H, Hkv, Dh, scale, window, stream, variant);
}

}  // namespace diffrun::engine
