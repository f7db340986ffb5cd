// A weight matrix as the engine's linear layers read it: dense rows of the engine's type W, or the
// GGUF blocks of a quantized format kept as they are in the file (engine/ops/qgemv.cuh reads them).
#pragma once

#include <cstdint>

#include "model/gguf.hpp"

namespace diffrun::engine {

template <typename W>
struct DeviceMatrix {
  // Consecutive quantized rows of one format (a concatenated group may mix formats: Q5_K_M's
  // attn_v is Q6_K in some layers, its attn_q and attn_k Q5_K).
  struct Segment {
    GgmlType type = GgmlType::F32;
    const void* raw = nullptr;  // rows × (K / block elements) blocks
    int rows = 0;
  };
  static constexpr int kMaxSegments = 3;

  const W* dense = nullptr;  // [rows, K], or nullptr when quantized
  int K = 0;
  int rows = 0;  // rows from this matrix to the end of its concatenation group (Wq|Wk|Wv, Wgate|Wup)
  int n_segments = 0;
  Segment segments[kMaxSegments];
  W* scratch = nullptr;  // quantized only: the dense rows of a step of several tokens, shared by all matrices

  bool quantized() const { return dense == nullptr; }
};

}  // namespace diffrun::engine
