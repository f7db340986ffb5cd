// Variants of ops that both backends share (twin ops take the same argument). Production runs each
// default; the fault catalog's faults on these ops (faults/faults.hpp) run the same ops, kernels
// included, with another variant, so a fault tests the code production runs, not a copy of it. The
// fault plan (faults/fault_plan.hpp) holds the variants a run's ops take.
#pragma once

#include <utility>

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

// What an RMSNorm gets wrong (none in production). The clean rms_norm ops carry no flaw; the
// backends' faults/ directories hold the flawed variant and the entry point that takes these flaws
// (the clean op when there are none).
struct RmsNormFlaws {
  bool off_by_one = false;        // rms_norm_off_by_one: the sum of squares misses x[D-1]
  bool eps_outside_sqrt = false;  // rms_eps_outside_sqrt: 1 / (sqrt(mean) + eps)
  bool unweighted = false;        // embd_norm_fused_no_weight (the reference's twin): the weight not applied
  bool skipped = false;           // post_norm_skipped: the op not run at all (in place: x stays as it is)
  bool any() const { return off_by_one || eps_outside_sqrt || unweighted || skipped; }
};

// What mixture-of-experts routing gets wrong (none in production); the backends' faults/ directories hold the entry
// point that takes these flaws.
struct MoeRoutingFlaws {
  bool softmax_over_topk = false;  // moe_softmax_over_topk: the weights a softmax over the K selected logits
  bool not_renormalised = false;   // moe_weights_not_renormalised: the K weights used as they are
  bool id_off_by_one = false;      // moe_expert_id_off_by_one: expert id + 1 (mod E) selected, and its weight
  bool any() const { return softmax_over_topk || not_renormalised || id_off_by_one; }
};

// Two operands of an op in the order it takes them: (a, b), or (b, a) when `swapped` (the fault plan's
// operand-order arguments: swiglu_gate_up_swapped hands SwiGLU (up, gate)).
template <typename P>
std::pair<P, P> in_order(P a, P b, bool swapped) {
  return swapped ? std::pair<P, P>{b, a} : std::pair<P, P>{a, b};
}

}  // namespace diffrun
