// Embedding lookup (ggml get_rows): one row of the token table per input id. T tokens, D model width, V table rows.
#pragma once

#include <cstdint>


namespace diffrun::ref {

template <typename T>
class WeightMatrix;  // reference_cpu/weights.hpp (not included: ops headers carry no Eigen types)

// out[t, :] = table[tokens[t], :]. Throws InputError for an id outside [0, V).
template <typename T>
void embedding(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const T* table /* [V,D] */, int n_tokens,
               int D, int V);

// The same from a table held as GGUF bytes: each id's row decoded (weights.hpp), the same values.
template <typename T>
void embedding(T* out /* [T,D] */, const int32_t* tokens /* [T] */, const WeightMatrix<T>& table /* [>=V,D] */,
               int n_tokens, int D, int V);

}  // namespace diffrun::ref
