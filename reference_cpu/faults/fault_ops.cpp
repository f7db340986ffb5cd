// Flawed variants of reference ops for fault injection: transposed embedding read, flawed attention and RMSNorm, wrong-lda weights.
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
void attention_flawed(T* out /* [T,H*Dh] */, T* probs /* [H,T,S] */, const T* q /* [T,H*Dh] */,
                      const T* k_cache /* [S,Hkv*Dh] */, const T* v_cache /* [S,Hkv*Dh] */, int n_tokens, int n_past,
                      int H, int Hkv, int Dh, T scale, int window, AttentionFlaws flaws) {
  const int S = n_past + n_tokens;
  const int group = H / Hkv;
  const int64_t q_stride = static_cast<int64_t>(H) * Dh;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < H; ++h) {
    for (int t = 0; t < n_tokens; ++t) {
      const int kvh = flaws.head_modulo ? h % Hkv : h / group;
      const int n_visible = flaws.no_causal_mask ? S : n_past + t + 1;
      const int first = window > 0 && !flaws.no_causal_mask ? std::max(0, n_visible - window) : 0;
      const T* qt = q + t * q_stride + static_cast<int64_t>(h) * Dh;
      T* p = probs + (static_cast<int64_t>(h) * n_tokens + t) * S;
      T max_score = -std::numeric_limits<T>::infinity();
      for (int s = 0; s < first; ++s) p[s] = 0;
      for (int s = first; s < n_visible; ++s) {
        const T* ks = k_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
        T dot = 0;
        for (int d = 0; d < Dh; ++d) dot += qt[d] * ks[d];
        p[s] = flaws.f16_exp ? dot : dot * scale;
        if (p[s] > max_score) max_score = p[s];
      }
      T sum = 0;
      for (int s = first; s < n_visible; ++s) {
        if (flaws.f16_exp) {  // exp of the raw score rounded to f16 (Inf above 65504), then ^scale
          const T e = T(static_cast<float>(Eigen::half(static_cast<float>(std::exp(p[s])))));
          p[s] = std::pow(e, scale);
        } else {
          p[s] = std::exp(p[s] - max_score);
        }
        sum += p[s];
      }
      for (int s = first; s < n_visible; ++s) p[s] /= sum;
      for (int s = n_visible; s < S; ++s) p[s] = 0;
      T* ot = out + t * q_stride + static_cast<int64_t>(h) * Dh;
      for (int d = 0; d < Dh; ++d) ot[d] = 0;
      for (int s = first; s < n_visible; ++s) {
        const T* vs = v_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
        for (int d = 0; d < Dh; ++d) ot[d] += p[s] * vs[d];
      }
    }
  }
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
template void attention_flawed<float>(float*, float*, const float*, const float*, const float*, int, int, int, int,
                                      int, float, int, AttentionFlaws);
template void attention_flawed<double>(double*, double*, const double*, const double*, const double*, int, int, int,
                                       int, int, double, int, AttentionFlaws);
template void rms_norm_flawed<float>(float*, const float*, const float*, int, int, float, RmsNormFlaws);
template void rms_norm_flawed<double>(double*, const double*, const double*, int, int, double, RmsNormFlaws);
template Matrix<float> wrong_leading_dimension<float>(const Matrix<float>&);
template Matrix<double> wrong_leading_dimension<double>(const Matrix<double>&);

}  // namespace diffrun::ref
