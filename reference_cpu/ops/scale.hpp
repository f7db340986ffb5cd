// Elementwise scalings: a constant factor (gemma3's embedding times sqrt(D)) and the logit softcap.
#pragma once

#include <cstdint>

namespace diffrun::ref {

// out[i] = x[i]·s for n elements. out may alias x.
template <typename T>
void scale(T* out /* [N] */, const T* x /* [N] */, T s, int64_t n);

// out[i] = cap·tanh(x[i]/cap) for n elements (cap > 0). out may alias x.
template <typename T>
void softcap(T* out /* [N] */, const T* x /* [N] */, T cap, int64_t n);

}  // namespace diffrun::ref
