// The reference's KV cache: per layer, rotated keys and values of every position so far.
// C = max_ctx positions, Hkv key/value heads, Dh head width.
#pragma once

#include <vector>

#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

template <typename T>
struct KvCache {
  std::vector<Matrix<T>> k;  // [n_layer][C, Hkv*Dh]
  std::vector<Matrix<T>> v;  // [n_layer][C, Hkv*Dh]

  KvCache(int n_layer, int max_ctx, int kv_width)
      : k(n_layer, Matrix<T>::Zero(max_ctx, kv_width)), v(n_layer, Matrix<T>::Zero(max_ctx, kv_width)) {}
};

}  // namespace diffrun::ref
