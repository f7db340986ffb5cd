// Rotary position embedding, rope_norm (pairs 2i, 2i+1) and rope_neox (pairs i, i+Dh/2). T tokens, nh heads, Dh width.
#include "reference_cpu/ops/rope.hpp"

#include <cmath>
#include <cstdint>

namespace diffrun::ref {

namespace {

// Rotates the pair (a, b) of every head of every token; `stride` is the distance between a and b,
// `step` the distance between consecutive pairs' first elements.
template <typename T>
void rope(T* out, const T* x, int n_tokens, int n_head, int Dh, int pos0, T theta, const T* freq_factors, int stride,
          int step) {
  const int half = Dh / 2;
  for (int t = 0; t < n_tokens; ++t) {
    const T pos = static_cast<T>(pos0 + t);
    for (int i = 0; i < half; ++i) {
      const T freq = std::pow(theta, -T(2) * T(i) / T(Dh));
      const T angle = freq_factors ? pos * freq / freq_factors[i] : pos * freq;
      const T c = std::cos(angle);
      const T s = std::sin(angle);
      for (int h = 0; h < n_head; ++h) {
        const int64_t base = (static_cast<int64_t>(t) * n_head + h) * Dh + static_cast<int64_t>(i) * step;
        const T a = x[base];
        const T b = x[base + stride];
        out[base] = a * c - b * s;
        out[base + stride] = a * s + b * c;
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_norm(T* out /* [T,nh*Dh] */, const T* x /* [T,nh*Dh] */, int n_tokens, int n_head, int Dh, int pos0,
               T theta, const T* freq_factors) {
  rope(out, x, n_tokens, n_head, Dh, pos0, theta, freq_factors, /*stride=*/1, /*step=*/2);
}

template <typename T>
void rope_neox(T* out /* [T,nh*Dh] */, const T* x /* [T,nh*Dh] */, int n_tokens, int n_head, int Dh, int pos0,
               T theta, const T* freq_factors) {
  rope(out, x, n_tokens, n_head, Dh, pos0, theta, freq_factors, /*stride=*/Dh / 2, /*step=*/1);
}

template void rope_norm<float>(float*, const float*, int, int, int, int, float, const float*);
template void rope_norm<double>(double*, const double*, int, int, int, int, double, const double*);
template void rope_neox<float>(float*, const float*, int, int, int, int, float, const float*);
template void rope_neox<double>(double*, const double*, int, int, int, int, double, const double*);

}  // namespace diffrun::ref
