// `diffrun show DUMP.h5 NAME [--step N] [--rows R --cols C]`: one checkpoint's stats and a slice of it.
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "checkpoints/dump.hpp"
#include "checkpoints/name_map.hpp"
#include "cli/command.hpp"

namespace diffrun::cli {
namespace {

struct ShowOptions {
  std::string path;
  std::string names;  // name map (--names)
  std::string name;
  int step = 0;
  int rows = 8;
  int cols = 8;
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

int run_show(const ShowOptions& o) {
  const std::optional<NameMap> names = o.names.empty() ? std::nullopt : std::optional<NameMap>(NameMap::load(o.names));
  const DumpReader r(o.path, names ? &*names : nullptr);
  const std::vector<float> v = r.read(o.step, o.name);  // DumpError naming file and dataset if absent
  const DatasetInfo& d = *r.find(o.step, o.name);
  std::string shape = "[";
  for (size_t i = 0; i < d.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(d.shape[i]);
  shape += "]";
  fmt::print("{} step {} {}: shape {} ({}), stored {}, native {}, order {}, layer {}\n", o.path, o.step, o.name, shape,
             d.layout, d.stored_dtype, d.native_dtype, d.order, d.layer);

  const Stats s = stats_of(v);
  if (s.finite > 0) {
    fmt::print("  min  {:<14.7g} at {}\n", s.min, coords(s.argmin, d.shape));
    fmt::print("  max  {:<14.7g} at {}\n", s.max, coords(s.argmax, d.shape));
    fmt::print("  mean {:<14.7g} std {:<14.7g} rms {:.7g}\n", s.mean, s.std, s.rms);
  }
  fmt::print("  {} values: {} finite, {} NaN, {} Inf\n", v.size(), s.finite, s.nan, s.inf);
  if (v.empty()) return 0;

  // A 2-D view: rows are the leading dimensions (labelled by their coordinates), columns the last.
  const size_t n_cols = d.shape.empty() ? 1 : static_cast<size_t>(d.shape.back());
  const size_t n_rows = n_cols ? v.size() / n_cols : 0;
  const size_t show_rows = std::min(n_rows, static_cast<size_t>(o.rows));
  const size_t show_cols = std::min(n_cols, static_cast<size_t>(o.cols));
  std::vector<int64_t> lead(d.shape.begin(), d.shape.empty() ? d.shape.end() : d.shape.end() - 1);
  const auto dims = layout_dims(d.layout);
  fmt::print("\n  first {} of {} rows ({}) x first {} of {} columns ({})\n", show_rows, n_rows,
             d.shape.size() > 1 ? d.layout.substr(0, d.layout.rfind(',')) : "-", show_cols, n_cols,
             dims.empty() ? "" : dims.back());
  fmt::print("  {:<12}", "");
  for (size_t c = 0; c < show_cols; ++c) fmt::print(" {:>12}", c);
  fmt::print("{}\n", show_cols < n_cols ? "  ..." : "");
  for (size_t row = 0; row < show_rows; ++row) {
    fmt::print("  {:<12}", lead.empty() ? std::string("") : coords(row, lead));
    for (size_t c = 0; c < show_cols; ++c) {
      const float x = v[row * n_cols + c];
      if (d.is_int) fmt::print(" {:>12}", static_cast<int64_t>(x));
      else fmt::print(" {:>12.5g}", x);
    }
    fmt::print("{}\n", show_cols < n_cols ? "  ..." : "");
  }
  if (show_rows < n_rows) fmt::print("  ...\n");
  return 0;
}

const CommandRegistrar reg("show", "Print one checkpoint's stats and a slice of its values", [](CLI::App& app) {
  auto o = std::make_shared<ShowOptions>();
  app.add_option("dump", o->path, "HDF5 dump")->required();
  app.add_option("--names", o->names, "Name map of the dump: llamacpp, hf or a JSON file (fixtures/names/README.md)");
  app.add_option("name", o->name, "Checkpoint name, e.g. Qcur-3 or result_output")->required();
  app.add_option("--step", o->step, "Step (0 is the prefill)")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--rows", o->rows, "Rows of the slice")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--cols", o->cols, "Columns of the slice")->capture_default_str()->check(CLI::NonNegativeNumber);
  return [o] { return run_show(*o); };
});

}  // namespace
}  // namespace diffrun::cli
