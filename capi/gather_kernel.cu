// The C API's one CUDA kernel: the batched copy behind diffrun_dump_flush_device. The library links no
// CUDA (capi/cuda_driver.hpp): this file is not compiled into it. Its PTX, made once with
//   nvcc -arch=compute_75 -ptx -o - capi/gather_kernel.cu
// is embedded in capi/gather_kernel_ptx.hpp (".version" lowered to 7.0, which every driver since CUDA 11
// JIT-compiles), loaded with cuModuleLoadData and launched with cuLaunchKernel. Change both together.
#include <cstdint>

struct DiffrunGatherItem {
  unsigned long long src;    // device memory
  unsigned long long dst;    // the staging memory as the device addresses it
  unsigned long long bytes;
};

struct DiffrunGatherBatch {
  DiffrunGatherItem item[64];
  int count;
};

// Block row blockIdx.y copies item blockIdx.y, the blocks of the row striding over its bytes: 16 at a
// time when both ends are 16-aligned, else 4 or 1.
extern "C" __global__ void diffrun_gather(const DiffrunGatherBatch batch) {
  const int t = static_cast<int>(blockIdx.y);
  if (t >= batch.count) return;
  const DiffrunGatherItem it = batch.item[t];
  const char* src = reinterpret_cast<const char*>(it.src);
  char* dst = reinterpret_cast<char*>(it.dst);
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long first = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long done = 0;
  if (((it.src | it.dst) & 15) == 0) {
    const unsigned long long n = it.bytes / 16;
    for (unsigned long long k = first; k < n; k += stride)
      reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
    done = n * 16;
  } else if (((it.src | it.dst) & 3) == 0) {
    const unsigned long long n = it.bytes / 4;
    for (unsigned long long k = first; k < n; k += stride)
      reinterpret_cast<uint32_t*>(dst)[k] = reinterpret_cast<const uint32_t*>(src)[k];
    done = n * 4;
  }
  for (unsigned long long k = done + first; k < it.bytes; k += stride) dst[k] = src[k];
}
