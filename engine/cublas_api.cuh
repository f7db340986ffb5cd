// cuBLAS, opened at run time (dlopen) rather than linked.
//
// Loading libcublas and its libcublasLt costs a process 60-100 ms before main() (their static
// initialisers touch tens of MB), and most diffrun processes never call it: compare, validate,
// show, a run without a GPU. The engine calls cuBLAS through cublas() instead; the main job opens
// the library on a thread of its own while the model loads (cuda_preload_libraries in
// engine/engine.hpp), so a GPU run does not wait for it either. The library is the one this build was compiled against: libcublas.so.<major>
// as the dynamic loader finds it (LD_LIBRARY_PATH, the system's cache), else the file CMake found.
#pragma once

#include <cublas_v2.h>

namespace diffrun::engine {

// The functions the engine calls, resolved once. cublas_v2.h maps some names to their _v2 symbols
// (cublasCreate is cublasCreate_v2); each entry is the symbol the name maps to.
struct CublasApi {
  decltype(&cublasCreate) create;
  decltype(&cublasDestroy) destroy;
  decltype(&cublasSetStream) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasGetMathMode) get_math_mode;
  decltype(&cublasSetWorkspace) set_workspace;
  // The C function (C++ also sees an inline overload taking a cudaDataType compute type).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&cublasGetVersion) get_version;
  decltype(&cublasGetStatusName) status_name;
  decltype(&cublasGetStatusString) status_string;
};

// The library, opened on the first call (thread-safe; later calls return at once). Throws Error
// naming each file it tried and the loader's reason when it cannot be opened or lacks a function.
const CublasApi& cublas();

// Opens the library now, on the caller's thread, without throwing: an error is kept for the
// engine's first cublas() to report.
void preload_cublas();

}  // namespace diffrun::engine
