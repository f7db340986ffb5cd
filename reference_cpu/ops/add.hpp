// Residual add, elementwise: out = a + b. T tokens, D model width.
#pragma once

#include <cstdint>

namespace diffrun::ref {

// n = T*D elements; out may alias a or b.
template <typename T>
void add(T* out /* [T,D] */, const T* a /* [T,D] */, const T* b /* [T,D] */, int64_t n);

}  // namespace diffrun::ref
