// Greedy argmax over one row of logits: the largest value, ties to the lowest index (or the highest).
#include "reference_cpu/ops/argmax.hpp"

namespace diffrun::ref {

int32_t argmax(const float* logits /* [V] */, int V, ArgmaxTies ties) {
  int32_t best = -1;
  for (int i = 0; i < V; ++i) {
    if (logits[i] != logits[i]) continue;  // NaN
    if (best < 0 || logits[i] > logits[best] || (ties == ArgmaxTies::highest && logits[i] == logits[best])) best = i;
  }
  return best;
}

}  // namespace diffrun::ref
