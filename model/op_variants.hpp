// Variants of ops that both backends share (twin ops take the same argument). Production runs each
// default; the fault catalog's faults on these ops (checkpoints/faults.hpp) run the same ops, kernels
// included, with another variant, so a fault tests the code production runs, not a copy of it.
#pragma once

namespace diffrun {

// How attention forms its probabilities. Default: causal (with the layer's sliding window), softmax with
// the row max subtracted, in the op's precision.
struct AttentionVariant {
  bool causal = true;    // false: every query attends to all S positions, and the window is dropped
  bool f16_exp = false;  // weights f16(exp(q·k))^scale with no max subtracted: Inf once q·k > ~11.09
};

// Which index argmax returns among equal largest values: the lowest (production, as llama.cpp's greedy
// sampler and every reference) or the highest (fault argmax_ties_highest).
enum class ArgmaxTies { lowest, highest };

}  // namespace diffrun
