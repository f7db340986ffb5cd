// Loads the CUDA driver for the C API's device puts (capi/cuda_driver.hpp): dlopen("libcuda.so.1"), once.
#include "cuda_driver.hpp"

#include <dlfcn.h>

#include <mutex>

namespace diffrun::capi {

namespace {

struct Loaded {
  CudaDriver cu{};
  const CudaDriver* ok = nullptr;
  std::string why;
};

template <class F>
bool bind(void* lib, const char* name, F*& fn, std::string& why) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  if (!fn && why.empty()) why = std::string("CUDA driver too old: libcuda.so.1 has no ") + name;
  return fn != nullptr;
}

Loaded load() {
  Loaded l;
  // RTLD_NOLOAD first: the driver the engine already loaded (any path), else the system's.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    l.why = std::string("CUDA driver not found (") + (e ? e : "libcuda.so.1") +
            "): device puts need the NVIDIA driver; put host memory with diffrun_dump_put";
    return l;
  }
  CudaDriver& c = l.cu;
  bool all = bind(lib, "cuInit", c.cuInit, l.why) & bind(lib, "cuGetErrorName", c.cuGetErrorName, l.why) &
             bind(lib, "cuGetErrorString", c.cuGetErrorString, l.why) &
             bind(lib, "cuCtxGetCurrent", c.cuCtxGetCurrent, l.why) &
             bind(lib, "cuCtxPushCurrent_v2", c.cuCtxPushCurrent, l.why) &
             bind(lib, "cuCtxPopCurrent_v2", c.cuCtxPopCurrent, l.why) &
             bind(lib, "cuMemHostAlloc", c.cuMemHostAlloc, l.why) & bind(lib, "cuMemFreeHost", c.cuMemFreeHost, l.why) &
             bind(lib, "cuMemcpyDtoHAsync_v2", c.cuMemcpyDtoHAsync, l.why) &
             bind(lib, "cuPointerGetAttribute", c.cuPointerGetAttribute, l.why) &
             bind(lib, "cuStreamIsCapturing", c.cuStreamIsCapturing, l.why) &
             bind(lib, "cuEventCreate", c.cuEventCreate, l.why) &
             bind(lib, "cuEventDestroy_v2", c.cuEventDestroy, l.why) &
             bind(lib, "cuEventRecord", c.cuEventRecord, l.why) &
             bind(lib, "cuEventSynchronize", c.cuEventSynchronize, l.why) &
             bind(lib, "cuMemHostGetDevicePointer_v2", c.cuMemHostGetDevicePointer, l.why) &
             bind(lib, "cuModuleLoadData", c.cuModuleLoadData, l.why) &
             bind(lib, "cuModuleUnload", c.cuModuleUnload, l.why) &
             bind(lib, "cuModuleGetFunction", c.cuModuleGetFunction, l.why) &
             bind(lib, "cuLaunchKernel", c.cuLaunchKernel, l.why);
  if (!all) return l;  // the library stays loaded: the engine may use it
  if (const CUresult rc = c.cuInit(0); rc != kCudaSuccess) {
    l.why = "no usable CUDA device (cuInit: " + cuda_error_text(c, rc) + ")";
    return l;
  }
  l.ok = &l.cu;
  return l;
}

}  // namespace

const CudaDriver* cuda_driver(std::string* why) {
  static std::once_flag once;
  static Loaded loaded;
  std::call_once(once, [] {
    loaded = load();
    if (loaded.ok) loaded.ok = &loaded.cu;  // the copy's own table
  });
  if (!loaded.ok && why) *why = loaded.why;
  return loaded.ok;
}

std::string cuda_error_text(const CudaDriver& cu, CUresult rc) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cu.cuGetErrorName) cu.cuGetErrorName(rc, &name);
  if (cu.cuGetErrorString) cu.cuGetErrorString(rc, &text);
  std::string s = name ? name : "CUDA error " + std::to_string(rc);
  if (text) s += std::string(" (") + text + ")";
  return s;
}

}  // namespace diffrun::capi
