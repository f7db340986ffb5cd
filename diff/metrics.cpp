// Per-checkpoint error metrics, in double; mirrored by python/diffrun/metrics.py.
#include "diff/metrics.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numeric>

#include <fmt/core.h>

#include "checkpoints/dump_schema_names.hpp"
#include "checkpoints/vocabulary.hpp"

namespace diffrun::diff {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
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

// Classes of non-finite values that count as equal on both sides.
bool same_nonfinite(double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::isinf(a) && std::isinf(b) && (a > 0) == (b > 0);
}

}  // namespace

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
  double sum_d2 = 0, sum_a2 = 0, sum_b2 = 0, sum_ab = 0, sum_absd = 0;
  int64_t n_finite = 0;
  double worst_score = -1.0;

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
  int64_t idx[3] = {0, 0, 0};
  int64_t pos = inner;  // position within the innermost run
  for (int64_t i = 0; i < m.n; ++i) {
    if (pos == inner) {
      pos = 0;
      for (int k = 0; k < 2; ++k) {
        if (sl[k].extent > 0) idx[k] = (i / sl[k].stride) % sl[k].extent;
      }
    }
    for (int k = 0; k < 2; ++k) {
      if (sl[k].stride == 1 && sl[k].extent > 0) idx[k] = pos;  // a row or head axis that is the last one
    }
    idx[2] = pos++;
    const double x = a[i], y = b[i];
    const bool fx = std::isfinite(x), fy = std::isfinite(y);
    if (!fx) {
      ++(std::isnan(x) ? m.nan_a : m.inf_a);
      if (m.first_nonfinite_a.flat < 0) m.first_nonfinite_a = {i, {}, x};
    }
    if (!fy) {
      ++(std::isnan(y) ? m.nan_b : m.inf_b);
      if (m.first_nonfinite_b.flat < 0) m.first_nonfinite_b = {i, {}, y};
    }
    double score;
    double abs_err;
    if (fx && fy) {
      const double d = x - y;
      abs_err = std::abs(d);
      sum_d2 += d * d;
      sum_a2 += x * x;
      sum_b2 += y * y;
      sum_ab += x * y;
      sum_absd += abs_err;
      ++n_finite;
      for (int k = 0; k < 3; ++k) {
        if (sl[k].extent == 0) continue;
        sl[k].d2[idx[k]] += d * d;
        sl[k].b2[idx[k]] += y * y;
      }
      m.max_abs = std::max(m.max_abs, abs_err);
      const double bound = tol.atol + tol.rtol * std::abs(y);
      if (abs_err > bound) ++m.n_fail;
      score = bound > 0 ? abs_err / bound : abs_err;
      if (abs_err > tol.atol) {
        m.min_rtol = std::max(m.min_rtol, std::abs(y) > 0 ? (abs_err - tol.atol) / std::abs(y) : kInf);
      }
    } else if (same_nonfinite(x, y)) {
      continue;
    } else {
      ++m.nonfinite_mismatch;
      ++m.n_fail;
      abs_err = kInf;
      score = kInf;
      m.min_rtol = kInf;
    }
    if (score > worst_score) {
      worst_score = score;
      m.worst.flat = i;
      m.worst.a = x;
      m.worst.b = y;
      m.worst.abs_err = abs_err;
    }
  }
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

// Indices of the k largest finite values, by value descending then index ascending.
std::vector<int32_t> top_k(std::span<const float> row, size_t k) {
  std::vector<int32_t> idx;
  idx.reserve(row.size());
  for (size_t i = 0; i < row.size(); ++i) {
    if (std::isfinite(row[i])) idx.push_back(static_cast<int32_t>(i));
  }
  k = std::min(k, idx.size());
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                    [&](int32_t x, int32_t y) { return row[x] > row[y] || (row[x] == row[y] && x < y); });
  idx.resize(k);
  return idx;
}

// log-softmax in double; empty when the row holds a non-finite value.
std::vector<double> log_softmax(std::span<const float> row) {
  double mx = -kInf;
  for (float v : row) {
    if (!std::isfinite(v)) return {};
    mx = std::max(mx, static_cast<double>(v));
  }
  double sum = 0;
  for (float v : row) sum += std::exp(static_cast<double>(v) - mx);
  const double lse = mx + std::log(sum);
  std::vector<double> out(row.size());
  for (size_t i = 0; i < row.size(); ++i) out[i] = static_cast<double>(row[i]) - lse;
  return out;
}

}  // namespace

LogitMetrics compute_logit_metrics(std::span<const float> a, std::span<const float> b, int64_t rows,
                                   int64_t vocab) {
  LogitMetrics lm;
  lm.tokens = rows;
  if (rows <= 0 || vocab <= 0) return lm;
  // Each row on its own (in parallel where the caller's OpenMP threads allow: a prefill's logits are
  // ~15M exps), then the sums in row order, as one loop would take them.
  struct Row {
    int32_t argmax_a = -1, argmax_b = -1;
    double overlap = 0, kl = kNaN;
  };
  std::vector<Row> row(static_cast<size_t>(rows));
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
  for (int64_t t = 0; t < rows; ++t) {
    auto ra = a.subspan(static_cast<size_t>(t * vocab), static_cast<size_t>(vocab));
    auto rb = b.subspan(static_cast<size_t>(t * vocab), static_cast<size_t>(vocab));
    Row& r = row[static_cast<size_t>(t)];
    r.argmax_a = argmax(ra);
    r.argmax_b = argmax(rb);
    std::vector<int32_t> ka = top_k(ra, 5), kb = top_k(rb, 5);
    int64_t common = 0;
    for (int32_t i : ka) common += std::count(kb.begin(), kb.end(), i);
    r.overlap = static_cast<double>(common) / static_cast<double>(std::min<int64_t>(5, vocab));
    std::vector<double> la = log_softmax(ra), lb = log_softmax(rb);
    if (!la.empty() && !lb.empty()) {
      double kl = 0;
      for (int64_t v = 0; v < vocab; ++v) kl += std::exp(lb[v]) * (lb[v] - la[v]);
      r.kl = std::max(kl, 0.0);
    }
  }
  int64_t agree = 0;
  double overlap_sum = 0, kl_sum = 0;
  bool finite = true;
  for (const Row& r : row) {
    lm.argmax_a.push_back(r.argmax_a);
    lm.argmax_b.push_back(r.argmax_b);
    if (r.argmax_a == r.argmax_b) ++agree;
    overlap_sum += r.overlap;
    lm.kl.push_back(r.kl);
    kl_sum += r.kl;
    lm.kl_max = std::max(lm.kl_max, r.kl);
    finite = finite && !std::isnan(r.kl);
  }
  const auto last = a.subspan(static_cast<size_t>((rows - 1) * vocab), static_cast<size_t>(vocab));
  for (int32_t i : top_k(last, LogitMetrics::kLastTop)) lm.top_a_last.emplace_back(last[static_cast<size_t>(i)], i);
  lm.top1 = static_cast<double>(agree) / static_cast<double>(rows);
  lm.top5_overlap = overlap_sum / static_cast<double>(rows);
  lm.kl_mean = kl_sum / static_cast<double>(rows);
  if (!finite) lm.top1 = lm.top5_overlap = lm.kl_mean = lm.kl_max = kNaN;
  return lm;
}

}  // namespace diffrun::diff
