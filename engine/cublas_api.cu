// cuBLAS opened with dlopen (cublas_api.cuh).
#include "engine/cublas_api.cuh"

#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "model/error.hpp"

#ifndef DIFFRUN_CUBLAS_LIBRARY
#define DIFFRUN_CUBLAS_LIBRARY ""
#endif

namespace diffrun::engine {

namespace {

#define DIFFRUN_SYMBOL_NAME(name) DIFFRUN_SYMBOL_NAME_(name)
#define DIFFRUN_SYMBOL_NAME_(name) #name

struct Loaded {
  CublasApi api{};
  std::string error;  // empty when api is complete
};

Loaded open_cublas() {
  Loaded out;
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  std::string tried;
  void* lib = nullptr;
  for (const std::string& name : {soname, std::string(DIFFRUN_CUBLAS_LIBRARY)}) {
    if (name.empty()) continue;
    lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* why = dlerror();
    tried += (tried.empty() ? "" : "; ") + name + ": " + (why ? why : "not found");
  }
  if (!lib) {
    out.error = "cannot open cuBLAS (" + tried + "); put its directory on LD_LIBRARY_PATH";
    return out;
  }
  const auto resolve = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    if (!fn && out.error.empty()) out.error = std::string("cuBLAS (") + soname + ") has no function " + symbol;
  };
  resolve(out.api.create, DIFFRUN_SYMBOL_NAME(cublasCreate));
  resolve(out.api.destroy, DIFFRUN_SYMBOL_NAME(cublasDestroy));
  resolve(out.api.set_stream, DIFFRUN_SYMBOL_NAME(cublasSetStream));
  resolve(out.api.set_math_mode, DIFFRUN_SYMBOL_NAME(cublasSetMathMode));
  resolve(out.api.get_math_mode, DIFFRUN_SYMBOL_NAME(cublasGetMathMode));
  resolve(out.api.set_workspace, DIFFRUN_SYMBOL_NAME(cublasSetWorkspace));
  resolve(out.api.gemm_ex, DIFFRUN_SYMBOL_NAME(cublasGemmEx));
  resolve(out.api.get_version, DIFFRUN_SYMBOL_NAME(cublasGetVersion));
  resolve(out.api.status_name, DIFFRUN_SYMBOL_NAME(cublasGetStatusName));
  resolve(out.api.status_string, DIFFRUN_SYMBOL_NAME(cublasGetStatusString));
  return out;
}

const Loaded& loaded() {
  static const Loaded l = open_cublas();  // the first caller opens it; the others wait
  return l;
}

}  // namespace

const CublasApi& cublas() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw Error(l.error);
  return l.api;
}

void preload_cublas() { (void)loaded(); }

}  // namespace diffrun::engine
