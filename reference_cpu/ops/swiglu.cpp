// SwiGLU: silu(gate) * up elementwise. T tokens, F hidden width.
#include "reference_cpu/ops/swiglu.hpp"

#include <cmath>

namespace diffrun::ref {

template <typename T>
void swiglu(T* out /* [T,F] */, const T* gate /* [T,F] */, const T* up /* [T,F] */, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (T(1) + std::exp(-gate[i])) * up[i];
}

template void swiglu<float>(float*, const float*, const float*, int64_t);
template void swiglu<double>(double*, const double*, const double*, int64_t);

}  // namespace diffrun::ref
