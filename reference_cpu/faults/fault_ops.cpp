// Flawed variants of reference ops for fault injection: transposed embedding read, the modulo KV-head expansion,
// flawed RMSNorm, wrong-lda weights. The attention faults run the clean attention with another AttentionVariant.
#include "reference_cpu/faults/fault_ops.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <Eigen/Core>

#include "model/error.hpp"

namespace diffrun::ref {

template <typename T>
void embedding_transposed(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const T* table /* [V,D] */,
                          int n_tokens, int D, int V) {
  for (int t = 0; t < n_tokens; ++t) {
    const int32_t id = tokens[t];
    if (id < 0 || id >= V) {
      throw InputError("token id " + std::to_string(id) + " at position " + std::to_string(t) +
                       " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
    for (int i = 0; i < D; ++i) out[static_cast<int64_t>(t) * D + i] = table[static_cast<int64_t>(i) * V + id];
  }
}

template <typename T>
void expand_kv_heads_modulo(T* out /* [rows,H*Dh] */, const T* kv /* [rows,Hkv*Dh] */, int rows, int H, int Hkv, int Dh) {
  for (int s = 0; s < rows; ++s)
    for (int h = 0; h < H; ++h)
      std::copy_n(kv + (static_cast<int64_t>(s) * Hkv + h % Hkv) * Dh, Dh, out + (static_cast<int64_t>(s) * H + h) * Dh);
}

template <typename T>
void rms_norm_flawed(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps,
                     RmsNormFlaws flaws) {
  const int summed = flaws.off_by_one ? D - 1 : D;
  for (int r = 0; r < n_rows; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * D;
    T* yr = out + static_cast<int64_t>(r) * D;
    T sum = 0;
    for (int i = 0; i < summed; ++i) sum += xr[i] * xr[i];
    const T scale = flaws.eps_outside_sqrt ? T(1) / (std::sqrt(sum / T(D)) + eps) : T(1) / std::sqrt(sum / T(D) + eps);
    for (int i = 0; i < D; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

template <typename T>
Matrix<T> wrong_leading_dimension(const Matrix<T>& w /* [N,K] */) {
  const Eigen::Map<const Matrix<T>> as_kn(w.data(), w.cols(), w.rows());  // the same memory as [K, N]
  return as_kn.transpose();
}

template void embedding_transposed<float>(float*, const int32_t*, const float*, int, int, int);
template void embedding_transposed<double>(double*, const int32_t*, const double*, int, int, int);
template void expand_kv_heads_modulo<float>(float*, const float*, int, int, int, int);
template void expand_kv_heads_modulo<double>(double*, const double*, int, int, int, int);
template void rms_norm_flawed<float>(float*, const float*, const float*, int, int, float, RmsNormFlaws);
template void rms_norm_flawed<double>(double*, const double*, const double*, int, int, double, RmsNormFlaws);
template Matrix<float> wrong_leading_dimension<float>(const Matrix<float>&);
template Matrix<double> wrong_leading_dimension<double>(const Matrix<double>&);

}  // namespace diffrun::ref
