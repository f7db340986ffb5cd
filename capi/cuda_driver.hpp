// The few CUDA driver API functions the C API's device puts use, loaded from libcuda.so.1 when first needed.
// No CUDA header and no link to CUDA: the library builds and runs where CUDA is absent, and a device put
// there fails with a message. The driver, not the runtime: a process has one driver, shared by every CUDA
// runtime in it (an engine's static cudart, a shared libcudart.so.12 or .13, torch's), so the engine's
// streams, pointers and current context are the same objects here. The types and values below are the
// driver's ABI (cuda.h), stable across CUDA versions.
#pragma once

#include <cstddef>
#include <string>

namespace diffrun::capi {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;

inline constexpr CUresult kCudaSuccess = 0;
inline constexpr CUresult kCudaErrorInvalidValue = 1;
inline constexpr CUresult kCudaErrorNotReady = 600;
inline constexpr int kPointerAttributeMemoryType = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
inline constexpr int kStreamCaptureNone = 0;           // CU_STREAM_CAPTURE_STATUS_NONE
inline constexpr int kStreamCaptureActive = 1;         // CU_STREAM_CAPTURE_STATUS_ACTIVE
inline constexpr unsigned kEventDisableTiming = 0x2;   // CU_EVENT_DISABLE_TIMING
inline constexpr unsigned kMemHostAllocPortable = 0x1;  // CU_MEMHOSTALLOC_PORTABLE
inline constexpr unsigned kMemHostAllocDeviceMap = 0x2;  // CU_MEMHOSTALLOC_DEVICEMAP

// The functions, by their exported (versioned, non per-thread) names in libcuda.so.1.
struct CudaDriver {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuGetErrorName)(CUresult error, const char** name);
  CUresult (*cuGetErrorString)(CUresult error, const char** text);
  CUresult (*cuCtxGetCurrent)(CUcontext* ctx);
  CUresult (*cuCtxPushCurrent)(CUcontext ctx);   // cuCtxPushCurrent_v2
  CUresult (*cuCtxPopCurrent)(CUcontext* ctx);   // cuCtxPopCurrent_v2
  CUresult (*cuMemHostAlloc)(void** p, size_t bytes, unsigned flags);
  CUresult (*cuMemFreeHost)(void* p);
  CUresult (*cuMemcpyDtoHAsync)(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);  // _v2
  CUresult (*cuPointerGetAttribute)(void* data, int attribute, CUdeviceptr ptr);
  CUresult (*cuStreamIsCapturing)(CUstream stream, int* status);
  CUresult (*cuEventCreate)(CUevent* event, unsigned flags);
  CUresult (*cuEventDestroy)(CUevent event);  // cuEventDestroy_v2
  CUresult (*cuEventRecord)(CUevent event, CUstream stream);
  CUresult (*cuEventSynchronize)(CUevent event);
  // The batched copy of diffrun_dump_flush_device (capi/gather_kernel.cu).
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr* dev, void* host, unsigned flags);  // _v2
  CUresult (*cuModuleLoadData)(CUmodule* module, const void* image);
  CUresult (*cuModuleUnload)(CUmodule module);
  CUresult (*cuModuleGetFunction)(CUfunction* fn, CUmodule module, const char* name);
  CUresult (*cuLaunchKernel)(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shared_bytes, CUstream stream, void** params, void** extra);
};

// The driver, loaded and initialized (cuInit) once per process; nullptr when it cannot be, with the
// reason in *why ("CUDA driver not found (libcuda.so.1: ...)", "cuInit failed: CUDA_ERROR_NO_DEVICE ...").
const CudaDriver* cuda_driver(std::string* why);

// "CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)" for a driver result.
std::string cuda_error_text(const CudaDriver& cu, CUresult rc);

}  // namespace diffrun::capi
