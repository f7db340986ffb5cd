// Linear layer out = x · Wᵀ (+ bias) with Eigen. T tokens, K inputs, N outputs; W is [N,K] row-major.
#include "reference_cpu/ops/matmul.hpp"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include <Eigen/Core>

#include "model/error.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

namespace {

template <typename T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;

// One output of a decode mat-vec: both matmuls take exactly this sum, so they agree bit for bit.
template <typename T>
T row_dot(const T* w /* [K] */, const Eigen::Map<const Vec<T>>& x /* [K] */, const T* bias /* [N] or null */, int n) {
  return Eigen::Map<const Vec<T>>(w, x.size()).dot(x) + (bias ? bias[n] : T(0));
}

// Rows [n0, n1) of out = x · W[n0:n1]ᵀ (+ bias) as one single-threaded Eigen GEMM; w points at row n0.
template <typename T>
void gemm_block(T* out /* [T,N] */, const T* x /* [T,K] */, const T* w /* [n1-n0,K] */, const T* bias,
                int n_tokens, int K, int N, int n0, int n1) {
  const Eigen::Map<const Mat<T>> xm(x, n_tokens, K);
  Eigen::Map<Mat<T>> om(out, n_tokens, N);
  const Eigen::Map<const Mat<T>> wm(w, n1 - n0, K);
  om.middleCols(n0, n1 - n0).noalias() = xm * wm.transpose();
  if (bias) {
    om.middleCols(n0, n1 - n0).rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias + n0, n1 - n0);
  }
}

// Output columns (weight rows) a prefill GEMM takes at once: about 512 KB of weight values (in L2 while the GEMM
// reads them), a multiple of 8, at least 32 (each GEMM packs the tokens' rows anew). A function of K alone, so
// the GEMMs, and their values, are the same for any number of threads.
template <typename T>
int gemm_columns(int K) {
  const int64_t cols = 524288 / (static_cast<int64_t>(K) * sizeof(T));
  return static_cast<int>(std::max<int64_t>(32, cols / 8 * 8));
}

// Rows a decode tile holds: about 32 KB of decoded weights, so the tile stays in L1/L2 between decode and dots.
template <typename T>
int tile_rows(int K) {
  return std::max(1, static_cast<int>(32768 / (static_cast<int64_t>(K) * sizeof(T))));
}

}  // namespace

template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N) {
  if (n_tokens == 1) {
    // Decode: memory bound on W; each thread streams its own block of rows.
    const Eigen::Map<const Vec<T>> xv(x, K);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) out[n] = row_dot(W + static_cast<int64_t>(n) * K, xv, bias, n);
    return;
  }
  // Prefill: blocks of output columns, each a single-threaded Eigen GEMM, shared among the threads (Eigen's own
  // threaded GEMM spins badly when the cores are shared).
  const int cols = gemm_columns<T>(K);
  const int n_blocks = (N + cols - 1) / cols;
#pragma omp parallel for schedule(dynamic)
  for (int b = 0; b < n_blocks; ++b) {
    const int n0 = b * cols, n1 = std::min(N, n0 + cols);
    gemm_block(out, x, W + static_cast<int64_t>(n0) * K, bias, n_tokens, K, N, n0, n1);
  }
}

template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */,
            const T* bias /* [N] or null */, int n_tokens, int K, int N) {
  if (W.cols() != K || W.rows() < N) {
    throw ModelError("matmul: a [" + std::to_string(W.rows()) + ", " + std::to_string(W.cols()) +
                     "] weight cannot give " + std::to_string(N) + " outputs of " + std::to_string(K) + " inputs");
  }
  if (W.dense()) {
    matmul(out, x, W.data(), bias, n_tokens, K, N);
    return;
  }
  if (n_tokens == 1) {
    // Decode: the weights' bytes are read once (a quarter to an eighth of the dense values' bytes); each tile of
    // rows is decoded into a small per-thread buffer and used at once.
    const Eigen::Map<const Vec<T>> xv(x, K);
    const int rows_per_tile = tile_rows<T>(K);
    const int n_tiles = (N + rows_per_tile - 1) / rows_per_tile;
#pragma omp parallel
    {
      const std::unique_ptr<T[]> tile(new T[static_cast<size_t>(rows_per_tile) * K]);  // [rows_per_tile,K]
#pragma omp for schedule(static) nowait
      for (int i = 0; i < n_tiles; ++i) {
        const int n0 = i * rows_per_tile, n1 = std::min(N, n0 + rows_per_tile);
        W.decode_rows(tile.get(), n0, n1 - n0);
        for (int n = n0; n < n1; ++n) out[n] = row_dot(tile.get() + static_cast<int64_t>(n - n0) * K, xv, bias, n);
      }
    }
    return;
  }
  // Prefill: the same column blocks and GEMMs as the pointer path, each on its block decoded into a buffer of the
  // thread's own, so that a matrix is never decoded whole.
  const int cols = gemm_columns<T>(K);
  const int n_blocks = (N + cols - 1) / cols;
#pragma omp parallel
  {
    const std::unique_ptr<T[]> block(new T[static_cast<size_t>(cols) * K]);  // [cols,K]
#pragma omp for schedule(dynamic) nowait
    for (int b = 0; b < n_blocks; ++b) {
      const int n0 = b * cols, n1 = std::min(N, n0 + cols);
      W.decode_rows(block.get(), n0, n1 - n0);
      gemm_block(out, x, block.get(), bias, n_tokens, K, N, n0, n1);
    }
  }
}

template void matmul<float>(float*, const float*, const float*, const float*, int, int, int);
template void matmul<double>(double*, const double*, const double*, const double*, int, int, int);
template void matmul<float>(float*, const float*, const WeightMatrix<float>&, const float*, int, int, int);
template void matmul<double>(double*, const double*, const WeightMatrix<double>&, const double*, int, int, int);

}  // namespace diffrun::ref
