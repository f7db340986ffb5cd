// Linear layer out = x · Wᵀ (+ bias) with Eigen. T tokens, K inputs, N outputs; W is [N,K] row-major.
#include "reference_cpu/ops/matmul.hpp"

#include <cstdint>

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
  const Eigen::Map<const Mat> xm(x, n_tokens, K);
  const Eigen::Map<const Mat> wm(W, N, K);
  Eigen::Map<Mat> om(out, n_tokens, N);
  om.noalias() = xm * wm.transpose();
  if (bias) om.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, N);
}

template void matmul<float>(float*, const float*, const float*, const float*, int, int, int);
template void matmul<double>(double*, const double*, const double*, const double*, int, int, int);

}  // namespace diffrun::ref
