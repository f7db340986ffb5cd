// Per-checkpoint error metrics between an engine tensor (a) and a reference tensor (b), in double.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace diffrun::diff {

// Element-wise tolerance: an element passes when |a-b| <= atol + rtol*|b|.
struct ElementTolerance {
  double atol = 0.0;
  double rtol = 0.0;
};

// Sizes of the layout letters (D, H, Hkv, Dh, F, V, ...) used to split a combined stored dimension
// such as "H*Dh" into its named coordinates.
using DimSizes = std::map<std::string, int64_t, std::less<>>;

// One coordinate of the worst element, named by its layout letter ("T" = 3).
struct Coordinate {
  std::string dim;
  int64_t index;
};

// The first non-finite element of one side (row-major order).
struct NonFiniteSite {
  int64_t flat = -1;                  // -1 when that side is finite
  std::vector<Coordinate> coords;     // split by layout letters
  double value = 0.0;                 // NaN, inf or -inf
};

struct WorstElement {
  int64_t flat = -1;                  // row-major index; -1 when the tensors are empty
  std::vector<Coordinate> coords;     // split by layout letters
  double a = 0.0;                     // engine value
  double b = 0.0;                     // reference value
  double abs_err = 0.0;               // |a-b| (inf when one side is non-finite)
};

// The worst slice of one axis: rel L2 ||a_i - b_i|| / ||b_i|| over each index i of the axis (a token
// row, a head, a channel), the largest of them and which. Absent (extent 0) when the layout has no
// such axis; rel_l2 NaN when the data holds a NaN or Inf.
struct AxisWorst {
  std::string dim;        // "T", "S" (cache rows), "H", "Hkv", or the last dimension's letter
  int64_t extent = 0;     // 0: the tensor has no such axis
  int64_t index = -1;     // the worst slice
  double rel_l2 = 0.0;    // 0 when both sides of every slice are 0, inf when only b's worst one is
};

// A tensor's dimensions as named by its layout, combined dimensions ("H*Dh") split where their
// sizes are known; empty when the layout does not name every stored dimension.
struct NamedDim {
  std::string dim;
  int64_t extent;
};
std::vector<NamedDim> named_dims(std::span<const int64_t> shape, std::string_view layout, const DimSizes& dims);

// Which named dimension is the row (T, else S), the head (H or Hkv) and the channel (the last) axis;
// -1 where there is none (channel: only for rank >= 2).
struct SliceAxes {
  int row = -1, head = -1, channel = -1;
};
SliceAxes slice_axes(const std::vector<NamedDim>& named);

// For logits [T, V]: agreement of the distributions per token.
struct LogitMetrics {
  int64_t tokens = 0;
  std::vector<int32_t> argmax_a;      // per token
  std::vector<int32_t> argmax_b;
  double top1 = 0.0;                  // fraction of tokens whose argmax agrees
  double top5_overlap = 0.0;          // mean |top5(a) ∩ top5(b)| / min(5, V) over tokens
  std::vector<double> kl;             // KL(softmax(b) || softmax(a)) per token, in nats
  double kl_mean = 0.0;
  double kl_max = 0.0;
  // The engine's (side a's) last row: its kLastTop largest finite values as (value, index), by value
  // descending then index ascending; what compare's argmax check reads (compare.cpp), so that it needs
  // no values kept.
  static constexpr size_t kLastTop = 8;
  std::vector<std::pair<float, int32_t>> top_a_last;
};

// Aggregates over data holding a NaN or Inf on either side are NaN (undefined), never a finite
// number: max_abs, mean_abs, rel_l2, nmse, cosine, sqnr_db, min_atol, min_rtol and the logit metrics.
struct TensorMetrics {
  int64_t n = 0;                      // elements compared
  double max_abs = 0.0;
  double mean_abs = 0.0;
  double rel_l2 = 0.0;                // ||a-b|| / ||b||; 0 when both are 0, inf when only b is 0
  double nmse = 0.0;                  // sum (a-b)^2 / sum b^2
  double cosine = 1.0;                // a.b / (|a||b|); 1 when both are zero, 0 when one is
  double sqnr_db = 0.0;               // 10 log10(sum b^2 / sum (a-b)^2); inf when equal
  int64_t n_fail = 0;                 // elements outside atol + rtol*|b| (non-finite mismatches included)
  double fail_frac = 0.0;
  int64_t nan_a = 0, inf_a = 0, nan_b = 0, inf_b = 0;
  int64_t nonfinite_mismatch = 0;     // non-finite on one side where the other side differs
  NonFiniteSite first_nonfinite_a, first_nonfinite_b;
  AxisWorst row, head, channel;       // per token row (or cache row), per head, per channel
  WorstElement worst;                 // largest |a-b| / (atol + rtol|b|), or largest |a-b| if both 0
  double min_atol = 0.0;              // smallest atol (rtol = 0) that passes every element
  double min_rtol = 0.0;              // smallest rtol (at the given atol) that passes every element
  ElementTolerance tolerance;         // the atol/rtol used for n_fail, worst, min_rtol
  std::optional<LogitMetrics> logits;

  int64_t nonfinite() const { return nan_a + inf_a + nan_b + inf_b; }  // on both sides
  bool finite() const { return nonfinite() == 0; }
};

// Row-major index -> coordinates named by `layout` ("T,H*Dh": T, H, Dh). A combined dimension
// "X*Y" is split when the size of Y (and X) is known in `dims` and matches the stored extent.
std::vector<Coordinate> layout_coordinates(int64_t flat, std::span<const int64_t> shape,
                                           std::string_view layout, const DimSizes& dims);
std::string format_coordinates(const std::vector<Coordinate>& coords);  // "T=3, H=2, Dh=17"

// a and b have the same number of elements (callers check shapes first).
// compute_metrics' pass takes a group of 4 finite elements in one AVX2 register where the CPU has AVX2 (chosen at
// run time), else in two SSE2 registers; every path gives the same bits. allow_metrics_avx2(false) keeps it to SSE2
// (tests and benchmarks compare the two); metrics_avx2() says whether the next pass uses AVX2.
void allow_metrics_avx2(bool allowed);
bool metrics_avx2();

TensorMetrics compute_metrics(std::span<const float> a, std::span<const float> b,
                              std::span<const int64_t> shape, std::string_view layout,
                              const DimSizes& dims, ElementTolerance tol);

// Logit metrics over rows of length V (shape [T, V]); a row holding a non-finite value has KL NaN,
// and top1, top5_overlap, kl_mean and kl_max are NaN when any row does.
LogitMetrics compute_logit_metrics(std::span<const float> a, std::span<const float> b, int64_t rows,
                                   int64_t vocab);

// Index of the largest finite value of a row (-1 when none is finite).
int32_t argmax(std::span<const float> row);

}  // namespace diffrun::diff
