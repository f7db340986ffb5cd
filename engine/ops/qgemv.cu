// Quantized GEMV, row dequantization and embedding over GGUF blocks in device memory (see qgemv.cuh).
//
// Each format is split into chunks that one lane decodes: two runs of kRun consecutive elements,
// [a, a+kRun) and [b, b+kRun) within the block (kRun 4 for the 32-element formats, from one 4-byte
// or two 2-byte loads of quants; 16 for the K-quants, from 16-byte loads where the block allows). The decoding is ggml's dequantize_row_* (the layouts are commented in engine/dequant.cu),
// with __fmul_rn/__fadd_rn/__fsub_rn so that no FMA contraction changes a weight's value.
#include "engine/ops/qgemv.cuh"

#include <string>
#include <type_traits>

#include "engine/cuda_check.cuh"
#include "engine/ops/gemv_epilogue.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {



__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
// 4 bytes at a 2-byte aligned address (blocks of 18, 22, 34 or 210 bytes).
__device__ __forceinline__ uint32_t ld_u32_a2(const uint8_t* p) {
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  return uint32_t(q[0]) | (uint32_t(q[1]) << 16);
}
__device__ __forceinline__ float ld_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(ld_u16(p))));
}
// float(q) for 0 <= q < 2^23, exact: the bits of 2^23 + q minus 2^23 (cheaper than an I2F).
__device__ __forceinline__ float u2f(uint32_t q) { return __int_as_float(0x4B000000u | q) - 8388608.0f; }

// Byte k (0..11) of the K-quants' 12 scale bytes, held as three words.
__device__ __forceinline__ uint32_t scale_byte(uint32_t s0, uint32_t s1, uint32_t s2, int k) {
  const uint32_t w = k < 4 ? s0 : (k < 8 ? s1 : s2);
  return (w >> (8 * (k & 3))) & 0xFFu;
}
// ggml's get_scale_min_k4 for sub-block j (0..7).
__device__ __forceinline__ void scale_min_k4(int j, uint32_t s0, uint32_t s1, uint32_t s2, float* sc, float* m) {
  if (j < 4) {
    *sc = u2f(scale_byte(s0, s1, s2, j) & 63);
    *m = u2f(scale_byte(s0, s1, s2, j + 4) & 63);
  } else {
    *sc = u2f((scale_byte(s0, s1, s2, j + 4) & 0xF) | ((scale_byte(s0, s1, s2, j - 4) >> 6) << 4));
    *m = u2f((scale_byte(s0, s1, s2, j + 4) >> 4) | ((scale_byte(s0, s1, s2, j) >> 6) << 4));
  }
}

// ---- formats: kElems and kBytes per block, kChunks of 2·kRun values; chunk(block, c, v, a, b) ----

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18, kChunks = 4, kRun = 4;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const float d = ld_half(p);
    const uint32_t q = ld_u32_a2(p + 2 + 4 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = __fmul_rn(u2f((q >> (8 * i)) & 0xF) - 8.0f, d);
      v[4 + i] = __fmul_rn(u2f((q >> (8 * i + 4)) & 0xF) - 8.0f, d);
    }
    a = 4 * c;
    b = 16 + 4 * c;
  }
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20, kChunks = 4, kRun = 4;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const float d = ld_half(p), m = ld_half(p + 2);
    const uint32_t q = ld_u32(p + 4 + 4 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = __fadd_rn(__fmul_rn(u2f((q >> (8 * i)) & 0xF), d), m);
      v[4 + i] = __fadd_rn(__fmul_rn(u2f((q >> (8 * i + 4)) & 0xF), d), m);
    }
    a = 4 * c;
    b = 16 + 4 * c;
  }
};

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22, kChunks = 4, kRun = 4;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const float d = ld_half(p);
    const uint32_t qh = ld_u32_a2(p + 2);
    const uint32_t q = ld_u32_a2(p + 6 + 4 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * c + i;
      const uint32_t lo = ((q >> (8 * i)) & 0xF) | (((qh >> j) & 1u) << 4);
      const uint32_t hi = ((q >> (8 * i + 4)) & 0xF) | (((qh >> (j + 16)) & 1u) << 4);
      v[i] = __fmul_rn(u2f(lo) - 16.0f, d);
      v[4 + i] = __fmul_rn(u2f(hi) - 16.0f, d);
    }
    a = 4 * c;
    b = 16 + 4 * c;
  }
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24, kChunks = 4, kRun = 4;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const float d = ld_half(p), m = ld_half(p + 2);
    const uint32_t qh = ld_u32(p + 4);
    const uint32_t q = ld_u32(p + 8 + 4 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * c + i;
      const uint32_t lo = ((q >> (8 * i)) & 0xF) | (((qh >> j) & 1u) << 4);
      const uint32_t hi = ((q >> (8 * i + 4)) & 0xF) | (((qh >> (j + 16)) & 1u) << 4);
      v[i] = __fadd_rn(__fmul_rn(u2f(lo), d), m);
      v[4 + i] = __fadd_rn(__fmul_rn(u2f(hi), d), m);
    }
    a = 4 * c;
    b = 16 + 4 * c;
  }
};

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34, kChunks = 4, kRun = 4;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const float d = ld_half(p);
    const uint32_t q0 = ld_u32_a2(p + 2 + 8 * c), q1 = ld_u32_a2(p + 6 + 8 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // int8 s as (s + 128) = its byte with the sign bit flipped
      v[i] = __fmul_rn(u2f(((q0 >> (8 * i)) & 0xFF) ^ 0x80) - 128.0f, d);
      v[4 + i] = __fmul_rn(u2f(((q1 >> (8 * i)) & 0xFF) ^ 0x80) - 128.0f, d);
    }
    a = 8 * c;
    b = 8 * c + 4;
  }
};

// The K-quants decode 32 weights per chunk (two runs of 16), so that a chunk's scale unpacking
// (two 6-bit scale/min pairs, or two int8 scales) is paid once per 32 weights, not per 8.

struct Q4_K {  // d, dmin, scales[12], qs[128]; 4 groups of 64: low nibbles sub-block 2j, high 2j+1
  static constexpr int kElems = 256, kBytes = 144, kChunks = 8, kRun = 16;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const int j = c >> 1, h = c & 1;
    const float d = ld_half(p), dmin = ld_half(p + 2);
    const uint32_t s0 = ld_u32(p + 4), s1 = ld_u32(p + 8), s2 = ld_u32(p + 12);
    float sc, m;
    scale_min_k4(2 * j, s0, s1, s2, &sc, &m);
    const float d1 = __fmul_rn(d, sc), m1 = __fmul_rn(dmin, m);
    scale_min_k4(2 * j + 1, s0, s1, s2, &sc, &m);
    const float d2 = __fmul_rn(d, sc), m2 = __fmul_rn(dmin, m);
    const uint4 q4 = *reinterpret_cast<const uint4*>(p + 16 + 32 * j + 16 * h);  // 144-byte blocks: 16-aligned
    const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t byte = q[i / 4] >> (8 * (i % 4));
      v[i] = __fsub_rn(__fmul_rn(d1, u2f(byte & 0xF)), m1);
      v[16 + i] = __fsub_rn(__fmul_rn(d2, u2f((byte >> 4) & 0xF)), m2);
    }
    a = 64 * j + 16 * h;
    b = a + 32;
  }
};

struct Q5_K {  // d, dmin, scales[12], qh[32], qs[128]; group j's fifth bits are qh bits 2j, 2j+1
  static constexpr int kElems = 256, kBytes = 176, kChunks = 8, kRun = 16;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const int j = c >> 1, h = c & 1;
    const float d = ld_half(p), dmin = ld_half(p + 2);
    const uint32_t s0 = ld_u32(p + 4), s1 = ld_u32(p + 8), s2 = ld_u32(p + 12);
    float sc, m;
    scale_min_k4(2 * j, s0, s1, s2, &sc, &m);
    const float d1 = __fmul_rn(d, sc), m1 = __fmul_rn(dmin, m);
    scale_min_k4(2 * j + 1, s0, s1, s2, &sc, &m);
    const float d2 = __fmul_rn(d, sc), m2 = __fmul_rn(dmin, m);
    const uint4 h4 = *reinterpret_cast<const uint4*>(p + 16 + 16 * h);  // 176-byte blocks: 16-aligned
    const uint4 q4 = *reinterpret_cast<const uint4*>(p + 48 + 32 * j + 16 * h);
    const uint32_t qh[4] = {h4.x, h4.y, h4.z, h4.w}, q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t byte = q[i / 4] >> (8 * (i % 4)), hb = qh[i / 4] >> (8 * (i % 4) + 2 * j);
      v[i] = __fsub_rn(__fmul_rn(d1, u2f((byte & 0xF) + ((hb & 1u) << 4))), m1);
      v[16 + i] = __fsub_rn(__fmul_rn(d2, u2f(((byte >> 4) & 0xF) + ((hb & 2u) << 3))), m2);
    }
    a = 64 * j + 16 * h;
    b = a + 32;
  }
};

struct Q6_K {  // ql[128], qh[64], scales[16] (int8), d; two halves of 128 elements
  static constexpr int kElems = 256, kBytes = 210, kChunks = 8, kRun = 16;
  __device__ static __forceinline__ void chunk(const uint8_t* p, int c, float* v, int& a, int& b) {
    const int n = c >> 2, hi = (c >> 1) & 1, s = c & 1, l0 = 16 * s;
    uint32_t ql[4], qh[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // 210-byte blocks: 2-byte aligned only
      ql[w] = ld_u32_a2(p + 64 * n + 32 * hi + l0 + 4 * w);
      qh[w] = ld_u32_a2(p + 128 + 32 * n + l0 + 4 * w);
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * n;
    const float d = ld_half(p + 208);
    // hi = 0: q1 (ql low nibble, qh bits 0-1, scale s) and q3 (ql high, bits 4-5, scale s+4);
    // hi = 1: q2 (ql[l+32] low, bits 2-3, scale s+2) and q4 (ql[l+32] high, bits 6-7, scale s+6).
    const float da = __fmul_rn(d, static_cast<float>(sc[s + 2 * hi]));
    const float db = __fmul_rn(d, static_cast<float>(sc[s + 4 + 2 * hi]));
    const int sha = 2 * hi, shb = 4 + 2 * hi;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t l = ql[i / 4] >> (8 * (i % 4)), h = qh[i / 4] >> (8 * (i % 4));
      const uint32_t qa = (l & 0xF) | (((h >> sha) & 3u) << 4);
      const uint32_t qb = ((l >> 4) & 0xF) | (((h >> shb) & 3u) << 4);
      v[i] = __fmul_rn(da, u2f(qa) - 32.0f);
      v[16 + i] = __fmul_rn(db, u2f(qb) - 32.0f);
    }
    a = 128 * n + 32 * hi + l0;
    b = a + 64;
  }
};

__device__ __forceinline__ void load4(const float* p, float* o) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  o[0] = f.x;
  o[1] = f.y;
  o[2] = f.z;
  o[3] = f.w;
}

__device__ __forceinline__ void load4(const __half* p, float* o) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  o[0] = f0.x;
  o[1] = f0.y;
  o[2] = f1.x;
  o[3] = f1.y;
}

__device__ __forceinline__ void store4(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void store4(__half* p, const float* v) {
  const __half2 h0 = __floats2half2_rn(v[0], v[1]), h1 = __floats2half2_rn(v[2], v[3]);
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&h0);
  u.y = *reinterpret_cast<const uint32_t*>(&h1);
  *reinterpret_cast<uint2*>(p) = u;
}

// y[row0 + r] = Σ_k w[r, k] · x[k] in f32 (+ bias). kWarpsPerRow warps (1 or 4) share a row; each
// lane takes every (32·kWarpsPerRow)-th chunk of the row, then a warp reduction and, for 4 warps,
// one through shared memory in warp order. With prefetch, the block first asks L2 for its rows
// before the PDL wait (as gemv_kernel in matmul.cu). kEpi: kGemvPlain, or a paired epilogue of
// engine/ops/gemv_epilogue.cuh (row0 0, rows the whole concatenation).
template <typename Q, typename X, int kWarpsPerRow, int kEpi>
static __global__ void __launch_bounds__(gemv_block_threads(kWarpsPerRow, kEpi))
qgemv_kernel(GemvParts parts, int row0, int rows, const X* __restrict__ x, const uint8_t* __restrict__ w, int K,
             bool prefetch, X* __restrict__ act, GemvRope rope) {
  constexpr int kRowsPerBlock = gemv_block_rows(kWarpsPerRow, kEpi);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp / kWarpsPerRow;
  const int sub = (warp % kWarpsPerRow) * 32 + lane;
  const int64_t row_bytes = int64_t(K / Q::kElems) * Q::kBytes;
  int pair;
  const int r = gemv_slot_row<kEpi, kRowsPerBlock>(blockIdx.x, slot, rows, rope, pair);
  if (prefetch) {  // the block's rows, while the preceding kernel runs
    if constexpr (kEpi == kGemvPlain) {
      if (threadIdx.x == 0) {
        const int first = blockIdx.x * kRowsPerBlock;
        prefetch_l2(w + first * row_bytes, size_t(min(kRowsPerBlock, rows - first)) * row_bytes);
      }
    } else if (sub == 0 && r < rows) {
      prefetch_l2(w + r * row_bytes, size_t(row_bytes));
    }
  }
  pdl_wait();
  pdl_trigger();
  const GemvRopeAt at = gemv_rope_positions<kEpi>(rope);
  constexpr int kLanes = 32 * kWarpsPerRow;
  float acc = 0.0f;
  if (r < rows) {
    const int nb = K / Q::kElems;
    const uint8_t* wr = w + int64_t(r) * nb * Q::kBytes;
    const int chunks = nb * Q::kChunks;
    constexpr int kUnroll = Q::kRun == 4 ? 4 : 1;
#pragma unroll kUnroll
    for (int i = sub; i < chunks; i += kLanes) {
      const int blk = i / Q::kChunks, c = i % Q::kChunks;
      float v[2 * Q::kRun], xv[2 * Q::kRun];
      int a, b;
      Q::chunk(wr + blk * Q::kBytes, c, v, a, b);
      if constexpr (std::is_same_v<X, __half>) {  // the f16 engine's weights are f16 (see qgemv.cuh)
#pragma unroll
        for (int k = 0; k < 2 * Q::kRun; ++k) v[k] = __half2float(__float2half_rn(v[k]));
      }
      const X* xb = x + blk * Q::kElems;
#pragma unroll
      for (int k = 0; k < Q::kRun; k += 4) {
        load4(xb + a + k, xv + k);
        load4(xb + b + k, xv + Q::kRun + k);
      }
#pragma unroll
      for (int k = 0; k < 2 * Q::kRun; ++k) acc = fmaf(v[k], xv[k], acc);
    }
  }
  gemv_finish<kWarpsPerRow, kEpi>(parts, act, gemv_rope_with(rope, at), acc, pair, row0 + r, r < rows);
}

// ---- the f16 engine's K-quant GEMV on tensor cores (Q4_K, Q5_K, Q6_K with f16 activations) ----
//
// A block of kWarps warps computes a tile of 16 output rows with mma.m16n8k16 (f16 A and B, f32
// accumulators). Lane (g, t) = (lane / 4, lane % 4) holds the A fragment's rows g and g + 8; for each
// 32-weight sub-block it decodes positions 8t..8t+7 of both rows, each weight the value qgemv_kernel
// computes and rounds to f16. The mma's k-slots are a permutation of those positions: slice s (0, 1)
// of a sub-block gives lane t's slots 2t, 2t+1 the positions 8t+4s, 8t+4s+1 and its slots 2t+8, 2t+9
// the positions 8t+4s+2, 8t+4s+3; B holds x at the same positions in all 8 columns, so every column
// of C is the tile's w·x. Warp w takes super-blocks w, w + kWarps, ...; the warps' sums are added
// in warp order. kWarps is mma_warps(rows, K): 8, or 16 where a matrix has few tiles and long rows
// (the down projection), so that each warp's chain of super-blocks is half as long; the same for
// every launch of a matrix. A row's value depends on its own weights and x only, never on the
// tile's other rows, so the paired epilogues (a pair in rows m and m + 8 of a tile) match the plain
// launch bit for bit.

// Warps of a tensor-core GEMV block for a matrix of `rows` rows of K: 16 for at most 4,096 rows
// (256 tiles, about two an SM) of at least 16 super-blocks, else 8.
constexpr int mma_warps(int rows, int K) { return rows <= 4096 && K / 256 >= 16 ? 16 : 8; }

// The f16x2 bits of (lo, hi), each rounded to nearest even.
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// 2^23 + byte i of v, as a float (the byte in the mantissa of 2^23).
template <int i>
__device__ __forceinline__ float byte_2p23(uint32_t v) {
  return __int_as_float(static_cast<int>(__byte_perm(v, 0x4B000000u, 0x7440u | i)));
}

// 8 bytes at a 2-byte aligned address.
__device__ __forceinline__ uint2 ld_u64_a2(const uint8_t* p) { return make_uint2(ld_u32_a2(p), ld_u32_a2(p + 4)); }

// The f16x2 words of 8 weights d1·q − m1 (Q4_K, Q5_K) whose quants are the bytes of b0 (positions
// 0..3) and b1 (4..7): out[k] holds positions 2k, 2k + 1. d1·q is exact in f32 (d1 has at most 17
// significant bits, q at most 5), so fmaf(d1, q, −m1) is __fsub_rn(__fmul_rn(d1, q), m1).
__device__ __forceinline__ void kquant_min8(uint32_t b0, uint32_t b1, float d1, float m1, uint32_t* out) {
  constexpr float k2p23 = 8388608.0f;
  out[0] = pack_h2(fmaf(d1, byte_2p23<0>(b0) - k2p23, -m1), fmaf(d1, byte_2p23<1>(b0) - k2p23, -m1));
  out[1] = pack_h2(fmaf(d1, byte_2p23<2>(b0) - k2p23, -m1), fmaf(d1, byte_2p23<3>(b0) - k2p23, -m1));
  out[2] = pack_h2(fmaf(d1, byte_2p23<0>(b1) - k2p23, -m1), fmaf(d1, byte_2p23<1>(b1) - k2p23, -m1));
  out[3] = pack_h2(fmaf(d1, byte_2p23<2>(b1) - k2p23, -m1), fmaf(d1, byte_2p23<3>(b1) - k2p23, -m1));
}

// Lane t's 8 weights of each sub-block u of one super-block at p, as f16x2 words w[u][0..3]
// (positions 8t..8t+7 of elements 32u..32u+31).
template <typename Q>
struct MmaLane;

// Q4_K and Q5_K: d, dmin, scales[12], then (Q5_K) qh[32], then qs[128]; group j's bytes 32j + l hold
// sub-block 2j's element l (low nibble) and 2j + 1's (high); Q5_K's fifth bit of sub-block u is bit u
// of qh[l].
template <bool kFifthBit>
struct MmaLaneK4 {
  __device__ static __forceinline__ void decode(const uint8_t* p, int t, uint32_t (&w)[8][4]) {
    const uint4 hd = *reinterpret_cast<const uint4*>(p);  // d, dmin, scales[12]
    const uint2 qh = kFifthBit ? *reinterpret_cast<const uint2*>(p + 16 + 8 * t) : make_uint2(0, 0);
    uint2 qs[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) qs[j] = *reinterpret_cast<const uint2*>(p + (kFifthBit ? 48 : 16) + 32 * j + 8 * t);
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(hd.x & 0xFFFF)));
    const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(hd.x >> 16)));
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      float sc, m;
      scale_min_k4(u, hd.y, hd.z, hd.w, &sc, &m);
      const int sh = 4 * (u & 1);
      const uint32_t b0 = ((qs[u / 2].x >> sh) & 0x0F0F0F0Fu) | (((qh.x >> u) & 0x01010101u) << 4);
      const uint32_t b1 = ((qs[u / 2].y >> sh) & 0x0F0F0F0Fu) | (((qh.y >> u) & 0x01010101u) << 4);
      kquant_min8(b0, b1, __fmul_rn(d, sc), __fmul_rn(dmin, m), w[u]);
    }
  }
};

template <>
struct MmaLane<Q4_K> : MmaLaneK4<false> {};

template <>
struct MmaLane<Q5_K> : MmaLaneK4<true> {};

template <>
struct MmaLane<Q6_K> {  // ql[128], qh[64], scales[16] (int8), d; sub-block u = 4n + k (see Q6_K above)
  __device__ static __forceinline__ void decode(const uint8_t* p, int t, uint32_t (&w)[8][4]) {
    uint2 ql[2][2], qh[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // 210-byte blocks: 2-byte aligned only
      ql[n][0] = ld_u64_a2(p + 64 * n + 8 * t);
      ql[n][1] = ld_u64_a2(p + 64 * n + 32 + 8 * t);
      qh[n] = ld_u64_a2(p + 128 + 32 * n + 8 * t);
    }
    uint32_t scw[8];  // the two scale bytes 8n + 2k, 8n + 2k + 1; lane t uses byte t / 2 (positions 8t.. in one half)
#pragma unroll
    for (int u = 0; u < 8; ++u) scw[u] = ld_u16(p + 192 + 2 * u);
    const float d = ld_half(p + 208);
    constexpr float k2p23_32 = 8388640.0f;  // 2^23 + 32: q − 32 from 2^23 + q
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int n = u / 4, k = u % 4, shl = 4 * (k >> 1), shh = 2 * k;
      const uint2 l = ql[n][k & 1];
      const uint32_t b0 = ((l.x >> shl) & 0x0F0F0F0Fu) | (((qh[n].x >> shh) & 0x03030303u) << 4);
      const uint32_t b1 = ((l.y >> shl) & 0x0F0F0F0Fu) | (((qh[n].y >> shh) & 0x03030303u) << 4);
      const float da =
          __fmul_rn(d, static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(scw[u] >> (8 * (t >> 1))))));
      w[u][0] = pack_h2(__fmul_rn(da, byte_2p23<0>(b0) - k2p23_32), __fmul_rn(da, byte_2p23<1>(b0) - k2p23_32));
      w[u][1] = pack_h2(__fmul_rn(da, byte_2p23<2>(b0) - k2p23_32), __fmul_rn(da, byte_2p23<3>(b0) - k2p23_32));
      w[u][2] = pack_h2(__fmul_rn(da, byte_2p23<0>(b1) - k2p23_32), __fmul_rn(da, byte_2p23<1>(b1) - k2p23_32));
      w[u][3] = pack_h2(__fmul_rn(da, byte_2p23<2>(b1) - k2p23_32), __fmul_rn(da, byte_2p23<3>(b1) - k2p23_32));
    }
  }
};

// c += A·B for one m16n8k16 tile (A row-major f16, B column-major f16, f32 accumulators).
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the host launches this kernel on compute capability 8.0+ only (qgemv_mma_enabled)
#endif
}

// c += the mma products of one sub-block's decoded rows a (g) and b (g + 8) with xv, lane t's 8 x of the sub-block.
__device__ __forceinline__ void mma_sub_block(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[4], uint4 xv) {
  mma_16816(c, a[0], b[0], a[1], b[1], xv.x, xv.y);  // positions 8t + 0..3
  mma_16816(c, a[2], b[2], a[3], b[3], xv.z, xv.w);  // positions 8t + 4..7
}

// c += the mma products of one super-block's decoded rows A (g) and B (g + 8) with x at xs (lane t's positions:
// the super-block's x + 8t).
__device__ __forceinline__ void mma_super_block(float (&c)[4], const uint32_t (&A)[8][4], const uint32_t (&B)[8][4],
                                                const __half* xs) {
#pragma unroll
  for (int u = 0; u < 8; ++u) mma_sub_block(c, A[u], B[u], *reinterpret_cast<const uint4*>(xs + 32 * u));
}

// This warp's share of a tile's sums: c += the mma products of its super-blocks (warp, warp + kWarps,
// ...) of the rows at wa (A rows g) and wb (rows g + 8).
template <typename Q, int kWarps>
__device__ __forceinline__ void mma_tile_sums(const uint8_t* wa, const uint8_t* wb, const __half* x, int K, int warp,
                                              int t, float (&c)[4]) {
  const int nb = K / Q::kElems;
  for (int sb = warp; sb < nb; sb += kWarps) {
    uint32_t A[8][4], B[8][4];
    MmaLane<Q>::decode(wa + int64_t(sb) * Q::kBytes, t, A);
    MmaLane<Q>::decode(wb + int64_t(sb) * Q::kBytes, t, B);
    mma_super_block(c, A, B, x + int64_t(sb) * Q::kElems + 8 * t);
  }
}

// The end of a tile: the warps' sums of each row added in warp order, each row's output (+ bias),
// then the paired epilogue. Column 0 of C: lane (g, 0) holds rows g (c[0]) and g + 8 (c[2]). A block of
// kWarps / kFold warps holds kFold warps' sums in each (c[i]: warp `warp + i·kWarps / kFold`'s).
template <int kEpi, int kWarps, int kFold = 1>
__device__ __forceinline__ void mma_tile_finish(const GemvParts& parts, int row0, int rows, const GemvRope& rope,
                                                __half* act, const float (&c)[kFold][4], int warp, int g, int t) {
  __shared__ float part[kWarps][16];
  __shared__ float value[16];
  if (t == 0) {
#pragma unroll
    for (int i = 0; i < kFold; ++i) {
      part[warp + i * (kWarps / kFold)][g] = c[i][0];
      part[warp + i * (kWarps / kFold)][g + 8] = c[i][2];
    }
  }
  __syncthreads();
  const int m = threadIdx.x;
  int pair = 0, r = rows;
  if (m < 16) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) acc += part[i][m];
    r = gemv_slot_row<kEpi, 16>(blockIdx.x, m, rows, rope, pair);
    float y = 0.0f;
    if (r < rows) {
      float* out = nullptr;
      y = gemv_row_value(parts, row0 + r, acc, out);
      if constexpr (kEpi != kGemvRope) *out = y;  // RoPE: its epilogue writes every output
    }
    value[m] = y;
  }
  if constexpr (kEpi != kGemvPlain) {
    __syncthreads();
    if (m < 8 && r < rows) gemv_pair_epilogue<kEpi>(parts, act, rope, pair, value[m], value[m + 8]);
  }
}

// Where row r's blocks lie: w + r·row_bytes, or with expert rows (ex.table[0] set) row r % ex.rows of the expert
// the launch's slot (r / ex.rows) % ex.K selected, in table (r / (ex.K·ex.rows)). The ids are values (ffn_moe_topk),
// clamped to 0..E-1 as gather_experts clamps them.
__device__ __forceinline__ const uint8_t* gemv_row_blocks(const uint8_t* w, int r, int64_t row_bytes,
                                                          const GemvExpertRows& ex) {
  if (ex.table[0] == nullptr) return w + int64_t(r) * row_bytes;
  const int per_table = ex.K * ex.rows;
  const int i = r / per_table, rr = r - i * per_table, slot = rr / ex.rows;
  const float v = ex.ids[slot];
  const int e = v >= 0.0f ? min(static_cast<int>(v), ex.E - 1) : 0;
  return reinterpret_cast<const uint8_t*>(ex.table[i][e]) + int64_t(rr - slot * ex.rows) * row_bytes;
}

// kFold > 1: a block of kWarps / kFold warps, each taking the super-blocks of kFold of the kWarps warps in turn
// (warp w: those of w, w + kWarps / kFold, ...) with a sum of its own for each, so that every row's sums and their
// order stay those of kWarps warps: fewer threads a tile, so that a launch of many tiles has them all resident at
// once.
template <typename Q, int kEpi, int kWarps, int kFold = 1>
static __global__ void __launch_bounds__(kWarps / kFold * 32)
qgemv_mma_kernel(GemvParts parts, int row0, int rows, const __half* __restrict__ x, const uint8_t* __restrict__ w,
                 int K, bool prefetch, __half* __restrict__ act, GemvRope rope, int x_group, GemvExpertRows ex) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t row_bytes = int64_t(K / Q::kElems) * Q::kBytes;
  int pair_a, pair_b;
  const int ra = gemv_slot_row<kEpi, 16>(blockIdx.x, g, rows, rope, pair_a);
  const int rb = gemv_slot_row<kEpi, 16>(blockIdx.x, g + 8, rows, rope, pair_b);
  if (prefetch && ex.table[0] == nullptr) {  // the tile's rows, while the preceding kernel runs (expert rows: their
                                             // ids are not known before the wait)
    if constexpr (kEpi == kGemvPlain) {
      if (threadIdx.x == 0) {
        const int first = blockIdx.x * 16;
        prefetch_l2(w + first * row_bytes, size_t(min(16, rows - first)) * row_bytes);
      }
    } else if (warp == 0 && t == 0) {
      if (ra < rows) prefetch_l2(w + ra * row_bytes, size_t(row_bytes));
      if (rb < rows) prefetch_l2(w + rb * row_bytes, size_t(row_bytes));
    }
  }
  pdl_wait();
  pdl_trigger();
  const GemvRopeAt at = gemv_rope_positions<kEpi>(rope);
  // A slot without a row (the last tile) computes row 0 again; its value is never written.
  float c[kFold][4] = {};
  // x_group > 0 (plain launches only): the tile's 16 rows read x row (first row / x_group), one group's input.
  const __half* xt = x_group > 0 ? x + int64_t(blockIdx.x * 16 / x_group) * K : x;
  const uint8_t* wa = gemv_row_blocks(w, ra < rows ? ra : 0, row_bytes, ex);
  const uint8_t* wb = gemv_row_blocks(w, rb < rows ? rb : 0, row_bytes, ex);
#pragma unroll
  for (int i = 0; i < kFold; ++i) mma_tile_sums<Q, kWarps>(wa, wb, xt, K, warp + i * (kWarps / kFold), t, c[i]);
  mma_tile_finish<kEpi, kWarps, kFold>(parts, row0, rows, gemv_rope_with(rope, at), act, c, warp, g, t);
}

// A one-token MoE step's n_slots down projections, read where they lie, and their weighted sum
// (qgemv_experts_down_combine): block b computes rows 16b..16b+15 of every slot. Each row is summed as the grouped
// launch's kWarps warps sum it: one sum per warp of super-blocks w, w + kWarps, ..., added in warp order. A slot has
// P warps of the block (slot s: warps sP..sP+P-1): with P = 1 its warp computes the grouped launch's warps in turn;
// with P = min(K / 256, kWarps) (where n_slots · P warps fit a block) warp w computes the grouped launch's warp w
// alone, so that each waits on memory once and not once a super-block (the downs of Qwen3-30B-A3B's experts at K =
// 768: three warps a slot). The grouped launch's warps past the super-blocks add zeros, which change nothing, and are
// left out. The slots' rows are then weighted and added as moe_combine adds them.
constexpr int kDownCombineMaxSlots = 16;
constexpr int kDownCombineMaxWarps = 24;  // 768 threads: 80 registers a thread for the K-quant decode
template <typename Q, int kWarps>
static __global__ void __launch_bounds__(kDownCombineMaxWarps * 32)
qgemv_experts_down_combine_kernel(float* __restrict__ down, float* __restrict__ out, const __half* __restrict__ x,
                                  const uint64_t* __restrict__ table, const float* __restrict__ ids,
                                  const float* __restrict__ weights, int E, int N, int K, int P) {
  __shared__ float part[kDownCombineMaxWarps][16];
  __shared__ float value[kDownCombineMaxSlots][16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int slot = warp / P, n_slots = blockDim.x / 32 / P, row0 = blockIdx.x * 16;
  pdl_wait();
  pdl_trigger();
  const float v = ids[slot];  // clamped as gemv_row_blocks clamps
  const int e = v >= 0.0f ? min(static_cast<int>(v), E - 1) : 0;
  const int64_t row_bytes = int64_t(K / Q::kElems) * Q::kBytes;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(table[e]) + int64_t(row0) * row_bytes;
  const __half* xs = x + int64_t(slot) * K;
  float ya = 0.0f, yb = 0.0f;  // rows g and g + 8: the slot's sums (P = 1), or grouped warp (warp % P)'s
  if (P == 1) {
#pragma unroll
    for (int gw = 0; gw < kWarps; ++gw) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_tile_sums<Q, kWarps>(w + int64_t(g) * row_bytes, w + int64_t(g + 8) * row_bytes, xs, K, gw, t, c);
      ya += c[0];
      yb += c[2];
    }
  } else {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_tile_sums<Q, kWarps>(w + int64_t(g) * row_bytes, w + int64_t(g + 8) * row_bytes, xs, K, warp % P, t, c);
    ya = c[0];
    yb = c[2];
  }
  if (t == 0) {
    part[warp][g] = ya;
    part[warp][g + 8] = yb;
  }
  __syncthreads();
  if (threadIdx.x < n_slots * 16) {  // thread 16s + r: slot s's row r, its warps' sums in warp order
    const int s = threadIdx.x / 16, r = threadIdx.x % 16;
    float y = part[s * P][r];
    if (P > 1) {
      y = 0.0f;
      for (int i = 0; i < P; ++i) y += part[s * P + i][r];
    }
    down[int64_t(s) * N + row0 + r] = value[s][r] = y;
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float o = 0.0f;
    for (int j = 0; j < n_slots; ++j) {
      const float p = __fmul_rn(value[j][threadIdx.x], weights[j]);
      o = j == 0 ? p : __fadd_rn(o, p);
    }
    out[row0 + threadIdx.x] = o;
  }
}

// The rows of one expert (qgemm_experts): block (group, 16-row tile) runs the GEMV's warps and sums on up to
// kQgemmCols of the group's rows a round, in column tiles of 8: column g of tile j holds row 8j + g (the round's last
// row again past its end: computed, never written), so column n of C is that row's GEMV, summed in the same order;
// the warps' sums are added in warp order, as mma_tile_finish adds them. A warp with at most one super-block (K <=
// kWarps · 256) decodes it once for all the group's rows; there, kGroups > 1 sets of nb warps (nb = K / 256) share
// each round's column tiles (tile j to set j % kGroups), each set's warp w holding super-block w. The sums of a
// missing warp (w >= nb) are the GEMV's zeros, which the warp-order sum would add and which change nothing (the sum
// starts at +0, so it is never −0), so they are left out.
constexpr int kQgemmTiles = 4, kQgemmCols = 8 * kQgemmTiles;
// c[i] += the mma products of one super-block's decoded rows A (g) and B (g + 8) with column tile i's x (xr[i]: lane
// t's positions of its column's row, at + 8t onwards), the tiles' x loaded before their mmas, sub-block by sub-block in
// mma_super_block's order.
template <int kMine>
__device__ __forceinline__ void qgemm_tiles(float (&c)[kMine][4], const uint32_t (&A)[8][4], const uint32_t (&B)[8][4],
                                            const __half* const (&xr)[kMine], int64_t at) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    uint4 xv[kMine];
#pragma unroll
    for (int i = 0; i < kMine; ++i) xv[i] = *reinterpret_cast<const uint4*>(xr[i] + at + 32 * u);
#pragma unroll
    for (int i = 0; i < kMine; ++i) mma_sub_block(c[i], A[u], B[u], xv[i]);
  }
}

template <typename Q, int kWarps, int kGroups>
static __global__ void __launch_bounds__(kWarps * 32)
qgemm_experts_kernel(float* __restrict__ out, const __half* __restrict__ x, const int32_t* __restrict__ rows, int div,
                     const uint64_t* __restrict__ table, const ExpertRows* __restrict__ groups, int N, int K) {
  constexpr int kStride = kQgemmCols + 4;  // a row of part, padded against bank conflicts
  constexpr int kMine = kQgemmTiles / kGroups;  // column tiles a warp computes each round
  static_assert(kQgemmTiles % kGroups == 0, "the column tiles split evenly among the warp sets");
  __shared__ float part[kWarps][16][kStride];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  pdl_wait();
  pdl_trigger();
  const int4 gr = *reinterpret_cast<const int4*>(groups + blockIdx.x);  // expert, first, count
  const int row0 = blockIdx.y * 16, nb = K / Q::kElems;
  const int64_t row_bytes = int64_t(nb) * Q::kBytes;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(table[gr.x]) + int64_t(row0) * row_bytes;
  const uint8_t* wa = w + int64_t(g) * row_bytes;
  const uint8_t* wb = w + int64_t(g + 8) * row_bytes;
  const bool once = kGroups > 1 || nb <= kWarps;  // the host picks kGroups > 1 only where nb · kGroups <= kWarps
  // The GEMV warp whose sums this warp makes (its chain of super-blocks), and its set of column tiles.
  const int chain = kGroups > 1 ? warp % nb : warp, set = kGroups > 1 ? warp / nb : 0;
  const int chains = once ? nb : kWarps;
  const bool active = chain < chains && set < kGroups;
  uint32_t A[8][4], B[8][4];
  if (once && active) {
    MmaLane<Q>::decode(wa + int64_t(chain) * Q::kBytes, t, A);
    MmaLane<Q>::decode(wb + int64_t(chain) * Q::kBytes, t, B);
  }
  for (int r0 = 0; r0 < gr.z; r0 += kQgemmCols) {
    const int n = min(kQgemmCols, gr.z - r0);
    if (active) {
      // This warp's column tiles set + kGroups·i; lane (g, t) reads the x row of the tile's column g.
      const __half* xr[kMine];
#pragma unroll
      for (int i = 0; i < kMine; ++i) {
        const int col = min(8 * (set + kGroups * i) + g, n - 1);
        xr[i] = x + int64_t(rows[gr.y + r0 + col] / div) * K + 8 * t;
      }
      float c[kMine][4] = {};
      if (once) {
        qgemm_tiles(c, A, B, xr, int64_t(chain) * Q::kElems);
      } else {
        for (int sb = warp; sb < nb; sb += kWarps) {
          MmaLane<Q>::decode(wa + int64_t(sb) * Q::kBytes, t, A);
          MmaLane<Q>::decode(wb + int64_t(sb) * Q::kBytes, t, B);
          qgemm_tiles(c, A, B, xr, int64_t(sb) * Q::kElems);
        }
      }
#pragma unroll
      for (int i = 0; i < kMine; ++i) {  // C rows g, g + 8; columns 2t, 2t + 1 of the tile
        const int col = 8 * (set + kGroups * i) + 2 * t;
        *reinterpret_cast<float2*>(&part[chain][g][col]) = make_float2(c[i][0], c[i][1]);
        *reinterpret_cast<float2*>(&part[chain][g + 8][col]) = make_float2(c[i][2], c[i][3]);
      }
    }
    __syncthreads();
    for (int m = threadIdx.x; m < 16 * n; m += kWarps * 32) {
      const int r = m % 16, col = m / 16;
      float acc = 0.0f;
      for (int i = 0; i < chains; ++i) acc += part[i][r][col];
      out[int64_t(rows[gr.y + r0 + col]) * N + row0 + r] = acc;
    }
    __syncthreads();
  }
}

// The RoPE launch over Wq|Wk|Wv in two formats: rows [0, rows_a) (Wq|Wk) are QA blocks at wa, the Wv
// rows QB blocks at wb. A tile's 16 rows lie in one head (Dh a multiple of 16), so in one segment: the
// tile runs that segment's decoder, and each row is what its segment's own launch computes.
template <typename QA, typename QB, int kWarps>
static __global__ void __launch_bounds__(kWarps * 32)
qgemv_mma_rope2_kernel(GemvParts parts, int rows, int rows_a, const __half* __restrict__ x,
                       const uint8_t* __restrict__ wa, const uint8_t* __restrict__ wb, int K, bool prefetch,
                       GemvRope rope) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  int pair_a, pair_b;
  const int ra = gemv_slot_row<kGemvRope, 16>(blockIdx.x, g, rows, rope, pair_a);
  const int rb = gemv_slot_row<kGemvRope, 16>(blockIdx.x, g + 8, rows, rope, pair_b);
  const int first = gemv_slot_row<kGemvRope, 16>(blockIdx.x, 0, rows, rope, pair_a);
  const bool in_b = first < rows && first >= rows_a;
  const int64_t bytes = in_b ? int64_t(K / QB::kElems) * QB::kBytes : int64_t(K / QA::kElems) * QA::kBytes;
  const uint8_t* seg = in_b ? wb : wa;
  const int seg_row0 = in_b ? rows_a : 0;
  // Row r's blocks; a slot without a row (the last tile) computes its segment's first row again
  // (never written).
  const auto row_at = [&](int r) { return seg + int64_t((r < rows ? r : seg_row0) - seg_row0) * bytes; };
  if (prefetch && warp == 0 && t == 0) {  // the tile's rows, while the preceding kernel runs
    if (ra < rows) prefetch_l2(row_at(ra), size_t(bytes));
    if (rb < rows) prefetch_l2(row_at(rb), size_t(bytes));
  }
  pdl_wait();
  pdl_trigger();
  const GemvRopeAt at = gemv_rope_positions<kGemvRope>(rope);
  const uint8_t* pa = row_at(ra);
  const uint8_t* pb = row_at(rb);
  float c[1][4] = {};
  if (in_b)
    mma_tile_sums<QB, kWarps>(pa, pb, x, K, warp, t, c[0]);
  else
    mma_tile_sums<QA, kWarps>(pa, pb, x, K, warp, t, c[0]);
  mma_tile_finish<kGemvRope, kWarps>(parts, 0, rows, gemv_rope_with(rope, at), nullptr, c, warp, g, t);
}

template <typename Q>
constexpr bool kHasMmaLane = std::is_same_v<Q, Q4_K> || std::is_same_v<Q, Q5_K> || std::is_same_v<Q, Q6_K>;

template <typename Q, typename Out>
static __global__ void dequant_rows_kernel(const uint8_t* __restrict__ w, int64_t n_chunks, Out* __restrict__ dst) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t blk = i / Q::kChunks;
    const int c = static_cast<int>(i % Q::kChunks);
    float v[2 * Q::kRun];
    int a, b;
    Q::chunk(w + blk * Q::kBytes, c, v, a, b);
    Out* y = dst + blk * Q::kElems;
#pragma unroll
    for (int k = 0; k < Q::kRun; k += 4) {
      store4(y + a + k, v + k);
      store4(y + b + k, v + Q::kRun + k);
    }
  }
}

template <typename Q>
static __global__ void embedding_q_kernel(float* out, const int32_t* tokens, const uint8_t* __restrict__ table, int D,
                                          int V, bool round_to_f16) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int32_t id = tokens[t];
  float* out_row = out + static_cast<int64_t>(t) * D;
  if (id < 0 || id >= V) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) out_row[d] = NAN;
    return;
  }
  const int nb = D / Q::kElems;
  const uint8_t* row = table + static_cast<int64_t>(id) * nb * Q::kBytes;
  for (int i = threadIdx.x; i < nb * Q::kChunks; i += blockDim.x) {
    const int blk = i / Q::kChunks, c = i % Q::kChunks;
    float v[2 * Q::kRun];
    int a, b;
    Q::chunk(row + blk * Q::kBytes, c, v, a, b);
    if (round_to_f16)
      for (int k = 0; k < 2 * Q::kRun; ++k) v[k] = __half2float(__float2half_rn(v[k]));
    float* y = out_row + blk * Q::kElems;
    for (int k = 0; k < Q::kRun; ++k) {
      y[a + k] = v[k];
      y[b + k] = v[Q::kRun + k];
    }
  }
}

// Calls f(Q{}) for the format type t.
template <typename F>
void dispatch(GgmlType t, const char* what, F&& f) {
  switch (t) {
    case GgmlType::Q4_0: f(Q4_0{}); break;
    case GgmlType::Q4_1: f(Q4_1{}); break;
    case GgmlType::Q5_0: f(Q5_0{}); break;
    case GgmlType::Q5_1: f(Q5_1{}); break;
    case GgmlType::Q8_0: f(Q8_0{}); break;
    case GgmlType::Q4_K: f(Q4_K{}); break;
    case GgmlType::Q5_K: f(Q5_K{}); break;
    case GgmlType::Q6_K: f(Q6_K{}); break;
    default: throw Error(std::string(what) + ": no quantized kernel for GGUF type " + ggml_type_name(t));
  }
}

// The alignment the format's loads need from a block (blocks of 144 and 176 bytes are read with
// 16-byte loads, of 20 and 24 bytes with 4-byte loads, the others with 2-byte loads).
uintptr_t block_alignment(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: case GgmlType::Q5_K: return 16;
    case GgmlType::Q4_1: case GgmlType::Q5_1: return 4;
    default: return 2;
  }
}

void check_blocks(GgmlType t, const void* w, const char* what) {
  if (reinterpret_cast<uintptr_t>(w) % block_alignment(t) != 0)
    throw Error(std::string(what) + ": " + ggml_type_name(t) + " blocks must start at a multiple of " +
                std::to_string(block_alignment(t)) + " bytes");
}

void check_k(GgmlType t, int K, const char* what) {
  const int64_t be = ggml_block_elements(t);
  if (K <= 0 || K % be != 0)
    throw Error(std::string(what) + ": K = " + std::to_string(K) + " is not a multiple of the " + ggml_type_name(t) +
                " block size " + std::to_string(be));
}

// Whether a launch over `rows` rows of Q blocks of K columns prefetches them (gemv_prefetch: by the matrix's bytes).
template <typename Q>
bool prefetch_rows(int64_t rows, int K) {
  return gemv_prefetch(uint64_t(rows) * uint64_t(K / Q::kElems) * Q::kBytes);
}

template <typename X, int kEpi>
void qgemv_impl(GgmlType t, const GemvParts& parts, int row0, int rows, const X* x, const void* w, int K,
                cudaStream_t stream, X* act, const GemvRope& rope) {
  check_k(t, K, "qgemv");
  check_blocks(t, w, "qgemv");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw Error("qgemv: the activation vector is not 16-byte aligned");
  if (kEpi != kGemvPlain && (row0 != 0 || rows % 2 != 0))
    throw Error("qgemv: a paired epilogue takes the whole concatenation (row 0, an even row count)");
  if (rows <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  dispatch(t, "qgemv", [&](auto q) {
    using Q = decltype(q);
    if constexpr (std::is_same_v<X, __half> && kHasMmaLane<Q>) {
      if (qgemv_mma_enabled()) {
        const int tiles = gemv_grid(16, kEpi, rows);
        // The warp count follows the launch's rows and K: a paired launch and the plain one over the
        // same matrix agree.
        if (mma_warps(rows, K) == 16)
          launch_pdl(qgemv_mma_kernel<Q, kEpi, 16>, static_cast<unsigned>(tiles), 16 * 32, 0, stream, parts, row0,
                     rows, x, wb, K, prefetch_rows<Q>(rows, K), act, rope, 0,
                     GemvExpertRows{});
        else
          launch_pdl(qgemv_mma_kernel<Q, kEpi, 8>, static_cast<unsigned>(tiles), 8 * 32, 0, stream, parts, row0,
                     rows, x, wb, K, prefetch_rows<Q>(rows, K), act, rope, 0,
                     GemvExpertRows{});
        return;
      }
    }
    const int chunks = K / Q::kElems * Q::kChunks;
    if (rows < 4096 && chunks >= 256) {  // few rows with long K: 4 warps share each row
      launch_pdl(qgemv_kernel<Q, X, 4, kEpi>, static_cast<unsigned>(gemv_blocks(4, kEpi, rows)),
                 gemv_block_threads(4, kEpi), 0, stream, parts, row0, rows, x, wb, K,
                 prefetch_rows<Q>(rows, K), act, rope);
    } else {
      launch_pdl(qgemv_kernel<Q, X, 1, kEpi>, static_cast<unsigned>(gemv_blocks(1, kEpi, rows)),
                 gemv_block_threads(1, kEpi), 0, stream, parts, row0, rows, x, wb, K,
                 prefetch_rows<Q>(rows, K), act, rope);
    }
  });
  check_launch(kEpi == kGemvPlain ? "qgemv" : kEpi == kGemvSwiglu ? "qgemv swiglu" : "qgemv rope", stream);
}

template <typename Out>
void dequant_rows_impl(GgmlType t, const void* w, int64_t rows, int K, Out* dst, cudaStream_t stream) {
  check_k(t, K, "dequant_rows");
  check_blocks(t, w, "dequant_rows");
  if (rows <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  dispatch(t, "dequant_rows", [&](auto q) {
    using Q = decltype(q);
    const int64_t n_chunks = rows * (K / Q::kElems) * Q::kChunks;
    launch_pdl(dequant_rows_kernel<Q, Out>, op_grid(n_chunks), kOpThreads, 0, stream, wb, n_chunks, dst);
  });
  check_launch("dequant_rows", stream);
}

}  // namespace

bool qgemv_rope2(GgmlType ta, const void* wa, int rows_a, GgmlType tb, const void* wb, const GemvParts& qkv,
                 const GemvRope& rope, const __half* x, int K, cudaStream_t stream) {
  const int N = qkv.end[2], rows_b = N - rows_a;
  const bool pair_ok = (ta == GgmlType::Q4_K && (tb == GgmlType::Q5_K || tb == GgmlType::Q6_K)) ||
                       (ta == GgmlType::Q5_K && tb == GgmlType::Q6_K);
  // Each row summed as its own segment's launch sums it: the same warp count for both and the whole.
  const int warps = mma_warps(N, K);
  if (!pair_ok || !qgemv_mma_enabled() || rope.Dh % 16 != 0 || rows_a != (rope.H + rope.Hkv) * rope.Dh ||
      rows_b != rope.Hkv * rope.Dh || mma_warps(rows_a, K) != warps || mma_warps(rows_b, K) != warps)
    return false;
  check_k(ta, K, "qgemv");
  check_blocks(ta, wa, "qgemv");
  check_blocks(tb, wb, "qgemv");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw Error("qgemv: the activation vector is not 16-byte aligned");
  const auto* a = static_cast<const uint8_t*>(wa);
  const auto* b = static_cast<const uint8_t*>(wb);
  const unsigned tiles = static_cast<unsigned>(gemv_grid(16, kGemvRope, N));  // 8 pairs a tile
  const auto launch = [&](auto qa, auto qb) {
    using QA = decltype(qa);
    using QB = decltype(qb);
    // One matrix of two formats: by its whole bytes, as a one-format launch.
    const bool prefetch = gemv_prefetch(uint64_t(rows_a) * (K / QA::kElems) * QA::kBytes +
                                        uint64_t(N - rows_a) * (K / QB::kElems) * QB::kBytes);
    if (warps == 16)
      launch_pdl(qgemv_mma_rope2_kernel<QA, QB, 16>, tiles, 16 * 32, 0, stream, qkv, N, rows_a, x, a, b, K, prefetch,
                 rope);
    else
      launch_pdl(qgemv_mma_rope2_kernel<QA, QB, 8>, tiles, 8 * 32, 0, stream, qkv, N, rows_a, x, a, b, K, prefetch,
                 rope);
  };
  if (ta == GgmlType::Q4_K && tb == GgmlType::Q5_K) launch(Q4_K{}, Q5_K{});
  else if (ta == GgmlType::Q4_K) launch(Q4_K{}, Q6_K{});
  else launch(Q5_K{}, Q6_K{});
  check_launch("qgemv rope (two formats)", stream);
  return true;
}

namespace {

// The plain or SwiGLU tensor-core launch over `rows` rows with x groups and expert rows (qgemv_grouped,
// qgemv_experts_*), the warps of a launch over `like_rows` rows. False where there is no such kernel.
template <int kEpi>
bool mma_launch(GgmlType t, const GemvParts& parts, int rows, int like_rows, const __half* x, int x_group,
                const void* w, const GemvExpertRows& ex, int K, __half* act, cudaStream_t stream, const char* what) {
  if (!qgemv_mma_enabled() || (t != GgmlType::Q4_K && t != GgmlType::Q5_K && t != GgmlType::Q6_K)) return false;
  check_k(t, K, what);
  if (w) check_blocks(t, w, what);
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || (x_group > 0 && (K * sizeof(__half)) % 16 != 0))
    throw Error(std::string(what) + ": the activation rows are not 16-byte aligned");
  if (rows <= 0) return true;
  const auto* wb = static_cast<const uint8_t*>(w);
  const unsigned tiles = static_cast<unsigned>(gemv_grid(16, kEpi, rows));
  const bool wide = mma_warps(like_rows, K) == 16;
  // The in-place experts' gate|up (many tiles, each behind two dependent loads): each warp takes two warps' sums, so
  // that about every tile is resident at once (Qwen3-30B-A3B's shape: 3.02 ms a decode step with 8 warps a tile, 2.88
  // with 4, 2.89 with 2; bench/NOTES.md).
  const bool fold = kEpi == kGemvSwiglu && ex.table[0] != nullptr;
  dispatch(t, what, [&](auto q) {
    using Q = decltype(q);
    if constexpr (kHasMmaLane<Q>) {
      const auto launch = [&](auto kernel, int warps) {
        launch_pdl(kernel, tiles, warps * 32, 0, stream, parts, 0, rows, x, wb, K,
                   prefetch_rows<Q>(rows, K), act, GemvRope{}, x_group, ex);
      };
      if (wide && fold) launch(qgemv_mma_kernel<Q, kEpi, 16, 2>, 8);
      else if (wide) launch(qgemv_mma_kernel<Q, kEpi, 16>, 16);
      else if (fold) launch(qgemv_mma_kernel<Q, kEpi, 8, 2>, 4);
      else launch(qgemv_mma_kernel<Q, kEpi, 8>, 8);
    }
  });
  check_launch(what, stream);
  return true;
}

}  // namespace

bool qgemv_grouped(GgmlType t, float* out, const __half* x, const void* w, int rows, int group, int K,
                   cudaStream_t stream) {
  if (group <= 0 || group % 16 != 0 || rows % group != 0) return false;
  // Each row summed as one group's own launch (qgemv over `group` rows) sums it: that launch's warp count.
  return mma_launch<kGemvPlain>(t, GemvParts{{out}, {nullptr}, {rows}, 1}, rows, group, x, group, w, GemvExpertRows{},
                                K, nullptr, stream, "qgemv_grouped");
}

bool qgemv_experts_swiglu(GgmlType t, float* gate, float* up, __half* act, const __half* x,
                          const uint64_t* gate_table, const uint64_t* up_table, const float* ids, int E, int n_slots,
                          int F, int K, cudaStream_t stream) {
  if (n_slots <= 0 || F <= 0) return false;
  const GemvExpertRows ex{{gate_table, up_table}, ids, E, n_slots, F};
  const int rows = 2 * n_slots * F;
  return mma_launch<kGemvSwiglu>(t, GemvParts{{gate, up}, {nullptr, nullptr}, {n_slots * F, rows}, 2}, rows, rows, x,
                                 0, nullptr, ex, K, act, stream, "qgemv_experts_swiglu");
}

bool qgemv_experts_grouped(GgmlType t, float* out, const __half* x, const uint64_t* table, const float* ids, int E,
                           int n_slots, int N, int K, cudaStream_t stream) {
  if (n_slots <= 0 || N <= 0 || N % 16 != 0) return false;
  const GemvExpertRows ex{{table, nullptr}, ids, E, n_slots, N};
  const int rows = n_slots * N;
  return mma_launch<kGemvPlain>(t, GemvParts{{out}, {nullptr}, {rows}, 1}, rows, N, x, N, nullptr, ex, K, nullptr,
                                stream, "qgemv_experts_grouped");
}

bool qgemm_experts(GgmlType t, float* out, const __half* x, const int32_t* rows, int div, const uint64_t* table,
                   const ExpertRows* groups, int n_groups, int N, int K, cudaStream_t stream) {
  if (!qgemv_mma_enabled() || (t != GgmlType::Q4_K && t != GgmlType::Q5_K && t != GgmlType::Q6_K) || N <= 0 ||
      N % 16 != 0)
    return false;
  check_k(t, K, "qgemm_experts");
  if (div < 1) throw Error("qgemm_experts: div = " + std::to_string(div) + " (at least 1)");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw Error("qgemm_experts: the activation rows are not 16-byte aligned");
  if (n_groups <= 0) return true;
  const dim3 grid(static_cast<unsigned>(n_groups), static_cast<unsigned>(N / 16));
  // The warps of qgemv over one expert's N rows, so that each row is summed as that launch sums it.
  const int warps = mma_warps(N, K);
  // Two sets of warps share the column tiles where the GEMV's warps hold at most one super-block and half of them
  // would hold none (Qwen3-30B-A3B's downs: 3 super-blocks, 8 warps).
  const bool two_sets = K / 256 * 2 <= warps;
  dispatch(t, "qgemm_experts", [&](auto q) {
    using Q = decltype(q);
    if constexpr (kHasMmaLane<Q>) {
      const auto launch = [&](auto kernel) {
        launch_pdl(kernel, grid, warps * 32, 0, stream, out, x, rows, div, table, groups, N, K);
      };
      if (warps == 16 && two_sets) launch(qgemm_experts_kernel<Q, 16, 2>);
      else if (warps == 16) launch(qgemm_experts_kernel<Q, 16, 1>);
      else if (two_sets) launch(qgemm_experts_kernel<Q, 8, 2>);
      else launch(qgemm_experts_kernel<Q, 8, 1>);
    }
  });
  check_launch("qgemm_experts", stream);
  return true;
}

bool qgemv_experts_down_combine(GgmlType t, float* down, float* out, const __half* x, const uint64_t* table,
                                const float* ids, const float* weights, int E, int n_slots, int N, int K,
                                cudaStream_t stream) {
  if (!qgemv_mma_enabled() || (t != GgmlType::Q4_K && t != GgmlType::Q5_K && t != GgmlType::Q6_K) || n_slots <= 0 ||
      n_slots > kDownCombineMaxSlots || N <= 0 || N % 16 != 0)
    return false;
  check_k(t, K, "qgemv_experts_down_combine");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || (K * sizeof(__half)) % 16 != 0)
    throw Error("qgemv_experts_down_combine: the activation rows are not 16-byte aligned");
  const unsigned tiles = static_cast<unsigned>(N / 16);
  // The warps of the grouped launch over one slot's N rows (qgemv_experts_grouped), whose sums each row repeats.
  const bool wide = mma_warps(N, K) == 16;
  dispatch(t, "qgemv_experts_down_combine", [&](auto q) {
    using Q = decltype(q);
    if constexpr (kHasMmaLane<Q>) {
      const int warps = wide ? 16 : 8, chains = std::min(K / Q::kElems, warps);
      const int P = n_slots * chains <= kDownCombineMaxWarps && down_combine_split_enabled() ? chains : 1;
      const unsigned threads = static_cast<unsigned>(n_slots * P * 32);
      if (wide)
        launch_pdl(qgemv_experts_down_combine_kernel<Q, 16>, tiles, threads, 0, stream, down, out, x, table, ids,
                   weights, E, N, K, P);
      else
        launch_pdl(qgemv_experts_down_combine_kernel<Q, 8>, tiles, threads, 0, stream, down, out, x, table, ids,
                   weights, E, N, K, P);
    }
  });
  check_launch("qgemv_experts_down_combine", stream);
  return true;
}

bool qgemv_supported(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q8_0:
    case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

void qgemv(GgmlType t, const GemvParts& parts, int row0, int rows, const float* x, const void* w, int K,
           cudaStream_t stream) {
  qgemv_impl<float, kGemvPlain>(t, parts, row0, rows, x, w, K, stream, nullptr, GemvRope{});
}

void qgemv(GgmlType t, const GemvParts& parts, int row0, int rows, const __half* x, const void* w, int K,
           cudaStream_t stream) {
  qgemv_impl<__half, kGemvPlain>(t, parts, row0, rows, x, w, K, stream, nullptr, GemvRope{});
}

void qgemv_swiglu(GgmlType t, float* gate, float* up, float* act, const float* x, const void* w, int K, int F,
                  cudaStream_t stream) {
  qgemv_impl<float, kGemvSwiglu>(t, GemvParts{{gate, up}, {nullptr, nullptr}, {F, 2 * F}, 2}, 0, 2 * F, x, w, K,
                                 stream, act, GemvRope{});
}

void qgemv_swiglu(GgmlType t, float* gate, float* up, __half* act, const __half* x, const void* w, int K, int F,
                  cudaStream_t stream) {
  qgemv_impl<__half, kGemvSwiglu>(t, GemvParts{{gate, up}, {nullptr, nullptr}, {F, 2 * F}, 2}, 0, 2 * F, x, w, K,
                                  stream, act, GemvRope{});
}

void qgemv_rope(GgmlType t, const GemvParts& qkv, const GemvRope& rope, const float* x, const void* w, int K,
                cudaStream_t stream) {
  qgemv_impl<float, kGemvRope>(t, qkv, 0, qkv.end[2], x, w, K, stream, nullptr, rope);
}

void qgemv_rope(GgmlType t, const GemvParts& qkv, const GemvRope& rope, const __half* x, const void* w, int K,
                cudaStream_t stream) {
  qgemv_impl<__half, kGemvRope>(t, qkv, 0, qkv.end[2], x, w, K, stream, nullptr, rope);
}

void dequant_rows(GgmlType t, const void* w, int64_t rows, int K, float* dst, cudaStream_t stream) {
  dequant_rows_impl(t, w, rows, K, dst, stream);
}

void dequant_rows(GgmlType t, const void* w, int64_t rows, int K, __half* dst, cudaStream_t stream) {
  dequant_rows_impl(t, w, rows, K, dst, stream);
}

void embedding_quantized(float* out, const int32_t* tokens, GgmlType t, const void* table, int T, int D, int V,
                         bool round_to_f16, cudaStream_t stream) {
  check_k(t, D, "embedding");
  check_blocks(t, table, "embedding");
  const auto* tb = static_cast<const uint8_t*>(table);
  dispatch(t, "embedding", [&](auto q) {
    using Q = decltype(q);
    launch_pdl(embedding_q_kernel<Q>, T, kOpThreads, 0, stream, out, tokens, tb, D, V, round_to_f16);
  });
  check_launch("embedding", stream);
}

}  // namespace diffrun::engine
