// RMSNorm times weight over the last dimension: rows of width D (T tokens, or T*H heads of width Dh).
#pragma once

namespace diffrun::ref {

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:]. out may alias x.
template <typename T>
void rms_norm(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D, T eps);

}  // namespace diffrun::ref
