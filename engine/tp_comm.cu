#include "engine/tp_comm.cuh"

#include <cstdlib>
#include <cstring>

#include "engine/cuda_check.cuh"
#include "engine/device_buffer.cuh"
#include "engine/ops/launch.cuh"
#include "model/error.hpp"

#ifdef DIFFRUN_HAVE_NCCL
#include <nccl.h>
#endif

namespace diffrun::engine {

#ifdef DIFFRUN_HAVE_NCCL

namespace {
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}
}  // namespace

bool nccl_built() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z from 2.9 on.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

std::vector<void*> nccl_comms(int world) {
  std::vector<ncclComm_t> comms(static_cast<size_t>(world));
  std::vector<int> devices(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) devices[static_cast<size_t>(r)] = r;
  nccl_check(ncclCommInitAll(comms.data(), world, devices.data()), "ncclCommInitAll");
  return std::vector<void*>(comms.begin(), comms.end());
}

void nccl_destroy(void* comm) {
  if (comm) ncclCommDestroy(static_cast<ncclComm_t>(comm));
}

void nccl_abort(void* comm) {
  if (comm) ncclCommAbort(static_cast<ncclComm_t>(comm));
}

void all_reduce_sum(float* buf, size_t count, void* comm, cudaStream_t stream) {
  nccl_check(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, static_cast<ncclComm_t>(comm), stream),
             "ncclAllReduce");
}

#else

namespace {
[[noreturn]] void no_nccl() {
  throw InputError("this diffrun was built without NCCL, so it has no tensor-parallel engine (--tp N > 1): "
                   "configure it where nccl.h and libnccl are found (the CUDA toolkit's, NCCL_ROOT, or the "
                   "nvidia-nccl wheel of the Python CMake finds)");
}
}  // namespace

bool nccl_built() { return false; }
std::string nccl_version() { return "none"; }
std::vector<void*> nccl_comms(int) { no_nccl(); }
void nccl_destroy(void*) {}
void nccl_abort(void*) {}
void all_reduce_sum(float*, size_t, void*, cudaStream_t) { no_nccl(); }

#endif

namespace {

__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

constexpr int kPeerThreads = 1024;

__global__ void __launch_bounds__(kPeerThreads) peer_all_reduce_kernel(float* x, int count, PeerAllReduce p) {
  pdl_wait();
  __shared__ unsigned long long e;
  if (threadIdx.x == 0) e = *p.epoch + 1;
  __syncthreads();
  const size_t parity = size_t(e & 1);
  // Push: this rank's values into slot `rank` of every rank's receive buffer of this parity.
  const bool vec = count % 4 == 0;
  for (int q = 0; q < p.world; ++q) {
    float* dst = p.peer_buf[q] + (parity * p.world + p.rank) * size_t(p.max_floats);
    if (vec) {
      for (int i = threadIdx.x; i < count / 4; i += blockDim.x)
        reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(x)[i];
    } else {
      for (int i = threadIdx.x; i < count; i += blockDim.x) dst[i] = x[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int q = 0; q < p.world; ++q) store_release(p.peer_flags[q] + p.rank, e);
  }
  // Wait for every rank's push into this rank's buffer.
  if (threadIdx.x < p.world) {
    const unsigned long long* flag = p.peer_flags[p.rank] + threadIdx.x;
    const unsigned long long t0 = global_ns();
    while (load_acquire(flag) < e)
      if (global_ns() - t0 > 10000000000ull) __trap();  // a rank never came: fail the step, do not hang
  }
  __syncthreads();
  // Sum the slots in rank order: the same bits on every rank.
  const float* base = p.peer_buf[p.rank] + parity * p.world * size_t(p.max_floats);
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    float s = 0.0f;
    for (int q = 0; q < p.world; ++q) s += base[size_t(q) * p.max_floats + i];
    x[i] = s;
  }
  if (threadIdx.x == 0) *p.epoch = e;
}

// DIFFRUN_TP_ALLREDUCE=peer asks for the one-shot kernel (opt-in: see DESIGN.md, "Tensor parallelism").
bool env_asks_peer() {
  const char* v = std::getenv("DIFFRUN_TP_ALLREDUCE");
  return v && std::strcmp(v, "peer") == 0;
}

}  // namespace

std::unique_ptr<PeerAllReduceSet> PeerAllReduceSet::make(int world, int max_floats) {
  if (world < 2 || world > PeerAllReduce::kMaxRanks || !env_asks_peer()) return nullptr;
  for (int r = 0; r < world; ++r)
    for (int q = 0; q < world; ++q) {
      int can = 0;
      if (q != r && (cudaDeviceCanAccessPeer(&can, r, q) != cudaSuccess || !can)) {
        (void)cudaGetLastError();
        return nullptr;
      }
    }
  int previous = 0;
  CUDA_CHECK(cudaGetDevice(&previous));
  std::unique_ptr<PeerAllReduceSet> set(new PeerAllReduceSet());
  set->world_ = world;
  set->max_floats_ = max_floats;
  set->bufs_.assign(size_t(world), nullptr);
  set->flags_.assign(size_t(world), nullptr);
  for (int r = 0; r < world; ++r) {
    CUDA_CHECK(cudaSetDevice(r));
    for (int q = 0; q < world; ++q) {
      if (q == r) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(q, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else CUDA_CHECK(e);
    }
    CUDA_CHECK(cudaMalloc(&set->bufs_[size_t(r)], sizeof(float) * 2 * size_t(world) * size_t(max_floats)));
    CUDA_CHECK(cudaMalloc(&set->flags_[size_t(r)], sizeof(unsigned long long) * size_t(world + 1)));
    // Zeroed on a stream of its own and waited for: the all-reduce's non-blocking streams do not wait on the legacy
    // stream, and a cudaDeviceSynchronize would invalidate a capture of another engine on the device.
    cudaStream_t zero = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&zero, cudaStreamNonBlocking));
    const cudaError_t set_err =
        cudaMemsetAsync(set->flags_[size_t(r)], 0, sizeof(unsigned long long) * size_t(world + 1), zero);
    const cudaError_t sync_err = set_err == cudaSuccess ? cudaStreamSynchronize(zero) : set_err;
    cudaStreamDestroy(zero);
    CUDA_CHECK(sync_err);
  }
  CUDA_CHECK(cudaSetDevice(previous));
  return set;
}

PeerAllReduceSet::~PeerAllReduceSet() {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = 0;
  for (int r = 0; r < world_; ++r) {
    if (cudaSetDevice(r) != cudaSuccess) continue;
    device_free(bufs_[size_t(r)]);
    device_free(flags_[size_t(r)]);
  }
  cudaSetDevice(previous);
  (void)cudaGetLastError();
}

PeerAllReduce PeerAllReduceSet::rank(int r) const {
  PeerAllReduce p;
  for (int q = 0; q < world_; ++q) {
    p.peer_buf[q] = bufs_[size_t(q)];
    p.peer_flags[q] = flags_[size_t(q)];
  }
  p.epoch = flags_[size_t(r)] + world_;
  p.rank = r;
  p.world = world_;
  p.max_floats = max_floats_;
  return p;
}

void peer_all_reduce_sum(float* buf, int count, const PeerAllReduce& p, cudaStream_t stream) {
  if (count > p.max_floats) throw Error("peer_all_reduce_sum: " + std::to_string(count) + " floats, above the " +
                                        std::to_string(p.max_floats) + " its buffers hold");
  launch_pdl(peer_all_reduce_kernel, 1, kPeerThreads, 0, stream, buf, count, p);
  check_launch("peer_all_reduce_sum", stream);
}

}  // namespace diffrun::engine
