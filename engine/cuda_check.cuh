// CUDA and cuBLAS error checking: CUDA_CHECK, CUBLAS_CHECK, the check after every kernel launch, DIFFRUN_SYNC_CHECK.
#pragma once

#include <cstdint>
#include <string>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "model/error.hpp"

namespace diffrun::engine {

// A failed CUDA or cuBLAS call, or a kernel that failed (names the call or op, file and line).
struct CudaError : Error {
  using Error::Error;
};

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

// DIFFRUN_SYNC_CHECK=1 (read once): synchronize after every op so a failing kernel is named.
bool sync_check_enabled();

// The current device's multiprocessor count.
int sm_count();

// Programmatic Dependent Launch for the op kernels (read once): on for devices of compute
// capability 9.0 and later unless DIFFRUN_PDL=0.
bool pdl_enabled();

// GEMV weight prefetch: the one-token GEMV kernels of a matrix of at most gemv_prefetch_limit() bytes start bringing
// their block's weight rows into L2 before the PDL wait (so under PDL while the preceding kernel runs). A larger
// matrix's blocks would ask for more than L2 holds before their rows are read, evicting what the kernel ahead and they
// themselves are about to read: with every matrix prefetched, Llama-7B's F16 shape decoded 5.42 ms/token against 4.35
// with the limit (two H200s: TP = 2 3.71 against 3.23), and the smaller shapes lost nothing (bench/NOTES.md). The
// limit (read once): kGemvPrefetchDefaultBytes (DIFFRUN_GEMV_PREFETCH unset or 1); DIFFRUN_GEMV_PREFETCH=0 (never),
// all (every matrix), or NM (up to N MiB, e.g. 16M).
constexpr uint64_t kGemvPrefetchDefaultBytes = uint64_t(32) << 20;
uint64_t gemv_prefetch_limit();
// Whether a GEMV over `matrix_bytes` bytes of weights prefetches them.
inline bool gemv_prefetch(uint64_t matrix_bytes) { return matrix_bytes <= gemv_prefetch_limit(); }
// The "gemv_prefetch" fact: "off", "every matrix" or "matrices up to N MiB".
std::string gemv_prefetch_name();

// Rows each warp of the one-token dense GEMV computes where one warp takes a row (N >= 4096 rows, or
// rows of at most 128 16-byte chunks: on the 0.5B shape every GEMV but the down projection), the loads
// of all of them in flight together: by default (auto) 2, and 4 from kGemvFourRowsFrom rows (the lm
// head); DIFFRUN_GEMV_ROWS_PER_WARP=1|2|4 sets it for every launch (read at each launch). Each row's
// value is the same for every choice (the same lanes and order); an invalid value is an InputError.
// The name: what the "gemv_rows_per_warp" fact says.
constexpr int kGemvFourRowsFrom = 32768;
int gemv_rows_per_warp(int N);
std::string gemv_rows_per_warp_name();

// DIFFRUN_GEMV_WARPS_PER_ROW (read at each launch, like the above), for measuring the dense one-token GEMV's shapes
// in the engine (bench_cuda_engine) and alone (bench_cuda_gemv): "auto" or unset (warps 0: the shape decides, as
// engine/ops/matmul.cu's gemv_epi says), or W[xB] with W 1, 2, 4 or 8 and B 4 or 8: every 16-byte-aligned GEMV
// takes W warps a row (1: the rows kernel) and B loads a lane issues at once (4 if not given).
struct GemvWarps {
  int warps = 0, batch = 4;
};
GemvWarps gemv_warps_per_row();

// The f16 engine's Q4_K/Q5_K/Q6_K GEMV on tensor cores (read once): on for devices of compute
// capability 8.0 and later unless DIFFRUN_QGEMV_MMA=0 (the SIMT kernel of the other formats then).
bool qgemv_mma_enabled();

// The one-token MoE downs+sum (qgemv_experts_down_combine, read once): a warp for each of the grouped GEMV's warps
// that holds super-blocks, where they fit a block, unless DIFFRUN_DOWN_COMBINE_SPLIT=0 (one warp a slot). The same
// values either way.
bool down_combine_split_enabled();

// Where the forward pass is (step, layer; layer -1 outside layers), named in op errors. Cheap.
void set_op_context(int step, int layer);

// Called after every kernel launch: throws CudaError naming `op` on a launch error, and with
// DIFFRUN_SYNC_CHECK=1 synchronizes `stream` first so an execution error is attributed to `op`.
void check_launch(const char* op, cudaStream_t stream);

}  // namespace diffrun::engine

#define CUDA_CHECK(call)                                                               \
  do {                                                                                 \
    const cudaError_t diffrun_err_ = (call);                                           \
    if (diffrun_err_ != cudaSuccess)                                                   \
      ::diffrun::engine::throw_cuda_error(diffrun_err_, #call, __FILE__, __LINE__);    \
  } while (0)

#define CUBLAS_CHECK(call)                                                             \
  do {                                                                                 \
    const cublasStatus_t diffrun_st_ = (call);                                         \
    if (diffrun_st_ != CUBLAS_STATUS_SUCCESS)                                          \
      ::diffrun::engine::throw_cublas_error(diffrun_st_, #call, __FILE__, __LINE__);   \
  } while (0)
