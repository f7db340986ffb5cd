// Residual add, elementwise. T tokens, D model width.
#include "reference_cpu/ops/add.hpp"

namespace diffrun::ref {

template <typename T>
void add(T* out /* [T,D] */, const T* a /* [T,D] */, const T* b /* [T,D] */, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template void add<float>(float*, const float*, const float*, int64_t);
template void add<double>(double*, const double*, const double*, int64_t);

}  // namespace diffrun::ref
