// Greedy argmax over one row of logits, the twin of engine/ops/argmax.
#pragma once

#include <cstdint>

#include "model/op_variants.hpp"

namespace diffrun::ref {

// The index of the largest of logits[0..V), the lowest among equal values (ArgmaxTies::highest: the
// highest); NaN never wins; -1 when no value is comparable (all NaN).
int32_t argmax(const float* logits /* [V] */, int V, ArgmaxTies ties = ArgmaxTies::lowest);

}  // namespace diffrun::ref
