// `diffrun show A.h5 [B.h5] NAME [--step N] [--slice DIM=I,...]`: a checkpoint's stats and a slice; with two dumps both sides, |a−b| and the worst coordinates.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "checkpoints/name_map.hpp"
#include "checkpoints/vocabulary.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "dump/dump.hpp"
#include "model/error.hpp"

namespace diffrun::cli {
namespace {

struct ShowOptions {
  std::vector<std::string> args;  // DUMP NAME or A B NAME
  std::string path;
  std::string names;  // name map (--names)
  std::string name;
  int step = 0;
  int rows = 8;
  int cols = 8;
  int top = 5;        // worst coordinates listed with two dumps
  std::string slice;  // "T=3,H=1": fixed coordinates (layout letters)
  bool no_color = false;  // accepted as compare accepts it; show prints no colours
};

// Coordinates of flat index `i` in `shape`, e.g. "[3, 1, 17]".
std::string coords(size_t i, const std::vector<int64_t>& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = static_cast<int64_t>(i % static_cast<size_t>(shape[d]));
    i /= static_cast<size_t>(shape[d]);
  }
  std::string out = "[";
  for (size_t d = 0; d < c.size(); ++d) out += (d ? ", " : "") + std::to_string(c[d]);
  return out + "]";
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

struct Stats {
  double min = std::numeric_limits<double>::infinity(), max = -std::numeric_limits<double>::infinity();
  size_t argmin = 0, argmax = 0;
  double mean = 0, std = 0, rms = 0;
  size_t finite = 0, nan = 0, inf = 0;
};

// Over the finite values; NaN and Inf are counted apart.
Stats stats_of(const std::vector<float>& v) {
  Stats s;
  double sum = 0, sum_sq = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double x = v[i];
    if (std::isnan(x)) { ++s.nan; continue; }
    if (std::isinf(x)) { ++s.inf; continue; }
    ++s.finite;
    sum += x;
    sum_sq += x * x;
    if (x < s.min) s.min = x, s.argmin = i;
    if (x > s.max) s.max = x, s.argmax = i;
  }
  if (s.finite > 0) {
    const double n = static_cast<double>(s.finite);
    s.mean = sum / n;
    s.rms = std::sqrt(sum_sq / n);
    s.std = std::sqrt(std::max(0.0, sum_sq / n - s.mean * s.mean));
  }
  return s;
}

std::optional<NameMap> name_map(const ShowOptions& o) {
  return o.names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(o.names));
}

// Coordinates of flat index `i` labelled by the layout's letters: "T=3, H=1, Dh=17".
std::string named_coords(size_t i, const std::vector<int64_t>& shape, const std::vector<std::string>& dims) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = static_cast<int64_t>(i % static_cast<size_t>(shape[d]));
    i /= static_cast<size_t>(shape[d]);
  }
  std::string out;
  for (size_t d = 0; d < c.size(); ++d) {
    out += fmt::format("{}{}={}", d ? ", " : "", d < dims.size() ? dims[d] : fmt::format("d{}", d), c[d]);
  }
  return out;
}

// --slice "T=3,H=1" -> per dimension the fixed index, or -1. Unknown letters and out-of-range
// indices are InputErrors naming them.
std::vector<int64_t> parse_slice(const std::string& text, const std::vector<int64_t>& shape,
                                 const std::vector<std::string>& dims, const std::string& layout) {
  std::vector<int64_t> fixed(shape.size(), -1);
  size_t pos = 0;
  while (!text.empty() && pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string part = text.substr(pos, end - pos);
    pos = end + 1;
    const size_t eq = part.find('=');
    const std::string dim = part.substr(0, eq);
    const auto it = std::find(dims.begin(), dims.end(), dim);
    if (eq == std::string::npos || it == dims.end()) {
      throw InputError(fmt::format("--slice '{}': expected DIM=INDEX with DIM a letter of the layout {}", part, layout));
    }
    const size_t d = static_cast<size_t>(it - dims.begin());
    char* stop = nullptr;
    const long long idx = std::strtoll(part.c_str() + eq + 1, &stop, 10);
    if (eq + 1 == part.size() || *stop != '\0' || idx < 0 || idx >= shape[d]) {
      throw InputError(fmt::format("--slice '{}': {} ranges over 0..{}", part, dim, shape[d] - 1));
    }
    fixed[d] = idx;
  }
  return fixed;
}

bool in_slice(size_t i, const std::vector<int64_t>& shape, const std::vector<int64_t>& fixed) {
  for (size_t d = shape.size(); d-- > 0;) {
    const auto c = static_cast<int64_t>(i % static_cast<size_t>(shape[d]));
    i /= static_cast<size_t>(shape[d]);
    if (fixed[d] >= 0 && fixed[d] != c) return false;
  }
  return true;
}

int run_show(const ShowOptions& o) {
  const std::optional<NameMap> names = name_map(o);
  const DumpReader r(o.path, names ? &*names : nullptr);
  const std::vector<float> v = r.read(o.step, o.name);  // DumpError naming file and dataset if absent
  const DatasetInfo& d = *r.find(o.step, o.name);
  const auto dims = layout_dims(d.layout);
  const std::vector<int64_t> fixed = parse_slice(o.slice, d.shape, dims, d.layout);
  fmt::print("{} step {} {}: shape {} ({}), stored {}, native {}, order {}, layer {}{}\n", printable(o.path, 400, 0),
             o.step, printable(o.name, 200, 0), shape_str(d.shape), printable(d.layout, 100, 0),
             printable(d.stored_dtype, 100, 0), printable(d.native_dtype, 100, 0), d.order, d.layer,
             o.slice.empty() ? "" : fmt::format(", slice {}", printable(o.slice, 100, 0)));

  // The values of the slice (all of them without --slice) and their flat indices.
  std::vector<size_t> idx;
  std::vector<float> sv;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!in_slice(i, d.shape, fixed)) continue;
    idx.push_back(i);
    sv.push_back(v[i]);
  }
  const Stats s = stats_of(sv);
  if (s.finite > 0) {
    fmt::print("  min  {:<14.7g} at {}\n", s.min, coords(idx[s.argmin], d.shape));
    fmt::print("  max  {:<14.7g} at {}\n", s.max, coords(idx[s.argmax], d.shape));
    fmt::print("  mean {:<14.7g} std {:<14.7g} rms {:.7g}\n", s.mean, s.std, s.rms);
  }
  fmt::print("  {} values{}: {} finite, {} NaN, {} Inf\n", sv.size(), o.slice.empty() ? "" : " in the slice", s.finite,
             s.nan, s.inf);
  if (sv.empty()) return 0;

  // A 2-D view: rows are the leading dimensions (labelled by their coordinates), columns the last
  // (one column where the slice fixes it).
  const size_t n_cols = d.shape.empty() ? 1 : static_cast<size_t>(d.shape.back());
  const size_t col_fixed = fixed.empty() || fixed.back() < 0 ? 0 : static_cast<size_t>(fixed.back());
  const size_t width = fixed.empty() || fixed.back() < 0 ? n_cols : 1;
  std::vector<size_t> rows;
  for (size_t i = 0; n_cols && i < v.size(); i += n_cols) {
    if (in_slice(i + col_fixed, d.shape, fixed)) rows.push_back(i);
  }
  const size_t show_rows = std::min(rows.size(), static_cast<size_t>(o.rows));
  const size_t show_cols = std::min(width, static_cast<size_t>(o.cols));
  std::vector<int64_t> lead(d.shape.begin(), d.shape.empty() ? d.shape.end() : d.shape.end() - 1);
  const std::string col_dim = dims.empty() ? "" : dims.back();
  const bool col_is_fixed = !fixed.empty() && fixed.back() >= 0;
  fmt::print("\n  first {} of {} rows ({}) x {}\n", show_rows, rows.size(),
             d.shape.size() > 1 ? d.layout.substr(0, d.layout.rfind(',')) : "-",
             col_is_fixed ? fmt::format("column {}={}", col_dim, col_fixed)
                          : fmt::format("first {} of {} columns ({})", show_cols, width, col_dim));
  fmt::print("  {:<12}", "");
  for (size_t c = 0; c < show_cols; ++c) fmt::print(" {:>12}", col_fixed + c);
  fmt::print("{}\n", show_cols < width ? "  ..." : "");
  for (size_t row = 0; row < show_rows; ++row) {
    fmt::print("  {:<12}", lead.empty() ? std::string("") : coords(rows[row] / n_cols, lead));
    for (size_t c = 0; c < show_cols; ++c) {
      const float x = v[rows[row] + col_fixed + c];
      if (d.is_int) fmt::print(" {:>12}", static_cast<int64_t>(x));
      else fmt::print(" {:>12.5g}", x);
    }
    fmt::print("{}\n", show_cols < width ? "  ..." : "");
  }
  if (show_rows < rows.size()) fmt::print("  ...\n");
  return 0;
}

// Both sides of one checkpoint: stats of each, of a−b, the worst coordinates, and a slice of a, b and |a−b|.
int run_show_pair(const ShowOptions& o, const std::string& path_a, const std::string& path_b) {
  const std::optional<NameMap> names = name_map(o);
  const DumpReader ra(path_a, names ? &*names : nullptr), rb(path_b, names ? &*names : nullptr);
  const std::vector<float> a = ra.read(o.step, o.name), b = rb.read(o.step, o.name);
  const DatasetInfo& da = *ra.find(o.step, o.name);
  const DatasetInfo& db = *rb.find(o.step, o.name);
  if (da.shape != db.shape) {
    throw InputError(fmt::format("{} step {}: shape {} in {} but {} in {}", o.name, o.step, shape_str(da.shape),
                                 path_a, shape_str(db.shape), path_b));
  }
  const std::vector<std::string> dims = layout_dims(da.layout);
  const std::vector<int64_t> fixed = parse_slice(o.slice, da.shape, dims, da.layout);
  fmt::print("{} step {}: shape {} ({}){}\n", printable(o.name, 200, 0), o.step, shape_str(da.shape),
             printable(da.layout, 100, 0), o.slice.empty() ? "" : fmt::format(", slice {}", printable(o.slice, 100, 0)));
  std::vector<size_t> idx;
  for (size_t i = 0; i < a.size(); ++i) {
    if (in_slice(i, da.shape, fixed)) idx.push_back(i);
  }
  std::vector<float> sa, sb, diff;
  double d2 = 0, b2 = 0;
  size_t nonfinite = 0;
  for (size_t i : idx) {
    sa.push_back(a[i]);
    sb.push_back(b[i]);
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    if (!std::isfinite(d)) ++nonfinite;
    diff.push_back(static_cast<float>(std::fabs(d)));
    if (std::isfinite(d)) {
      d2 += d * d;
      b2 += static_cast<double>(b[i]) * b[i];
    }
  }
  const auto side = [&](const char* label, const std::string& path, const DatasetInfo& d, const std::vector<float>& v) {
    const Stats st = stats_of(v);
    fmt::print("  {} {} (stored {}, native {})\n", label, printable(path, 400, 0), printable(d.stored_dtype, 100, 0),
               printable(d.native_dtype, 100, 0));
    fmt::print("      min {:.7g}  max {:.7g}  mean {:.7g}  rms {:.7g}  NaN {}  Inf {}\n", st.min, st.max, st.mean, st.rms,
               st.nan, st.inf);
  };
  side("a", path_a, da, sa);
  side("b", path_b, db, sb);
  const Stats sd = stats_of(diff);
  fmt::print("  |a-b| max {:.7g}  mean {:.7g}  rel_l2 {:.4g}  over {} values{}\n", sd.finite ? sd.max : 0.0, sd.mean,
             b2 > 0 ? std::sqrt(d2 / b2) : (d2 > 0 ? INFINITY : 0.0), idx.size(),
             nonfinite ? fmt::format(", {} non-finite", nonfinite) : "");

  // The worst coordinates: non-finite differences first, then by |a−b|.
  std::vector<size_t> order(idx.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto key = [&](size_t k) { return std::isfinite(diff[k]) ? static_cast<double>(diff[k]) : INFINITY; };
  const size_t n_top = std::min(order.size(), static_cast<size_t>(o.top));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n_top), order.end(),
                    [&](size_t x, size_t y) { return key(x) > key(y); });
  if (n_top > 0) {
    fmt::print("\n  worst {} ({})\n", n_top, da.layout);
    fmt::print("    {:<24} {:>14} {:>14} {:>12}\n", "at", "a", "b", "|a-b|");
    for (size_t k = 0; k < n_top; ++k) {
      const size_t j = order[k];
      fmt::print("    {:<24} {:>14.7g} {:>14.7g} {:>12.4g}\n", named_coords(idx[j], da.shape, dims), sa[j], sb[j], diff[j]);
    }
  }
  // A 2-D view of the slice: rows are the leading coordinates, columns the last dimension.
  const size_t n_cols = da.shape.empty() ? 1 : static_cast<size_t>(da.shape.back());
  const size_t col_fixed = fixed.empty() || fixed.back() < 0 ? 0 : static_cast<size_t>(fixed.back());
  const size_t width = fixed.empty() || fixed.back() < 0 ? n_cols : 1;
  const size_t show_cols = std::min(width, static_cast<size_t>(o.cols));
  std::vector<int64_t> lead(da.shape.begin(), da.shape.empty() ? da.shape.end() : da.shape.end() - 1);
  std::vector<std::string> lead_dims(dims.begin(), dims.empty() ? dims.end() : dims.end() - 1);
  std::vector<size_t> rows;
  for (size_t i = 0; i < a.size(); i += n_cols) {
    if (in_slice(i + col_fixed, da.shape, fixed)) rows.push_back(i);
  }
  const size_t show_rows = std::min(rows.size(), static_cast<size_t>(o.rows));
  if (show_rows == 0 || show_cols == 0) return 0;
  fmt::print("\n  first {} of {} rows x {} of {} columns ({} from {}): a, b, |a-b|\n", show_rows, rows.size(), show_cols,
             width, dims.empty() ? "-" : dims.back(), col_fixed);
  for (size_t r = 0; r < show_rows; ++r) {
    const std::string label = lead.empty() ? std::string("") : named_coords(rows[r] / n_cols, lead, lead_dims);
    const std::pair<const char*, int> lines[] = {{"a", 0}, {"b", 1}, {"|a-b|", 2}};
    for (const auto& [name, which] : lines) {
      fmt::print("  {:<16} {:<5}", which == 0 ? label : "", name);
      for (size_t c = 0; c < show_cols; ++c) {
        const size_t i = rows[r] + col_fixed + c;
        const double x = which == 0 ? a[i] : which == 1 ? b[i] : std::fabs(static_cast<double>(a[i]) - b[i]);
        fmt::print(" {:>11.5g}", x);
      }
      fmt::print("{}\n", show_cols < width ? " ..." : "");
    }
  }
  if (show_rows < rows.size()) fmt::print("  ...\n");
  return 0;
}

const CommandRegistrar reg("show", "One checkpoint of one dump (stats, a slice) or of two (both sides, |a-b|, the worst)",
                           [](CLI::App& app) {
  auto o = std::make_shared<ShowOptions>();
  app.add_option("args", o->args, "DUMP NAME, or A.h5 B.h5 NAME (NAME e.g. Qcur-3 or result_output)")
      ->required()
      ->expected(2, 3);
  app.add_option("--names", o->names, "Name map of the dump(s): llamacpp, hf or a JSON file (fixtures/names/README.md)");
  app.add_option("--step", o->step, "Step (0 is the prefill)")->capture_default_str()->check(count_in(0));
  app.add_option("--rows", o->rows, "Rows of the slice")->capture_default_str()->check(count_in(0));
  app.add_option("--cols", o->cols, "Columns of the slice")->capture_default_str()->check(count_in(0));
  app.add_option("--top", o->top, "With two dumps: how many worst coordinates to list")
      ->capture_default_str()
      ->check(count_in(0));
  app.add_option("--slice", o->slice, "Fix coordinates by layout letter, e.g. T=3 or H=1,T=0 (diffrun ls shows layouts)");
  app.add_flag("--no-color", o->no_color, "No ANSI colours (show prints none; accepted as compare accepts it)");
  return [o] {
    o->name = o->args.back();
    if (o->args.size() == 3) return run_show_pair(*o, o->args[0], o->args[1]);
    o->path = o->args[0];
    return run_show(*o);
  };
});

}  // namespace
}  // namespace diffrun::cli
