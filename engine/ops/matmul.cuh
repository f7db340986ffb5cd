// Linear layer (T, K, N): out = x · wᵀ (+ bias), w a GGUF weight with ne = [K, N]. One token (decode):
// our GEMV kernel (weights read once in 16-byte loads, f32 accumulation, bias in the epilogue);
// several tokens: the cuBLAS GEMM of engine/gemm, then the bias kernel. A quantized DeviceMatrix:
// one token runs the quantized GEMV (engine/ops/qgemv.cuh) on its blocks; several tokens dequantize
// its rows into the shared scratch (the same values the expanded matrix holds), then the dense path.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/device_matrix.cuh"
#include "engine/gemm.cuh"
#include "engine/ops/qgemv.cuh"
#include "model/op_variants.hpp"

namespace diffrun::engine {

// out [T, N] f32; x [T, K]; w [N, K] (same type as x); bias [N] f32 or nullptr (qwen2 q/k/v).
void matmul(float* out, const float* x, const float* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream);
void matmul(float* out, const __half* x, const __half* w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream);

// The same on a DeviceMatrix (its first N rows): dense, or quantized as above.
void matmul(float* out, const float* x, const DeviceMatrix<float>& w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream);
void matmul(float* out, const __half* x, const DeviceMatrix<__half>& w, const float* bias, int T, int K, int N,
            const CublasHandle& cublas, cudaStream_t stream);

// The first `rows` rows of w as dense W [rows, K]: w.dense, or dequantized into w.scratch on
// `stream` (valid until the next dequantization into the scratch). For the faults that read a
// matrix through cuBLAS with a wrong layout or as a table.
const float* dense_rows(const DeviceMatrix<float>& w, int rows, cudaStream_t stream);
const __half* dense_rows(const DeviceMatrix<__half>& w, int rows, cudaStream_t stream);

// One part of a concatenated linear layer: out [T, N] f32, bias [N] f32 or nullptr.
struct MatmulPart {
  float* out;
  const float* bias;
  int N;
};

// Fused twin of one ref::matmul per part over the same x: w is the parts' weights stored as
// consecutive rows, one [ΣN, K] matrix (Wq|Wk|Wv, or Wgate|Wup). One token: one GEMV launch over
// all ΣN rows, each part's rows written to its own output (so every checkpoint stays a whole
// tensor); several tokens: one matmul per part on its rows of w. At most 3 parts.
void matmul_cat(std::initializer_list<MatmulPart> parts, const float* x, const float* w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream);
void matmul_cat(std::initializer_list<MatmulPart> parts, const __half* x, const __half* w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream);
// The same on a DeviceMatrix covering the parts' rows (a quantized one: one GEMV launch per segment).
void matmul_cat(std::initializer_list<MatmulPart> parts, const float* x, const DeviceMatrix<float>& w, int T, int K,
                const CublasHandle& cublas, cudaStream_t stream);
void matmul_cat(std::initializer_list<MatmulPart> parts, const __half* x, const DeviceMatrix<__half>& w, int T,
                int K, const CublasHandle& cublas, cudaStream_t stream);

// G one-token matmuls in one launch, each on its own x row and its own rows of w: out row g [N] = the rows
// [g·N, (g+1)·N) of w · x row g [K] (w [G·N, K]: a one-token MoE step's K selected experts' down projections,
// gathered one after another). Each value bit-identical to matmul(out + g·N, x + g·K, those rows, T = 1). Returns
// false, launching nothing, where no kernel takes it (qgemv_grouped: K-quant blocks, f16 activations, the
// tensor-core GEMV): then run the G matmuls.
bool matmul_grouped(float* out, const float* x, const DeviceMatrix<float>& w, int G, int K, int N,
                    cudaStream_t stream);
bool matmul_grouped(float* out, const __half* x, const DeviceMatrix<__half>& w, int G, int K, int N,
                    cudaStream_t stream);

// A one-token MoE step's selected experts read where they lie in their stacks (engine/ops/qgemv GemvExpertRows),
// so nothing is gathered: the experts' rows at table[ids[s]] (each [E] device addresses of the experts' matrices,
// in the format of `like`, expert 0's matrix). matmul_experts_gate_up_swiglu: matmul_gate_up_swiglu over the
// n_slots experts' gate rows [n_slots·F] then their up rows; matmul_experts_grouped: matmul_grouped over the n_slots
// experts' N rows, slot s on x row s. Each value bit-identical to those ops on the experts gathered in slot order.
// False, launching nothing, where no kernel takes them (only K-quant blocks with f16 activations on the tensor-core
// GEMV; gate and up in one format): then gather.
bool matmul_experts_gate_up_swiglu(float* gate, float* up, float* act, const float* x, const DeviceMatrix<float>& like,
                                   const uint64_t* gate_table, const uint64_t* up_table, const float* ids, int E,
                                   int n_slots, int K, int F, cudaStream_t stream);
bool matmul_experts_gate_up_swiglu(float* gate, float* up, __half* act, const __half* x,
                                   const DeviceMatrix<__half>& like, const uint64_t* gate_table,
                                   const uint64_t* up_table, const float* ids, int E, int n_slots, int K, int F,
                                   cudaStream_t stream);
bool matmul_experts_grouped(float* out, const float* x, const DeviceMatrix<float>& like, const uint64_t* table,
                            const float* ids, int E, int n_slots, int K, int N, cudaStream_t stream);
bool matmul_experts_grouped(float* out, const __half* x, const DeviceMatrix<__half>& like, const uint64_t* table,
                            const float* ids, int E, int n_slots, int K, int N, cudaStream_t stream);

// matmul_experts_grouped over the n_slots experts' down projections followed by moe_combine of the one token with
// the slots' weights, in one launch (qgemv_experts_down_combine): down [n_slots, N] and out [N] bit-identical to the
// two ops'. False, launching nothing, where no kernel takes it (as matmul_experts_grouped, or more than 16 slots):
// then run the two.
bool matmul_experts_down_combine(float* down, float* out, const float* x, const DeviceMatrix<float>& like,
                                 const uint64_t* table, const float* ids, const float* weights, int E, int n_slots,
                                 int K, int N, cudaStream_t stream);
bool matmul_experts_down_combine(float* down, float* out, const __half* x, const DeviceMatrix<__half>& like,
                                 const uint64_t* table, const float* ids, const float* weights, int E, int n_slots,
                                 int K, int N, cudaStream_t stream);

// A step of several tokens' MoE slots grouped by expert (engine/ops/qgemv ExpertRows, rows: the slots in that
// order): out [slots, N] row s = its expert's matrix (table: [E] device addresses, each in the format of `like`,
// expert 0's) times x row s / div [K], all experts in one launch (qgemm_experts), nothing gathered or scattered. Each
// value bit-identical to matmul (T = 1) of its expert on its row alone. False, launching nothing, where no kernel
// takes it (the f32 engine; experts not in one K-quant segment; N not a multiple of 16; the tensor-core GEMV off):
// then run a matmul per expert.
bool matmul_experts_rows(float* out, const float* x, int div, const int32_t* rows, const DeviceMatrix<float>& like,
                         const uint64_t* table, const ExpertRows* groups, int n_groups, int K, int N,
                         cudaStream_t stream);
bool matmul_experts_rows(float* out, const __half* x, int div, const int32_t* rows, const DeviceMatrix<__half>& like,
                         const uint64_t* table, const ExpertRows* groups, int n_groups, int K, int N,
                         cudaStream_t stream);

// Fused twin of matmul_cat({gate, up}) on Wgate|Wup for one token followed by swiglu: gate [F] and
// up [F] f32 bit-identical to matmul_cat's (the same GEMV per row, the same launch shape), and act [F]
// = silu(gate)·up bit-identical to the swiglu kernel's (f32, or f16 in the f16 engine); one launch.
// Returns false, launching nothing, when w cannot run it (a quantized matrix whose 2F rows are not
// one format) or would run it slower (Q4_K, Q5_K, Q6_K on the SIMT quantized kernel, i.e. with f32
// activations or DIFFRUN_QGEMV_MMA=0): then run matmul_cat and swiglu.
bool matmul_gate_up_swiglu(float* gate, float* up, float* act, const float* x, const DeviceMatrix<float>& w, int K,
                           int F, cudaStream_t stream);
bool matmul_gate_up_swiglu(float* gate, float* up, __half* act, const __half* x, const DeviceMatrix<__half>& w, int K,
                           int F, cudaStream_t stream);

// Fused twin of matmul_cat({q, bq, H·Dh}, {k, bk, Hkv·Dh}, {v, bv, Hkv·Dh}) on Wq|Wk|Wv for one token
// followed by rope_qk (T = 1, rope's H, Hkv, Dh, positions, θ, freq factors and pairing): q and k
// rotated, v, and the cache rows of k and v at *rope.write_pos, each bit-identical to the two ops
// (the same GEMV per row and launch shape, rope_qk's arithmetic). Returns false, launching nothing,
// when w cannot run it (Dh odd, or a quantized matrix whose rows are not one format, except Wq|Wk and
// Wv in two K-quant formats with f16 activations, which qgemv_rope2 takes): then run matmul_cat and
// rope_qk.
bool matmul_qkv_rope(float* q, float* k, float* v, const float* bq, const float* bk, const float* bv, const float* x,
                     const DeviceMatrix<float>& w, int K, const GemvRope& rope, cudaStream_t stream);
bool matmul_qkv_rope(float* q, float* k, float* v, const float* bq, const float* bk, const float* bv, const __half* x,
                     const DeviceMatrix<__half>& w, int K, const GemvRope& rope, cudaStream_t stream);

// Fused twin of matmul (T = 1, no bias) followed by argmax over the N outputs: out [N] bit-identical to
// matmul's (the one-token GEMV's rows, summed in its order), *token argmax's answer for them (the same
// order: the largest value, the lowest index on ties (or `ties`), NaN never; -1 when none is comparable), written
// to device or mapped host memory; scratch as argmax's. One launch whose blocks stay resident while the
// weights stream. Returns false, launching nothing, when w is quantized or matmul would not run the
// one-warp-per-row GEMV on it (few rows of long K, or rows not 16-byte aligned): then run matmul and
// argmax.
bool matmul_argmax(float* out, int32_t* token, const float* x, const DeviceMatrix<float>& w, int K, int N,
                   unsigned long long* scratch, cudaStream_t stream, ArgmaxTies ties = ArgmaxTies::lowest);
bool matmul_argmax(float* out, int32_t* token, const __half* x, const DeviceMatrix<__half>& w, int K, int N,
                   unsigned long long* scratch, cudaStream_t stream, ArgmaxTies ties = ArgmaxTies::lowest);

}  // namespace diffrun::engine
