// The routing verdict: flips of the selected experts, their margins and the router's error (routing.hpp).
#include "diff/routing.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <utility>

#include "checkpoints/vocabulary.hpp"

namespace diffrun::diff {
namespace {

// The limit of the check of `bound` ("max_row_rel_l2"), as scaled for the step; nullopt when the rule has none.
std::optional<double> limit_of(const std::vector<BoundCheck>& checks, std::string_view bound) {
  for (const BoundCheck& k : checks)
    if (k.bound == bound) return k.limit;
  return std::nullopt;
}

// An expert id as stored (a float holding a whole number), -1 where it is none.
int32_t expert_id(float v) {
  if (!std::isfinite(v) || v < 0 || v > static_cast<float>(std::numeric_limits<int32_t>::max()) || v != std::floor(v))
    return -1;
  return static_cast<int32_t>(v);
}

}  // namespace

const char* flip_kind_name(FlipKind k) {
  switch (k) {
    case FlipKind::drift: return "drift";
    case FlipKind::local: return "local";
    case FlipKind::undetermined: return "undetermined";
  }
  return "?";
}

double RoutingSummary::topk_overlap() const {
  int64_t slots = 0, overlap = 0;
  for (const RoutingLayer& l : layers) {
    slots += l.tokens * l.k;
    overlap += l.overlap_sum;
  }
  return slots ? static_cast<double>(overlap) / static_cast<double>(slots) : 1.0;
}

std::optional<RoutingRows> routing_rows(std::string_view base, std::string_view layout, std::span<const float> a,
                                        std::span<const float> b, std::span<const int64_t> shape,
                                        const std::vector<BoundCheck>& checks) {
  const std::vector<std::string> dims = layout_dims(layout);
  const bool per_slot = dims.size() >= 2 && dims[0] == "T" && dims[1] == "K" && shape.size() == dims.size();
  const bool logits = base == kRouterLogitsKind && shape.size() == 2;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if ((!per_slot && !logits) || a.size() != b.size() || static_cast<int64_t>(b.size()) != n) return std::nullopt;
  RoutingRows r;
  r.rows = shape[0];
  r.width = shape[1];
  if (per_slot) {
    const int64_t slots = r.rows * r.width, inner = slots ? n / slots : 0;
    r.slot_err2.assign(static_cast<size_t>(slots), 0.0);
    r.slot_ref2.assign(static_cast<size_t>(slots), 0.0);
    r.slot_max_abs.assign(static_cast<size_t>(slots), 0.0);
    for (int64_t s = 0; s < slots; ++s) {
      for (int64_t i = s * inner; i < (s + 1) * inner; ++i) {
        const double d = static_cast<double>(a[i]) - b[i];
        r.slot_err2[s] += d * d;
        r.slot_ref2[s] += static_cast<double>(b[i]) * b[i];
        r.slot_max_abs[s] = std::max(r.slot_max_abs[s], std::abs(d));
      }
    }
    if (base == kExpertIdsKind) {
      r.ids_engine.resize(a.size());
      r.ids_reference.resize(b.size());
      std::transform(a.begin(), a.end(), r.ids_engine.begin(), expert_id);
      std::transform(b.begin(), b.end(), r.ids_reference.begin(), expert_id);
    }
    return r;
  }
  r.logits_reference.assign(b.begin(), b.end());
  // The largest element error the rule admits on a row: max_abs, else a rel L2 bound (the row's, else
  // the tensor's) times the row's norm, all of it in one element.
  const std::optional<double> abs_limit = limit_of(checks, "max_abs");
  std::optional<double> rel_limit = limit_of(checks, "max_row_rel_l2");
  if (!rel_limit) rel_limit = limit_of(checks, "max_rel_l2");
  r.error.resize(static_cast<size_t>(r.rows));
  for (int64_t t = 0; t < r.rows; ++t) {
    double observed = 0, norm2 = 0;
    for (int64_t e = 0; e < r.width; ++e) {
      const size_t i = static_cast<size_t>(t * r.width + e);
      observed = std::max(observed, std::abs(static_cast<double>(a[i]) - b[i]));
      norm2 += static_cast<double>(b[i]) * b[i];
    }
    double allowed = rel_limit ? *rel_limit * std::sqrt(norm2) : 0.0;
    if (abs_limit) allowed = rel_limit ? std::min(allowed, *abs_limit) : *abs_limit;
    r.error[static_cast<size_t>(t)] = std::max(observed, allowed);
  }
  return r;
}

RoutingLayer analyse_routing(const CheckpointResult& topk, const CheckpointResult* logits) {
  RoutingLayer out;
  out.step = topk.step;
  out.layer = topk.layer;
  if (!topk.routing) return out;
  const RoutingRows& ids = *topk.routing;
  out.tokens = ids.rows;
  out.k = ids.width;
  const RoutingRows* lg = logits && logits->routing && logits->routing->rows == ids.rows &&
                                  logits->routing->width > ids.width && !logits->routing->logits_reference.empty()
                              ? &*logits->routing
                              : nullptr;
  const size_t K = static_cast<size_t>(ids.width);
  for (int64_t t = 0; t < ids.rows; ++t) {
    const auto row = [&](const std::vector<int32_t>& v) {
      return std::vector<int32_t>(v.begin() + t * ids.width, v.begin() + (t + 1) * ids.width);
    };
    RoutingFlip f;
    f.step = topk.step;
    f.layer = topk.layer;
    f.token = t;
    f.reference = row(ids.ids_reference);
    f.engine = row(ids.ids_engine);
    for (int32_t e : f.engine)
      if (e >= 0 && std::count(f.reference.begin(), f.reference.end(), e) > 0) ++f.overlap;
    out.overlap_sum += f.overlap;
    if (f.reference == f.engine) continue;
    f.reordered = f.overlap == static_cast<int>(K);
    if (lg) {
      const int64_t E = lg->width;
      const float* l = lg->logits_reference.data() + t * E;
      std::vector<float> sorted(l, l + E);
      std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(K), sorted.end(), std::greater<>());
      const float next = sorted[K];
      const float kth = *std::min_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(K));
      f.margin = static_cast<double>(kth) - next;
      // Rank of an expert on one side: its slot, or K outside the top K.
      const auto rank = [&](const std::vector<int32_t>& v, int32_t x) {
        return static_cast<size_t>(std::find(v.begin(), v.end(), x) - v.begin());
      };
      std::vector<int32_t> experts = f.reference;
      experts.insert(experts.end(), f.engine.begin(), f.engine.end());
      f.gap = -std::numeric_limits<double>::infinity();
      for (int32_t i : experts) {
        for (int32_t j : experts) {
          if (!(rank(f.reference, i) < rank(f.reference, j) && rank(f.engine, j) < rank(f.engine, i))) continue;
          if (i < 0 || j < 0 || i >= E || j >= E) {
            f.gap = std::numeric_limits<double>::infinity();  // an id that names no expert
            continue;
          }
          f.gap = std::max(f.gap, static_cast<double>(l[i]) - l[j]);
        }
      }
      f.router_error = lg->error[static_cast<size_t>(t)];
      // Drift: the pair was within the router's error of a tie on the reference's side. A negative gap beyond it
      // means the reference's own logits order the pair the engine's way: its choice contradicts its router, which
      // no drift of the engine explains.
      f.kind = std::abs(f.gap) <= 2 * f.router_error ? FlipKind::drift : FlipKind::local;
    }
    out.flips.push_back(std::move(f));
  }
  return out;
}

bool excuse_routing_flip(CheckpointResult& r, const std::function<const CheckpointResult*(const std::string&)>& find,
                         const ToleranceSet& tolerances) {
  if (!r.failed() || !r.metrics || !r.metrics->finite() || !r.routing || r.routing->slot_err2.empty()) return false;
  const CheckpointResult* topk = r.base == kExpertIdsKind ? &r : find(checkpoint_name(kExpertIdsKind, r.layer));
  if (!topk || !topk->routing || topk->routing->ids_reference.empty()) return false;
  const RoutingRows& ids = *topk->routing;
  const RoutingRows& mine = *r.routing;
  if (mine.rows != ids.rows || mine.width != ids.width) return false;
  const RoutingLayer layer = analyse_routing(*topk, find(checkpoint_name(kRouterLogitsKind, r.layer)));
  if (layer.flips.empty()) return false;
  for (const RoutingFlip& f : layer.flips)
    if (f.kind != FlipKind::drift) return false;
  // The slots compared: those holding the same expert on both sides.
  std::vector<char> kept(mine.slot_err2.size(), 1);
  int64_t left_out = 0;
  for (const RoutingFlip& f : layer.flips) {
    for (size_t k = 0; k < f.reference.size(); ++k) {
      if (f.reference[k] == f.engine[k]) continue;
      kept[static_cast<size_t>(f.token) * f.reference.size() + k] = 0;
      ++left_out;
    }
  }
  const auto rel = [](double err2, double ref2) {
    return ref2 > 0 ? std::sqrt(err2 / ref2) : err2 > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  };
  TensorMetrics m = *r.metrics;
  double err2 = 0, ref2 = 0;
  m.max_abs = 0;
  m.row.rel_l2 = 0;
  for (int64_t t = 0; t < mine.rows; ++t) {
    double row_err2 = 0, row_ref2 = 0;
    for (int64_t k = 0; k < mine.width; ++k) {
      const size_t s = static_cast<size_t>(t * mine.width + k);
      if (!kept[s]) continue;
      row_err2 += mine.slot_err2[s];
      row_ref2 += mine.slot_ref2[s];
      m.max_abs = std::max(m.max_abs, mine.slot_max_abs[s]);
    }
    err2 += row_err2;
    ref2 += row_ref2;
    if (m.row.extent > 0 && rel(row_err2, row_ref2) > m.row.rel_l2) {
      m.row.rel_l2 = rel(row_err2, row_ref2);
      m.row.index = t;
    }
  }
  m.rel_l2 = rel(err2, ref2);
  m.nmse = m.rel_l2 * m.rel_l2;
  std::vector<BoundCheck> checks = check_bounds(m, tolerances.rule_for(r.name), r.positions, r.bound_scale);
  if (!std::all_of(checks.begin(), checks.end(), [](const BoundCheck& k) { return k.pass; })) return false;
  r.metrics = std::move(m);
  r.checks = std::move(checks);
  r.status = CheckpointStatus::pass;
  r.routing_excused = left_out;
  r.f16_fit.reset();
  r.layout_suspect.clear();
  return true;
}

RoutingSummary summarise_routing(const std::vector<CheckpointResult>& results) {
  RoutingSummary s;
  std::map<std::pair<int, int>, const CheckpointResult*> logits;
  for (const CheckpointResult& r : results)
    if (r.base == kRouterLogitsKind && r.routing) logits[{r.step, r.layer}] = &r;
  for (const CheckpointResult& r : results) {
    if (r.base != kExpertIdsKind || !r.routing) continue;
    const auto it = logits.find({r.step, r.layer});
    RoutingLayer l = analyse_routing(r, it == logits.end() ? nullptr : it->second);
    s.token_layers += l.tokens;
    for (const RoutingFlip& f : l.flips) {
      ++(f.reordered ? s.reordered : s.flipped);
      if (f.kind == FlipKind::drift) ++s.drift;
      else if (f.kind == FlipKind::local) ++s.local;
      else ++s.undetermined;
    }
    s.layers.push_back(std::move(l));
  }
  return s;
}

std::optional<std::vector<RoutingFlip>> parse_routing_followed(std::string_view fact) {
  std::vector<RoutingFlip> flips;
  std::istringstream rows{std::string(fact)};
  std::string row;
  while (std::getline(rows, row, ';')) {
    RoutingFlip f;
    char colon = 0;
    std::string w_step, w_layer, w_token;
    std::istringstream in(row);
    if (!(in >> w_step >> f.step >> w_layer >> f.layer >> w_token >> f.token >> colon) || w_step != "step" ||
        w_layer != "layer" || w_token != "token" || colon != ':' || f.step < 0 || f.layer < 0 || f.token < 0)
      return std::nullopt;
    std::string ids;
    in >> ids;
    std::istringstream id_list(ids);
    std::string id;
    while (std::getline(id_list, id, ',')) {
      char* end = nullptr;
      const long v = std::strtol(id.c_str(), &end, 10);
      if (id.empty() || *end != '\0' || v < 0 || v > INT32_MAX) return std::nullopt;
      f.engine.push_back(static_cast<int32_t>(v));
    }
    std::string rest;
    if (f.engine.empty() || (in >> rest)) return std::nullopt;
    f.kind = FlipKind::drift;
    flips.push_back(std::move(f));
  }
  return flips;
}

}  // namespace diffrun::diff
