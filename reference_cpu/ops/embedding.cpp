// Embedding lookup (ggml get_rows). T tokens, D model width, V table rows.
#include "reference_cpu/ops/embedding.hpp"

#include <algorithm>
#include <string>

#include "model/error.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

namespace {

void check_id(int32_t id, int t, int V) {
  if (id < 0 || id >= V) {
    throw InputError("token id " + std::to_string(id) + " at position " + std::to_string(t) +
                     " is outside the vocabulary [0, " + std::to_string(V) + ")");
  }
}

}  // namespace

template <typename T>
void embedding(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const T* table /* [V,D] */, int n_tokens,
               int D, int V) {
  for (int t = 0; t < n_tokens; ++t) {
    check_id(tokens[t], t, V);
    std::copy_n(table + static_cast<int64_t>(tokens[t]) * D, D, out + static_cast<int64_t>(t) * D);
  }
}

template <typename T>
void embedding(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const WeightMatrix<T>& table /* [>=V,D] */,
               int n_tokens, int D, int V) {
  if (table.cols() != D || table.rows() < V) {
    throw ModelError("embedding: a [" + std::to_string(table.rows()) + ", " + std::to_string(table.cols()) +
                     "] table cannot give rows of " + std::to_string(D) + " for a vocabulary of " + std::to_string(V));
  }
  for (int t = 0; t < n_tokens; ++t) {
    check_id(tokens[t], t, V);
    table.decode_rows(out + static_cast<int64_t>(t) * D, tokens[t], 1);
  }
}

template void embedding<float>(float*, const int32_t*, const float*, int, int, int);
template void embedding<double>(double*, const int32_t*, const double*, int, int, int);
template void embedding<float>(float*, const int32_t*, const WeightMatrix<float>&, int, int, int);
template void embedding<double>(double*, const int32_t*, const WeightMatrix<double>&, int, int, int);

}  // namespace diffrun::ref
