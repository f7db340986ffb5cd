// Emulated storage precision for the reference: which tensors are rounded to f16, and the rounding itself.
//
// A precision spec is "<arith>" or "<arith>-<plan>", arith f32 | f64 (the arithmetic), plan:
//   f16store     the f16 CUDA engine's storage (engine/cuda_engine.cu, engine/weights.cuh): every weight
//                matrix (token_embd, the projections, the lm head) rounded to f16 once at load, nearest
//                even, from its exact dequantized value; norm weights and biases stay wide; and the three
//                activations the engine stores in f16 because they feed a GEMM: the RMSNorm outputs
//                attn_norm, ffn_norm, result_norm (not Qnorm/Knorm), the attention context kqv_out and
//                the SwiGLU output ffn_swiglu. Everything else (Q/K/V, KV cache, probabilities,
//                residual stream, logits) stays in the arithmetic type, as the engine keeps it in f32.
//   f16residual  only the residual stream (ffn_inp and l_out, the outputs of the residual adds)
//                rounded to f16: a precision choice an engine may make, not a bug (tests and the
//                verdict's storage rule use it).
//   f16store-f16residual  both: an f16 engine that also keeps its residual stream in f16 (judged by the
//                f16 engine's preset against f32-f16store).
// A checkpoint whose tensor is rounded is recorded with native dtype f16.
#pragma once

#include <cstdint>
#include <string>

#include <Eigen/Core>

namespace diffrun::ref {

struct StoragePlan {
  bool weights_f16 = false;       // weight matrices rounded to f16 at load
  bool gemm_inputs_f16 = false;   // attn_norm, ffn_norm, result_norm, kqv_out, ffn_swiglu rounded to f16
  bool residual_f16 = false;      // ffn_inp and l_out rounded to f16

  bool any() const { return weights_f16 || gemm_inputs_f16 || residual_f16; }
};

// Rounds n values to the nearest f16 (ties to even, overflow to ±inf), in place, kept in their type
// (a double through float first, as Eigen::half(float(x)) does). In reference_cpu/dequant_rows.cpp.
void round_f16(float* x, int64_t n);
void round_f16(double* x, int64_t n);

}  // namespace diffrun::ref
