#include "engine/tp_comm.cuh"

#include <string>

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

}  // namespace diffrun::engine
