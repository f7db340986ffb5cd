// Causal (by default) GQA attention over the KV cache, optionally within a sliding window. T new tokens, S = n_past + T positions, H/Hkv heads, Dh width.
#include "reference_cpu/ops/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <Eigen/Core>

namespace diffrun::ref {

template <typename T>
void attention(T* out /* [T,H*Dh] */, T* probs /* [H,T,S] */, const T* q /* [T,H*Dh] */,
               const T* k_cache /* [S,Hkv*Dh] */, const T* v_cache /* [S,Hkv*Dh] */, int n_tokens, int n_past,
               int H, int Hkv, int Dh, T scale, int window, AttentionVariant variant) {
  const int S = n_past + n_tokens;
  const int group = H / Hkv;
  const int64_t q_stride = static_cast<int64_t>(H) * Dh;
  const int64_t kv_stride = static_cast<int64_t>(Hkv) * Dh;
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < H; ++h) {
    for (int t = 0; t < n_tokens; ++t) {
      const int kvh = h / group;
      const int n_visible = variant.causal ? n_past + t + 1 : S;  // causal: positions 0..n_past+t
      const int first = variant.causal && window > 0 ? std::max(0, n_visible - window) : 0;  // the last `window`
      const T* qt = q + t * q_stride + static_cast<int64_t>(h) * Dh;
      T* p = probs + (static_cast<int64_t>(h) * n_tokens + t) * S;
      T max_score = -std::numeric_limits<T>::infinity();
      for (int s = 0; s < first; ++s) p[s] = 0;
      for (int s = first; s < n_visible; ++s) {
        const T* ks = k_cache + s * kv_stride + static_cast<int64_t>(kvh) * Dh;
        T dot = 0;
        for (int d = 0; d < Dh; ++d) dot += qt[d] * ks[d];
        p[s] = variant.f16_exp ? dot : dot * scale;  // f16_exp: the raw dot
        if (p[s] > max_score) max_score = p[s];
      }
      T sum = 0;
      for (int s = first; s < n_visible; ++s) {
        if (variant.f16_exp)  // exp of the raw dot rounded to f16 (Inf above 65504), then ^scale; no max
          p[s] = std::pow(T(static_cast<float>(Eigen::half(static_cast<float>(std::exp(p[s]))))), scale);
        else
          p[s] = std::exp(p[s] - max_score);
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

template void attention<float>(float*, float*, const float*, const float*, const float*, int, int, int, int, int,
                               float, int, AttentionVariant);
template void attention<double>(double*, double*, const double*, const double*, const double*, int, int, int, int,
                                int, double, int, AttentionVariant);

}  // namespace diffrun::ref
