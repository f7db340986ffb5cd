// Linear layer out = x · Wᵀ (+ bias) with Eigen. T tokens, K inputs, N outputs; W is [N,K] row-major.
#include "reference_cpu/ops/matmul.hpp"

#include <algorithm>
#include <cstdint>

#include <omp.h>

#include <Eigen/Core>

namespace diffrun::ref {

template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  if (n_tokens == 1) {
    // Decode: memory bound on W; each thread streams its own block of rows.
    const Eigen::Map<const Vec> xv(x, K);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      const Eigen::Map<const Vec> wn(W + static_cast<int64_t>(n) * K, K);
      out[n] = wn.dot(xv) + (bias ? bias[n] : T(0));
    }
    return;
  }
  // Prefill: each thread runs a single-threaded Eigen GEMM on its own block of output columns (one
  // barrier per call; Eigen's own threaded GEMM spins badly when the cores are shared).
  const Eigen::Map<const Mat> xm(x, n_tokens, K);
  Eigen::Map<Mat> om(out, n_tokens, N);
#pragma omp parallel
  {
    const int n_threads = omp_get_num_threads();
    const int chunk = (N + n_threads - 1) / n_threads;
    const int n0 = std::min(N, omp_get_thread_num() * chunk);
    const int n1 = std::min(N, n0 + chunk);
    if (n1 > n0) {
      const Eigen::Map<const Mat> wm(W + static_cast<int64_t>(n0) * K, n1 - n0, K);
      om.middleCols(n0, n1 - n0).noalias() = xm * wm.transpose();
      if (bias) {
        om.middleCols(n0, n1 - n0).rowwise() +=
            Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias + n0, n1 - n0);
      }
    }
  }
}

template void matmul<float>(float*, const float*, const float*, const float*, int, int, int);
template void matmul<double>(double*, const double*, const double*, const double*, int, int, int);

}  // namespace diffrun::ref
