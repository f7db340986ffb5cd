// The routing verdict: flips of the selected experts, their margins and the router's error (routing.hpp).
#include "diff/routing.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
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

std::optional<RoutingRows> routing_rows(std::string_view base, std::span<const float> a, std::span<const float> b,
                                        std::span<const int64_t> shape, const std::vector<BoundCheck>& checks) {
  const bool topk = base == "ffn_moe_topk", logits = base == "ffn_moe_logits";
  if ((!topk && !logits) || shape.size() != 2 || a.size() != b.size() ||
      static_cast<int64_t>(b.size()) != shape[0] * shape[1])
    return std::nullopt;
  RoutingRows r;
  r.rows = shape[0];
  r.width = shape[1];
  if (topk) {
    r.ids_engine.resize(a.size());
    r.ids_reference.resize(b.size());
    std::transform(a.begin(), a.end(), r.ids_engine.begin(), expert_id);
    std::transform(b.begin(), b.end(), r.ids_reference.begin(), expert_id);
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
      f.kind = f.gap <= 2 * f.router_error ? FlipKind::drift : FlipKind::local;
    }
    out.flips.push_back(std::move(f));
  }
  return out;
}

RoutingSummary summarise_routing(const std::vector<CheckpointResult>& results) {
  RoutingSummary s;
  std::map<std::pair<int, int>, const CheckpointResult*> logits;
  for (const CheckpointResult& r : results)
    if (r.base == "ffn_moe_logits" && r.routing) logits[{r.step, r.layer}] = &r;
  for (const CheckpointResult& r : results) {
    if (r.base != "ffn_moe_topk" || !r.routing) continue;
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

}  // namespace diffrun::diff
