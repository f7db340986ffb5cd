// cuBLAS handle set-up (math mode, workspace) and the row-major GEMM of gemm.cuh.
#include "engine/gemm.cuh"

#include "engine/cublas_api.cuh"
#include "engine/cuda_check.cuh"
#include "engine/device_buffer.cuh"

namespace diffrun::engine {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

void gemm_ex(void* y, const void* x, const void* w, cudaDataType_t in_type, int T, int K, int N,
             const CublasHandle& handle, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublas().set_stream(handle.get(), stream));
  CUBLAS_CHECK(cublas().gemm_ex(handle.get(), CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &alpha,
                            w, in_type, /*lda=*/K,
                            x, in_type, /*ldb=*/K, &beta,
                            y, CUDA_R_32F, /*ldc=*/N,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  check_launch("gemm", stream);
}

}  // namespace

CublasHandle::CublasHandle(EnginePrecision precision) : precision_(precision) {
  CUBLAS_CHECK(cublas().create(&handle_));
  CUBLAS_CHECK(cublas().set_math_mode(handle_, precision == EnginePrecision::f32 ? CUBLAS_PEDANTIC_MATH
                                                                            : CUBLAS_DEFAULT_MATH));
  workspace_ = device_alloc(kWorkspaceBytes, "the cuBLAS workspace");
  CUBLAS_CHECK(cublas().set_workspace(handle_, workspace_, kWorkspaceBytes));
}

// cublasDestroy synchronizes the device: past any capture in flight (after_captures), with its workspace after it.
CublasHandle::~CublasHandle() {
  if (!handle_) return;
  after_captures([h = handle_, ws = workspace_] {
    cublas().destroy(h);
    cudaFree(ws);
  });
}

std::string CublasHandle::math_mode_name() const {
  cublasMath_t mode;
  CUBLAS_CHECK(cublas().get_math_mode(handle_, &mode));
  std::string name;
  switch (static_cast<int>(mode) & ~static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) {
    case CUBLAS_DEFAULT_MATH: name = "CUBLAS_DEFAULT_MATH"; break;
    case CUBLAS_PEDANTIC_MATH: name = "CUBLAS_PEDANTIC_MATH"; break;
    case CUBLAS_TF32_TENSOR_OP_MATH: name = "CUBLAS_TF32_TENSOR_OP_MATH"; break;
    default: name = "cublasMath_t(" + std::to_string(static_cast<int>(mode)) + ")"; break;
  }
  if (static_cast<int>(mode) & static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION))
    name += "|CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION";
  return name;
}

bool CublasHandle::tf32_enabled() const {
  cublasMath_t mode;
  CUBLAS_CHECK(cublas().get_math_mode(handle_, &mode));
  const int base = static_cast<int>(mode) & ~static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  return base == static_cast<int>(CUBLAS_TF32_TENSOR_OP_MATH);
}

void gemm(float* y, const float* x, const float* w, int T, int K, int N, const CublasHandle& handle,
          cudaStream_t stream) {
  gemm_ex(y, x, w, CUDA_R_32F, T, K, N, handle, stream);
}

void gemm(float* y, const __half* x, const __half* w, int T, int K, int N, const CublasHandle& handle,
          cudaStream_t stream) {
  gemm_ex(y, x, w, CUDA_R_16F, T, K, N, handle, stream);
}

}  // namespace diffrun::engine
