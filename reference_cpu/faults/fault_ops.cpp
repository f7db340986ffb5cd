// Flawed variants of reference ops for fault injection (the modulo KV-head expansion, flawed RMSNorm, wrong-lda
// weights, logits over a padded vocabulary), and the entry points that take the fault plan's op arguments.
#include "reference_cpu/faults/fault_ops.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <Eigen/Core>

#include "faults/faults.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/ops/moe.hpp"
#include "reference_cpu/ops/rms_norm.hpp"

namespace diffrun::ref {

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
void rms_norm(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps,
              RmsNormFlaws flaws) {
  if (!flaws.any()) {
    rms_norm(out, x, w, n_rows, D, eps);
  } else if (flaws.skipped) {
    if (out != x) std::copy_n(x, static_cast<int64_t>(n_rows) * D, out);
  } else if (flaws.unweighted) {  // the op handed ones for its weight
    const std::vector<T> ones(static_cast<size_t>(D), T(1));
    RmsNormFlaws rest = flaws;
    rest.unweighted = false;
    rms_norm(out, x, ones.data(), n_rows, D, eps, rest);
  } else {
    rms_norm_flawed(out, x, w, n_rows, D, eps, flaws);
  }
}

template <typename T>
Matrix<T> wrong_leading_dimension(const Matrix<T>& w /* [N,K] */) {
  const Eigen::Map<const Matrix<T>> as_kn(w.data(), w.cols(), w.rows());  // the same memory as [K, N]
  return as_kn.transpose();
}

template <typename T>
void matmul_padded(T* out /* [T,Np] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */, int n_tokens,
                   int K, int N, int Np) {
  if (Np == N) {
    matmul(out, x, W, static_cast<const T*>(nullptr), n_tokens, K, N);
    return;
  }
  for (int t = 0; t < n_tokens; ++t) {  // one row at a time: the same values (the sums' order is K's alone)
    T* row = out + static_cast<int64_t>(t) * Np;
    matmul(row, x + static_cast<int64_t>(t) * K, W, static_cast<const T*>(nullptr), 1, K, N);
    std::fill(row + N, row + Np, T(kFaultUninitialisedLogit));
  }
}

template <typename T>
AttentionKv<T>::AttentionKv(const T* k, const T* v, int rows, int H, int Hkv, int Dh, bool gqa_head_modulo)
    : k_(k), v_(v), heads_(Hkv) {
  if (!gqa_head_modulo) return;
  k_held_.resize(static_cast<size_t>(rows) * H * Dh);
  v_held_.resize(k_held_.size());
  expand_kv_heads_modulo(k_held_.data(), k, rows, H, Hkv, Dh);
  expand_kv_heads_modulo(v_held_.data(), v, rows, H, Hkv, Dh);
  k_ = k_held_.data();
  v_ = v_held_.data();
  heads_ = H;
}

template <typename T>
void moe_route(T* probs /* [T,E] */, int32_t* topk /* [T,K] */, T* weights /* [T,K] */, T* weights_norm /* [T,K] */,
               const T* logits /* [T,E] */, int n_tokens, int E, int K, bool renormalise, MoeRoutingFlaws flaws) {
  moe_route(probs, topk, weights, weights_norm, logits, n_tokens, E, K, renormalise);
  if (!flaws.any()) return;
  for (int t = 0; t < n_tokens; ++t) {
    const T* l = logits + static_cast<size_t>(t) * E;
    const T* p = probs + static_cast<size_t>(t) * E;
    int32_t* ids = topk + static_cast<size_t>(t) * K;
    T* w = weights + static_cast<size_t>(t) * K;
    T* wn = weights_norm + static_cast<size_t>(t) * K;
    if (flaws.id_off_by_one)
      for (int j = 0; j < K; ++j) w[j] = p[ids[j] = (ids[j] + 1) % E];
    if (flaws.softmax_over_topk) {
      T max = l[ids[0]], sum = 0;
      for (int j = 1; j < K; ++j) max = std::max(max, l[ids[j]]);
      for (int j = 0; j < K; ++j) sum += (w[j] = std::exp(l[ids[j]] - max));
      for (int j = 0; j < K; ++j) w[j] /= sum;
    }
    T w_sum = 0;
    for (int j = 0; j < K; ++j) w_sum += w[j];
    const bool norm = renormalise && !flaws.not_renormalised;
    for (int j = 0; j < K; ++j) wn[j] = norm ? w[j] / std::max(w_sum, T(6.103515625e-5)) : w[j];
  }
}

template <typename T>
void scale_rows(T* out /* [T,D] */, const T* shexp /* [T,D] */, const T* gate /* [T] */, int n_tokens, int D,
                bool gate_skipped) {
  if (!gate_skipped) return scale_rows(out, shexp, gate, n_tokens, D);
  if (out != shexp) std::copy_n(shexp, static_cast<size_t>(n_tokens) * D, out);
}

template void scale_rows<float>(float*, const float*, const float*, int, int, bool);
template void scale_rows<double>(double*, const double*, const double*, int, int, bool);
template void moe_route<float>(float*, int32_t*, float*, float*, const float*, int, int, int, bool, MoeRoutingFlaws);
template void moe_route<double>(double*, int32_t*, double*, double*, const double*, int, int, int, bool,
                                MoeRoutingFlaws);
template void expand_kv_heads_modulo<float>(float*, const float*, int, int, int, int);
template void expand_kv_heads_modulo<double>(double*, const double*, int, int, int, int);
template void rms_norm_flawed<float>(float*, const float*, const float*, int, int, float, RmsNormFlaws);
template void rms_norm_flawed<double>(double*, const double*, const double*, int, int, double, RmsNormFlaws);
template void rms_norm<float>(float*, const float*, const float*, int, int, float, RmsNormFlaws);
template void rms_norm<double>(double*, const double*, const double*, int, int, double, RmsNormFlaws);
template Matrix<float> wrong_leading_dimension<float>(const Matrix<float>&);
template Matrix<double> wrong_leading_dimension<double>(const Matrix<double>&);
template void matmul_padded<float>(float*, const float*, const WeightMatrix<float>&, int, int, int, int);
template void matmul_padded<double>(double*, const double*, const WeightMatrix<double>&, int, int, int, int);
template class AttentionKv<float>;
template class AttentionKv<double>;

}  // namespace diffrun::ref
