// The verdict on the first divergence: dataflow inputs per checkpoint kind and the ordered rules.
#include "diff/verdict.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "checkpoints/vocabulary.hpp"

namespace diffrun::diff {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void collect_inputs(std::string_view base, int layer, int n_layer,
                    const std::function<bool(const std::string&)>& recorded, int depth,
                    std::vector<std::string>& out) {
  // The direct operands (the vocabulary's dataflow); an unrecorded one is replaced by its own inputs.
  for (const auto& name : checkpoint_inputs(base, layer, n_layer, recorded)) {
    if (std::find(out.begin(), out.end(), name) != out.end()) continue;
    if (recorded(name)) {
      out.push_back(name);
    } else if (depth < 64) {
      ParsedCheckpointName p = parse_checkpoint_name(name);
      collect_inputs(p.base, p.layer, n_layer, recorded, depth + 1, out);
    }
  }
}

void collect_unrecorded(std::string_view base, int layer, int n_layer,
                        const std::function<bool(const std::string&)>& recorded, int depth,
                        std::vector<std::string>& out) {
  // One entry per operand in each list: the chosen alternative, the first and the last.
  const auto chosen = checkpoint_inputs(base, layer, n_layer, recorded);
  const auto first = checkpoint_inputs(base, layer, n_layer, [](const std::string&) { return true; });
  const auto last = checkpoint_inputs(base, layer, n_layer, [](const std::string&) { return false; });
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (recorded(chosen[i])) continue;
    const ParsedCheckpointName p = parse_checkpoint_name(chosen[i]);
    if (const CheckpointKind* k = find_checkpoint_kind(p.base); k && !k->read_back && depth < 8) {
      collect_unrecorded(p.base, p.layer, n_layer, recorded, depth + 1, out);
      continue;
    }
    std::string name = i < first.size() && i < last.size() && first[i] != last[i] ? first[i] + " or " + last[i] : chosen[i];
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(std::move(name));
  }
}

struct Context {
  const CheckpointResult& failing;
  const TensorMetrics* metrics;  // null on a shape mismatch
  std::vector<const CheckpointResult*> inputs;
  std::vector<LayerError> growth;
  double jump_factor;
  std::optional<RoutingLayer> routing;  // the failing ffn_moe_topk's flips
  std::optional<RoutingFlip> prior_flip; // the first drift flip before the failing checkpoint
};

using Rule = bool (*)(const Context&, Verdict&);

bool rule_shape(const Context& c, Verdict& v) {
  if (c.failing.status != CheckpointStatus::shape_mismatch) return false;
  v.kind = VerdictKind::local;
  v.rule = "shape";
  v.explanation = "the engine's tensor has a different shape from the reference's";
  return true;
}

// The engine's greedy token is not the argmax of its own logits (check "argmax", compare.cpp): whatever
// the logits' error, the choice made from them is wrong, so no input explains it.
bool rule_argmax(const Context& c, Verdict& v) {
  for (const BoundCheck& b : c.failing.checks) {
    if (b.metric != "argmax" || b.pass) continue;
    v.kind = VerdictKind::local;
    v.rule = "argmax";
    v.explanation = fmt::format("the engine chose token {} where its own logits' argmax (larger value, then the lower "
                                "index) is {}: the argmax or sampling, not the logits",
                                static_cast<int64_t>(b.value), static_cast<int64_t>(b.limit));
    return true;
  }
  return false;
}

// Ranks holding copies of one slice disagree (check "replicas", diff/shards.hpp): an all-reduce or a replicated
// computation gives every rank the same bits, so no error carried in from the inputs explains it.
bool rule_replicas(const Context& c, Verdict& v) {
  for (const BoundCheck& b : c.failing.checks) {
    if (b.metric != "replicas" || b.pass) continue;
    v.kind = VerdictKind::local;
    v.rule = "replicas";
    v.explanation = "ranks holding the same slice hold different values: the ranks' copies of a replicated value "
                    "(an all-reduce, a broadcast, a KV head copied) differ, whatever their inputs' error";
    if (c.failing.ranks && !c.failing.ranks->blamed.empty())
      v.explanation += fmt::format(" (rank{} {})", c.failing.ranks->blamed.size() == 1 ? "" : "s",
                                   fmt::join(c.failing.ranks->blamed, ", "));
    return true;
  }
  return false;
}

// The dump's layout: an equal-sized pair of dims read swapped matches the reference (find_layout_suspect).
bool rule_layout(const Context& c, Verdict& v) {
  if (c.failing.layout_suspect.empty()) return false;
  std::string stored = c.failing.layout, looks = c.failing.layout_suspect;
  v.kind = VerdictKind::undetermined;
  v.rule = "layout";
  v.explanation = fmt::format("the layout looks like [{}], not [{}]: read as [{}] the engine's values give rel_l2 {:.3g} "
                              "against {:.3g} as read; label the dataset with the layout attribute (layout = \"{}\")",
                              looks, stored, looks, c.failing.layout_suspect_rel_l2, c.metrics->rel_l2, looks);
  return true;
}

double storage_roundoff(std::string_view dtype);

// Largest |a - b| in halves of the f16 spacing at the reference value that an f16 store explains: 1
// on the reference's inputs (isolation replay); 1 + 1/8 where the inputs carry an error of their own
// (a sum near a rounding midpoint may round the other way).
constexpr double kF16HalfUlps = 1.0, kF16HalfUlpsCarried = 1.125;

// The error's structure, not its size: every engine value is an f16 value and the error is at most
// half an f16 spacing of the reference everywhere, against a reference that does not store it in
// f16 itself: the engine stores this tensor in f16, a precision choice (an engine keeping its
// residual stream in f16). The isolated values decide where the replay ran this op.
bool rule_f16_storage(const Context& c, Verdict& v) {
  const CheckpointResult& f = c.failing;
  if (f.native_reference == "f16" || f.native_reference == "bf16") return false;
  // A declared f16 store without a replay: rule storage says the same by its declared roundoff.
  if (storage_roundoff(f.native_engine) > 0 && !f.local) return false;
  const bool isolated = f.local && f.local->f16_fit;
  const std::optional<F16Fit>& fit = isolated ? f.local->f16_fit : f.f16_fit;
  if (!fit || !fit->engine_exact || !(fit->max_half_ulps <= (isolated ? kF16HalfUlps : kF16HalfUlpsCarried))) return false;
  v.kind = VerdictKind::drift;
  v.rule = "f16_storage";
  v.precision = true;
  const std::string declared = f.native_engine == "f16" ? std::string("as its native dtype f16 declares")
                               : f.native_engine.empty() ? std::string("its native dtype is not declared")
                                                         : fmt::format("though its native dtype says {}", f.native_engine);
  v.explanation = fmt::format("precision: the engine stores this tensor in f16 ({}): every engine value is an f16 value "
                              "and {}|a - b| is at most {:.3g} half f16 spacings of the reference value, what one "
                              "rounding to f16 gives",
                              declared, isolated ? "on the reference's inputs (isolation replay) " : "", fit->max_half_ulps);
  return true;
}

bool rule_isolation(const Context& c, Verdict& v) {
  if (!c.failing.local) return false;
  const LocalError& loc = *c.failing.local;
  const std::string local_err = loc.status == CheckpointStatus::shape_mismatch ? std::string("a different shape")
                                                                              : fmt::format("rel_l2 {:.3g}", loc.rel_l2);
  if (loc.failed()) {
    v.kind = VerdictKind::local;
    v.rule = "isolation";
    v.explanation = fmt::format("on the reference's inputs (isolation replay) this op alone gives {} and fails its tolerance",
                                local_err);
  } else {
    v.kind = VerdictKind::drift;
    v.rule = "isolation";
    v.explanation = fmt::format("on the reference's inputs (isolation replay) this op alone gives {}, within tolerance: "
                                "the error came in through its inputs",
                                local_err);
  }
  return true;
}

// "engine NaN 3, Inf 0; reference NaN 3, Inf 0"
std::string nonfinite_counts(const TensorMetrics& m) {
  return fmt::format("engine NaN {}, Inf {}; reference NaN {}, Inf {}", m.nan_a, m.inf_a, m.nan_b, m.inf_b);
}

// Decides whenever the checkpoint holds a NaN or Inf on either side: the other rules' metrics are
// undefined there.
bool rule_nonfinite(const Context& c, Verdict& v) {
  const TensorMetrics& m = *c.metrics;
  if (m.finite()) return false;
  v.rule = "nonfinite";
  std::vector<std::string> carried;
  for (const auto* in : c.inputs) {
    if (!in->metrics->finite()) carried.push_back(in->name);
  }
  if (!carried.empty()) {
    v.kind = VerdictKind::drift;
    v.explanation = fmt::format("non-finite values ({}) came in through its input {}", nonfinite_counts(m),
                                carried.front());
    return true;
  }
  if (c.inputs.empty() && c.failing.base != "embd") {
    v.kind = VerdictKind::undetermined;
    v.explanation = fmt::format("non-finite values here ({}); none of its inputs was recorded in this step",
                                nonfinite_counts(m));
    return true;
  }
  if (!v.unrecorded_inputs.empty()) {
    // The first non-finite value is located (it fails the run) but not blamed on this op: an op computing
    // an unrecorded input may produce it. Never local on the strength of what was not recorded.
    v.kind = VerdictKind::undetermined;
    v.explanation = fmt::format("local or upstream: non-finite values appear here ({}) while its recorded inputs are "
                                "finite: this op or the unrecorded {} before it produces them: record it to decide",
                                nonfinite_counts(m), fmt::join(v.unrecorded_inputs, ", "));
    return true;
  }
  v.kind = VerdictKind::local;
  if (c.inputs.empty()) {
    v.explanation = fmt::format("non-finite values appear at embd ({}), which has no float input: the embedding "
                                "table holds them", nonfinite_counts(m));
    return true;
  }
  const bool both = (m.nan_a + m.inf_a) > 0 && (m.nan_b + m.inf_b) > 0;
  v.explanation = fmt::format("non-finite values appear here ({}) while its inputs are finite on both sides{}",
                              nonfinite_counts(m),
                              both ? ": on both sides, so from this op's weights or its math, not the engine alone"
                                   : ": this op produces them");
  return true;
}

std::string ids_text(const std::vector<int32_t>& ids) { return fmt::format("{{{}}}", fmt::join(ids, ",")); }

// The selected experts differ (diff/routing.hpp): the flip with the largest gap over its router error
// decides. The isolation rule, before it, decides where the replay fed the reference's router inputs.
bool rule_routing(const Context& c, Verdict& v) {
  if (c.failing.base != kExpertIdsKind || !c.routing || c.routing->flips.empty()) return false;
  const std::vector<RoutingFlip>& flips = c.routing->flips;
  v.flips = flips;
  v.rule = "routing";
  const auto over = [](const RoutingFlip& f) { return f.gap / f.router_error; };
  const RoutingFlip* worst = nullptr;
  for (const RoutingFlip& f : flips) {
    if (f.kind == FlipKind::undetermined) {
      v.kind = VerdictKind::undetermined;
      v.explanation = fmt::format("token {} chose experts {} where the reference chose {}, and ffn_moe_logits-{} was "
                                  "not compared: record the router logits on both sides to tell a flip by drift "
                                  "from a routing bug",
                                  f.token, ids_text(f.engine), ids_text(f.reference), f.layer);
      return true;
    }
    // A local flip before any drift one, then the largest gap over the router error.
    const bool local = f.kind == FlipKind::local;
    if (!worst || (local && worst->kind != FlipKind::local) ||
        (local == (worst->kind == FlipKind::local) && over(f) > over(*worst)))
      worst = &f;
  }
  const RoutingFlip& w = *worst;
  const std::string what = fmt::format("token {} chose experts {} where the reference chose {} ({} in common)", w.token,
                                       ids_text(w.engine), ids_text(w.reference), w.overlap);
  if (w.kind == FlipKind::local) {
    v.kind = VerdictKind::local;
    v.explanation = fmt::format("{}: the reference's router logits rank them apart by {:.3g} (margin between the "
                                "K-th and (K+1)-th {:.3g}), {} twice the router error {:.3g} at that token: the "
                                "selection is wrong, not the logits ({} of {} tokens differ)",
                                what, w.gap, w.margin,
                                std::isinf(w.gap) ? std::string("an id naming no expert, far beyond")
                                                  : fmt::format("{:.3g}x", w.gap / (2 * w.router_error)),
                                w.router_error, flips.size(), c.routing->tokens);
    return true;
  }
  v.kind = VerdictKind::drift;
  v.rule = "routing_flip";
  v.routing_flip = true;
  v.explanation = fmt::format("{} of {} tokens chose other experts, each across a gap of the reference's router "
                              "logits within twice the router error (largest: {}, gap {:.3g}, margin {:.3g}, router "
                              "error {:.3g}): a near tie that precision error tipped; what follows in this token "
                              "comes from the other experts",
                              flips.size(), c.routing->tokens, what, w.gap, w.margin, w.router_error);
  return true;
}

// Downstream of a routing flip by drift (its token's other experts change ffn_moe_out, the layers after
// and, through the cache, the later steps): the error here is the flip's, not a bug of this op. The
// isolation rule, before it, checks the op on the reference's inputs where the replay ran.
bool rule_after_flip(const Context& c, Verdict& v) {
  if (!c.prior_flip || c.failing.base == kExpertIdsKind) return false;
  const RoutingFlip& f = *c.prior_flip;
  v.kind = VerdictKind::drift;
  v.rule = "routing_flip";
  v.routing_flip = true;
  v.flips = {f};
  v.explanation = fmt::format("downstream of a routing flip by drift: at step {} layer {} token {} chose experts {} where "
                              "the reference chose {}, across a gap of {:.3g} within twice the router error {:.3g}; the "
                              "other experts' output carries on from there (--isolate checks this op on the "
                              "reference's inputs)",
                              f.step, f.layer, f.token, ids_text(f.engine), ids_text(f.reference), f.gap,
                              f.router_error);
  return true;
}

// Unit roundoff of a storage dtype narrower than f32, 0 for the others.
double storage_roundoff(std::string_view dtype) {
  if (dtype == "f16") return std::ldexp(1.0, -11);
  if (dtype == "bf16") return std::ldexp(1.0, -8);
  return 0.0;
}

bool rule_storage(const Context& c, Verdict& v) {
  const double u = storage_roundoff(c.failing.native_engine);
  const double u_ref = storage_roundoff(c.failing.native_reference);
  if (!(u > 0) || (u_ref > 0 && u_ref >= u)) return false;  // the reference stores it at least as narrow
  double max_in = 0;
  for (const auto& in : v.inputs) max_in = std::max(max_in, in.rel_l2);
  const double bound = u + c.jump_factor * max_in;
  if (!(c.metrics->rel_l2 <= bound)) return false;
  v.kind = VerdictKind::drift;
  v.rule = "storage";
  v.precision = true;
  v.explanation = fmt::format("the engine stores {} in {} (unit roundoff {:.3g}) where the reference keeps {}: rel_l2 {:.3g} "
                              "<= {:.3g} = roundoff + {:g} x its inputs' {:.3g}, what one rounding explains",
                              c.failing.name, c.failing.native_engine, u,
                              c.failing.native_reference.empty() ? "a wider type" : c.failing.native_reference,
                              c.metrics->rel_l2, bound, c.jump_factor, max_in);
  return true;
}

bool rule_embedding(const Context& c, Verdict& v) {
  if (c.failing.base != "embd") return false;
  v.kind = VerdictKind::local;
  v.rule = "embedding";
  v.explanation = "embd is read from identical token ids: its error cannot come from an input";
  return true;
}

bool rule_jump(const Context& c, Verdict& v) {
  if (c.inputs.empty() || !(v.ratio > c.jump_factor)) return false;
  double max_in = 0;
  std::string worst_in;
  for (const auto& in : v.inputs) {
    if (in.rel_l2 >= max_in) { max_in = in.rel_l2; worst_in = in.name; }
  }
  if (!v.unrecorded_inputs.empty()) {
    // The jump is over the recorded inputs only: the op computing an unrecorded one may hold the bug.
    v.kind = VerdictKind::undetermined;
    v.rule = "unrecorded_input";
    v.explanation = fmt::format("local or upstream: rel_l2 {:.3g} is {}x its recorded inputs' max {:.3g} ({}), but its "
                                "input {} was not recorded, so the error may come from there: record it to decide",
                                c.metrics->rel_l2, std::isinf(v.ratio) ? std::string("inf") : fmt::format("{:.3g}", v.ratio),
                                max_in, worst_in, fmt::join(v.unrecorded_inputs, ", "));
    return true;
  }
  v.kind = VerdictKind::local;
  v.rule = "jump";
  v.explanation = std::isinf(v.ratio)
                      ? fmt::format("rel_l2 {:.3g} while its inputs are exact (max rel_l2 0, {})", c.metrics->rel_l2, worst_in)
                      : fmt::format("rel_l2 {:.3g} is {:.3g}x its inputs' max {:.3g} ({}), above the jump factor {:g}",
                                    c.metrics->rel_l2, v.ratio, max_in, worst_in, c.jump_factor);
  return true;
}

bool rule_smooth_growth(const Context& c, Verdict& v) {
  const auto& g = c.growth;
  if (g.size() < 3) return false;
  double max_step = 0;
  for (size_t i = 1; i < g.size(); ++i) {
    if (g[i - 1].rel_l2 <= 0) return false;
    double r = g[i].rel_l2 / g[i - 1].rel_l2;
    if (r > c.jump_factor) return false;
    max_step = std::max(max_step, r);
  }
  if (!(g.back().rel_l2 > g.front().rel_l2)) return false;
  v.kind = VerdictKind::drift;
  v.rule = "smooth_growth";
  v.explanation = fmt::format("{} rel_l2 grew from {:.3g} (layer {}) to {:.3g} (layer {}), at most {:.3g}x per layer (jump factor {:g})",
                              c.failing.base, g.front().rel_l2, g.front().layer, g.back().rel_l2, g.back().layer,
                              max_step, c.jump_factor);
  return true;
}

bool rule_no_jump(const Context& c, Verdict& v) {
  if (c.inputs.empty()) return false;
  v.kind = VerdictKind::drift;
  v.rule = "no_jump";
  v.explanation = fmt::format("rel_l2 {:.3g} is only {:.3g}x its inputs' (jump factor {:g}): error carried in crossed the tolerance",
                              c.metrics->rel_l2, v.ratio, c.jump_factor);
  if (!v.unrecorded_inputs.empty()) v.explanation += fmt::format(" (its input {} was not recorded)", fmt::join(v.unrecorded_inputs, ", "));
  return true;
}

// In order; the first rule that decides wins.
constexpr Rule kRules[] = {rule_shape,   rule_argmax, rule_replicas, rule_layout,        rule_f16_storage,
                           rule_isolation, rule_nonfinite, rule_routing, rule_storage, rule_embedding,
                           rule_after_flip, rule_jump,    rule_smooth_growth, rule_no_jump};

}  // namespace

const char* verdict_kind_name(VerdictKind k) {
  switch (k) {
    case VerdictKind::none: return "none";
    case VerdictKind::local: return "local";
    case VerdictKind::drift: return "drift";
    case VerdictKind::undetermined: return "undetermined";
  }
  return "?";
}

std::vector<std::string> dataflow_inputs(std::string_view base, int layer, int n_layer,
                                         const std::function<bool(const std::string&)>& recorded) {
  std::vector<std::string> out;
  collect_inputs(base, layer, n_layer, recorded, 0, out);
  return out;
}

std::vector<std::string> unrecorded_inputs(std::string_view base, int layer, int n_layer,
                                           const std::function<bool(const std::string&)>& recorded) {
  std::vector<std::string> out;
  collect_unrecorded(base, layer, n_layer, recorded, 0, out);
  return out;
}

Verdict decide_verdict(const std::vector<CheckpointResult>& results, size_t failing, int n_layer,
                       double jump_factor) {
  const CheckpointResult& f = results.at(failing);
  std::map<std::string, const CheckpointResult*> step;
  for (const auto& r : results) {
    if (r.step == f.step && r.compared()) step[r.name] = &r;
  }
  auto recorded = [&](const std::string& name) { return step.count(name) > 0; };

  Context c{f, f.compared() ? &*f.metrics : nullptr, {}, {}, jump_factor, std::nullopt, std::nullopt};
  Verdict v;
  v.unrecorded_inputs = unrecorded_inputs(f.base, f.layer, n_layer, recorded);
  for (const auto& name : dataflow_inputs(f.base, f.layer, n_layer, recorded)) {
    const CheckpointResult* in = step.at(name);
    c.inputs.push_back(in);
    v.inputs.push_back({name, in->metrics->rel_l2});
  }
  if (f.layer >= 0) {
    for (int l = 0; l <= f.layer; ++l) {
      auto it = step.find(checkpoint_name(f.base, l));
      if (it != step.end()) c.growth.push_back({l, it->second->metrics->rel_l2});
    }
  }
  v.growth = c.growth;
  if (f.base == kExpertIdsKind && f.routing) {
    const auto logits = step.find(checkpoint_name(kRouterLogitsKind, f.layer));
    c.routing = analyse_routing(f, logits == step.end() ? nullptr : logits->second);
  }
  // The first drift flip before it: an earlier step's, or this step's at an earlier checkpoint.
  for (const CheckpointResult& r : results) {
    if (r.base != kExpertIdsKind || !r.routing || r.step > f.step || (r.step == f.step && r.order >= f.order)) continue;
    const CheckpointResult* logits = nullptr;
    for (const CheckpointResult& x : results)
      if (x.step == r.step && x.layer == r.layer && x.base == kRouterLogitsKind && x.compared()) logits = &x;
    const RoutingLayer l = analyse_routing(r, logits);
    const auto drift = std::find_if(l.flips.begin(), l.flips.end(), [](const RoutingFlip& x) { return x.kind == FlipKind::drift; });
    if (drift == l.flips.end()) continue;
    if (!c.prior_flip || std::make_pair(drift->step, drift->layer) < std::make_pair(c.prior_flip->step, c.prior_flip->layer))
      c.prior_flip = *drift;
  }
  if (c.metrics) {
    double max_in = 0;
    for (const auto& in : v.inputs) max_in = std::max(max_in, in.rel_l2);
    v.ratio = !c.metrics->finite() ? std::numeric_limits<double>::quiet_NaN()
              : max_in > 0         ? c.metrics->rel_l2 / max_in
                                   : (c.metrics->rel_l2 > 0 ? kInf : 0.0);
  }
  for (Rule rule : kRules) {
    if (rule != rule_shape && !c.metrics) break;
    if (rule(c, v)) return v;
  }
  v.kind = VerdictKind::undetermined;
  v.rule = "no_inputs";
  v.explanation = "none of its dataflow inputs was recorded in this step";
  return v;
}

}  // namespace diffrun::diff
