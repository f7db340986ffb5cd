// SwiGLU activation of the feed-forward block: silu(gate) * up, elementwise. T tokens, F hidden width.
#pragma once

#include <cstdint>

namespace diffrun::ref {

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for n = T*F elements. out may alias gate or up.
template <typename T>
void swiglu(T* out /* [T,F] */, const T* gate /* [T,F] */, const T* up /* [T,F] */, int64_t n);

}  // namespace diffrun::ref
