// The error pattern of one checkpoint: which heads, token rows, cache rows or channels are exact and which wrong.
//
// The tensor-wide metrics say how large an error is; the pattern says where it sits, which names the
// bug class: some heads exact and the rest wrong in attention (a query-to-KV head mapping), one cache
// row all zero in the engine (a write position), one token row wrong (that token), a few channels
// wrong (a weight row, bias or scale), cosine near 0 (a layout, a transpose or the wrong tensor),
// probability on future positions (the causal mask).
//
// Decisions:
// - A slice (one index of an axis) is exact when its rel L2 ||a_i - b_i|| / ||b_i|| is at most
//   `exact_below` (the caller passes its tolerance: the rule's row/head bound, else its rel L2 bound),
//   wrong otherwise; a slice holding a NaN or Inf on either side is wrong.
// - Axes reported: the row axis (T, or S for the cache), the head axis (H/Hkv), the channel axis (the
//   last dimension). An axis says something only when it has exact and wrong slices; when every
//   slice of every axis is wrong the summary says the error is spread over the whole tensor.
// - Where the data holds a NaN or Inf, the summary names the slices that hold them instead (the
//   finite differences beside them are beside the point), and only the token and channel hints
//   apply (one token; a few channels: a weight row).
// - Bug classes read from the error's structure (each checked only on the checkpoint given, each
//   silent unless the structure fits; PatternContext supplies what they need):
//   - Qrope/Krope [T, H, Dh]: every head vector keeps its length but the pairs that rotate together
//     differ (and the position-0 row is exact): the RoPE pairing ((2i, 2i+1) against (i, i+Dh/2)).
//     With the model's pairing, base and positions known, the engine's values are the reference's
//     with each pair i turned by an angle: k·f_i for every row (f_i = base^(-2i/Dh), k an integer:
//     the positions are off by k), or pos·(g_i - f_i) with g_i = base'^(-2i/Dh) (pair 0 exact: the
//     RoPE base, base' named); the turned reference must leave under 1% of the error's energy.
//   - the last dim a multiple of 32 (>= 64): the error constant within each block of 32 consecutive
//     elements of a row, and not the same in every block: a quantized block's offset (Q4_1's min with
//     the wrong sign).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "diff/metrics.hpp"

namespace diffrun::diff {

struct AxisPattern {
  std::string dim;                    // "H", "T", "S", "Dh", ...
  std::string label;                  // "heads", "token rows", "cache rows", "channels", "positions"
  int64_t extent = 0;
  std::vector<int64_t> exact, wrong;  // slice indices
  std::vector<int64_t> zero_engine;   // wrong slices that are all zero in the engine (and not in the reference)
  std::vector<int64_t> nonfinite;     // wrong slices holding a NaN or Inf on either side
  bool partial() const { return !exact.empty() && !wrong.empty(); }
};

struct ErrorPattern {
  std::string summary;       // one line; empty when the tensors agree
  std::string hint;          // the bug class it points to ("write position"); empty when none
  double cosine = 1.0;       // over the elements finite on both sides
  double exact_below = 0.0;  // the threshold used
  int64_t future_nonzero = 0;  // kq_soft_max: engine probability > 0 on a future position where the reference has 0
  std::vector<AxisPattern> axes;
};

// What the RoPE hints need to know beyond the data; the defaults leave them to the data alone.
struct PatternContext {
  int64_t first_position = -1;  // position of token row 0 (T layouts); -1 unknown
  double rope_theta = 0.0;      // the model's RoPE base for this layer; 0 unknown
  bool rope_neox = false;       // pairs (i, i+Dh/2); false: (2i, 2i+1)
  std::vector<float> rope_freq_factors;  // per pair, dividing its frequency; empty: none
};

// "0-4,6,9-11" (sorted indices).
std::string format_ranges(const std::vector<int64_t>& indices);

// `base` is the checkpoint kind ("kq_soft_max"); a and b have the same number of elements.
ErrorPattern error_pattern(std::span<const float> a, std::span<const float> b, std::span<const int64_t> shape,
                           std::string_view layout, const DimSizes& dims, std::string_view base, double exact_below,
                           const PatternContext& context = {});

}  // namespace diffrun::diff
