// RMSNorm times weight over the last dimension (R rows of width D), summed in the scalar type.
#include "reference_cpu/ops/rms_norm.hpp"

#include <cmath>
#include <cstdint>

namespace diffrun::ref {

template <typename T>
void rms_norm(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps) {
  for (int r = 0; r < n_rows; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * D;
    T* yr = out + static_cast<int64_t>(r) * D;
    T sum = 0;
    for (int i = 0; i < D; ++i) sum += xr[i] * xr[i];
    const T scale = T(1) / std::sqrt(sum / T(D) + eps);
    for (int i = 0; i < D; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

template void rms_norm<float>(float*, const float*, const float*, int, int, float);
template void rms_norm<double>(double*, const double*, const double*, int, int, double);

}  // namespace diffrun::ref
