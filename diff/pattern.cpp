// The error pattern of one checkpoint: per-slice rel L2 along the row, head and channel axes, and the bug class it points to.
#include "diff/pattern.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoints/dump_schema_names.hpp"
#include "checkpoints/vocabulary.hpp"

namespace diffrun::diff {
namespace {

std::string label_of(const std::string& dim, bool is_row) {
  if (dim == dim_letter::T) return "token rows";
  if (dim == dim_letter::S) return is_row ? "cache rows" : "positions";
  if (dim == dim_letter::H) return "heads";
  if (dim == dim_letter::Hkv) return "KV heads";
  return "channels " + dim;
}

struct Sums {
  std::vector<double> d2, a2, b2, ab;
  std::vector<char> nonfinite;
};

// The RoPE hints of Qrope/Krope [T, H or Hkv, Dh] (pattern.hpp); "" when none fits. sd: the error's energy.
std::string rope_hint(std::span<const float> a, std::span<const float> b, const std::vector<NamedDim>& named,
                      const PatternContext& cx, double exact_below, double sd) {
  if (named.size() != 3 || named[0].dim != dim_letter::T ||
      (named[1].dim != dim_letter::H && named[1].dim != dim_letter::Hkv) || named[2].dim != dim_letter::Dh ||
      named[2].extent < 4 || named[2].extent % 2 != 0 || !(sd > 0))
    return "";
  const int64_t T = named[0].extent, H = named[1].extent, Dh = named[2].extent, half = Dh / 2;
  const auto pair_of = [&](bool neox, int64_t i) {
    return neox ? std::pair<int64_t, int64_t>{i, i + half} : std::pair<int64_t, int64_t>{2 * i, 2 * i + 1};
  };
  const bool known = cx.rope_theta > 0;
  // Lengths: of each head vector, and of each pair under both pairings.
  double head_dev = 0, pair_dev[2] = {0, 0}, row0_d2 = 0, row0_b2 = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t o = (t * H + h) * Dh;
      double na = 0, nb = 0;
      for (int64_t j = 0; j < Dh; ++j) {
        na += double(a[o + j]) * a[o + j];
        nb += double(b[o + j]) * b[o + j];
        if (t == 0) {
          row0_d2 += (double(a[o + j]) - b[o + j]) * (double(a[o + j]) - b[o + j]);
          row0_b2 += double(b[o + j]) * b[o + j];
        }
      }
      head_dev += (std::sqrt(na) - std::sqrt(nb)) * (std::sqrt(na) - std::sqrt(nb));
      for (int k = 0; k < 2; ++k) {
        for (int64_t i = 0; i < half; ++i) {
          const auto [x, y] = pair_of(k == 1, i);
          const double la = std::hypot(double(a[o + x]), double(a[o + y])), lb = std::hypot(double(b[o + x]), double(b[o + y]));
          pair_dev[k] += (la - lb) * (la - lb);
        }
      }
    }
  }
  const bool row0_exact = std::sqrt(row0_d2) <= exact_below * std::sqrt(row0_b2);
  if (head_dev <= 1e-3 * sd) {
    // Both sides rotations of one vector, the pairs differing: under the model's pairing when known, else under both.
    const bool pairs_differ = known ? pair_dev[cx.rope_neox ? 1 : 0] >= 0.05 * sd
                                    : pair_dev[0] >= 0.05 * sd && pair_dev[1] >= 0.05 * sd;
    if (pairs_differ && (cx.first_position != 0 || row0_exact)) {
      return fmt::format("each head vector keeps its length but the pairs that rotate together differ{}: the RoPE "
                         "pairing ({})",
                         cx.first_position == 0 ? " (position 0 exact)" : "",
                         !known         ? "(2i, 2i+1) against (i, i+Dh/2)"
                         : cx.rope_neox ? "the model pairs (i, i+Dh/2), the engine seems to pair (2i, 2i+1)"
                                        : "the model pairs (2i, 2i+1), the engine seems to pair (i, i+Dh/2)");
    }
  }
  if (!known || cx.first_position < 0 || pair_dev[cx.rope_neox ? 1 : 0] > 1e-3 * sd) return "";
  // Each pair of the model's pairing turned by an angle: the engine's rotation minus the reference's,
  // per row and pair (summed over the heads).
  std::vector<double> dot(T * half), cross(T * half);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t o = (t * H + h) * Dh;
        const auto [x, y] = pair_of(cx.rope_neox, i);
        const double ax = a[o + x], ay = a[o + y], bx = b[o + x], by = b[o + y];
        dot[t * half + i] += bx * ax + by * ay;
        cross[t * half + i] += bx * ay - by * ax;
      }
  const auto factor = [&](int64_t i) {
    return static_cast<size_t>(i) < cx.rope_freq_factors.size() && cx.rope_freq_factors[i] > 0 ? double(cx.rope_freq_factors[i]) : 1.0;
  };
  const auto freq = [&](double theta, int64_t i) { return std::pow(theta, -2.0 * double(i) / double(Dh)) / factor(i); };
  // The error left after turning the reference's pairs by delta(t, i): under 1% of the error's energy.
  const auto explains = [&](const std::function<double(int64_t, int64_t)>& delta) {
    double res = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double d = delta(t, i), c = std::cos(d), s = std::sin(d);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t o = (t * H + h) * Dh;
          const auto [x, y] = pair_of(cx.rope_neox, i);
          const double px = b[o + x] * c - b[o + y] * s, py = b[o + x] * s + b[o + y] * c;
          res += (a[o + x] - px) * (a[o + x] - px) + (a[o + y] - py) * (a[o + y] - py);
        }
      }
    return res <= 0.01 * sd;
  };
  // Positions off by k: delta = k f_i in every row; k fitted on the pairs slow enough not to wrap.
  double num = 0, den = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 1; i < half; ++i) {
      const double f = freq(cx.rope_theta, i), w = std::hypot(dot[t * half + i], cross[t * half + i]);
      if (f > 0.2 || f < 1e-4) continue;
      num += w * std::atan2(cross[t * half + i], dot[t * half + i]) * f;
      den += w * f * f;
    }
  if (den > 0) {
    const double k_fit = num / den, k = std::round(k_fit);
    if (k != 0 && std::abs(k_fit - k) <= 0.1 &&
        explains([&](int64_t, int64_t i) { return k * freq(cx.rope_theta, i); })) {
      return fmt::format("each pair i turned by {:+d}·base^(-2i/Dh), the same in every row: the position is off by "
                         "{:+d} (the engine rotates as at position p{:+d})",
                         int(k), int(k), int(k));
    }
  }
  // A wrong base: delta = pos (g_i - f_i), g_i from base'; base' fitted on pair 1 at the first position > 0.
  const int64_t t1 = cx.first_position == 0 ? 1 : 0;
  const double pos1 = double(cx.first_position + t1);
  if (t1 < T && half >= 2 && pos1 > 0) {
    const double g1 = freq(cx.rope_theta, 1) + std::atan2(cross[t1 * half + 1], dot[t1 * half + 1]) / pos1;
    if (g1 * factor(1) > 0 && g1 * factor(1) < 1) {
      const double theta = std::pow(g1 * factor(1), -double(Dh) / 2.0);
      if (std::abs(theta / cx.rope_theta - 1) > 1e-3 &&
          explains([&](int64_t t, int64_t i) {
            return double(cx.first_position + t) * (freq(theta, i) - freq(cx.rope_theta, i));
          })) {
        return fmt::format("pair 0 exact at every position, the other pairs turned by pos·(base'^(-2i/Dh) - "
                           "base^(-2i/Dh)): the RoPE base (the engine's looks like {:.4g}, the model's is {:.4g})",
                           theta, cx.rope_theta);
      }
    }
  }
  return "";
}

// A per-block offset: the error constant within each block of 32 consecutive elements of a row
// (the last dim a multiple of 32, at least 64), and not one offset for the whole row.
std::string block_offset_hint(std::span<const float> a, std::span<const float> b, std::span<const int64_t> shape,
                              double sd) {
  constexpr int64_t kBlock = 32;
  if (shape.empty() || !(sd > 0)) return "";
  const int64_t C = shape.back(), n = static_cast<int64_t>(std::min(a.size(), b.size()));
  if (C < 2 * kBlock || C % kBlock != 0 || n % C != 0) return "";
  double within = 0, between = 0;
  std::vector<double> means(C / kBlock);
  for (int64_t r = 0; r < n / C; ++r) {
    double row_mean = 0;
    for (int64_t j = 0; j < C / kBlock; ++j) {
      double m = 0;
      for (int64_t e = 0; e < kBlock; ++e) m += double(a[r * C + j * kBlock + e]) - b[r * C + j * kBlock + e];
      means[j] = m / kBlock;
      row_mean += means[j];
      for (int64_t e = 0; e < kBlock; ++e) {
        const double d = double(a[r * C + j * kBlock + e]) - b[r * C + j * kBlock + e] - means[j];
        within += d * d;
      }
    }
    row_mean /= double(C / kBlock);
    for (double m : means) between += kBlock * (m - row_mean) * (m - row_mean);
  }
  if (within > 1e-3 * sd || between < 0.01 * sd) return "";
  return "the error is constant within each block of 32 elements of a row, a different offset per block: a "
         "quantized block's offset (a Q4_1/Q5_1 min m subtracted instead of added, or dropped)";
}

}  // namespace

std::string format_ranges(const std::vector<int64_t>& indices) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < indices.size();) {
    size_t j = i;
    while (j + 1 < indices.size() && indices[j + 1] == indices[j] + 1) ++j;
    parts.push_back(j == i ? fmt::format("{}", indices[i]) : fmt::format("{}-{}", indices[i], indices[j]));
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(parts, ","));
}

namespace {

// The tensor's dims as the pattern slices it: the named dims, the slice axes' positions in them (-1:
// absent; none unless the named dims cover every element), and each dim's stride.
struct SliceLayout {
  std::vector<NamedDim> named;
  int64_t named_n = 1;  // the elements the named dims cover
  SliceAxes ax;
  int order[3];  // the axes in the order the summary names them in: head, row, channel
  std::vector<int64_t> strides;
};

SliceLayout slice_layout(std::span<const int64_t> shape, std::string_view layout, const DimSizes& dims, int64_t n) {
  SliceLayout L;
  L.named = named_dims(shape, layout, dims);
  for (const auto& d : L.named) L.named_n *= d.extent;
  L.ax = L.named_n == n ? slice_axes(L.named) : SliceAxes{};
  L.order[0] = L.ax.head, L.order[1] = L.ax.row, L.order[2] = L.ax.channel;
  L.strides.assign(L.named.size(), 1);
  for (size_t k = L.named.size(); k-- > 1;) L.strides[k - 1] = L.strides[k] * L.named[k].extent;
  return L;
}

// The sums of one pass over the elements: over the whole tensor (finite pairs only), per slice of each
// axis in `order`, and in kq_soft_max's [H, T, S] the probabilities the engine puts on future positions.
struct Totals {
  double sa = 0, sb = 0, sab = 0, sd = 0;
  std::vector<Sums> sums;  // by order's index
  int64_t future_nonzero = 0;
};

Totals sum_slices(std::span<const float> a, std::span<const float> b, int64_t n, const SliceLayout& L,
                  std::string_view base) {
  Totals t;
  t.sums.resize(3);
  const std::vector<NamedDim>& named = L.named;
  for (int k = 0; k < 3; ++k) {
    if (L.order[k] < 0) continue;
    const size_t e = static_cast<size_t>(named[L.order[k]].extent);
    t.sums[k] = {std::vector<double>(e), std::vector<double>(e), std::vector<double>(e), std::vector<double>(e),
                 std::vector<char>(e)};
  }
  // Causal mask: in [H, T, S], token t of a step with S - T cached positions sees positions <= S - T + t.
  const bool causal = base == kAttentionProbsKind && named.size() == 3 && named[1].dim == dim_letter::T &&
                      named[2].dim == dim_letter::S;
  const int64_t n_past = causal ? named[2].extent - named[1].extent : 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = a[i], y = b[i];
    const bool finite = std::isfinite(x) && std::isfinite(y);
    if (finite) {
      t.sa += x * x;
      t.sb += y * y;
      t.sab += x * y;
      t.sd += (x - y) * (x - y);
    }
    for (int k = 0; k < 3; ++k) {
      if (L.order[k] < 0) continue;
      const int64_t j = (i / L.strides[L.order[k]]) % named[L.order[k]].extent;
      Sums& s = t.sums[k];
      if (!finite) {
        s.nonfinite[j] = 1;
        continue;
      }
      s.d2[j] += (x - y) * (x - y);
      s.a2[j] += x * x;
      s.b2[j] += y * y;
      s.ab[j] += x * y;
    }
    if (causal && finite) {
      const int64_t tok = (i / L.strides[1]) % named[1].extent, pos = i % named[2].extent;
      if (pos > n_past + tok && y == 0 && x != 0) ++t.future_nonzero;
    }
  }
  return t;
}

// One axis's slices split into exact (rel L2 <= exact_below) and wrong, the wrong ones into non-finite
// and all zero in the engine.
AxisPattern axis_pattern(const NamedDim& d, bool is_row, const Sums& s, double exact_below) {
  AxisPattern axp;
  axp.dim = d.dim;
  axp.label = label_of(d.dim, is_row);
  axp.extent = d.extent;
  for (int64_t j = 0; j < d.extent; ++j) {
    const double rel = s.nonfinite[j] ? INFINITY : s.b2[j] > 0 ? std::sqrt(s.d2[j] / s.b2[j]) : (s.d2[j] > 0 ? INFINITY : 0.0);
    if (rel <= exact_below) {
      axp.exact.push_back(j);
    } else {
      axp.wrong.push_back(j);
      if (s.nonfinite[j]) axp.nonfinite.push_back(j);
      if (!s.nonfinite[j] && s.a2[j] == 0 && s.b2[j] > 0) axp.zero_engine.push_back(j);
    }
  }
  return axp;
}

// The summary: the axes whose slices split into exact and wrong (into finite and not, over non-finite
// data).
std::string axes_summary(const std::vector<AxisPattern>& axes, bool any_nonfinite, bool any_wrong) {
  std::vector<std::string> parts;
  for (const auto& axp : axes) {
    if (any_nonfinite) {
      if (!axp.nonfinite.empty() && static_cast<int64_t>(axp.nonfinite.size()) < axp.extent) {
        parts.push_back(fmt::format("{}{} {}", parts.empty() ? "NaN/Inf only in " : "", axp.label,
                                    format_ranges(axp.nonfinite)));
      }
      continue;
    }
    if (!axp.partial()) continue;
    std::string wrong = axp.zero_engine == axp.wrong ? fmt::format("{} all zero in engine", format_ranges(axp.wrong))
                        : axp.zero_engine.empty()    ? fmt::format("{} wrong", format_ranges(axp.wrong))
                                                     : fmt::format("{} wrong ({} all zero in engine)", format_ranges(axp.wrong),
                                                                   format_ranges(axp.zero_engine));
    parts.push_back(fmt::format("{} {} exact, {}", axp.label, format_ranges(axp.exact), wrong));
  }
  if (parts.empty() && any_nonfinite) {
    parts.push_back("NaN/Inf in every slice");
  } else if (parts.empty() && any_wrong) {
    std::vector<std::string> labels;
    for (const auto& axp : axes) labels.push_back(axp.label);
    parts.push_back(labels.empty() ? std::string("the error is spread over the tensor")
                                   : fmt::format("every slice wrong ({}): the error is spread over the tensor",
                                                 fmt::join(labels, ", ")));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

// What the hint is read from: the row, head and channel axes' patterns (null where absent), whether any
// slice is wrong or non-finite, the bug class read from the error's structure, and whether one factor (or
// one per channel) explains the error.
struct Evidence {
  const AxisPattern* rows = nullptr;
  const AxisPattern* heads = nullptr;
  const AxisPattern* channels = nullptr;
  bool any_wrong = false, any_nonfinite = false;
  std::string structural;
  double scale = 1;
  bool scaled = false, channel_scaled = false;
};

// Scaled copies: the error the best single factor (or one factor per channel) leaves is under 1% of
// the error's energy.
void find_scaling(const Totals& t, const SliceLayout& L, Evidence& e) {
  e.scale = t.sb > 0 ? t.sab / t.sb : 1.0;
  e.scaled = e.any_wrong && t.sb > 0 && t.sd > 0 && (t.sa - t.sab * t.sab / t.sb) <= 0.01 * t.sd &&
             std::abs(e.scale - 1) > 1e-3;
  if (e.any_wrong && !e.scaled && t.sd > 0 && e.channels && e.rows && e.rows->extent >= 2 && e.channels->extent >= 2) {
    const Sums* cs = nullptr;
    for (int k = 0; k < 3; ++k)
      if (L.order[k] == L.ax.channel) cs = &t.sums[k];
    double left = 0;
    for (size_t j = 0; cs && j < cs->a2.size(); ++j) left += cs->b2[j] > 0 ? cs->a2[j] - cs->ab[j] * cs->ab[j] / cs->b2[j] : cs->a2[j];
    e.channel_scaled = cs && left <= 0.01 * t.sd;
  }
}

// The bug class the pattern points to (pattern.hpp), the first that fits; "" when none does.
std::string bug_hint(const ErrorPattern& p, const Evidence& e, std::string_view base) {
  const AxisPattern* rows = e.rows;
  const AxisPattern* heads = e.heads;
  const AxisPattern* channels = e.channels;
  if (e.any_nonfinite) {
    // Over non-finite data "wrong" means "holds a NaN/Inf": only the token and channel hints hold.
    const size_t nt = rows ? rows->nonfinite.size() : 0, nc = channels ? channels->nonfinite.size() : 0;
    if (rows && rows->dim == dim_letter::T && nt == 1 && rows->extent > 1)
      return fmt::format("one token holds them: that token (T={})", rows->nonfinite.front());
    if (channels && nc > 0 && nc * 8 <= static_cast<size_t>(channels->extent) &&
        (!rows || static_cast<int64_t>(nt) == rows->extent))
      return "a few channels hold them in every token: a weight row, a bias or a scale of those channels";
    return "";
  }
  if (p.future_nonzero > 0)
    return fmt::format("{} probabilities on future positions where the reference has 0: the causal mask",
                       p.future_nonzero);
  if (rows && rows->dim == dim_letter::S && !rows->zero_engine.empty() && rows->partial())
    return fmt::format("cache row {} never written in the engine: the K/V write position", format_ranges(rows->zero_engine));
  if (!e.structural.empty()) return e.structural;
  if (heads && heads->partial() && (base == kAttentionProbsKind || base == kAttentionOutKind))
    return "some query heads exact, others not: the query-to-KV head mapping (GQA)";
  if (rows && rows->dim == dim_letter::T && rows->partial() && rows->wrong.size() == 1)
    return fmt::format("one token wrong: that token (T={})", rows->wrong.front());
  if (channels && channels->partial() && channels->wrong.size() * 8 <= static_cast<size_t>(channels->extent))
    return "a few channels wrong: a weight row, a bias or a scale of those channels";
  if (e.scaled)
    return fmt::format("the engine's values are the reference's x {:.4g} (cosine {:.4f}): a scale factor (a constant "
                       "missing or applied twice, a unit or a dtype), not a layout", e.scale, p.cosine);
  if (e.channel_scaled)
    return "each channel scaled by its own factor, the same in every token: a per-channel weight applied twice or "
           "not at all (an RMSNorm weight)";
  if (e.any_wrong && std::abs(p.cosine) < 0.1)
    return fmt::format("cosine {:.3f}, uncorrelated: a layout, a transpose or the wrong tensor", p.cosine);
  return "";
}

}  // namespace

ErrorPattern error_pattern(std::span<const float> a, std::span<const float> b, std::span<const int64_t> shape,
                           std::string_view layout, const DimSizes& dims, std::string_view base, double exact_below,
                           const PatternContext& context) {
  ErrorPattern p;
  p.exact_below = exact_below;
  const int64_t n = static_cast<int64_t>(std::min(a.size(), b.size()));
  const SliceLayout L = slice_layout(shape, layout, dims, n);
  const Totals t = sum_slices(a, b, n, L, base);
  p.future_nonzero = t.future_nonzero;
  p.cosine = (t.sa == 0 && t.sb == 0) ? 1.0 : (t.sa == 0 || t.sb == 0) ? 0.0 : t.sab / std::sqrt(t.sa * t.sb);

  Evidence e;
  for (int k = 0; k < 3; ++k) {
    if (L.order[k] < 0) continue;
    p.axes.push_back(axis_pattern(L.named[L.order[k]], L.order[k] == L.ax.row, t.sums[k], exact_below));
    e.any_wrong = e.any_wrong || !p.axes.back().wrong.empty();
  }
  for (const auto& axp : p.axes) e.any_nonfinite = e.any_nonfinite || !axp.nonfinite.empty();
  p.summary = axes_summary(p.axes, e.any_nonfinite, e.any_wrong);

  auto find = [&](int axis) -> const AxisPattern* {
    for (const auto& axp : p.axes) {
      if (axis >= 0 && axp.dim == L.named[axis].dim) return &axp;
    }
    return nullptr;
  };
  e.rows = find(L.ax.row);
  e.heads = find(L.ax.head);
  e.channels = find(L.ax.channel);
  find_scaling(t, L, e);
  // The bug classes read from the error's structure (pattern.hpp), before the generic slice hints.
  if (!e.any_nonfinite && e.any_wrong && p.future_nonzero == 0 && t.sd > 0) {
    if ((base == "Qrope" || base == "Krope") && L.named_n == n)
      e.structural = rope_hint(a.first(n), b.first(n), L.named, context, exact_below, t.sd);
    if (e.structural.empty()) e.structural = block_offset_hint(a.first(n), b.first(n), shape, t.sd);
  }
  p.hint = bug_hint(p, e, base);
  return p;
}

}  // namespace diffrun::diff
