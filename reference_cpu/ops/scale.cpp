// Elementwise scalings: a constant factor and the logit softcap cap·tanh(x/cap).
#include "reference_cpu/ops/scale.hpp"

#include <cmath>

namespace diffrun::ref {

template <typename T>
void scale(T* out /* [N] */, const T* x /* [N] */, T s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * s;
}

template <typename T>
void softcap(T* out /* [N] */, const T* x /* [N] */, T cap, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = cap * std::tanh(x[i] / cap);
}

template void scale<float>(float*, const float*, float, int64_t);
template void scale<double>(double*, const double*, double, int64_t);
template void softcap<float>(float*, const float*, float, int64_t);
template void softcap<double>(double*, const double*, double, int64_t);

}  // namespace diffrun::ref
