// Quantized weights read as GGUF blocks from device memory: the decode GEMV (dequantized in registers,
// f32 accumulation), the rows' dequantization for cuBLAS (steps of several tokens), and the embedding.
//
// Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. Every weight is dequantized to the exact
// f32 value ggml's dequantize_row_* computes (each multiply and add rounded separately, as in
// engine/dequant.cu), then multiplied into an f32 accumulator with the f32 (or f16, widened)
// activation. With f16 activations (the f16 engine) each weight is first rounded to f16, the value
// the expanded matrix and the prefill's dequantized scratch hold: the f16 engine has f16 weights in
// every step, as the precision-matched reference (f32-f16store) emulates. No activation quantization.
// Q4_K, Q5_K and Q6_K with f16 activations run on tensor cores (mma.m16n8k16 on those f16 weights,
// f32 accumulators; compute capability 8.0+, DIFFRUN_QGEMV_MMA=0 turns it off): the same weights and
// products, another summation order. Every launch of a matrix sums each row in the same order, so the
// fused epilogues stay bit-identical to qgemv followed by the unfused op.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "model/gguf.hpp"

namespace diffrun::engine {

constexpr int kGemvMaxParts = 3;

// Where each output row of a GEMV goes: rows [end[p-1], end[p]) of the (concatenated) weight are
// part p, written to out[p] + row - end[p-1], plus bias[p][row - end[p-1]] when bias[p] is set.
struct GemvParts {
  float* out[kGemvMaxParts];
  const float* bias[kGemvMaxParts];
  int end[kGemvMaxParts];
  int n_parts;
};

// A one-token MoE step's selected experts' rows, read where they lie in their stacks (no gather): row r of the
// launch is row r % rows of expert ids[(r / rows) % K] of table[r / (K·rows)] (table: [E] device addresses of
// each expert's rows, the expert views as the fault edits left them; ids: ffn_moe_topk's values, clamped to
// 0..E-1). table[0] null: the launch's own contiguous rows.
struct GemvExpertRows {
  const uint64_t* table[2] = {nullptr, nullptr};
  const float* ids = nullptr;
  int E = 0, K = 0, rows = 0;
};

// The RoPE epilogue of a one-token Wq|Wk|Wv GEMV (matmul_qkv_rope): rope_qk's arguments for T = 1.
struct GemvRope {
  float* k_cache = nullptr;            // [max_ctx, Hkv·Dh] (one layer): row write_pos ← rotated k
  float* v_cache = nullptr;            // [max_ctx, Hkv·Dh]: row write_pos ← v
  const int32_t* pos0 = nullptr;       // [1] device: the token's position
  const int32_t* write_pos = nullptr;  // [1] device: its cache row
  const float* freq_factors = nullptr; // [Dh/2] device or null
  float theta = 0.0f;
  int H = 0, Hkv = 0, Dh = 0;
  bool neox = false;
  // *pos0 and *write_pos as the kernel read them right after its PDL wait (gemv_rope_positions, then
  // gemv_rope_with), so the epilogue does not wait on those loads at its end. Set on the device only.
  int pos = 0, row = 0;
  // Optional outputs, null in production: q and k as the GEMV computed them, before the rotation
  // ([H·Dh] and [Hkv·Dh], the Qcur and Kcur checkpoints of a recorded step). Writing them changes no
  // other output, so a recorded step runs this same launch.
  float* q_unrotated = nullptr;
  float* k_unrotated = nullptr;
};

// Formats with quantized kernels here (a matrix in another format is expanded at load).
bool qgemv_supported(GgmlType t);

// Output rows [row0, row0 + rows) of `parts` (global row numbers) = w · x, where w holds those
// rows as GGUF blocks of type t (rows × K/block_elements blocks, row-major), x [K] on the device
// (16-byte aligned). K must be a multiple of the block size (32 or 256).
void qgemv(GgmlType t, const GemvParts& parts, int row0, int rows, const float* x, const void* w, int K,
           cudaStream_t stream);
void qgemv(GgmlType t, const GemvParts& parts, int row0, int rows, const __half* x, const void* w, int K,
           cudaStream_t stream);

// Fused twin of qgemv over rows 0..2F of Wgate|Wup (one format) then swiglu: gate [F] = rows 0..F-1,
// up [F] = rows F..2F-1, each the value qgemv writes (same launch shape for 2F rows), and
// act [F] = silu(gate)·up as the swiglu kernel writes it (f32, or f16 with f16 activations).
void qgemv_swiglu(GgmlType t, float* gate, float* up, float* act, const float* x, const void* w, int K, int F,
                  cudaStream_t stream);
void qgemv_swiglu(GgmlType t, float* gate, float* up, __half* act, const __half* x, const void* w, int K, int F,
                  cudaStream_t stream);

// qgemv of `rows` rows (one format, t) whose input changes every `group` rows: out[r] = w row r · x row
// (r / group), x [rows / group, K] (f16, 16-byte aligned rows). Each row's value is bit-identical to a qgemv
// over its own group of `group` rows (the same launch shape). One launch for a one-token MoE step's K down
// projections (each slot's expert on its own act row). Returns false, launching nothing, where it has no
// kernel: only Q4_K, Q5_K and Q6_K on the tensor-core path, group a multiple of 16 dividing rows; the caller then
// runs qgemv per group.
bool qgemv_grouped(GgmlType t, float* out, const __half* x, const void* w, int rows, int group, int K,
                   cudaStream_t stream);

// The same launches on a one-token MoE step's selected experts where they lie (GemvExpertRows), so that nothing is
// gathered: qgemv_experts_swiglu is qgemv_swiglu over the n_slots experts' gate rows [n_slots·F] then their up rows
// (gate_table, up_table); qgemv_experts_grouped is qgemv_grouped over the n_slots experts' N rows each (table), slot
// s on x row s. Each value bit-identical to those launches on the experts' rows gathered in that order. False,
// launching nothing, where there is no such kernel (as qgemv_grouped): the caller gathers.
bool qgemv_experts_swiglu(GgmlType t, float* gate, float* up, __half* act, const __half* x,
                          const uint64_t* gate_table, const uint64_t* up_table, const float* ids, int E, int n_slots,
                          int F, int K, cudaStream_t stream);
bool qgemv_experts_grouped(GgmlType t, float* out, const __half* x, const uint64_t* table, const float* ids, int E,
                           int n_slots, int N, int K, cudaStream_t stream);

// qgemv_experts_grouped over the n_slots experts' down projections (N rows each, slot s on x row s) and the slots'
// weighted sum (moe_combine for one token) in one launch: down [n_slots, N] bit-identical to qgemv_experts_grouped's,
// out [N] = the sum over s = 0..n_slots-1, in that order, of weights[s] · down row s, bit-identical to moe_combine's.
// False, launching nothing, where there is no such kernel (as qgemv_experts_grouped, or more than 16 slots).
bool qgemv_experts_down_combine(GgmlType t, float* down, float* out, const __half* x, const uint64_t* table,
                                const float* ids, const float* weights, int E, int n_slots, int N, int K,
                                cudaStream_t stream);

// A step of several tokens' MoE slots grouped by expert: the positions [first, first + count) of the grouped order
// (rows[i]: the slot at position i) are expert `expert`'s, one entry per expert used, built on the host once a layer.
struct alignas(16) ExpertRows {
  int32_t expert;  // its matrix: table[expert]
  int32_t first;   // its first position
  int32_t count;   // its slots, at least 1
  int32_t unused;
};

// out row s [N] = the N rows of its expert's matrix (table: [E] device addresses, format t; N a multiple of 16) · x
// row s / div [K] (f16; div 1: the slot's own row, div K: its token's), for every slot s = rows[i] of every group.
// One launch over (group, 16-row tile) on tensor cores, 32 slots a round: the 8 columns of each mma are 8 slots
// where the one-token GEMV repeats one x, and a warp decodes its weights once for all the group's slots where it has
// one super-block (K <= the GEMV's warps · 256; where at most half the warps would have one, two sets of warps share
// the round's slots). Each value bit-identical to qgemv of its expert's N rows on its row
// alone (the same warps, the same sums). False, launching nothing, where there is no such kernel (as qgemv_grouped):
// the caller runs a matmul per expert.
bool qgemm_experts(GgmlType t, float* out, const __half* x, const int32_t* rows, int div, const uint64_t* table,
                   const ExpertRows* groups, int n_groups, int N, int K, cudaStream_t stream);

// Fused twin of qgemv over Wq|Wk|Wv (one format; qkv: parts q [H·Dh], k and v [Hkv·Dh], with their
// biases or null) for one token then rope_qk: q and k rotated at *rope.pos0, k and v written to cache
// row *rope.write_pos, each value bit-identical to qgemv followed by rope_qk (same launch shape as
// qgemv over the Q + 2·KV rows). Dh even.
void qgemv_rope(GgmlType t, const GemvParts& qkv, const GemvRope& rope, const float* x, const void* w, int K,
                cudaStream_t stream);
void qgemv_rope(GgmlType t, const GemvParts& qkv, const GemvRope& rope, const __half* x, const void* w, int K,
                cudaStream_t stream);

// qgemv_rope over a Wq|Wk|Wv stored in two formats, as Q4_K_M and Q5_K_M files store it: rows
// [0, rows_a) = Wq|Wk in format ta at wa, the Wv rows in format tb at wb; f16 activations, one launch on
// tensor cores, each value bit-identical to qgemv on each segment followed by rope_qk. Returns false,
// launching nothing, where it cannot run: a format pair other than Q4_K|Q5_K, Q4_K|Q6_K, Q5_K|Q6_K, the
// tensor-core kernel off, Dh not a multiple of 16, rows_a not (H + Hkv)·Dh, or segments whose own
// launches would take another number of warps.
bool qgemv_rope2(GgmlType ta, const void* wa, int rows_a, GgmlType tb, const void* wb, const GemvParts& qkv,
                 const GemvRope& rope, const __half* x, int K, cudaStream_t stream);

// dst [rows, K] = the rows' dequantized values, bit-identical to dequantize_device (f16: the exact
// value rounded to nearest even); one thread per 8 values, coalesced stores.
void dequant_rows(GgmlType t, const void* w, int64_t rows, int K, float* dst, cudaStream_t stream);
void dequant_rows(GgmlType t, const void* w, int64_t rows, int K, __half* dst, cudaStream_t stream);

// Embedding gather from a quantized table [V, D]: out[t, :] = row tokens[t] (NaN for an id outside
// [0, V)), each value as the engine of weight type W stores it (f32, or rounded to f16 and widened),
// so the embd checkpoint is the one the expanded table gives.
void embedding_quantized(float* out, const int32_t* tokens, GgmlType t, const void* table, int T, int D, int V,
                         bool round_to_f16, cudaStream_t stream);

}  // namespace diffrun::engine
