// GeGLU activation of the feed-forward block (gemma3): gelu_tanh(gate) * up, elementwise. T tokens, F hidden width.
#pragma once

#include <cstdint>

namespace diffrun::ref {

// out[i] = 0.5·g·(1 + tanh(sqrt(2/π)·(g + 0.044715·g³)))·up[i], g = gate[i], for n = T*F elements
// (GELU's tanh approximation, as ggml_geglu and transformers' gelu_pytorch_tanh). out may alias gate or up.
template <typename T>
void geglu(T* out /* [T,F] */, const T* gate /* [T,F] */, const T* up /* [T,F] */, int64_t n);

}  // namespace diffrun::ref
