// GeGLU: gelu_tanh(gate) * up elementwise. T tokens, F hidden width.
#include "reference_cpu/ops/geglu.hpp"

#include <cmath>

namespace diffrun::ref {

template <typename T>
void geglu(T* out /* [T,F] */, const T* gate /* [T,F] */, const T* up /* [T,F] */, int64_t n) {
  const T c = std::sqrt(T(2) / T(M_PI));
  for (int64_t i = 0; i < n; ++i) {
    const T g = gate[i];
    out[i] = T(0.5) * g * (T(1) + std::tanh(c * (g + T(0.044715) * g * g * g))) * up[i];
  }
}

template void geglu<float>(float*, const float*, const float*, int64_t);
template void geglu<double>(double*, const double*, const double*, int64_t);

}  // namespace diffrun::ref
