// Embedding lookup (ggml get_rows). T tokens, D model width, V table rows.
#include "reference_cpu/ops/embedding.hpp"

#include <algorithm>
#include <string>

#include "model/error.hpp"

namespace diffrun::ref {

template <typename T>
void embedding(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const T* table /* [V,D] */, int n_tokens,
               int D, int V) {
  for (int t = 0; t < n_tokens; ++t) {
    const int32_t id = tokens[t];
    if (id < 0 || id >= V) {
      throw InputError("token id " + std::to_string(id) + " at position " + std::to_string(t) +
                       " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
    std::copy_n(table + static_cast<int64_t>(id) * D, D, out + static_cast<int64_t>(t) * D);
  }
}

template void embedding<float>(float*, const int32_t*, const float*, int, int, int);
template void embedding<double>(double*, const int32_t*, const double*, int, int, int);

}  // namespace diffrun::ref
