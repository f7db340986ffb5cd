// Per-checkpoint error metrics, in double; mirrored by python/diffrun/metrics.py.
#include "diff/metrics.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DIFFRUN_METRICS_AVX2 1  // groups_avx2, compiled for AVX2 alone and chosen at run time
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <tuple>

#include <fmt/core.h>

#include "checkpoints/dump_schema_names.hpp"
#include "checkpoints/vocabulary.hpp"

namespace diffrun::diff {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kBelow = 1.0 - 1e-12;  // may_pass's margin over fl(w * den)'s rounding
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Splits one stored dimension of `extent` into the sizes of its factors ("H*Dh"), or returns
// an empty vector when the factors' sizes cannot be established.
std::vector<int64_t> factor_sizes(const std::vector<std::string>& factors, int64_t extent,
                                  const DimSizes& dims) {
  std::vector<int64_t> sizes(factors.size(), 0);
  int unknown = -1;
  int64_t known_product = 1;
  for (size_t i = 0; i < factors.size(); ++i) {
    auto it = dims.find(factors[i]);
    if (it == dims.end() || it->second <= 0) {
      if (unknown >= 0) return {};
      unknown = static_cast<int>(i);
      continue;
    }
    sizes[i] = it->second;
    known_product *= it->second;
  }
  if (unknown >= 0) {
    if (known_product <= 0 || extent % known_product != 0) return {};
    sizes[unknown] = extent / known_product;
  } else if (known_product != extent) {
    return {};
  }
  return sizes;
}

// The lanes of a sum (compute_metrics' summation order), added as (0 + 1) + (2 + 3).
constexpr int kLanes = 4;
struct Lanes {
  double v[kLanes] = {};
  double total() const { return (v[0] + v[1]) + (v[2] + v[3]); }
};

// Whether num / den may be greater than w (w the largest quotient so far, den > 0): not when num is below w * den,
// as then the quotient rounds to at most w. fl(w * den), shrunk by far more than its rounding, is the test; where it
// is not a normal number the quotient must be computed. compute_metrics divides only for the rare elements that may
// set a new largest.
bool may_pass(double num, double w, double den) {
  const double p = w * den;
  return !(p >= std::numeric_limits<double>::min() && num <= p * kBelow);
}

// Classes of non-finite values that count as equal on both sides.
bool same_nonfinite(double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::isinf(a) && std::isinf(b) && (a > 0) == (b > 0);
}

// compute_metrics' one pass over a tensor's elements, in the summation order of DESIGN.md ("The comparison's sums"),
// and what it has found so far. An innermost run goes through run(): its whole groups of kLanes elements finite on
// both sides by groups() (two lanes to an SSE2 register), the others (a group holding a NaN or an Inf, the run's last
// elements) by element(), whose arithmetic for a finite element is a group's for one lane, so that the path an
// element takes changes no bit.
struct ElementPass {
  ElementPass(TensorMetrics& metrics, ElementTolerance tolerance) : m(metrics), tol(tolerance) {}

  TensorMetrics& m;
  ElementTolerance tol;
  bool in_run[2] = {false, false};  // the row's and the head's sums stay in run_d2, run_b2 over a run
  double* pos_d2[3] = {};  // the slice sums indexed by the position in the run (a last-axis row or head; channel)
  double* pos_b2[3] = {};
  Lanes d2, a2, b2, ab, absd;     // the whole-tensor sums
  Lanes run_d2[2], run_b2[2];     // the current run's row and head sums
  double max_abs = 0.0, min_rtol = 0.0, worst_score = -1.0;
  int64_t n_fail = 0, n_finite = 0;
  const bool use_avx2 = metrics_avx2();

  void run(const float* ra, const float* rb, int64_t start, int64_t len) {
    for (int k = 0; k < 2; ++k) run_d2[k] = run_b2[k] = {};
#if DIFFRUN_METRICS_AVX2
    int64_t j = use_avx2 ? groups_avx2(ra, rb, start, len) : groups(ra, rb, start, len);
#else
    int64_t j = groups(ra, rb, start, len);
#endif
    for (; j < len; ++j) element(start + j, j, ra[j], rb[j]);
  }

  // The worst element and the smallest passing rtol, for element i (finite on both sides): each quotient divided out
  // only where it may pass the largest so far (may_pass).
  void largest(int64_t i, double x, double y, double abs_err, double abs_y, double bound) {
    if (bound > 0 ? may_pass(abs_err, worst_score, bound) : abs_err > worst_score) {
      const double score = bound > 0 ? abs_err / bound : abs_err;
      if (score > worst_score) {
        worst_score = score;
        m.worst = {i, {}, x, y, abs_err};
      }
    }
    if (abs_err > tol.atol && (!(abs_y > 0) || may_pass(abs_err - tol.atol, min_rtol, abs_y)))
      min_rtol = std::max(min_rtol, abs_y > 0 ? (abs_err - tol.atol) / abs_y : kInf);
  }

  // Element i, at position j of its run, alone.
  void element(int64_t i, int64_t j, double x, double y) {
    const bool fx = std::isfinite(x), fy = std::isfinite(y);
    if (fx && fy) {
      const int lane = static_cast<int>(j % kLanes);
      const double d = x - y;
      const double dd = d * d, yy = y * y, abs_err = std::abs(d), abs_y = std::abs(y);
      const double bound = tol.atol + tol.rtol * abs_y;
      d2.v[lane] += dd;
      a2.v[lane] += x * x;
      b2.v[lane] += yy;
      ab.v[lane] += x * y;
      absd.v[lane] += abs_err;
      for (int k = 0; k < 2; ++k) {
        if (!in_run[k]) continue;
        run_d2[k].v[lane] += dd;
        run_b2[k].v[lane] += yy;
      }
      for (int k = 0; k < 3; ++k) {
        if (!pos_d2[k]) continue;
        pos_d2[k][j] += dd;
        pos_b2[k][j] += yy;
      }
      max_abs = std::max(max_abs, abs_err);
      n_fail += abs_err > bound;
      ++n_finite;
      largest(i, x, y, abs_err, abs_y, bound);
      return;
    }
    if (!fx) {
      ++(std::isnan(x) ? m.nan_a : m.inf_a);
      if (m.first_nonfinite_a.flat < 0) m.first_nonfinite_a = {i, {}, x};
    }
    if (!fy) {
      ++(std::isnan(y) ? m.nan_b : m.inf_b);
      if (m.first_nonfinite_b.flat < 0) m.first_nonfinite_b = {i, {}, y};
    }
    if (same_nonfinite(x, y)) return;
    ++m.nonfinite_mismatch;
    ++n_fail;
    min_rtol = kInf;
    if (kInf > worst_score) {
      worst_score = kInf;
      m.worst = {i, {}, x, y, kInf};
    }
  }

  // The run's whole groups of kLanes elements; returns how many elements it took (none without SSE2). The lanes'
  // sums stay in registers but while element() takes a group; largest() is asked only for a group one of whose
  // elements may set a new worst score or smallest passing rtol (checked as masks, the same test as may_pass).
  int64_t groups(const float* ra, const float* rb, int64_t start, int64_t len) {
#if defined(__SSE2__)
    const __m128d zero = _mm_setzero_pd(), sign = _mm_set1_pd(-0.0), atol = _mm_set1_pd(tol.atol),
                  rtol = _mm_set1_pd(tol.rtol), smallest = _mm_set1_pd(std::numeric_limits<double>::min()),
                  below = _mm_set1_pd(kBelow), all_ones = _mm_cmpeq_pd(zero, zero);
    const int64_t end = len - len % kLanes;
    Lanes* const sums[5] = {&d2, &a2, &b2, &ab, &absd};
    __m128d acc[5][2];
    __m128d vmax;
    const auto load = [&] {
      for (int q = 0; q < 5; ++q)
        for (int h = 0; h < 2; ++h) acc[q][h] = _mm_loadu_pd(sums[q]->v + 2 * h);
      vmax = _mm_set1_pd(max_abs);
    };
    const auto store = [&] {
      for (int q = 0; q < 5; ++q)
        for (int h = 0; h < 2; ++h) _mm_storeu_pd(sums[q]->v + 2 * h, acc[q][h]);
      max_abs = std::max(_mm_cvtsd_f64(vmax), _mm_cvtsd_f64(_mm_unpackhi_pd(vmax, vmax)));
    };
    load();
    for (int64_t j = 0; j < end; j += kLanes) {
      const __m128 xf = _mm_loadu_ps(ra + j), yf = _mm_loadu_ps(rb + j);
      const __m128d x[2] = {_mm_cvtps_pd(xf), _mm_cvtps_pd(_mm_movehl_ps(xf, xf))};
      const __m128d y[2] = {_mm_cvtps_pd(yf), _mm_cvtps_pd(_mm_movehl_ps(yf, yf))};
      int finite = 3;  // v - v is 0 for a finite v, NaN for an infinite or NaN one
      for (int h = 0; h < 2; ++h)
        finite &= _mm_movemask_pd(_mm_and_pd(_mm_cmpeq_pd(_mm_sub_pd(x[h], x[h]), zero),
                                             _mm_cmpeq_pd(_mm_sub_pd(y[h], y[h]), zero)));
      if (finite != 3) [[unlikely]] {
        store();
        for (int64_t q = j; q < j + kLanes; ++q) element(start + q, q, ra[q], rb[q]);
        load();
        continue;
      }
      const __m128d w = _mm_set1_pd(worst_score), r = _mm_set1_pd(min_rtol);
      int may_set = 0;
      for (int h = 0; h < 2; ++h) {
        const __m128d d = _mm_sub_pd(x[h], y[h]);
        const __m128d dd = _mm_mul_pd(d, d), yy = _mm_mul_pd(y[h], y[h]);
        const __m128d abs_err = _mm_andnot_pd(sign, d), abs_y = _mm_andnot_pd(sign, y[h]);
        const __m128d bound = _mm_add_pd(atol, _mm_mul_pd(rtol, abs_y));
        acc[0][h] = _mm_add_pd(acc[0][h], dd);
        acc[1][h] = _mm_add_pd(acc[1][h], _mm_mul_pd(x[h], x[h]));
        acc[2][h] = _mm_add_pd(acc[2][h], yy);
        acc[3][h] = _mm_add_pd(acc[3][h], _mm_mul_pd(x[h], y[h]));
        acc[4][h] = _mm_add_pd(acc[4][h], abs_err);
        const auto add = [](double* p, __m128d v) { _mm_storeu_pd(p, _mm_add_pd(_mm_loadu_pd(p), v)); };
        for (int k = 0; k < 2; ++k) {
          if (!in_run[k]) continue;
          add(run_d2[k].v + 2 * h, dd);
          add(run_b2[k].v + 2 * h, yy);
        }
        for (int k = 0; k < 3; ++k) {
          if (!pos_d2[k]) continue;
          add(pos_d2[k] + j + 2 * h, dd);
          add(pos_b2[k] + j + 2 * h, yy);
        }
        vmax = _mm_max_pd(vmax, abs_err);
        const int over = _mm_movemask_pd(_mm_cmpgt_pd(abs_err, bound));
        n_fail += (over & 1) + (over >> 1);
        const __m128d p1 = _mm_mul_pd(w, bound), p2 = _mm_mul_pd(r, abs_y);
        const __m128d skip1 = _mm_and_pd(_mm_cmpge_pd(p1, smallest), _mm_cmple_pd(abs_err, _mm_mul_pd(p1, below)));
        const __m128d skip2 = _mm_and_pd(_mm_cmpge_pd(p2, smallest),
                                         _mm_cmple_pd(_mm_sub_pd(abs_err, atol), _mm_mul_pd(p2, below)));
        const __m128d positive = _mm_cmpgt_pd(bound, zero);
        const __m128d score = _mm_or_pd(_mm_andnot_pd(skip1, positive),
                                        _mm_andnot_pd(positive, _mm_cmpgt_pd(abs_err, w)));
        const __m128d rt = _mm_and_pd(_mm_cmpgt_pd(abs_err, atol),
                                      _mm_or_pd(_mm_cmpngt_pd(abs_y, zero), _mm_andnot_pd(skip2, all_ones)));
        may_set |= _mm_movemask_pd(_mm_or_pd(score, rt));
      }
      n_finite += kLanes;
      if (may_set) [[unlikely]] {
        for (int64_t q = j; q < j + kLanes; ++q) {
          const double x1 = ra[q], y1 = rb[q], abs_y = std::abs(y1);
          largest(start + q, x1, y1, std::abs(x1 - y1), abs_y, tol.atol + tol.rtol * abs_y);
        }
      }
    }
    store();
    return end;
#else
    (void)ra, (void)rb, (void)start, (void)len;
    return 0;
#endif
  }

#if DIFFRUN_METRICS_AVX2
  // groups() with a group's kLanes elements in one AVX2 register, lane for lane the same operations (a product and
  // a sum, never fused: the build asks for AVX2 alone), so the same bits; chosen where the CPU has AVX2.
  __attribute__((target("avx2"))) int64_t groups_avx2(const float* ra, const float* rb, int64_t start, int64_t len) {
    const __m256d zero = _mm256_setzero_pd(), sign = _mm256_set1_pd(-0.0), atol = _mm256_set1_pd(tol.atol),
                  rtol = _mm256_set1_pd(tol.rtol), smallest = _mm256_set1_pd(std::numeric_limits<double>::min()),
                  below = _mm256_set1_pd(kBelow);
    const int64_t end = len - len % kLanes;
    Lanes* const sums[5] = {&d2, &a2, &b2, &ab, &absd};
    __m256d acc[5];
    for (int q = 0; q < 5; ++q) acc[q] = _mm256_loadu_pd(sums[q]->v);
    __m256d vmax = _mm256_set1_pd(max_abs);
    for (int64_t j = 0; j < end; j += kLanes) {
      const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(ra + j)), y = _mm256_cvtps_pd(_mm_loadu_ps(rb + j));
      // v - v is 0 for a finite v, NaN for an infinite or NaN one
      const __m256d finite = _mm256_and_pd(_mm256_cmp_pd(_mm256_sub_pd(x, x), zero, _CMP_EQ_OQ),
                                           _mm256_cmp_pd(_mm256_sub_pd(y, y), zero, _CMP_EQ_OQ));
      if (_mm256_movemask_pd(finite) != 0xf) [[unlikely]] {
        for (int q = 0; q < 5; ++q) _mm256_storeu_pd(sums[q]->v, acc[q]);
        max_abs = max_lane(vmax);
        for (int64_t q = j; q < j + kLanes; ++q) element(start + q, q, ra[q], rb[q]);
        for (int q = 0; q < 5; ++q) acc[q] = _mm256_loadu_pd(sums[q]->v);
        vmax = _mm256_set1_pd(max_abs);
        continue;
      }
      const __m256d d = _mm256_sub_pd(x, y);
      const __m256d dd = _mm256_mul_pd(d, d), yy = _mm256_mul_pd(y, y);
      const __m256d abs_err = _mm256_andnot_pd(sign, d), abs_y = _mm256_andnot_pd(sign, y);
      const __m256d bound = _mm256_add_pd(atol, _mm256_mul_pd(rtol, abs_y));
      acc[0] = _mm256_add_pd(acc[0], dd);
      acc[1] = _mm256_add_pd(acc[1], _mm256_mul_pd(x, x));
      acc[2] = _mm256_add_pd(acc[2], yy);
      acc[3] = _mm256_add_pd(acc[3], _mm256_mul_pd(x, y));
      acc[4] = _mm256_add_pd(acc[4], abs_err);
      for (int k = 0; k < 2; ++k) {
        if (!in_run[k]) continue;
        _mm256_storeu_pd(run_d2[k].v, _mm256_add_pd(_mm256_loadu_pd(run_d2[k].v), dd));
        _mm256_storeu_pd(run_b2[k].v, _mm256_add_pd(_mm256_loadu_pd(run_b2[k].v), yy));
      }
      for (int k = 0; k < 3; ++k) {
        if (!pos_d2[k]) continue;
        _mm256_storeu_pd(pos_d2[k] + j, _mm256_add_pd(_mm256_loadu_pd(pos_d2[k] + j), dd));
        _mm256_storeu_pd(pos_b2[k] + j, _mm256_add_pd(_mm256_loadu_pd(pos_b2[k] + j), yy));
      }
      vmax = _mm256_max_pd(vmax, abs_err);
      n_fail += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_pd(_mm256_cmp_pd(abs_err, bound, _CMP_GT_OQ))));
      const __m256d w = _mm256_set1_pd(worst_score), r = _mm256_set1_pd(min_rtol);
      const __m256d p1 = _mm256_mul_pd(w, bound), p2 = _mm256_mul_pd(r, abs_y);
      const __m256d skip1 = _mm256_and_pd(_mm256_cmp_pd(p1, smallest, _CMP_GE_OQ),
                                          _mm256_cmp_pd(abs_err, _mm256_mul_pd(p1, below), _CMP_LE_OQ));
      const __m256d skip2 = _mm256_and_pd(_mm256_cmp_pd(p2, smallest, _CMP_GE_OQ),
                                          _mm256_cmp_pd(_mm256_sub_pd(abs_err, atol), _mm256_mul_pd(p2, below), _CMP_LE_OQ));
      const __m256d positive = _mm256_cmp_pd(bound, zero, _CMP_GT_OQ);
      const __m256d score = _mm256_or_pd(_mm256_andnot_pd(skip1, positive),
                                         _mm256_andnot_pd(positive, _mm256_cmp_pd(abs_err, w, _CMP_GT_OQ)));
      // rt: abs_err > atol and (not abs_y > 0, or not skip2)
      const __m256d rt = _mm256_and_pd(_mm256_cmp_pd(abs_err, atol, _CMP_GT_OQ),
                                       _mm256_or_pd(_mm256_cmp_pd(abs_y, zero, _CMP_NGT_UQ),
                                                    _mm256_xor_pd(skip2, _mm256_cmp_pd(zero, zero, _CMP_EQ_OQ))));
      n_finite += kLanes;
      if (_mm256_movemask_pd(_mm256_or_pd(score, rt))) [[unlikely]] {
        for (int64_t q = j; q < j + kLanes; ++q) {
          const double x1 = ra[q], y1 = rb[q], abs_y1 = std::abs(y1);
          largest(start + q, x1, y1, std::abs(x1 - y1), abs_y1, tol.atol + tol.rtol * abs_y1);
        }
      }
    }
    for (int q = 0; q < 5; ++q) _mm256_storeu_pd(sums[q]->v, acc[q]);
    max_abs = max_lane(vmax);
    return end;
  }

  __attribute__((target("avx2"))) static double max_lane(__m256d v) {
    alignas(32) double lanes[kLanes];
    _mm256_store_pd(lanes, v);
    return std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  }
#endif
};

}  // namespace

namespace {
#if DIFFRUN_METRICS_AVX2
std::atomic<bool> g_avx2_allowed{true};
const bool g_cpu_avx2 = __builtin_cpu_supports("avx2");
#endif
}  // namespace

void allow_metrics_avx2(bool allowed) {
#if DIFFRUN_METRICS_AVX2
  g_avx2_allowed = allowed;
#else
  (void)allowed;
#endif
}

bool metrics_avx2() {
#if DIFFRUN_METRICS_AVX2
  return g_cpu_avx2 && g_avx2_allowed.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

std::vector<Coordinate> layout_coordinates(int64_t flat, std::span<const int64_t> shape,
                                           std::string_view layout, const DimSizes& dims) {
  std::vector<int64_t> index(shape.size(), 0);
  int64_t rest = flat;
  for (size_t i = shape.size(); i-- > 0;) {
    int64_t extent = std::max<int64_t>(shape[i], 1);
    index[i] = rest % extent;
    rest /= extent;
  }
  const std::vector<std::string> parts = layout.empty() ? std::vector<std::string>{} : layout_dims(layout);
  const std::vector<std::vector<std::string>> all_factors = layout_factors(layout);
  std::vector<Coordinate> coords;
  if (parts.size() != shape.size()) {
    for (size_t i = 0; i < shape.size(); ++i) coords.push_back({fmt::format("d{}", i), index[i]});
    return coords;
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::vector<std::string>& factors = all_factors[i];
    std::vector<int64_t> sizes = factors.size() > 1 ? factor_sizes(factors, shape[i], dims)
                                                    : std::vector<int64_t>{};
    if (sizes.empty()) {
      coords.push_back({parts[i], index[i]});
      continue;
    }
    std::vector<int64_t> sub(factors.size());
    int64_t r = index[i];
    for (size_t f = factors.size(); f-- > 0;) {
      sub[f] = r % sizes[f];
      r /= sizes[f];
    }
    for (size_t f = 0; f < factors.size(); ++f) coords.push_back({factors[f], sub[f]});
  }
  return coords;
}

std::vector<NamedDim> named_dims(std::span<const int64_t> shape, std::string_view layout, const DimSizes& dims) {
  const std::vector<std::string> parts = layout.empty() ? std::vector<std::string>{} : layout_dims(layout);
  const std::vector<std::vector<std::string>> all_factors = layout_factors(layout);
  std::vector<NamedDim> out;
  if (parts.size() != shape.size()) return out;
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::vector<std::string>& factors = all_factors[i];
    std::vector<int64_t> sizes = factors.size() > 1 ? factor_sizes(factors, shape[i], dims) : std::vector<int64_t>{};
    if (sizes.empty()) {
      out.push_back({parts[i], shape[i]});
      continue;
    }
    for (size_t f = 0; f < factors.size(); ++f) out.push_back({factors[f], sizes[f]});
  }
  return out;
}

SliceAxes slice_axes(const std::vector<NamedDim>& named) {
  SliceAxes ax;
  for (size_t i = 0; i < named.size(); ++i) {
    const std::string& d = named[i].dim;
    if (d == dim_letter::T) ax.row = static_cast<int>(i);
    if (d == dim_letter::S && ax.row < 0) ax.row = static_cast<int>(i);
    if ((d == dim_letter::H || d == dim_letter::Hkv) && ax.head < 0) ax.head = static_cast<int>(i);
  }
  // S is the row axis only of cache-like layouts (S first); in H,T,S it is the channel.
  if (ax.row >= 0 && named[ax.row].dim == dim_letter::S && ax.row != 0) ax.row = -1;
  if (named.size() >= 2) ax.channel = static_cast<int>(named.size()) - 1;
  if (ax.channel == ax.row || ax.channel == ax.head) ax.channel = -1;
  return ax;
}

std::string format_coordinates(const std::vector<Coordinate>& coords) {
  std::string out;
  for (const auto& c : coords) {
    if (!out.empty()) out += ", ";
    out += c.dim + "=" + std::to_string(c.index);
  }
  return out;
}

TensorMetrics compute_metrics(std::span<const float> a, std::span<const float> b,
                              std::span<const int64_t> shape, std::string_view layout,
                              const DimSizes& dims, ElementTolerance tol) {
  TensorMetrics m;
  m.tolerance = tol;
  m.n = static_cast<int64_t>(std::min(a.size(), b.size()));

  // Per-slice sums (d², b²) of the row, head and channel axes, filled in the same pass: the index of
  // an element along axis k is (i / stride_k) % extent_k, computed once per innermost run.
  const std::vector<NamedDim> named = named_dims(shape, layout, dims);
  int64_t named_n = 1;
  for (const auto& d : named) named_n *= d.extent;
  const SliceAxes ax = named_n == m.n ? slice_axes(named) : SliceAxes{};
  struct Slices {
    int axis = -1;
    int64_t stride = 1, extent = 0;
    std::vector<double> d2, b2;
  };
  Slices sl[3];
  sl[0].axis = ax.row;
  sl[1].axis = ax.head;
  sl[2].axis = ax.channel;
  for (auto& s : sl) {
    if (s.axis < 0) continue;
    s.extent = named[s.axis].extent;
    for (size_t k = s.axis + 1; k < named.size(); ++k) s.stride *= named[k].extent;
    s.d2.assign(static_cast<size_t>(s.extent), 0.0);
    s.b2.assign(static_cast<size_t>(s.extent), 0.0);
  }
  const int64_t inner = named.empty() || named_n != m.n ? std::max<int64_t>(m.n, 1) : named.back().extent;
  // The summation order (DESIGN.md, "The comparison's sums"): the tensor in its innermost runs (the last named
  // dimension's extent; the whole tensor where the layout does not name its shape), element j of a run into lane
  // j mod kLanes of each whole-tensor sum and of the row and head sums (whose index is the same over a run), each
  // lane in index order, the lanes added as (0 + 1) + (2 + 3): at the end for the whole-tensor sums, at the end of
  // each run into its row and head. A channel's sums (the position in the run) are in index order. Maxima, counts
  // and the worst element (its first occurrence) do not depend on the order.
  ElementPass pass(m, tol);
  for (int k = 0; k < 2; ++k) pass.in_run[k] = sl[k].extent > 0 && sl[k].stride != 1;
  for (int k = 0; k < 3; ++k) {
    if (sl[k].extent > 0 && (k == 2 || !pass.in_run[k])) {
      pass.pos_d2[k] = sl[k].d2.data();
      pass.pos_b2[k] = sl[k].b2.data();
    }
  }
  for (int64_t start = 0; start < m.n; start += inner) {
    pass.run(a.data() + start, b.data() + start, start, std::min(inner, m.n - start));
    for (int k = 0; k < 2; ++k) {
      if (!pass.in_run[k]) continue;
      const int64_t idx = (start / sl[k].stride) % sl[k].extent;
      sl[k].d2[idx] += pass.run_d2[k].total();
      sl[k].b2[idx] += pass.run_b2[k].total();
    }
  }
  const double sum_d2 = pass.d2.total(), sum_a2 = pass.a2.total(), sum_b2 = pass.b2.total(),
               sum_ab = pass.ab.total(), sum_absd = pass.absd.total();
  const int64_t n_finite = pass.n_finite;
  m.max_abs = pass.max_abs;
  m.min_rtol = pass.min_rtol;
  m.n_fail = pass.n_fail;
  if (m.worst.flat >= 0) m.worst.coords = layout_coordinates(m.worst.flat, shape, layout, dims);
  for (NonFiniteSite* site : {&m.first_nonfinite_a, &m.first_nonfinite_b}) {
    if (site->flat >= 0) site->coords = layout_coordinates(site->flat, shape, layout, dims);
  }
  m.mean_abs = n_finite > 0 ? sum_absd / static_cast<double>(n_finite) : 0.0;
  if (sum_b2 > 0) {
    m.rel_l2 = std::sqrt(sum_d2) / std::sqrt(sum_b2);
    m.nmse = sum_d2 / sum_b2;
  } else {
    m.rel_l2 = sum_d2 > 0 ? kInf : 0.0;
    m.nmse = m.rel_l2;
  }
  if (sum_a2 == 0 && sum_b2 == 0) {
    m.cosine = 1.0;
  } else if (sum_a2 == 0 || sum_b2 == 0) {
    m.cosine = 0.0;
  } else {
    m.cosine = sum_ab / std::sqrt(sum_a2 * sum_b2);
  }
  if (sum_d2 == 0) {
    m.sqnr_db = kInf;
  } else {
    m.sqnr_db = sum_b2 > 0 ? 10.0 * std::log10(sum_b2 / sum_d2) : -kInf;
  }
  m.fail_frac = m.n > 0 ? static_cast<double>(m.n_fail) / static_cast<double>(m.n) : 0.0;
  m.min_atol = m.nonfinite_mismatch > 0 ? kInf : m.max_abs;
  AxisWorst* worst_of[3] = {&m.row, &m.head, &m.channel};
  for (int k = 0; k < 3; ++k) {
    if (sl[k].extent == 0) continue;
    AxisWorst& w = *worst_of[k];
    w.dim = named[sl[k].axis].dim;
    w.extent = sl[k].extent;
    for (int64_t j = 0; j < sl[k].extent; ++j) {
      const double d2 = sl[k].d2[j], b2 = sl[k].b2[j];
      // A slice whose d2 is below the largest so far squared times its b2, by far more than their rounding, has a
      // quotient that rounds below it: two square roots and a division saved (most of a decode step's small
      // checkpoints' cost was here, a slice per channel).
      if (w.index >= 0 && b2 > 0 && !may_pass(d2, w.rel_l2 * w.rel_l2, b2)) continue;
      const double rel = b2 > 0 ? std::sqrt(d2) / std::sqrt(b2) : (d2 > 0 ? kInf : 0.0);
      if (w.index < 0 || rel > w.rel_l2) {
        w.index = j;
        w.rel_l2 = rel;
      }
    }
    if (!m.finite()) w.rel_l2 = kNaN;
  }
  if (!m.finite()) {
    // Over the finite pairs alone these would look like a verdict on the whole tensor (rel_l2 0
    // next to thousands of NaN): undefined instead.
    m.max_abs = m.mean_abs = m.rel_l2 = m.nmse = m.cosine = m.sqnr_db = m.min_atol = m.min_rtol = kNaN;
  }
  return m;
}

int32_t argmax(std::span<const float> row) {
  int32_t best = -1;
  for (size_t i = 0; i < row.size(); ++i) {
    if (!std::isfinite(row[i])) continue;
    if (best < 0 || row[i] > row[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

namespace {

// Indices of the k largest finite values among row[i] for i in `ids` (every index of the row when null), by value
// descending then index ascending: one pass keeping the best k so far in that order (the order is total, so these
// are the k a sort would put first, in its order).
std::vector<int32_t> top_k(std::span<const float> row, size_t k, int64_t begin, int64_t end,
                           const std::vector<int32_t>* ids = nullptr) {
  std::vector<int32_t> best;
  best.reserve(k);
  const auto before = [&](int32_t x, int32_t y) { return row[x] > row[y] || (row[x] == row[y] && x < y); };
  const auto take = [&](int32_t id) {
    if (!std::isfinite(row[static_cast<size_t>(id)])) return;
    if (best.size() == k && (k == 0 || !before(id, best.back()))) return;
    if (best.size() == k) best.pop_back();
    best.insert(std::upper_bound(best.begin(), best.end(), id, before), id);
  };
  if (ids) {
    for (int32_t id : *ids) take(id);
  } else {
    for (int64_t i = begin; i < end; ++i) take(static_cast<int32_t>(i));
  }
  return best;
}

// Logits a piece of work of compute_logit_metrics takes (a row's chunk).
constexpr int64_t kLogitChunk = 8192;

}  // namespace

LogitMetrics compute_logit_metrics(std::span<const float> a, std::span<const float> b, int64_t rows,
                                   int64_t vocab) {
  LogitMetrics lm;
  lm.tokens = rows;
  if (rows <= 0 || vocab <= 0) return lm;
  // Each row in chunks of kLogitChunk logits, the chunks of every row shared among the caller's OpenMP threads (a
  // decode step's one row of 152k logits is 450k exps), in three passes: each chunk's maxima and top k, then its sums
  // of exp(v - max), then its part of the KL. A row's sums are its chunks' sums (each in index order) added in chunk
  // order, so the figures do not depend on the thread count; maxima, argmax and top k are the whole row's.
  const int64_t per_row = (vocab + kLogitChunk - 1) / kLogitChunk, tasks = rows * per_row;
  const int64_t last = rows - 1;
  struct Chunk {
    bool finite_a = true, finite_b = true;
    double max_a = -kInf, max_b = -kInf, sum_a = 0, sum_b = 0, kl = 0;
    std::vector<int32_t> top_a, top_b, top_last;
  };
  struct Row {
    bool finite = false;
    double max_a = 0, max_b = 0, lse_a = 0, lse_b = 0;
  };
  std::vector<Chunk> chunk(static_cast<size_t>(tasks));
  std::vector<Row> row(static_cast<size_t>(rows));
  const auto range = [&](int64_t task) {
    const int64_t t = task / per_row, begin = (task % per_row) * kLogitChunk;
    return std::make_tuple(t, begin, std::min(vocab, begin + kLogitChunk));
  };
  const auto row_of = [&](std::span<const float> x, int64_t t) {
    return x.subspan(static_cast<size_t>(t * vocab), static_cast<size_t>(vocab));
  };
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const auto [t, begin, end] = range(task);
    const auto ra = row_of(a, t), rb = row_of(b, t);
    Chunk& c = chunk[static_cast<size_t>(task)];
    for (int64_t v = begin; v < end; ++v) {
      const float x = ra[static_cast<size_t>(v)], y = rb[static_cast<size_t>(v)];
      c.finite_a = c.finite_a && std::isfinite(x);
      c.finite_b = c.finite_b && std::isfinite(y);
      c.max_a = std::max(c.max_a, static_cast<double>(x));
      c.max_b = std::max(c.max_b, static_cast<double>(y));
    }
    c.top_a = top_k(ra, 5, begin, end);
    c.top_b = top_k(rb, 5, begin, end);
    if (t == last) c.top_last = top_k(ra, LogitMetrics::kLastTop, begin, end);
  }
  int64_t agree = 0;
  double overlap_sum = 0;
  for (int64_t t = 0; t < rows; ++t) {
    Row& r = row[static_cast<size_t>(t)];
    std::vector<int32_t> cand_a, cand_b, cand_last;
    r.finite = true;
    r.max_a = r.max_b = -kInf;
    for (int64_t i = t * per_row; i < (t + 1) * per_row; ++i) {
      const Chunk& c = chunk[static_cast<size_t>(i)];
      r.finite = r.finite && c.finite_a && c.finite_b;
      r.max_a = std::max(r.max_a, c.max_a);
      r.max_b = std::max(r.max_b, c.max_b);
      cand_a.insert(cand_a.end(), c.top_a.begin(), c.top_a.end());
      cand_b.insert(cand_b.end(), c.top_b.begin(), c.top_b.end());
      cand_last.insert(cand_last.end(), c.top_last.begin(), c.top_last.end());
    }
    const auto ra = row_of(a, t), rb = row_of(b, t);
    const std::vector<int32_t> ka = top_k(ra, 5, 0, 0, &cand_a), kb = top_k(rb, 5, 0, 0, &cand_b);
    lm.argmax_a.push_back(ka.empty() ? -1 : ka[0]);
    lm.argmax_b.push_back(kb.empty() ? -1 : kb[0]);
    if (lm.argmax_a.back() == lm.argmax_b.back()) ++agree;
    int64_t common = 0;
    for (int32_t i : ka) common += std::count(kb.begin(), kb.end(), i);
    overlap_sum += static_cast<double>(common) / static_cast<double>(std::min<int64_t>(5, vocab));
    if (t == last) {
      for (int32_t i : top_k(ra, LogitMetrics::kLastTop, 0, 0, &cand_last))
        lm.top_a_last.emplace_back(ra[static_cast<size_t>(i)], i);
    }
  }
  // fn(chunk, row of a, row of b, its Row, first, end) for each chunk of a row finite on both sides, the chunks shared
  // among the threads.
  const auto each_finite_chunk = [&](auto&& fn) {
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const auto [t, begin, end] = range(task);
      const Row& r = row[static_cast<size_t>(t)];
      if (r.finite) fn(chunk[static_cast<size_t>(task)], row_of(a, t), row_of(b, t), r, begin, end);
    }
  };
  // The sums of exp(v - max) (log-softmax in double: v - lse, lse = max + log sum).
  each_finite_chunk([](Chunk& c, std::span<const float> ra, std::span<const float> rb, const Row& r, int64_t begin,
                       int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      c.sum_a += std::exp(static_cast<double>(ra[static_cast<size_t>(v)]) - r.max_a);
      c.sum_b += std::exp(static_cast<double>(rb[static_cast<size_t>(v)]) - r.max_b);
    }
  });
  for (int64_t t = 0; t < rows; ++t) {
    Row& r = row[static_cast<size_t>(t)];
    if (!r.finite) continue;
    double sum_a = 0, sum_b = 0;
    for (int64_t i = t * per_row; i < (t + 1) * per_row; ++i) {
      sum_a += chunk[static_cast<size_t>(i)].sum_a;
      sum_b += chunk[static_cast<size_t>(i)].sum_b;
    }
    r.lse_a = r.max_a + std::log(sum_a);
    r.lse_b = r.max_b + std::log(sum_b);
  }
  // KL(softmax(b) || softmax(a)) = sum exp(lb) (lb - la).
  each_finite_chunk([](Chunk& c, std::span<const float> ra, std::span<const float> rb, const Row& r, int64_t begin,
                       int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const double la = static_cast<double>(ra[static_cast<size_t>(v)]) - r.lse_a;
      const double lb = static_cast<double>(rb[static_cast<size_t>(v)]) - r.lse_b;
      c.kl += std::exp(lb) * (lb - la);
    }
  });
  double kl_sum = 0;
  bool finite = true;
  for (int64_t t = 0; t < rows; ++t) {
    const Row& r = row[static_cast<size_t>(t)];
    double kl = kNaN;
    if (r.finite) {
      kl = 0;
      for (int64_t i = t * per_row; i < (t + 1) * per_row; ++i) kl += chunk[static_cast<size_t>(i)].kl;
      kl = std::max(kl, 0.0);
    }
    lm.kl.push_back(kl);
    kl_sum += kl;
    lm.kl_max = std::max(lm.kl_max, kl);
    finite = finite && !std::isnan(kl);
  }
  lm.top1 = static_cast<double>(agree) / static_cast<double>(rows);
  lm.top5_overlap = overlap_sum / static_cast<double>(rows);
  lm.kl_mean = kl_sum / static_cast<double>(rows);
  if (!finite) lm.top1 = lm.top5_overlap = lm.kl_mean = lm.kl_max = kNaN;
  return lm;
}

}  // namespace diffrun::diff
