// The terminal report: first divergence with its evidence, per-layer error table, token agreement.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "diff/report.hpp"
#include "diff/shards.hpp"
#include "model/config.hpp"

namespace diffrun::diff {
namespace {

struct Style {
  bool on;
  std::string wrap(std::string_view code, std::string_view text) const {
    return on ? fmt::format("\033[{}m{}\033[0m", code, text) : std::string(text);
  }
  std::string bold(std::string_view t) const { return wrap("1", t); }
  std::string red(std::string_view t) const { return wrap("1;31", t); }
  std::string green(std::string_view t) const { return wrap("32", t); }
  std::string yellow(std::string_view t) const { return wrap("33", t); }
  std::string dim(std::string_view t) const { return wrap("2", t); }
};

std::string num(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.3g}", x);
}

// rel_l2 of a checkpoint, or what stands in for it over non-finite data: "NaN" (any NaN on either
// side), else "Inf".
std::string rel_str(const TensorMetrics& m) {
  if (m.finite()) return num(m.rel_l2);
  return m.nan_a + m.nan_b > 0 ? "NaN" : "Inf";
}

// "NaN 2880, Inf 0, first nan at H=0, T=3, S=1" or "finite".
std::string side_nonfinite(int64_t nan, int64_t inf, const NonFiniteSite& first) {
  if (first.flat < 0) return "finite";
  return fmt::format("NaN {}, Inf {}, first {} at {}", nan, inf, num(first.value), format_coordinates(first.coords));
}

void nonfinite_lines(std::string& out, const TensorMetrics& m) {
  out += fmt::format("  nonfinite engine {}\n", side_nonfinite(m.nan_a, m.inf_a, m.first_nonfinite_a));
  out += fmt::format("            reference {}\n", side_nonfinite(m.nan_b, m.inf_b, m.first_nonfinite_b));
}

std::string shape_str(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

std::string side(const DumpMeta& m, const std::string& path) {
  return fmt::format("{}/{} ({})", m.backend, m.precision, path);
}

std::string where(const CheckpointResult& r) {
  return r.layer >= 0 ? fmt::format("step {}, layer {}", r.step, r.layer) : fmt::format("step {}", r.step);
}

std::string rule_label(const CheckpointResult& r) { return r.rule_match.empty() ? "default" : r.rule_match; }

// Isolation replay's error of a checkpoint: "rel_l2 1.2e-07", or "shape differs".
std::string local_str(const LocalError& l) {
  return l.status == CheckpointStatus::shape_mismatch ? std::string("shape differs") : "rel_l2 " + num(l.rel_l2);
}

// "pattern   heads 0,4,8 exact, 1-3,5-7 wrong -> the query-to-KV head mapping (GQA)"
void pattern_line(std::string& out, const std::optional<ErrorPattern>& p) {
  if (!p || (p->summary.empty() && p->hint.empty())) return;
  if (!p->summary.empty()) out += fmt::format("  pattern   {}\n", p->summary);
  if (!p->hint.empty()) out += fmt::format("  {}  -> {}\n", p->summary.empty() ? "pattern " : "        ", p->hint);
}

// "ranks     rank 1 (H 2..3), rel_l2 0.5 out of bounds; rank 0 (H 0..1) within": a checkpoint merged from rank dumps.
void ranks_line(std::string& out, const std::optional<RankBlame>& b) {
  if (!b) return;
  const std::string blamed = blamed_ranks_text(*b);
  std::vector<std::string> fine;
  for (const RankShare& s : b->ranks) {
    if (s.failed || s.copy_differs || std::isnan(s.rel_l2)) continue;
    fine.push_back(b->split.empty() ? fmt::format("{}", s.rank) : fmt::format("{} ({} {}..{})", s.rank, b->split, s.from, s.to - 1));
  }
  std::string text = blamed.empty() ? std::string() : blamed + ": out of bounds";
  if (!fine.empty()) text += fmt::format("{}rank{} {} within", text.empty() ? "" : "; ", fine.size() == 1 ? "" : "s", fmt::join(fine, ", "));
  if (!b->note.empty()) text += (text.empty() ? "" : "; ") + b->note;
  out += fmt::format("  ranks     {}\n", text);
}

void verdict_lines(std::string& out, const Verdict& v, const Style& s) {
  std::string kind = verdict_kind_name(v.kind);
  std::transform(kind.begin(), kind.end(), kind.begin(), [](unsigned char ch) { return std::toupper(ch); });
  if (v.precision) kind += " (precision)";
  if (v.routing_flip) kind += " (routing flip)";
  out += fmt::format("  verdict   {} (rule {}): {}\n", s.bold(kind), v.rule, v.explanation);
  if (!v.inputs.empty()) {
    std::vector<std::string> ins;
    for (const auto& in : v.inputs) {
      // rel_l2 is NaN only over non-finite data.
      ins.push_back(fmt::format("{} rel_l2 {}", in.name, std::isnan(in.rel_l2) ? "NaN/Inf" : num(in.rel_l2)));
    }
    out += fmt::format("            inputs: {}\n", fmt::join(ins, ", "));
  }
  if (!v.unrecorded_inputs.empty())
    out += fmt::format("            not recorded: {} (an input of this op)\n", fmt::join(v.unrecorded_inputs, ", "));
}

// The drift flips the reference followed (RoutingSummary::followed): the pair ran again with the engine's experts
// there; the first kMaxFlipLines of them.
constexpr size_t kMaxFollowedLines = 8;
void followed_lines(std::string& out, const RoutingSummary& r, const Style& s) {
  if (r.followed.empty()) return;
  out += s.yellow(fmt::format("ROUTING  followed {} routing flip{} by drift: the reference ran again with the engine's "
                              "experts there, so what comes after compares the same experts' outputs",
                              r.followed.size(), r.followed.size() == 1 ? "" : "s")) +
         "\n";
  for (size_t i = 0; i < r.followed.size() && i < kMaxFollowedLines; ++i) {
    const RoutingFlip& f = r.followed[i];
    out += fmt::format("  step {} layer {} token {}: the engine's experts {{{}}}", f.step, f.layer, f.token,
                       fmt::join(f.engine, ","));
    if (!f.reference.empty())
      out += fmt::format(" for the reference's {{{}}}, margin {}, gap {}, router error {}", fmt::join(f.reference, ","),
                         num(f.margin), num(f.gap), num(f.router_error));
    out += "\n";
  }
  if (r.followed.size() > kMaxFollowedLines)
    out += fmt::format("  ... {} more (the JSON report lists every one)\n", r.followed.size() - kMaxFollowedLines);
  if (r.differing() == 0) out += "\n";
}

// Mixtures of experts, before the first divergence: where the two sides chose other experts, per step,
// layer and token, with the margin and the router error that decide each (diff/routing.hpp); the first
// kMaxFlipLines flips, local ones first.
constexpr size_t kMaxFlipLines = 8;
void routing_lines(std::string& out, const RoutingSummary& r, const Style& s) {
  followed_lines(out, r, s);
  if (r.differing() == 0) return;
  const std::string head = fmt::format(
      "ROUTING  {} of {} (token, layer) chose other experts (flip rate {:.3g}%){}, top-k overlap {:.3f}: {} drift "
      "(routing flip), {} local{}",
      r.flipped, r.token_layers, 100.0 * r.flip_rate(),
      r.reordered ? fmt::format(", {} the same experts in another order", r.reordered) : std::string(),
      r.topk_overlap(), r.drift, r.local, r.undetermined ? fmt::format(", {} undetermined", r.undetermined) : std::string());
  out += (r.local ? s.red(head) : s.yellow(head)) + "\n";
  std::vector<const RoutingFlip*> flips;
  for (const RoutingLayer& l : r.layers)
    for (const RoutingFlip& f : l.flips) flips.push_back(&f);
  std::stable_sort(flips.begin(), flips.end(), [](const RoutingFlip* a, const RoutingFlip* b) {
    return (a->kind == FlipKind::local) > (b->kind == FlipKind::local);
  });
  for (size_t i = 0; i < flips.size() && i < kMaxFlipLines; ++i) {
    const RoutingFlip& f = *flips[i];
    out += fmt::format("  step {} layer {} token {}: experts {{{}}} vs reference {{{}}} ({} of {} shared), margin {}, "
                       "gap {}, router error {}: {}\n",
                       f.step, f.layer, f.token, fmt::join(f.engine, ","), fmt::join(f.reference, ","), f.overlap,
                       f.reference.size(), num(f.margin), num(f.gap), num(f.router_error),
                       f.kind == FlipKind::drift ? "drift (routing flip)" : flip_kind_name(f.kind));
  }
  if (flips.size() > kMaxFlipLines) out += fmt::format("  ... {} more (the JSON report lists every one)\n", flips.size() - kMaxFlipLines);
  out += "\n";
}

// notes: the tolerance rule's calibration note and the bounds that would pass ("to pass"), shown
// for a drift verdict or on request (--explain): for a local bug they invite the wrong fix.
void first_divergence(std::string& out, const Comparison& c, const Style& s, bool notes) {
  const CheckpointResult& f = c.results[*c.first_failure];
  out += s.red(fmt::format("FIRST DIVERGENCE  {}  ({})", f.name, where(f))) + "\n";
  out += notes ? fmt::format("  rule      {}: {}\n", rule_label(f), f.rule_reason)
               : fmt::format("  rule      {}\n", rule_label(f));
  if (f.bound_scale > 1.0) {
    out += fmt::format("  scaled    rel L2 bounds x{:.2f} (KL x{:.2f}): this step's context or the op's reduction length\n"
                       "            is longer than the preset's calibration (calibrated_positions, calibrated_reduction)\n",
                       f.bound_scale, f.bound_scale * f.bound_scale);
  }
  if (f.status == CheckpointStatus::shape_mismatch) {
    out += fmt::format("  shape     engine {} vs reference {} (layout {})\n", shape_str(f.shape_engine),
                       shape_str(f.shape_reference), f.layout);
  } else {
    const TensorMetrics& m = *f.metrics;
    std::vector<std::string> failed;
    for (const auto& k : f.checks) {
      if (k.pass) continue;
      if (k.metric == "nonfinite") {
        failed.push_back(fmt::format("{} NaN/Inf value(s) (engine {}, reference {}): non-finite always fails", num(k.value),
                                     m.nan_a + m.inf_a, m.nan_b + m.inf_b));
      } else if (k.metric == "argmax") {
        failed.push_back(fmt::format("argmax: the engine chose token {}, its own logits' argmax is {}",
                                     static_cast<int64_t>(k.value), static_cast<int64_t>(k.limit)));
      } else {
        bool upper = k.bound.rfind("max_", 0) == 0;
        failed.push_back(fmt::format("{} {} {} {} {}", k.metric, num(k.value), upper ? ">" : "<", k.bound, num(k.limit)));
      }
    }
    // One line when it fits 110 columns, else one bound per line.
    const std::string joined = fmt::format("{}", fmt::join(failed, "; "));
    out += fmt::format("  failed    {}\n", joined.size() <= 98 ? joined : fmt::format("{}", fmt::join(failed, "\n            ")));
    if (!m.finite()) {
      out += "  metrics   — (rel_l2, max_abs, cosine, ... are undefined over non-finite values)\n";
      nonfinite_lines(out, m);
    } else {
    out += fmt::format("  metrics   rel_l2 {}  max_abs {}  mean_abs {}  nmse {}  cosine {}  sqnr {} dB\n", num(m.rel_l2),
                       num(m.max_abs), num(m.mean_abs), num(m.nmse), fmt::format("{:.6f}", m.cosine), num(m.sqnr_db));
    if (m.tolerance.atol > 0 || m.tolerance.rtol > 0) {
      out += fmt::format("            {} of {} elements outside atol {} + rtol {}·|ref| ({})\n", m.n_fail, m.n,
                         num(m.tolerance.atol), num(m.tolerance.rtol), num(m.fail_frac));
    }
    }
    if (m.finite() && (m.row.extent > 0 || m.head.extent > 0 || m.channel.extent > 0)) {
      std::vector<std::string> parts;
      const std::pair<const char*, const AxisWorst*> axes[] = {{"row", &m.row}, {"head", &m.head}, {"channel", &m.channel}};
      for (const auto& [label, w] : axes) {
        if (w->extent > 0) parts.push_back(fmt::format("{} {}={} rel_l2 {}", label, w->dim, w->index, num(w->rel_l2)));
      }
      out += fmt::format("  slices    worst {}\n", fmt::join(parts, ", "));
    }
    if (m.worst.flat >= 0) {
      out += fmt::format("  worst     {} [{}]: engine {:.9g}  reference {:.9g}  |diff| {}\n",
                         format_coordinates(m.worst.coords), f.layout, m.worst.a, m.worst.b, num(m.worst.abs_err));
    }
    if (m.finite() && notes) {
      out += fmt::format("  to pass   atol >= {} (rtol 0), or rtol >= {} (atol {})\n", num(m.min_atol), num(m.min_rtol),
                         num(m.tolerance.atol));
    }
    if (m.logits && m.finite()) {
      out += fmt::format("  logits    top-1 agreement {}  top-5 overlap {}  KL(ref||eng) mean {} max {}\n",
                         num(m.logits->top1), num(m.logits->top5_overlap), num(m.logits->kl_mean), num(m.logits->kl_max));
    }
  }
  pattern_line(out, c.pattern);
  ranks_line(out, f.ranks);
  if (f.local) {
    out += fmt::format("  local     {} in isolation replay (this op on the reference's inputs): {}\n", local_str(*f.local),
                       f.local->failed() ? "fails its tolerance" : "within tolerance");
  }
  if (!c.preceding.empty()) {
    out += "  before it (passed):\n";
    for (size_t i : c.preceding) {
      const CheckpointResult& p = c.results[i];
      const std::string local = p.local ? fmt::format("  local {}", local_str(*p.local)) : "";
      out += s.dim(fmt::format("    step {:<3} {:<18} rel_l2 {}{}", p.step, p.name, num(p.metrics->rel_l2), local)) + "\n";
    }
    if (f.metrics) {
      out += fmt::format("    step {:<3} {:<18} rel_l2 {}  <-- first failure\n", f.step, f.name, rel_str(*f.metrics));
    }
  }
  verdict_lines(out, c.verdict, s);
}

// The first NaN/Inf, when an earlier finite failure leads the report.
void first_nonfinite(std::string& out, const Comparison& c, const Style& s) {
  const CheckpointResult& f = c.results[*c.first_nonfinite];
  out += '\n';
  out += s.red(fmt::format("FIRST NaN/Inf  {}  ({})", f.name, where(f))) + "\n";
  nonfinite_lines(out, *f.metrics);
  pattern_line(out, c.nonfinite_pattern);
  verdict_lines(out, c.nonfinite_verdict, s);
}

// The results of one step by kind and layer, and what the table's columns need to know of them.
struct LayerGrid {
  int step = 0;
  std::vector<std::string> kinds;  // in execution order
  std::map<std::string, std::map<int, const CheckpointResult*>> by_kind;  // kind -> layer -> result
  int last = 0;                    // the last layer
  double lo = INFINITY, hi = 0;    // the smallest and largest finite, nonzero rel_l2
  size_t kind_w = 4;               // the kind column's width
  bool any_local = false;          // some result of the step has a local error (isolation replay)
};

LayerGrid layer_grid(const Comparison& c, int step) {
  LayerGrid g;
  g.step = step;
  for (const auto& r : c.results) {
    if (r.step != step || r.layer < 0) continue;
    if (!g.by_kind.count(r.base)) g.kinds.push_back(r.base);
    g.by_kind[r.base][r.layer] = &r;
  }
  g.last = c.reference_meta.config.n_layer - 1;
  for (const auto& [kind, layers] : g.by_kind) {
    g.kind_w = std::max(g.kind_w, kind.size());
    g.last = std::max(g.last, layers.rbegin()->first);
    for (const auto& [l, r] : layers) {
      double v = r->metrics ? r->metrics->rel_l2 : 0.0;
      if (r->metrics && r->metrics->finite() && std::isfinite(v) && v > 0) {
        g.lo = std::min(g.lo, v);
        g.hi = std::max(g.hi, v);
      }
    }
  }
  g.any_local = std::any_of(c.results.begin(), c.results.end(), [&](const CheckpointResult& r) {
    return r.step == step && r.local.has_value();
  });
  return g;
}

// One kind's row of the table.
struct LayerRow {
  std::string kind, local, first, final_, max, first_fail;
  int fails = 0, compared = 0, first_fail_layer = -1;
  bool fails_on = false;  // fails at every compared layer from its first failure on
  bool local_fails = false;  // fails in isolation replay at some layer: an error of its own
  std::vector<double> series;
};

LayerRow layer_row(const std::string& kind, const std::map<int, const CheckpointResult*>& layers, int last) {
  LayerRow row;
  row.kind = kind;
  double local_mx = -1;
  for (const auto& [l, r] : layers) {
    if (r->local && r->local->failed()) row.local_fails = true;
    if (r->local && !std::isnan(r->local->rel_l2) && r->local->rel_l2 > local_mx) local_mx = r->local->rel_l2;
  }
  row.local = local_mx >= 0 ? fmt::format("{}", num(local_mx)) : "-";
  double mx = -1;
  int mx_layer = -1, first_nonfinite = -1;
  bool gap = false;  // a passing layer after the first failing one
  std::map<int, std::string> cells;  // layer -> what the column shows
  for (int l = 0; l <= last; ++l) {
    auto it = layers.find(l);
    const TensorMetrics* m = (it != layers.end() && it->second->metrics) ? &*it->second->metrics : nullptr;
    double v = m ? m->rel_l2 : std::nan("");
    if (it != layers.end() && it->second->compared()) ++row.compared;
    if (it != layers.end() && it->second->failed()) {
      ++row.fails;
      if (row.first_fail_layer < 0) row.first_fail_layer = l;
    } else if (it != layers.end() && it->second->compared() && row.first_fail_layer >= 0) {
      gap = true;
    }
    if (m && !m->finite()) {
      // Non-finite data: "NaN"/"Inf" in the cells, '!' in the growth line, never a number.
      cells[l] = rel_str(*m);
      if (first_nonfinite < 0) first_nonfinite = l;
      v = INFINITY;
    } else {
      cells[l] = std::isnan(v) ? std::string("-") : num(v);
      if (!std::isnan(v) && v > mx) { mx = v; mx_layer = l; }
    }
    row.series.push_back(v);
  }
  row.fails_on = row.fails > 0 && !gap;
  row.first = cells[0];
  row.final_ = cells[last];
  row.max = first_nonfinite >= 0 ? fmt::format("{} ({})", cells[first_nonfinite], first_nonfinite)
            : mx >= 0            ? fmt::format("{} ({})", num(mx), mx_layer)
                                 : std::string("-");
  row.first_fail = row.first_fail_layer >= 0 ? std::to_string(row.first_fail_layer) : "-";
  return row;
}

// The kinds that fail at every layer from where they first fail, as everything downstream of the
// divergence does, and the layers they first fail at.
struct Downstream {
  std::vector<std::string> kinds;
  int from = -1, to = -1;
};

// After a divergence, a kind carries information when it is the divergence's own, passes, fails only
// at some layers, fails in isolation replay (an error of its own), or fails first before the
// divergence's layer; the rest fail everywhere downstream. None without a divergence or with `full`.
Downstream downstream_kinds(const Comparison& c, const std::vector<LayerRow>& rows, bool full) {
  Downstream d;
  if (!c.first_failure || full) return d;
  const CheckpointResult& first = c.results[*c.first_failure];
  const int div_layer = std::max(0, first.layer);
  for (const auto& row : rows) {
    if (row.kind == first.base || !row.fails_on || row.local_fails || row.first_fail_layer < div_layer) continue;
    d.kinds.push_back(row.kind);
    d.from = d.from < 0 ? row.first_fail_layer : std::min(d.from, row.first_fail_layer);
    d.to = std::max(d.to, row.first_fail_layer);
  }
  return d;
}

// A row's growth series with `per_mark` layers to a mark (the largest of them).
std::vector<double> marks_of(const std::vector<double>& series, int per_mark) {
  std::vector<double> out;
  for (size_t i = 0; i < series.size(); i += per_mark) {
    double v = std::nan("");
    for (size_t j = i; j < std::min(series.size(), i + per_mark); ++j) {
      if (!std::isnan(series[j]) && (std::isnan(v) || series[j] > v)) v = series[j];
    }
    out.push_back(v);
  }
  return out;
}

// The table: its title and legend, the header, one line per row not in `downstream`, then the line
// naming those.
void print_layer_rows(std::string& out, const LayerGrid& g, const std::vector<LayerRow>& rows,
                      const Downstream& downstream, const Style& s) {
  // Fixed columns: kind, [local], layer 0, layer last, max (layer), fails, first; the rest is the sparkline.
  const int fixed = 2 + static_cast<int>(g.kind_w) + (g.any_local ? 9 : 0) + 9 + 9 + 14 + 6 + 6 + 2;
  const int spark_room = std::max(8, kTerminalWidth - fixed);
  const int per_mark = (g.last + 1 + spark_room - 1) / spark_room;  // layers per sparkline mark
  out += '\n';
  out += s.bold(fmt::format("Relative L2 error by layer (step {})", g.step)) + "\n";
  const std::string marks = per_mark > 1 ? fmt::format(", one mark per {} layers (the largest)", per_mark) : "";
  if (g.hi > 0) {
    out += fmt::format("  growth: layers 0..{}{}; log scale ▁ {} .. █ {}; ! NaN/Inf\n", g.last, marks, num(g.lo), num(g.hi));
  }
  if (g.any_local) out += "  local: the kind's largest rel_l2 in isolation replay (each op on the reference's inputs)\n";
  const std::string kind_fmt = fmt::format("{{:<{}}}", g.kind_w);
  out += fmt::format("  {}{} {:>8} {:>8} {:>13} {:>5} {:>5}  {}\n", fmt::format(fmt::runtime(kind_fmt), "kind"),
                     g.any_local ? fmt::format(" {:>8}", "local") : "", "layer 0", fmt::format("layer {}", g.last),
                     "max (layer)", "fails", "first", "growth");
  for (const auto& row : rows) {
    if (std::find(downstream.kinds.begin(), downstream.kinds.end(), row.kind) != downstream.kinds.end()) continue;
    const std::vector<double> series = marks_of(row.series, per_mark);
    std::string fails_str = row.fails ? s.red(fmt::format("{:>5}", row.fails)) : fmt::format("{:>5}", 0);
    std::string spark = g.hi > 0 ? sparkline(series, g.lo, g.hi) : sparkline(series);
    out += fmt::format("  {}{} {:>8} {:>8} {:>13} {} {:>5}  {}\n", fmt::format(fmt::runtime(kind_fmt), row.kind),
                       g.any_local ? fmt::format(" {:>8}", row.local) : "", row.first, row.final_, row.max, fails_str,
                       row.first_fail, spark);
  }
  if (!downstream.kinds.empty()) {
    const std::string from = downstream.to > downstream.from ? fmt::format("{}-{}", downstream.from, downstream.to)
                                                             : std::to_string(downstream.from);
    out += s.dim(fmt::format("  {} more kinds fail at every layer from layer {} on, downstream (--full shows them): {}",
                             downstream.kinds.size(), from, fmt::join(downstream.kinds, ", "))) + "\n";
  }
}

// One row per checkpoint kind of the first divergence's step: local error (isolation replay), rel_l2
// at the first and last layer, the max, failures, first failing layer, and a growth sparkline (one
// mark per layer, or per group of layers when they do not fit). After a divergence, the kinds that
// fail at every layer from where they first fail, as everything downstream does, are named in one
// line (`full` lists them as rows). Then the step's checkpoints outside the layers in one line.
void layer_table(std::string& out, const Comparison& c, const Style& s, bool full) {
  const int step = c.first_failure ? c.results[*c.first_failure].step : 0;
  const LayerGrid g = layer_grid(c, step);
  if (g.kinds.empty()) return;
  std::vector<LayerRow> rows;
  for (const auto& kind : g.kinds) rows.push_back(layer_row(kind, g.by_kind.at(kind), g.last));
  print_layer_rows(out, g, rows, downstream_kinds(c, rows, full), s);
  std::vector<std::string> others;
  for (const auto& r : c.results) {
    if (r.step == step && r.layer < 0 && r.metrics) {
      others.push_back(fmt::format("{} {}{}", r.name, rel_str(*r.metrics), r.failed() ? " (fail)" : ""));
    }
  }
  if (!others.empty()) out += fmt::format("  outside layers: {}\n", fmt::join(others, ", "));
}

// Token agreement in a few lines whatever the number of steps: the count, the reference's
// continuation, then the steps that differ (at most three).
void token_table(std::string& out, const Comparison& c, const Style& s, const TerminalOptions& opt) {
  if (c.tokens.empty()) return;
  int agree = 0, known = 0;
  for (const auto& t : c.tokens) {
    if (t.reference >= 0 && t.engine >= 0) ++known;
    if (t.match()) ++agree;
  }
  out += '\n';
  out += s.bold(fmt::format("Tokens (reference's next token vs engine argmax): {}/{} steps agree", agree, known)) + "\n";
  auto text = [&](int32_t id) {
    if (id < 0) return std::string("-");
    if (!opt.token_text) return fmt::format("{}", id);
    return fmt::format("{} {:?}", id, opt.token_text(id));
  };
  if (opt.token_text) {
    std::string cont;
    for (const auto& t : c.tokens) cont += t.reference >= 0 ? opt.token_text(t.reference) : "?";
    std::string shown = fmt::format("{:?}", cont);
    const size_t room = kTerminalWidth - 15;
    if (shown.size() > room) {
      size_t cut = room - 3;
      while (cut > 0 && (static_cast<unsigned char>(shown[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
      shown = shown.substr(0, cut) + "...";
    }
    out += fmt::format("  reference {}\n", shown);
  }
  int listed = 0, differ = 0;
  for (const auto& t : c.tokens) {
    if (t.match()) continue;
    ++differ;
    if (listed == 3) continue;
    ++listed;
    std::string mark = (t.reference < 0 || t.engine < 0) ? "?" : s.red("DIFFERS");
    out += fmt::format("  step {:<3} reference {:<24} engine {:<24} {}\n", t.step, text(t.reference), text(t.engine), mark);
  }
  if (differ > listed) out += fmt::format("  ... and {} more steps differ (all in the JSON report)\n", differ - listed);
}

// Display columns of a line: ANSI escapes take none, a UTF-8 character one.
int display_width(std::string_view line) {
  int w = 0;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '\033') {
      while (i < line.size() && line[i] != 'm') ++i;
      continue;
    }
    if ((static_cast<unsigned char>(line[i]) & 0xC0) != 0x80) ++w;
  }
  return w;
}

// Wraps each line wider than `width` at spaces; continuation lines are indented to where the
// line's text starts after its label ("  verdict   ..." continues at column 12).
std::string fit_width(const std::string& text, int width) {
  std::string out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (display_width(line) <= width) {
      out += line + "\n";
      continue;
    }
    size_t lead = line.find_first_not_of(' ');
    if (lead == std::string::npos) lead = 0;
    size_t indent = lead + 4;
    const size_t label_end = line.find(' ', lead);
    if (label_end != std::string::npos && line.compare(label_end, 2, "  ") == 0) {
      const size_t text_start = line.find_first_not_of(' ', label_end);
      if (text_start != std::string::npos && text_start <= 16) indent = text_start;
    }
    bool first = true;
    while (display_width(line) > width) {
      // The last space that keeps the head within width (beyond the indent), else the first one after
      // it; a field separator (two spaces) in the last 40% of the width is preferred, so that
      // "sqnr 26.5 dB" stays on one line.
      size_t cut = std::string::npos, field_cut = std::string::npos;
      for (size_t i = indent + 1; i < line.size(); ++i) {
        if (line[i] != ' ') continue;
        const int w = display_width(std::string_view(line).substr(0, i));
        if (w > width) {
          if (cut == std::string::npos) cut = i;
          break;
        }
        cut = i;
        if (line[i - 1] != ' ' && i + 1 < line.size() && line[i + 1] == ' ' && w >= width * 6 / 10) field_cut = i;
      }
      if (field_cut != std::string::npos) cut = field_cut;
      if (cut == std::string::npos) break;
      out += line.substr(0, cut) + "\n";
      const size_t next = line.find_first_not_of(' ', cut);
      if (next == std::string::npos) { line.clear(); break; }
      line = std::string(indent, ' ') + line.substr(next);
      first = false;
    }
    (void)first;
    if (!line.empty()) out += line + "\n";
  }
  return out;
}

}  // namespace

std::string sparkline(std::span<const double> values, double lo, double hi) {
  static const char* kBars[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  if (!(lo > 0 && hi > 0)) {
    lo = INFINITY;
    hi = -INFINITY;
    for (double v : values) {
      if (std::isfinite(v) && v > 0) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
  }
  const double llo = std::log10(lo), lhi = std::log10(hi);
  std::string out;
  for (double v : values) {
    if (std::isnan(v)) {
      out += " ";
    } else if (std::isinf(v)) {
      out += "!";
    } else if (v <= 0) {
      out += "·";
    } else {
      int level = lhi > llo ? static_cast<int>(std::lround((std::log10(v) - llo) / (lhi - llo) * 7.0)) : 0;
      out += kBars[std::clamp(level, 0, 7)];
    }
  }
  return out;
}

std::string render_terminal(const Comparison& c, const TerminalOptions& opt) {
  const Style s{opt.color};
  std::string out;
  const ModelConfig& cfg = c.reference_meta.config;
  out += s.bold(opt.title) + "\n";
  out += fmt::format("  engine     {}\n", side(c.engine_meta, c.engine_path));
  out += fmt::format("  reference  {}\n", side(c.reference_meta, c.reference_path));
  out += fmt::format("  model      {}\n             {}, {} layers, D {}, H {}/{}, V {}\n", c.reference_meta.model_path,
                     arch_name(cfg.arch), cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_vocab);
  out += fmt::format("  tolerances {}\n", c.tolerance_preset.empty() ? c.tolerance_source
                                                                        : fmt::format("{} ({})", c.tolerance_preset, c.tolerance_source));
  std::set<int> steps;
  for (const auto& r : c.results) steps.insert(r.step);
  out += fmt::format("  compared   {} checkpoints over {} steps: {} pass, {} fail", c.n_pass + c.n_fail, steps.size(),
                     c.n_pass, c.n_fail);
  out += c.n_one_sided ? fmt::format(", {} in one dump only\n", c.n_one_sided) : "\n";
  const Coverage& cov = c.coverage;
  std::string cov_line = fmt::format("  coverage   {} of the reference's {} float checkpoints compared ({:.1f}%)",
                                     cov.compared, cov.reference, cov.percent());
  if (cov.required > 0) cov_line += fmt::format(", {:g}% required", cov.required);
  out += (cov.met() ? cov_line : s.red(cov_line)) + "\n";
  if (!cov.missing_kinds.empty()) out += fmt::format("  missing    {}\n", fmt::join(cov.missing_kinds, ", "));
  if (!cov.missing_steps.empty())
    out += s.red(fmt::format("  missing    step{} {} of the reference: the engine dump holds no group for {}",
                             cov.missing_steps.size() == 1 ? "" : "s", fmt::join(cov.missing_steps, ", "),
                             cov.missing_steps.size() == 1 ? "it" : "them")) +
           "\n";
  if (c.recording) {
    const RecordingCheck& r = *c.recording;
    if (r.same)
      out += fmt::format("  recording  unchanged: every step's logits ({} steps) equal those of {}, bit for bit\n",
                         r.steps, r.unrecorded_source);
    else
      out += s.red(fmt::format("  recording  CHANGED the result: step {} logit {} is {:.9g} recorded, {:.9g} in {}",
                               r.step, r.index, r.recorded, r.unrecorded, r.unrecorded_source)) +
             "\n";
  }
  for (const auto& w : c.warnings) out += s.yellow("  warning: " + w) + "\n";
  if (c.n_one_sided) {
    std::vector<std::string> names;
    for (const auto& r : c.results) {
      if (r.status != CheckpointStatus::only_engine && r.status != CheckpointStatus::only_reference) continue;
      if (names.size() == 6) { names.push_back("..."); break; }
      names.push_back(fmt::format("{}@{} ({})", r.name, r.step,
                                  r.status == CheckpointStatus::only_engine ? "engine only" : "reference only"));
    }
    out += s.yellow(fmt::format("  warning: present in one dump only, not compared: {}", fmt::join(names, ", "))) + "\n";
  }
  out += "\n";
  routing_lines(out, c.routing, s);
  if (c.first_failure) {
    first_divergence(out, c, s, opt.explain || c.verdict.kind == VerdictKind::drift);
    if (c.first_nonfinite && *c.first_nonfinite != *c.first_failure) first_nonfinite(out, c, s);
  } else {
    out += s.green(fmt::format("All {} compared checkpoints are within tolerance.", c.n_pass)) + "\n";
  }
  layer_table(out, c, s, opt.full);
  token_table(out, c, s, opt);
  out += "\n";
  if (c.first_failure) {
    const CheckpointResult& f = c.results[*c.first_failure];
    std::string nonfinite;
    if (c.first_nonfinite) {
      const CheckpointResult& n = c.results[*c.first_nonfinite];
      nonfinite = c.first_nonfinite == c.first_failure ? "; NaN/Inf there"
                                                       : fmt::format("; first NaN/Inf at {} ({})", n.name, where(n));
    }
    out += s.red(fmt::format("RESULT: DIVERGED at {} ({}); verdict {}{}", f.name, where(f),
                             verdict_kind_name(c.verdict.kind), nonfinite)) + "\n";
  } else if (c.recording_changed()) {
    out += s.red(fmt::format("RESULT: FAIL: recording changed the result (step {}, logit {})", c.recording->step,
                             c.recording->index)) +
           "\n";
  } else if (!c.coverage.missing_steps.empty()) {
    out += s.red(fmt::format("RESULT: FAIL: coverage: the engine dump lacks step{} {} of the reference",
                             c.coverage.missing_steps.size() == 1 ? "" : "s", fmt::join(c.coverage.missing_steps, ", "))) +
           "\n";
  } else if (!c.coverage.met()) {
    out += s.red(fmt::format("RESULT: FAIL: coverage {:.1f}% is below the required {:g}% (missing: {})",
                             c.coverage.percent(), c.coverage.required, fmt::join(c.coverage.missing_kinds, ", "))) +
           "\n";
  } else {
    out += s.green("RESULT: PASS") + "\n";
  }
  return fit_width(out, kTerminalWidth);
}

std::string render_summary(const Comparison& c) {
  int agree = 0;
  for (const auto& t : c.tokens) agree += t.match() ? 1 : 0;
  std::string counts = fmt::format("{}/{} checkpoints fail; tokens {}/{} agree", c.n_fail, c.n_pass + c.n_fail, agree,
                                   c.tokens.size());
  if (c.routing.differing() > 0)
    counts += fmt::format("; routing: {} of {} (token, layer) chose other experts, {} drift, {} local", c.routing.differing(),
                          c.routing.token_layers, c.routing.drift, c.routing.local);
  if (!c.routing.followed.empty())
    counts += fmt::format("; routing: {} drift flip(s) followed", c.routing.followed.size());
  std::string nonfinite;
  if (c.first_nonfinite) {
    const CheckpointResult& n = c.results[*c.first_nonfinite];
    nonfinite = fmt::format("; first NaN/Inf {} ({})", n.name, where(n));
  }
  if (!c.first_failure && c.recording_changed())
    return fmt::format("FAIL {}: recording changed the result (step {}, logit {}); {}\n", c.engine_path,
                       c.recording->step, c.recording->index, counts);
  if (!c.first_failure && !c.coverage.missing_steps.empty())
    return fmt::format("FAIL {}: coverage: lacks step{} {} of the reference; {}\n", c.engine_path,
                       c.coverage.missing_steps.size() == 1 ? "" : "s", fmt::join(c.coverage.missing_steps, ", "), counts);
  if (!c.first_failure && !c.coverage.met())
    return fmt::format("FAIL {}: coverage {:.1f}% below the required {:g}%; {}\n", c.engine_path, c.coverage.percent(),
                       c.coverage.required, counts);
  if (!c.first_failure) return fmt::format("PASS {}: {}\n", c.engine_path, counts);
  const CheckpointResult& f = c.results[*c.first_failure];
  return fmt::format("DIVERGED at {} ({}) rel_l2 {}; verdict {} (rule {}); {}{}\n", f.name, where(f),
                     f.metrics ? rel_str(*f.metrics) : std::string("shape"), verdict_kind_name(c.verdict.kind),
                     c.verdict.rule, counts, nonfinite);
}

}  // namespace diffrun::diff
