// The paired epilogues of the one-token GEMV kernels (engine/ops/matmul.cu gemv_kernel, gemv_rows_kernel and
// engine/ops/qgemv.cu qgemv_kernel). A paired launch gives each block pairs of rows whose outputs one
// thread then combines: the SwiGLU (gate row i with up row F + i: act[i] = silu_mul) and RoPE (the two
// rows of each rotated pair of Wq|Wk|Wv's heads: rotated q and k, the cache rows of k and v). Every row
// is computed exactly as the plain launch of the same N computes it (same warps per row, same lanes,
// same order), and the epilogue applies the expression of the kernel it replaces (silu_mul, rope_pair
// in launch.cuh), so the outputs are bit-identical to the unfused ops.
#pragma once

#include <cstdint>

#include "engine/ops/launch.cuh"
#include "engine/ops/qgemv.cuh"

namespace diffrun::engine {

enum GemvEpilogue : int {
  kGemvPlain = 0,   // each row to its part's output (+ bias)
  kGemvSwiglu = 1,  // Wgate|Wup (N = 2F, parts gate and up): also act[i] = silu(gate_i)·up_i
  kGemvRope = 2,    // Wq|Wk|Wv (parts q, k, v): q and k rotated, k and v rows to the cache (rope_qk)
};

// Threads of a block: 4 warps, or one row's warps where a row takes more; a paired launch whose rows take several
// warps each holds at least a pair (8 warps for 4 a row, 16 for 8).
__host__ __device__ constexpr int gemv_block_threads(int warps_per_row, int epi) {
  return epi != kGemvPlain && warps_per_row > 1 ? (warps_per_row > 4 ? 64 * warps_per_row : 256)
                                                : (warps_per_row > 4 ? 32 * warps_per_row : 128);
}

// Rows per block of a launch: the block's warps over warps_per_row.
__host__ __device__ constexpr int gemv_block_rows(int warps_per_row, int epi) {
  return gemv_block_threads(warps_per_row, epi) / 32 / warps_per_row;
}

// Blocks of a launch over N rows whose blocks take rows_per_block rows each (a paired launch: N / 2
// pairs, rows_per_block / 2 a block). Every one-token GEMV kernel sizes its grid with it.
__host__ __device__ constexpr int gemv_grid(int rows_per_block, int epi, int N) {
  return epi == kGemvPlain ? (N + rows_per_block - 1) / rows_per_block
                           : (N / 2 + rows_per_block / 2 - 1) / (rows_per_block / 2);
}

// Blocks of a launch of gemv_kernel or qgemv_kernel over N rows.
__host__ __device__ constexpr int gemv_blocks(int warps_per_row, int epi, int N) {
  return gemv_grid(gemv_block_rows(warps_per_row, epi), epi, N);
}

// The row that slot `slot` of block `block` computes (N when none): plain, consecutive rows; paired,
// the first rows of the block's pairs, then their second rows.
template <int kEpi, int kRowsPerBlock>
__device__ __forceinline__ int gemv_slot_row(int block, int slot, int N, const GemvRope& rope, int& pair) {
  if constexpr (kEpi == kGemvPlain) {
    pair = 0;
    return block * kRowsPerBlock + slot;
  } else {
    constexpr int kPairs = kRowsPerBlock / 2;
    pair = block * kPairs + slot % kPairs;
    const bool second = slot >= kPairs;
    if (pair >= N / 2) return N;
    if constexpr (kEpi == kGemvSwiglu) {
      return pair + (second ? N / 2 : 0);
    } else {
      const int half = rope.Dh / 2, head_row = pair / half, i = pair % half;
      const int r0 = head_row * rope.Dh + (rope.neox ? i : 2 * i);
      return second ? (rope.neox ? r0 + half : r0 + 1) : r0;
    }
  }
}

// A row's output as the plain launch writes it: its part's row, + bias.
__device__ __forceinline__ float gemv_row_value(const GemvParts& parts, int row, float acc, float*& out) {
  int p = 0, begin = 0;
  while (row >= parts.end[p]) begin = parts.end[p++];
  const float* bias = parts.bias[p];
  out = parts.out[p] + (row - begin);
  return bias ? acc + bias[row - begin] : acc;
}

// The RoPE epilogue's positions (*pos0, *write_pos), read right after the PDL wait with the block's
// first loads (other epilogues: nothing read).
struct GemvRopeAt {
  int pos = 0, row = 0;
};
template <int kEpi>
__device__ __forceinline__ GemvRopeAt gemv_rope_positions(const GemvRope& rope) {
  GemvRopeAt at;
  if constexpr (kEpi == kGemvRope) {
    at.pos = *rope.pos0;
    at.row = *rope.write_pos;
  }
  return at;
}

// `rope` with the positions read at the kernel's start, for its epilogue.
__device__ __forceinline__ GemvRope gemv_rope_with(const GemvRope& rope, GemvRopeAt at) {
  GemvRope r = rope;
  r.pos = at.pos;
  r.row = at.row;
  return r;
}

// The combined outputs of pair `pair` from its rows' values ya (first row) and yb (second row); `rope`
// from gemv_rope_with.
template <int kEpi, typename A>
__device__ __forceinline__ void gemv_pair_epilogue(const GemvParts& parts, A* act, const GemvRope& rope, int pair,
                                                   float ya, float yb) {
  if constexpr (kEpi == kGemvSwiglu) {
    store_act(act, pair, silu_mul(ya, yb));
  } else if constexpr (kEpi == kGemvRope) {
    const int Dh = rope.Dh, half = Dh / 2, head_row = pair / half, i = pair % half;
    const int ra = head_row * Dh + (rope.neox ? i : 2 * i), rb = rope.neox ? ra + half : ra + 1;
    const int Q = rope.H * Dh, KV = rope.Hkv * Dh;
    if (head_row < rope.H + rope.Hkv) {  // q or k: rotated at position pos0 (the step's one token)
      float* unrotated = head_row < rope.H ? rope.q_unrotated : rope.k_unrotated;  // null in production
      if (unrotated != nullptr) {
        const int base = head_row < rope.H ? 0 : Q;
        unrotated[ra - base] = ya;
        unrotated[rb - base] = yb;
      }
      float y0, y1;
      rope_pair(ya, yb, rope.pos, i, Dh, rope.theta, rope.freq_factors, y0, y1);
      if (head_row < rope.H) {
        parts.out[0][ra] = y0;
        parts.out[0][rb] = y1;
      } else {
        const int64_t row0 = static_cast<int64_t>(rope.row) * KV;
        parts.out[1][ra - Q] = y0;
        parts.out[1][rb - Q] = y1;
        rope.k_cache[row0 + ra - Q] = y0;
        rope.k_cache[row0 + rb - Q] = y1;
      }
    } else {  // v: as computed, and to the cache
      const int64_t row0 = static_cast<int64_t>(rope.row) * KV;
      parts.out[2][ra - Q - KV] = ya;
      parts.out[2][rb - Q - KV] = yb;
      rope.v_cache[row0 + ra - Q - KV] = ya;
      rope.v_cache[row0 + rb - Q - KV] = yb;
    }
  }
}

// The end of both one-token GEMV kernels, for the block's thread with lanes' partial sum `acc`: the
// row's sum (warp_sum, then the row's warps in order), its output (+ bias) and, in a paired launch,
// the pair's epilogue. `row`: the global row of the thread's slot; `valid`: the slot has a row.
template <int kWarpsPerRow, int kEpi, typename A>
__device__ __forceinline__ void gemv_finish(const GemvParts& parts, A* act, const GemvRope& rope, float acc, int pair,
                                            int row, bool valid) {
  constexpr int kRowsPerBlock = gemv_block_rows(kWarpsPerRow, kEpi);
  constexpr int kPairs = kRowsPerBlock / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp / kWarpsPerRow;
  const int sub = (warp % kWarpsPerRow) * 32 + lane;
  acc = warp_sum(acc);
  if constexpr (kWarpsPerRow > 1) {
    __shared__ float partial[gemv_block_threads(kWarpsPerRow, kEpi) / 32];
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    acc = 0.0f;
    for (int i = 0; i < kWarpsPerRow; ++i) acc += partial[warp - warp % kWarpsPerRow + i];
  }
  float y = 0.0f;
  float* out = nullptr;
  if (valid && sub == 0) {
    y = gemv_row_value(parts, row, acc, out);
    if constexpr (kEpi != kGemvRope) *out = y;  // RoPE: its epilogue writes every output
  }
  if constexpr (kEpi != kGemvPlain) {
    __shared__ float value[kRowsPerBlock];
    if (sub == 0) value[slot] = y;
    __syncthreads();
    if (slot < kPairs && sub == 0 && valid)
      gemv_pair_epilogue<kEpi>(parts, act, rope, pair, value[slot], value[slot + kPairs]);
  }
}

}  // namespace diffrun::engine
