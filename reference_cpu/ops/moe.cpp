// Mixture-of-experts routing (softmax, top-k, renormalised weights), the weighted sum of the experts' outputs and
// qwen2moe's shared expert gate.
// T tokens, E experts, K experts used per token, D model width.
#include "reference_cpu/ops/moe.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace diffrun::ref {

template <typename T>
void moe_route(T* probs /* [T,E] */, int32_t* topk /* [T,K] */, T* weights /* [T,K] */, T* weights_norm /* [T,K] */,
               const T* logits /* [T,E] */, int n_tokens, int E, int K, bool renormalise) {
  std::vector<int32_t> order(E);
  for (int t = 0; t < n_tokens; ++t) {
    const T* l = logits + static_cast<size_t>(t) * E;
    T* p = probs + static_cast<size_t>(t) * E;
    const T max = *std::max_element(l, l + E);
    T sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - max));
    for (int e = 0; e < E; ++e) p[e] /= sum;

    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    int32_t* ids = topk + static_cast<size_t>(t) * K;
    std::copy_n(order.begin(), K, ids);
    moe_weigh(weights + static_cast<size_t>(t) * K, weights_norm + static_cast<size_t>(t) * K, p, ids, K, renormalise);
  }
}

template <typename T>
void moe_weigh(T* weights /* [K] */, T* weights_norm /* [K] */, const T* probs /* [E] */, const int32_t* ids /* [K] */,
               int K, bool renormalise) {
  T w_sum = 0;
  for (int j = 0; j < K; ++j) w_sum += (weights[j] = probs[ids[j]]);
  const T divisor = std::max(w_sum, T(6.103515625e-5));
  for (int j = 0; j < K; ++j) weights_norm[j] = renormalise ? weights[j] / divisor : weights[j];
}

template <typename T>
void moe_combine(T* out /* [T,D] */, const T* down /* [T,K,D] */, const T* weights /* [T,K] */, int n_tokens, int K,
                 int D) {
  for (int t = 0; t < n_tokens; ++t) {
    T* o = out + static_cast<size_t>(t) * D;
    for (int j = 0; j < K; ++j) {
      const T* d = down + (static_cast<size_t>(t) * K + j) * D;
      const T w = weights[static_cast<size_t>(t) * K + j];
      for (int i = 0; i < D; ++i) o[i] = j == 0 ? d[i] * w : o[i] + d[i] * w;
    }
  }
}

template <typename T>
void shexp_gate_logits(T* gate_inp /* [T] */, const T* x /* [T,D] */, const T* w /* [D] */, int n_tokens, int D) {
  for (int t = 0; t < n_tokens; ++t) {
    const T* xt = x + static_cast<size_t>(t) * D;
    T sum = 0;
    for (int i = 0; i < D; ++i) sum += xt[i] * w[i];
    gate_inp[t] = sum;
  }
}

template <typename T>
void sigmoid(T* out /* [n] */, const T* x /* [n] */, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = T(1) / (T(1) + std::exp(-x[i]));
}

template <typename T>
void scale_rows(T* out /* [T,D] */, const T* shexp /* [T,D] */, const T* gate /* [T] */, int n_tokens, int D) {
  for (int t = 0; t < n_tokens; ++t)
    for (int i = 0; i < D; ++i) out[static_cast<size_t>(t) * D + i] = shexp[static_cast<size_t>(t) * D + i] * gate[t];
}

template void shexp_gate_logits<float>(float*, const float*, const float*, int, int);
template void shexp_gate_logits<double>(double*, const double*, const double*, int, int);
template void sigmoid<float>(float*, const float*, int64_t);
template void sigmoid<double>(double*, const double*, int64_t);
template void scale_rows<float>(float*, const float*, const float*, int, int);
template void scale_rows<double>(double*, const double*, const double*, int, int);
template void moe_weigh<float>(float*, float*, const float*, const int32_t*, int, bool);
template void moe_weigh<double>(double*, double*, const double*, const int32_t*, int, bool);
template void moe_route<float>(float*, int32_t*, float*, float*, const float*, int, int, int, bool);
template void moe_route<double>(double*, int32_t*, double*, double*, const double*, int, int, int, bool);
template void moe_combine<float>(float*, const float*, const float*, int, int, int);
template void moe_combine<double>(double*, const double*, const double*, int, int, int);

}  // namespace diffrun::ref
