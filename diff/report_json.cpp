// The JSON report: everything the comparison found, machine-readable.
//
// Schema (report_version 2). JSON has no literal for non-finite numbers: a metric that is
// undefined (NaN: any aggregate over data holding a NaN or Inf, a local error not compared) is
// null, never 0 or 1; infinite metrics are the strings "inf" and "-inf". Element values (worst,
// first non-finite) are numbers or the strings "nan", "inf", "-inf".
// {
//   "report_version": 2,
//   "exit_code": 0 | 1,
//   "engine":    {"path", "backend", "precision", "model_path", "model_fingerprint", "prompt",
//                 "token_ids": [int], "created_utc", "diffrun_version", "facts": {str: str}},
//   "reference": { same },
//   "model": {"arch", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab",
//             "rope_theta", "rope_type", "rms_eps"},          // the reference's config
//   "tolerances": {"source", "preset"},
//   "isolated_path": null | str,                              // the isolation-replay dump, when it ran
//   "summary": {"compared", "pass", "fail", "one_sided", "steps", "diverged": bool},
//   "coverage": {"reference" (float checkpoints in the reference), "compared" (of those, also in
//                the engine dump), "percent", "required" (0: none), "met": bool, "missing_kinds": [str],
//                "missing_steps": [int] (steps of the reference the engine dump lacks: never met)},
//   "warnings": [str],
//   "routing": null (no ffn_moe_topk compared) | {              // mixtures of experts: diff/routing.hpp
//       "token_layers" (compared), "flipped" (another set of experts), "reordered" (the same set in
//       another order), "flip_rate" (flipped / token_layers), "topk_overlap" (mean shared ids / K),
//       "drift", "local", "undetermined" (of the flipped and reordered),
//       "layers": [{"step", "layer", "tokens", "k", "flipped", "differing", "topk_overlap"}],
//       "flips": [{"step", "layer", "token", "reference": [int], "engine": [int], "overlap",
//                  "reordered", "margin" (reference's K-th minus (K+1)-th router logit), "gap" (the
//                  largest reference logit difference the engine's choice crossed), "router_error",
//                  "kind": "drift"|"local"|"undetermined"}],
//       "followed": [flip as in "flips"] (drift flips the reference followed: the pair ran again with the
//                   engine's experts there; from a dump's fact routing_followed only "step", "layer",
//                   "token" and "engine" are known, "reference" is [] and the numbers null)},
//   "first_divergence": null | {
//       "index": int (into "checkpoints"), "step", "name", "layer",
//       "preceding": [int] (indices of the passing checkpoints just before it),
//       "pattern": null | {"summary", "hint", "cosine", "exact_below", "future_nonzero",   // diff/pattern.hpp
//                          "axes": [{"dim", "label", "extent", "exact": [int], "wrong": [int],
//                                    "zero_engine": [int]}]},
//       "verdict": {"kind": "local"|"drift"|"undetermined", "precision": bool (drift explained by the
//                   engine's storage precision, rule "storage"), "rule", "explanation", "ratio",
//                   "inputs": [{"name", "rel_l2"}], "growth": [{"layer", "rel_l2"}],
//                   "unrecorded_inputs": [str] (direct dataflow inputs the step did not record),
//                   "routing_flip": bool (drift: other experts chosen across a near tie, rule
//                   "routing_flip")}},
//   "first_nonfinite": null | {                               // the first checkpoint with a NaN/Inf on
//       "index", "step", "name", "layer",                     // either side (it always fails)
//       "engine": {"nan", "inf", "first": null | {"flat", "coords": {letter: index}, "value"}},
//       "reference": { same },
//       "pattern": { as above; slices holding a NaN/Inf are wrong },
//       "verdict": { as above, rule "nonfinite" }},
//   "checkpoints": [{                                        // step 0 first, execution order
//       "step", "name", "base", "layer", "order", "layout",
//       "status": "pass"|"fail"|"shape_mismatch"|"only_engine"|"only_reference",
//       "shape_engine": [int] | null, "shape_reference": [int] | null,
//       "rule": {"match": str ("" = default), "reason"},
//       "checks": [{"metric", "bound", "value", "limit", "pass"}],
//       "local": null | {"status", "rel_l2"},                 // isolation replay, when it ran
//       "ranks": null | {"split": letter ("" replicated), "partial": bool, "blamed": [int], "note": str,  // merged
//          "ranks": [{"rank", "path", "from", "to", "rel_l2", "failed", "copy_differs"}]},  // from rank dumps, failing
//       "routing_excused": int (slots left out as a routing flip's by drift; the metrics and checks
//                          are over the other slots: diff/routing.hpp),
//       "metrics": null | {
//          "n", "max_abs", "mean_abs", "rel_l2", "nmse", "cosine", "sqnr_db", "n_fail", "fail_frac",
//          "atol", "rtol", "nan_engine", "inf_engine", "nan_reference", "inf_reference",
//          "nonfinite_mismatch", "min_atol", "min_rtol",
//          "first_nonfinite_engine", "first_nonfinite_reference": null | {"flat", "coords", "value"},
//          "worst_row", "worst_head", "worst_channel": null | {"dim", "index", "rel_l2"},  // rel L2 per
//                                                     // token (or cache) row, head, last-dim channel
//          "worst": null | {"flat", "coords": {letter: index} (in layout order), "engine", "reference", "abs_err"},
//          "logits": null | {"tokens", "top1", "top5_overlap", "kl_mean", "kl_max", "kl": [num],
//                            "argmax_engine": [int], "argmax_reference": [int]}}}],
//   "tokens": [{"step", "reference", "engine", "match"}]        // -1 where unknown
// }
// A run that could not be done (exit 2) writes {"report_version": 2, "exit_code": 2, "title", "error"}
// instead (render_json_error). Strings that are not valid UTF-8 (a prompt) hold U+FFFD.
#include <cmath>
#include <set>

#include <nlohmann/json.hpp>

#include "diff/report.hpp"

namespace diffrun::diff {
namespace {

using json = nlohmann::ordered_json;

// A metric: null when undefined (NaN).
json number(double x) {
  if (std::isnan(x)) return nullptr;
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return x;
}

// An element's value.
json value(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return x;
}

json coords_json(const std::vector<Coordinate>& coords) {
  json out = json::object();
  for (const auto& c : coords) out[c.dim] = c.index;
  return out;
}

json site_json(const NonFiniteSite& site) {
  if (site.flat < 0) return nullptr;
  return {{"flat", site.flat}, {"coords", coords_json(site.coords)}, {"value", value(site.value)}};
}

json axis_json(const AxisWorst& w) {
  if (w.extent == 0) return nullptr;
  return {{"dim", w.dim}, {"index", w.index}, {"rel_l2", number(w.rel_l2)}};
}

json pattern_json(const std::optional<ErrorPattern>& p) {
  if (!p) return nullptr;
  json axes = json::array();
  for (const auto& a : p->axes) {
    axes.push_back({{"dim", a.dim}, {"label", a.label}, {"extent", a.extent}, {"exact", a.exact}, {"wrong", a.wrong},
                    {"zero_engine", a.zero_engine}});
  }
  return {{"summary", p->summary}, {"hint", p->hint}, {"cosine", number(p->cosine)}, {"exact_below", number(p->exact_below)},
          {"future_nonzero", p->future_nonzero}, {"axes", axes}};
}

json verdict_json(const Verdict& v) {
  json inputs = json::array(), growth = json::array();
  for (const auto& in : v.inputs) inputs.push_back({{"name", in.name}, {"rel_l2", number(in.rel_l2)}});
  for (const auto& g : v.growth) growth.push_back({{"layer", g.layer}, {"rel_l2", number(g.rel_l2)}});
  return {{"kind", verdict_kind_name(v.kind)},
          {"precision", v.precision},
          {"rule", v.rule},
          {"explanation", v.explanation},
          {"ratio", number(v.ratio)},
          {"inputs", inputs},
          {"growth", growth},
          {"unrecorded_inputs", v.unrecorded_inputs},
          {"routing_flip", v.routing_flip}};
}

json flip_json(const RoutingFlip& f) {
  return {{"step", f.step},          {"layer", f.layer},       {"token", f.token},
          {"reference", f.reference}, {"engine", f.engine},     {"overlap", f.overlap},
          {"reordered", f.reordered}, {"margin", number(f.margin)}, {"gap", number(f.gap)},
          {"router_error", number(f.router_error)}, {"kind", flip_kind_name(f.kind)}};
}

json routing_json(const RoutingSummary& r) {
  if (r.empty()) return nullptr;
  json layers = json::array(), flips = json::array();
  for (const RoutingLayer& l : r.layers) {
    int64_t flipped = 0;
    for (const RoutingFlip& f : l.flips) {
      flipped += f.reordered ? 0 : 1;
      flips.push_back(flip_json(f));
    }
    layers.push_back({{"step", l.step},
                      {"layer", l.layer},
                      {"tokens", l.tokens},
                      {"k", l.k},
                      {"flipped", flipped},
                      {"differing", l.flips.size()},
                      {"topk_overlap", l.tokens && l.k ? static_cast<double>(l.overlap_sum) / (l.tokens * l.k) : 1.0}});
  }
  json followed = json::array();
  for (const RoutingFlip& f : r.followed) followed.push_back(flip_json(f));
  return {{"token_layers", r.token_layers}, {"flipped", r.flipped},    {"reordered", r.reordered},
          {"flip_rate", r.flip_rate()},     {"topk_overlap", r.topk_overlap()}, {"drift", r.drift},
          {"local", r.local},               {"undetermined", r.undetermined}, {"layers", layers},
          {"flips", flips},                 {"followed", followed}};
}

json side(const DumpMeta& m, const std::string& path) {
  json facts = json::object();
  for (const auto& [k, v] : m.facts) facts[k] = v;
  return {{"path", path},
          {"backend", m.backend},
          {"precision", m.precision},
          {"model_path", m.model_path},
          {"model_fingerprint", m.model_fingerprint},
          {"prompt", m.prompt},
          {"token_ids", m.token_ids},
          {"created_utc", m.created_utc},
          {"diffrun_version", m.diffrun_version},
          {"facts", facts}};
}

json ranks_json(const RankBlame& b) {
  json ranks = json::array();
  for (const RankShare& s : b.ranks)
    ranks.push_back({{"rank", s.rank}, {"path", s.path}, {"from", s.from}, {"to", s.to}, {"rel_l2", number(s.rel_l2)},
                     {"failed", s.failed}, {"copy_differs", s.copy_differs}});
  return {{"split", b.split}, {"partial", b.partial}, {"blamed", b.blamed}, {"note", b.note}, {"ranks", ranks}};
}

json metrics_json(const TensorMetrics& m) {
  json j = {{"n", m.n},
            {"max_abs", number(m.max_abs)},
            {"mean_abs", number(m.mean_abs)},
            {"rel_l2", number(m.rel_l2)},
            {"nmse", number(m.nmse)},
            {"cosine", number(m.cosine)},
            {"sqnr_db", number(m.sqnr_db)},
            {"n_fail", m.n_fail},
            {"fail_frac", number(m.fail_frac)},
            {"atol", number(m.tolerance.atol)},
            {"rtol", number(m.tolerance.rtol)},
            {"nan_engine", m.nan_a},
            {"inf_engine", m.inf_a},
            {"nan_reference", m.nan_b},
            {"inf_reference", m.inf_b},
            {"nonfinite_mismatch", m.nonfinite_mismatch},
            {"min_atol", number(m.min_atol)},
            {"min_rtol", number(m.min_rtol)},
            {"first_nonfinite_engine", site_json(m.first_nonfinite_a)},
            {"first_nonfinite_reference", site_json(m.first_nonfinite_b)},
            {"worst_row", axis_json(m.row)},
            {"worst_head", axis_json(m.head)},
            {"worst_channel", axis_json(m.channel)}};
  if (m.worst.flat >= 0) {
    j["worst"] = {{"flat", m.worst.flat},
                  {"coords", coords_json(m.worst.coords)},
                  {"engine", value(m.worst.a)},
                  {"reference", value(m.worst.b)},
                  {"abs_err", value(m.worst.abs_err)}};
  } else {
    j["worst"] = nullptr;
  }
  if (m.logits) {
    const LogitMetrics& l = *m.logits;
    json kl = json::array();
    for (double k : l.kl) kl.push_back(number(k));
    j["logits"] = {{"tokens", l.tokens},
                   {"top1", number(l.top1)},
                   {"top5_overlap", number(l.top5_overlap)},
                   {"kl_mean", number(l.kl_mean)},
                   {"kl_max", number(l.kl_max)},
                   {"kl", kl},
                   {"argmax_engine", l.argmax_a},
                   {"argmax_reference", l.argmax_b}};
  } else {
    j["logits"] = nullptr;
  }
  return j;
}

json checkpoint_json(const CheckpointResult& r) {
  json checks = json::array();
  for (const auto& k : r.checks) {
    checks.push_back({{"metric", k.metric}, {"bound", k.bound}, {"value", number(k.value)}, {"limit", number(k.limit)},
                      {"pass", k.pass}});
  }
  return {{"step", r.step},
          {"name", r.name},
          {"base", r.base},
          {"layer", r.layer},
          {"order", r.order},
          {"layout", r.layout},
          {"status", checkpoint_status_name(r.status)},
          {"shape_engine", r.status == CheckpointStatus::only_reference ? json(nullptr) : json(r.shape_engine)},
          {"shape_reference", r.status == CheckpointStatus::only_engine ? json(nullptr) : json(r.shape_reference)},
          {"rule", {{"match", r.rule_match}, {"reason", r.rule_reason}, {"bound_scale", r.bound_scale}}},
          {"checks", checks},
          {"local", r.local ? json{{"status", checkpoint_status_name(r.local->status)}, {"rel_l2", number(r.local->rel_l2)}}
                            : json(nullptr)},
          {"ranks", r.ranks ? ranks_json(*r.ranks) : json(nullptr)},
          {"metrics", r.metrics ? metrics_json(*r.metrics) : json(nullptr)},
          {"routing_excused", r.routing_excused}};
}

}  // namespace

nlohmann::ordered_json report_json(const Comparison& c) {
  const ModelConfig& cfg = c.reference_meta.config;
  json j;
  j["report_version"] = 2;
  j["exit_code"] = exit_code(c);
  j["engine"] = side(c.engine_meta, c.engine_path);
  j["reference"] = side(c.reference_meta, c.reference_path);
  j["model"] = {{"arch", arch_name(cfg.arch)},   {"n_layer", cfg.n_layer},     {"n_embd", cfg.n_embd},
                {"n_head", cfg.n_head},          {"n_head_kv", cfg.n_head_kv}, {"head_dim", cfg.head_dim},
                {"n_ff", cfg.n_ff},              {"n_vocab", cfg.n_vocab},     {"rope_theta", cfg.rope_theta},
                {"rope_type", rope_type_name(cfg.rope_type)}, {"rms_eps", cfg.rms_eps}};
  j["tolerances"] = {{"source", c.tolerance_source}, {"preset", c.tolerance_preset}};
  j["isolated_path"] = c.isolated_path.empty() ? json(nullptr) : json(c.isolated_path);
  std::set<int> steps;
  for (const auto& r : c.results) steps.insert(r.step);
  j["summary"] = {{"compared", c.n_pass + c.n_fail}, {"pass", c.n_pass},  {"fail", c.n_fail},
                  {"one_sided", c.n_one_sided},       {"steps", steps.size()}, {"diverged", c.diverged()}};
  j["coverage"] = {{"reference", c.coverage.reference}, {"compared", c.coverage.compared},
                   {"percent", c.coverage.percent()},    {"required", c.coverage.required},
                   {"met", c.coverage.met()},            {"missing_kinds", c.coverage.missing_kinds},
                   {"missing_steps", c.coverage.missing_steps}};
  j["warnings"] = c.warnings;
  if (c.recording) {
    const RecordingCheck& r = *c.recording;
    j["recording_check"] = {{"steps", r.steps}, {"same", r.same}, {"unrecorded", r.unrecorded_source}};
    if (!r.same) {
      j["recording_check"]["step"] = r.step;
      j["recording_check"]["index"] = r.index;
      j["recording_check"]["recorded_value"] = r.recorded;
      j["recording_check"]["unrecorded_value"] = r.unrecorded;
    }
  } else {
    j["recording_check"] = nullptr;
  }
  j["routing"] = routing_json(c.routing);
  if (c.first_failure) {
    const CheckpointResult& f = c.results[*c.first_failure];
    j["first_divergence"] = {{"index", *c.first_failure},
                             {"step", f.step},
                             {"name", f.name},
                             {"layer", f.layer},
                             {"preceding", c.preceding},
                             {"pattern", pattern_json(c.pattern)},
                             {"verdict", verdict_json(c.verdict)}};
  } else {
    j["first_divergence"] = nullptr;
  }
  if (c.first_nonfinite) {
    const CheckpointResult& f = c.results[*c.first_nonfinite];
    const TensorMetrics& m = *f.metrics;
    j["first_nonfinite"] = {{"index", *c.first_nonfinite},
                            {"step", f.step},
                            {"name", f.name},
                            {"layer", f.layer},
                            {"engine", {{"nan", m.nan_a}, {"inf", m.inf_a}, {"first", site_json(m.first_nonfinite_a)}}},
                            {"reference", {{"nan", m.nan_b}, {"inf", m.inf_b}, {"first", site_json(m.first_nonfinite_b)}}},
                            {"pattern", pattern_json(c.nonfinite_pattern)},
                            {"verdict", verdict_json(c.nonfinite_verdict)}};
  } else {
    j["first_nonfinite"] = nullptr;
  }
  json checkpoints = json::array();
  for (const auto& r : c.results) checkpoints.push_back(checkpoint_json(r));
  j["checkpoints"] = std::move(checkpoints);
  json tokens = json::array();
  for (const auto& t : c.tokens) {
    tokens.push_back({{"step", t.step}, {"reference", t.reference}, {"engine", t.engine}, {"match", t.match()}});
  }
  j["tokens"] = std::move(tokens);
  return j;
}

std::string render_json(const Comparison& c) {
  // Bytes that are not valid UTF-8 (a prompt, a token's piece) become U+FFFD instead of failing the dump.
  return report_json(c).dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string render_json_error(const std::string& title, const std::string& error) {
  json j;
  j["report_version"] = 2;
  j["exit_code"] = 2;
  j["title"] = title;
  j["error"] = error;
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace diffrun::diff
