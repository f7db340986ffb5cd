// Error formatting for CUDA_CHECK / CUBLAS_CHECK and the per-op launch check (DIFFRUN_SYNC_CHECK).
#include "engine/cuda_check.cuh"

#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/cublas_api.cuh"

namespace diffrun::engine {

namespace {

thread_local int g_step = -1;
thread_local int g_layer = -1;

std::string where() {
  if (g_step < 0) return "";
  std::string s = " (step " + std::to_string(g_step);
  if (g_layer >= 0) s += ", layer " + std::to_string(g_layer);
  return s + ")";
}

}  // namespace

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw CudaError(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                  ") in " + call + " at " + file + ":" + std::to_string(line) + where());
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string("cuBLAS error ") + cublas().status_name(status) + " (" +
                  cublas().status_string(status) + ") in " + call + " at " + file + ":" +
                  std::to_string(line) + where());
}

bool sync_check_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DIFFRUN_SYNC_CHECK");
    return v != nullptr && std::strcmp(v, "") != 0 && std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

namespace {

// The environment variable `name` is "0".
bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// The current device's compute capability major version.
int device_major() {
  int device = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

}  // namespace

int sm_count() {
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

bool pdl_enabled() {
  static const bool enabled = !switched_off("DIFFRUN_PDL") && device_major() >= 9;
  return enabled;
}

uint64_t gemv_prefetch_limit() {
  static const uint64_t limit = []() -> uint64_t {
    const char* v = std::getenv("DIFFRUN_GEMV_PREFETCH");
    const std::string s = v ? v : "";
    if (s.empty() || s == "1") return kGemvPrefetchDefaultBytes;  // "1": on, as before the limit
    if (s == "0") return uint64_t(0);
    if (s == "all") return ~uint64_t(0);
    const std::string digits = s.substr(0, s.size() - 1);
    if (s.back() != 'M' || digits.empty() || digits.size() > 7 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      throw InputError("DIFFRUN_GEMV_PREFETCH=" + s + ": expected 0 (no GEMV prefetches), all (every matrix's), NM "
                       "(matrices up to N MiB) or 1 (the default, " +
                       std::to_string(kGemvPrefetchDefaultBytes >> 20) + "M)");
    return uint64_t(std::stoull(digits)) << 20;
  }();
  return limit;
}

std::string gemv_prefetch_name() {
  const uint64_t limit = gemv_prefetch_limit();
  if (limit == 0) return "off";
  if (limit == ~uint64_t(0)) return "every matrix";
  return "matrices up to " + std::to_string(limit >> 20) + " MiB";
}

int gemv_rows_per_warp(int N) {
  const char* v = std::getenv("DIFFRUN_GEMV_ROWS_PER_WARP");  // read at each launch: the tests switch it
  if (!v || !*v || std::strcmp(v, "auto") == 0) return N >= kGemvFourRowsFrom ? 4 : 2;
  const std::string s(v);
  if (s == "1" || s == "2" || s == "4") return std::stoi(s);
  throw InputError("DIFFRUN_GEMV_ROWS_PER_WARP=" + s + ": expected auto, 1, 2 or 4");
}

std::string gemv_rows_per_warp_name() {
  const char* v = std::getenv("DIFFRUN_GEMV_ROWS_PER_WARP");
  if (!v || !*v || std::strcmp(v, "auto") == 0)
    return "2, 4 from " + std::to_string(kGemvFourRowsFrom) + " rows";
  return std::to_string(gemv_rows_per_warp(0));
}

GemvWarps gemv_warps_per_row() {
  const char* v = std::getenv("DIFFRUN_GEMV_WARPS_PER_ROW");
  if (!v || !*v || std::strcmp(v, "auto") == 0) return {};
  const std::string s(v);
  const size_t x = s.find('x');
  const std::string w = s.substr(0, x), b = x == std::string::npos ? "4" : s.substr(x + 1);
  if ((w == "1" || w == "2" || w == "4" || w == "8") && (b == "4" || b == "8"))
    return {std::stoi(w), std::stoi(b)};
  throw InputError("DIFFRUN_GEMV_WARPS_PER_ROW=" + s + ": expected auto, or W or WxB with W 1, 2, 4 or 8 and B 4 or 8");
}

bool qgemv_mma_enabled() {
  static const bool enabled = !switched_off("DIFFRUN_QGEMV_MMA") && device_major() >= 8;
  return enabled;
}

bool down_combine_split_enabled() {
  static const bool enabled = !switched_off("DIFFRUN_DOWN_COMBINE_SPLIT");
  return enabled;
}

void set_op_context(int step, int layer) {
  g_step = step;
  g_layer = layer;
}

void check_launch(const char* op, cudaStream_t stream) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw CudaError(std::string("kernel launch of op ") + op + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")" + where());
  if (!sync_check_enabled()) return;
  err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess)
    throw CudaError(std::string("op ") + op + " failed (DIFFRUN_SYNC_CHECK): " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")" + where());
}

}  // namespace diffrun::engine
