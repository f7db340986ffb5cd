// The one cuBLAS wrapper: y[T, N] = x[T, K] · W^T for a GGUF weight W with ne = [K, N] (row-major [N, K]).
//
// Layout, once: W is stored as N rows of K contiguous values. cuBLAS is column-major, so that
// memory is the column-major matrix A (K×N, lda = K); x [T, K] row-major is the column-major
// matrix B (K×T, ldb = K); y [T, N] row-major is the column-major C (N×T, ldc = N). Then
// C = Aᵀ·B, i.e. cublasGemmEx(CUBLAS_OP_T, CUBLAS_OP_N, m = N, n = T, k = K, A = W, lda = K,
// B = x, ldb = K, C = y, ldc = N).
#pragma once

#include <string>

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace diffrun::engine {

enum class EnginePrecision { f16, f32 };

// A cuBLAS handle configured for one precision, with its own workspace (so GEMMs can be captured
// in a CUDA graph). f32: CUBLAS_PEDANTIC_MATH (no TF32, no reduced-precision reductions).
// f16: CUBLAS_DEFAULT_MATH (tensor cores for the f16 inputs, f32 accumulation); TF32 is off in both.
class CublasHandle {
 public:
  explicit CublasHandle(EnginePrecision precision);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t get() const { return handle_; }
  EnginePrecision precision() const { return precision_; }
  std::string math_mode_name() const;  // read back from cuBLAS, e.g. "CUBLAS_PEDANTIC_MATH"
  bool tf32_enabled() const;           // read back from the math mode

 private:
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  EnginePrecision precision_;
};

// y [T, N] f32 = x [T, K] · w [N, K]ᵀ, f32 accumulation (CUBLAS_COMPUTE_32F).
void gemm(float* y, const float* x, const float* w, int T, int K, int N, const CublasHandle& handle,
          cudaStream_t stream);
void gemm(float* y, const __half* x, const __half* w, int T, int K, int N, const CublasHandle& handle,
          cudaStream_t stream);

}  // namespace diffrun::engine
