// The comparator: refuses incomparable dumps, compares every checkpoint in order, finds the first divergence.
#include "diff/compare.hpp"
#include "diff/routing.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoints/dump_schema_names.hpp"
#include "checkpoints/vocabulary.hpp"
#include "diff/shards.hpp"
#include "dump/rows.hpp"
#include "model/error.hpp"

namespace diffrun::diff {
namespace {

std::vector<std::string> config_differences(const ModelConfig& a, const ModelConfig& b) {
  std::vector<std::string> out;
  auto field = [&](const char* name, auto x, auto y) {
    if (x != y) out.push_back(fmt::format("{} {} vs {}", name, x, y));
  };
  field(attr::arch, std::string(arch_name(a.arch)), std::string(arch_name(b.arch)));
  field(attr::n_layer, a.n_layer, b.n_layer);
  field(attr::n_embd, a.n_embd, b.n_embd);
  field(attr::n_head, a.n_head, b.n_head);
  field(attr::n_head_kv, a.n_head_kv, b.n_head_kv);
  field(attr::head_dim, a.head_dim, b.head_dim);
  field(attr::n_ff, a.n_ff, b.n_ff);
  field(attr::n_vocab, a.n_vocab, b.n_vocab);
  field(attr::rope_theta, a.rope_theta, b.rope_theta);
  field(attr::rope_type, std::string(rope_type_name(a.rope_type)), std::string(rope_type_name(b.rope_type)));
  field(attr::rms_eps, a.rms_eps, b.rms_eps);
  field(attr::tied_output, a.tied_output, b.tied_output);
  field(attr::qkv_bias, a.qkv_bias, b.qkv_bias);
  field(attr::qk_norm, a.qk_norm, b.qk_norm);
  return out;
}

struct Entry {
  int order;
  std::string name;
  const DatasetInfo* engine;
  const DatasetInfo* reference;
};

// The input ids of a step, checked for equality before the comparison, never compared as data.
bool is_token_ids(const DatasetInfo& d) { return d.is_int && d.name == kTokensCheckpoint; }

// Both sides' datasets of one step but the token ids, reference order first, engine-only ones by their
// order. An integer dataset outside the vocabulary (positions, ids of a foreign writer) is compared
// as values like any checkpoint, also against a float one of the same name.
std::vector<Entry> merged_entries(const std::vector<DatasetInfo>& eng, const std::vector<DatasetInfo>& ref) {
  std::vector<Entry> out;
  std::map<std::string, const DatasetInfo*> eng_by_name;
  for (const auto& d : eng) {
    if (!is_token_ids(d)) eng_by_name[d.name] = &d;
  }
  for (const auto& d : ref) {
    if (is_token_ids(d)) continue;
    auto it = eng_by_name.find(d.name);
    out.push_back({d.order, d.name, it == eng_by_name.end() ? nullptr : it->second, &d});
    if (it != eng_by_name.end()) eng_by_name.erase(it);
  }
  for (const auto& d : eng) {
    if (is_token_ids(d) || !eng_by_name.count(d.name)) continue;
    auto pos = std::find_if(out.begin(), out.end(), [&](const Entry& x) { return x.order > d.order; });
    out.insert(pos, {d.order, d.name, &d, nullptr});
  }
  return out;
}

// A slice is exact below the rule's row/head bound, else 4x its tensor-wide rel L2 bound (a slice's
// clean error runs a few times the tensor's), else 0.
double exact_threshold(const ToleranceRule& rule) {
  if (rule.max_row_rel_l2 || rule.max_head_rel_l2) {
    return std::max(rule.max_row_rel_l2.value_or(0.0), rule.max_head_rel_l2.value_or(0.0));
  }
  return rule.max_rel_l2 ? 4.0 * *rule.max_rel_l2 : 0.0;
}

bool has_tokens(const DumpReader& d, int step) {
  const DatasetInfo* info = d.find(step, std::string(kTokensCheckpoint));
  return info && info->is_int;
}

// A checkpoint holding its last rows only (row_offset, docs/dump-format.md "Rows"): how many leading rows of
// dimension rd (row_dim of its layout) of a tensor whose first row is `offset` fall before row_lo (0: none, or
// no such dimension).
int64_t rows_before(const std::vector<int64_t>& shape, int64_t offset, int64_t row_lo, int rd) {
  if (offset >= row_lo || rd < 0 || static_cast<size_t>(rd) >= shape.size() || shape[rd] < row_lo - offset) return 0;
  return row_lo - offset;
}

// The fit of the engine's values to f16 storage (F16Fit) over finite data.
F16Fit f16_fit(std::span<const float> a, std::span<const float> b) {
  F16Fit fit;
  fit.engine_exact = true;
  // The spacing of f16 values at |x| (subnormals: 2^-24).
  const auto spacing = [](double x) {
    int e = 0;
    std::frexp(std::abs(x), &e);  // |x| = m 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
    return std::ldexp(1.0, std::max(e - 1, -14) - 10);
  };
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double x = a[i], y = b[i];
    if (fit.engine_exact && x != 0) {
      const double q = x / spacing(x);
      fit.engine_exact = std::abs(x) <= 65504.0 && q == std::floor(q);
    }
    if (x != y) fit.max_half_ulps = std::max(fit.max_half_ulps, std::abs(x - y) / (0.5 * spacing(y)));
  }
  return fit;
}

// A failing checkpoint whose layout has two dims of equal size: the reading with those dims swapped
// ("T,H,S" for an unlabelled [T, H, S] array read as the vocabulary's [H, T, S] when T = H), when its
// rel_l2 against the reference is under a tenth of the as-stored one.
void find_layout_suspect(CheckpointResult& r, std::span<const float> a, std::span<const float> b) {
  const std::vector<std::string> dims = layout_dims(r.layout);
  const std::vector<int64_t>& shape = r.shape_reference;
  if (dims.size() != shape.size() || a.size() != b.size() || !r.metrics) return;
  const double as_stored = r.metrics->rel_l2;
  if (!(as_stored > 0)) return;
  double sb = 0;
  for (float y : b) sb += static_cast<double>(y) * y;
  if (!(sb > 0)) return;
  for (size_t i = 0; i < dims.size(); ++i) {
    for (size_t j = i + 1; j < dims.size(); ++j) {
      if (shape[i] != shape[j] || shape[i] < 2) continue;
      // a read with dims i and j swapped: element (.., x_i, .., x_j, ..) of the reading is a's
      // element (.., x_j, .., x_i, ..).
      int64_t inner_j = 1, inner_i = 1;
      for (size_t k = j + 1; k < shape.size(); ++k) inner_j *= shape[k];
      for (size_t k = i + 1; k < shape.size(); ++k) inner_i *= shape[k];
      const int64_t n = shape[i];
      double d2 = 0;
      for (size_t f = 0; f < b.size(); ++f) {
        const int64_t idx = static_cast<int64_t>(f);
        const int64_t xi = (idx / inner_i) % n, xj = (idx / inner_j) % n;
        const int64_t src = idx + (xj - xi) * inner_i + (xi - xj) * inner_j;
        const double d = static_cast<double>(a[static_cast<size_t>(src)]) - b[f];
        d2 += d * d;
      }
      const double rel = std::sqrt(d2 / sb);
      if (rel < as_stored / 10 && (r.layout_suspect.empty() || rel < r.layout_suspect_rel_l2)) {
        std::vector<std::string> looks = dims;
        std::swap(looks[i], looks[j]);
        r.layout_suspect = fmt::format("{}", fmt::join(looks, ","));
        r.layout_suspect_rel_l2 = rel;
      }
    }
  }
}

}  // namespace

const char* checkpoint_status_name(CheckpointStatus s) {
  switch (s) {
    case CheckpointStatus::pass: return "pass";
    case CheckpointStatus::fail: return "fail";
    case CheckpointStatus::shape_mismatch: return "shape_mismatch";
    case CheckpointStatus::only_engine: return "only_engine";
    case CheckpointStatus::only_reference: return "only_reference";
  }
  return "?";
}

DimSizes dim_sizes(const ModelConfig& cfg) {
  const auto sizes = diffrun::dim_sizes(cfg, -1, -1);  // the dump schema's letters (checkpoints/dump_schema.hpp)
  return DimSizes(sizes.begin(), sizes.end());
}

std::vector<std::string> incompatibilities(const DumpMeta& a, const DumpMeta& b) {
  std::vector<std::string> out;
  if (a.model_fingerprint != b.model_fingerprint) {
    out.push_back(fmt::format("different models (fingerprint {} vs {})", a.model_fingerprint, b.model_fingerprint));
  }
  for (const auto& d : config_differences(a.config, b.config)) out.push_back("config " + d);
  // The top-level job marks both dumps of a pair; a pair from two runs is what an interrupted run
  // leaves beside the previous one's file.
  const auto ra = a.facts.find(attr::run_id), rb = b.facts.find(attr::run_id);
  if (ra != a.facts.end() && rb != b.facts.end() && ra->second != rb->second) {
    out.push_back(fmt::format("different runs (run_id {} vs {}): was one of them left by an interrupted run?",
                              ra->second, rb->second));
  }
  if (a.token_ids != b.token_ids) {
    out.push_back(fmt::format("different prompt token ids ({} vs {} tokens)", a.token_ids.size(), b.token_ids.size()));
  }
  return out;
}

namespace {

// compare_checkpoint's bookkeeping before any value is read: r's identity, shapes and rule. The rule, or null
// when the checkpoint is one-sided or the shapes differ (r.status says which), and rd the row dimension.
const ToleranceRule* start_result(CheckpointResult& r, int step, const DatasetInfo* engine, const DatasetInfo* reference,
                                  const ToleranceSet& tolerances, int64_t positions, int& rd) {
  const DatasetInfo& any = reference ? *reference : *engine;
  r.step = step;
  r.name = any.name;
  r.base = parse_checkpoint_name(any.name).base;
  r.layer = any.layer;
  r.order = any.order;
  r.layout = any.layout;
  r.positions = positions;
  if (engine) r.shape_engine = engine->shape, r.native_engine = engine->native_dtype;
  if (reference) r.shape_reference = reference->shape, r.native_reference = reference->native_dtype;
  const ToleranceRule& rule = tolerances.rule_for(any.name);
  r.rule_match = rule.match;
  r.rule_reason = rule.reason;
  if (!engine || !reference) {
    r.status = engine ? CheckpointStatus::only_engine : CheckpointStatus::only_reference;
    return nullptr;
  }
  rd = row_dim(r.layout);
  const int64_t row_lo = std::max(engine->row_offset, reference->row_offset);
  if (rd >= 0) {
    r.shape_engine[rd] -= rows_before(r.shape_engine, engine->row_offset, row_lo, rd);
    r.shape_reference[rd] -= rows_before(r.shape_reference, reference->row_offset, row_lo, rd);
  }
  r.row_offset = row_lo;
  if (r.shape_engine != r.shape_reference) {
    r.status = CheckpointStatus::shape_mismatch;
    return nullptr;
  }
  return &rule;
}

// compare_checkpoint's judgement of the values both sides hold (the rows from r.row_offset, r.shape_reference).
void judge_values(CheckpointResult& r, const ToleranceRule& rule, const ToleranceSet& tolerances, const DimSizes& dims,
                  std::span<const float> a, std::span<const float> b) {
  TensorMetrics m = compute_metrics(a, b, r.shape_reference, r.layout, dims, rule.element);
  if (r.base == kLogitsCheckpoint && r.shape_reference.size() == 2) {
    m.logits = compute_logit_metrics(a, b, r.shape_reference[0], r.shape_reference[1]);
  }
  r.bound_scale = tolerances.length_scale(r.positions) * tolerances.reduction_scale(r.base, dims);
  r.checks = check_bounds(m, rule, r.positions, r.bound_scale);
  if (m.finite()) r.routing = routing_rows(r.base, r.layout, a, b, r.shape_reference, r.checks);
  r.metrics = std::move(m);
  const bool ok = std::all_of(r.checks.begin(), r.checks.end(), [](const BoundCheck& k) { return k.pass; });
  r.status = ok ? CheckpointStatus::pass : CheckpointStatus::fail;
  if (!ok && r.metrics->finite()) {
    // Only failing checkpoints pay for these passes (the verdict reads them).
    r.f16_fit = f16_fit(a, b);
    find_layout_suspect(r, a, b);
  }
}

// The rows from row_lo of a side's stored values (rows from `offset` along dimension rd of `shape`): a view
// into them where the rows dropped lead the data, else a copy into `cut`.
std::span<const float> compared_rows(std::span<const float> values, const std::vector<int64_t>& shape, int64_t offset,
                                     int64_t row_lo, int rd, std::vector<float>& cut) {
  const int64_t drop = rows_before(shape, offset, row_lo, rd);
  if (drop == 0) return values;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < rd; ++i) outer *= shape[i];
  for (size_t i = rd + 1; i < shape.size(); ++i) inner *= shape[i];
  if (outer == 1) return values.subspan(static_cast<size_t>(drop * inner));
  cut = rows_from(values, shape, rd, drop);
  return cut;
}

// The values both sides hold (a and b as stored, each the whole of its shape) judged into r: views of them, or the
// rows kept copied into c.
void judge_stored(CheckpointResult& r, const ToleranceRule& rule, const ToleranceSet& tolerances, const DimSizes& dims,
                  const DatasetInfo& engine, const DatasetInfo& reference, int rd, std::span<const float> a,
                  std::span<const float> b, ComparedValues& c) {
  for (const auto& [info, values] : {std::pair{&engine, a}, std::pair{&reference, b}}) {
    int64_t n = 1;
    for (int64_t e : info->shape) n *= e;
    if (static_cast<int64_t>(values.size()) != n)
      throw Error(fmt::format("{} of step {}: {} values for a shape of {} elements", info->name, r.step, values.size(), n));
  }
  c.a = compared_rows(a, engine.shape, engine.row_offset, r.row_offset, rd, c.a_cut);
  c.b = compared_rows(b, reference.shape, reference.row_offset, r.row_offset, rd, c.b_cut);
  judge_values(r, rule, tolerances, dims, c.a, c.b);
}

// `values` narrowed to `kept` (a view into it, or a copy held elsewhere) as a vector of its own.
std::vector<float> kept_values(std::vector<float>&& values, std::span<const float> kept) {
  if (kept.data() == values.data() && kept.size() == values.size()) return std::move(values);
  return {kept.begin(), kept.end()};
}

}  // namespace

CheckpointResult compare_checkpoint(int step, const DatasetInfo* engine, const DatasetInfo* reference,
                                    const ToleranceSet& tolerances, const DimSizes& dims, int64_t positions,
                                    const ReadValues& read,
                                    std::vector<float>* a_out, std::vector<float>* b_out) {
  CheckpointResult r;
  int rd = -1;
  const ToleranceRule* rule = start_result(r, step, engine, reference, tolerances, positions, rd);
  if (!rule) return r;
  std::vector<float> a, b;
  read(a, b);
  ComparedValues c;
  judge_stored(r, *rule, tolerances, dims, *engine, *reference, rd, a, b, c);
  if (a_out) *a_out = kept_values(std::move(a), c.a);
  if (b_out) *b_out = kept_values(std::move(b), c.b);
  return r;
}

CheckpointResult compare_checkpoint(int step, const DatasetInfo* engine, const DatasetInfo* reference,
                                    const ToleranceSet& tolerances, const DimSizes& dims, int64_t positions,
                                    std::span<const float> a, std::span<const float> b, ComparedValues* compared) {
  CheckpointResult r;
  int rd = -1;
  const ToleranceRule* rule = start_result(r, step, engine, reference, tolerances, positions, rd);
  if (!rule) return r;
  ComparedValues own;
  judge_stored(r, *rule, tolerances, dims, *engine, *reference, rd, a, b, compared ? *compared : own);
  return r;
}

void add_step_results(Comparison& c, const std::vector<DatasetInfo>& engine, const std::vector<DatasetInfo>& reference,
                      const std::function<CheckpointResult(const DatasetInfo* engine, const DatasetInfo* reference)>& result,
                      const ToleranceSet& tolerances) {
  const std::vector<Entry> entries = merged_entries(engine, reference);
  std::vector<CheckpointResult> step;
  step.reserve(entries.size());
  for (const Entry& e : entries) step.push_back(result(e.engine, e.reference));
  // A routing flip by drift: the slots of the other experts are left out (diff/routing.hpp).
  std::map<std::string, const CheckpointResult*> by_name;
  for (const CheckpointResult& r : step) by_name[r.name] = &r;
  const auto find = [&](const std::string& name) -> const CheckpointResult* {
    const auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  for (CheckpointResult& r : step) excuse_routing_flip(r, find, tolerances);
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    CheckpointResult r = std::move(step[i]);
    if (e.reference) ++c.coverage.reference;
    if (e.engine && e.reference) ++c.coverage.compared;
    if (!e.engine && std::find(c.coverage.missing_kinds.begin(), c.coverage.missing_kinds.end(), r.base) ==
                         c.coverage.missing_kinds.end())
      c.coverage.missing_kinds.push_back(r.base);
    if (!e.engine || !e.reference) ++c.n_one_sided;
    else if (r.status == CheckpointStatus::pass) ++c.n_pass;
    else ++c.n_fail;
    c.results.push_back(std::move(r));
  }
}

std::optional<size_t> first_failure_of(const std::vector<CheckpointResult>& results) {
  for (size_t i = 0; i < results.size(); ++i)
    if (results[i].failed()) return i;
  return std::nullopt;
}

std::optional<size_t> first_nonfinite_of(const std::vector<CheckpointResult>& results) {
  for (size_t i = 0; i < results.size(); ++i)
    if (results[i].metrics && !results[i].metrics->finite()) return i;
  return std::nullopt;
}

// The engine's own greedy choice (root attribute argmax) against its own logits: at each step whose
// token is not the argmax of the engine's last result_output row (larger value, then the lower index),
// that checkpoint fails with check "argmax", whatever the reference says. A token whose logit is below
// the row's best is wrong in any dtype; one tied with a lower index only where the logits were dumped
// exactly (f32), since rounding to f16 may tie values the engine saw apart. Read from the row's largest
// values (LogitMetrics::top_a_last): a token not among them is below the best, or tied with a lower id.
static void check_engine_argmax(Comparison& c, std::span<const int32_t> engine_argmax) {
  for (CheckpointResult& r : c.results) {
    if (r.base != kLogitsCheckpoint || !r.metrics || !r.metrics->logits) continue;
    const LogitMetrics& lm = *r.metrics->logits;
    if (lm.top_a_last.empty() || r.step < 0 || r.step >= static_cast<int>(engine_argmax.size())) continue;
    const int32_t token = engine_argmax[r.step], own = lm.top_a_last.front().second;
    if (token < 0 || token == own) continue;
    const float best = lm.top_a_last.front().first;
    const auto it = std::find_if(lm.top_a_last.begin(), lm.top_a_last.end(),
                                 [&](const std::pair<float, int32_t>& e) { return e.second == token; });
    const bool listed_all = lm.top_a_last.size() < LogitMetrics::kLastTop;  // every finite value is in the list
    // Not listed: below the best, unless the list is full of values equal to the best (then tied, lower ids first).
    const bool tied = it != lm.top_a_last.end() ? it->first == best : !listed_all && lm.top_a_last.back().first == best;
    const bool below = !tied;
    const bool wrong_tie = tied && r.native_engine == "f32";
    if (!below && !wrong_tie) continue;
    r.checks.push_back({"argmax", "own_logits_argmax", static_cast<double>(token), static_cast<double>(own), false});
    if (r.status == CheckpointStatus::pass) {
      r.status = CheckpointStatus::fail;
      --c.n_pass;
      ++c.n_fail;
    }
  }
}

void finish_comparison(Comparison& c, const ToleranceSet& tolerances, const CompareOptions& opt,
                       const std::function<void(size_t index, std::vector<float>& a, std::vector<float>& b)>& values,
                       std::span<const int> reference_steps, std::span<const int32_t> engine_argmax,
                       std::span<const int32_t> reference_argmax) {
  c.coverage.required = opt.require_coverage;
  const int n_layer = c.reference_meta.config.n_layer;
  const DimSizes dims = dim_sizes(c.reference_meta.config);
  const auto pattern_at = [&](size_t i) -> std::optional<ErrorPattern> {
    const CheckpointResult& r = c.results[i];
    if (!r.metrics) return std::nullopt;
    std::vector<float> a, b;
    values(i, a, b);
    // The RoPE hints: the layer's base and pairing, and the position of the first token row compared.
    PatternContext cx;
    const ModelConfig& cfg = c.reference_meta.config;
    if (r.layer >= 0) cx.rope_theta = cfg.layer_rope_theta(r.layer);
    cx.rope_neox = cfg.rope_type == RopeType::neox;
    cx.rope_freq_factors = cfg.rope_freq_factors;
    if (!r.layout.empty() && r.layout[0] == 'T' && (r.layout.size() == 1 || r.layout[1] == ',') &&
        !r.shape_reference.empty())
      cx.first_position = r.positions - r.shape_reference[0];
    return error_pattern(a, b, r.shape_reference, r.layout, dims, r.base, exact_threshold(tolerances.rule_for(r.name)),
                         cx);
  };
  check_engine_argmax(c, engine_argmax);
  c.routing = summarise_routing(c.results);
  if (const auto fact = c.reference_meta.facts.find("routing_followed"); fact != c.reference_meta.facts.end()) {
    if (auto followed = parse_routing_followed(fact->second)) c.routing.followed = std::move(*followed);
    else c.warnings.push_back("the reference's fact routing_followed does not read as 'step S layer L token T: ids; ...'");
  }
  c.first_failure = first_failure_of(c.results);
  c.first_nonfinite = first_nonfinite_of(c.results);
  if (c.first_nonfinite) c.nonfinite_verdict = decide_verdict(c.results, *c.first_nonfinite, n_layer, opt.jump_factor);
  // A failure of the argmax check alone has no error in its values to locate (and a streamed comparison
  // kept none of them): no pattern.
  const auto argmax_only = [&](size_t i) {
    const auto& checks = c.results[i].checks;
    return std::any_of(checks.begin(), checks.end(), [](const BoundCheck& k) { return !k.pass; }) &&
           std::all_of(checks.begin(), checks.end(), [](const BoundCheck& k) { return k.pass || k.metric == "argmax"; });
  };
  if (c.first_failure && !argmax_only(*c.first_failure)) c.pattern = pattern_at(*c.first_failure);
  // Checkpoints whose layout looks permuted (find_layout_suspect): one warning, the first named.
  int suspects = 0;
  const CheckpointResult* suspect = nullptr;
  for (const auto& r : c.results) {
    if (r.layout_suspect.empty()) continue;
    if (suspects++ == 0) suspect = &r;
  }
  if (suspect) {
    c.warnings.push_back(fmt::format("{} at step {}: the layout looks like [{}], not [{}] (read so, rel_l2 {:.3g} "
                                     "against {:.3g}): label it with the layout attribute{}",
                                     suspect->name, suspect->step, suspect->layout_suspect, suspect->layout,
                                     suspect->layout_suspect_rel_l2, suspect->metrics ? suspect->metrics->rel_l2 : 0.0,
                                     suspects > 1 ? fmt::format(" ({} checkpoints look so)", suspects) : std::string()));
  }
  if (c.first_failure && c.pattern && !c.results[*c.first_failure].layout_suspect.empty()) {
    const CheckpointResult& r = c.results[*c.first_failure];
    c.pattern->hint = fmt::format("the layout looks like [{}], not [{}]: label it with the layout attribute",
                                  r.layout_suspect, r.layout);
  }
  if (c.first_nonfinite) c.nonfinite_pattern = pattern_at(*c.first_nonfinite);
  if (c.first_failure) {
    for (size_t i = *c.first_failure; i-- > 0 && static_cast<int>(c.preceding.size()) < opt.preceding;) {
      if (c.results[i].status == CheckpointStatus::pass) c.preceding.insert(c.preceding.begin(), i);
    }
    c.verdict = decide_verdict(c.results, *c.first_failure, n_layer, opt.jump_factor);
  }

  // Token agreement: the per-step argmax when both sides carry it, else the last row of each step's
  // result_output.
  for (int step : reference_steps) {
    StepTokens t;
    t.step = step;
    if (step < static_cast<int>(reference_argmax.size())) t.reference = reference_argmax[step];
    if (step < static_cast<int>(engine_argmax.size())) t.engine = engine_argmax[step];
    for (const auto& r : c.results) {
      if (r.step != step || r.base != kLogitsCheckpoint || !r.metrics || !r.metrics->logits) continue;
      const LogitMetrics& lm = *r.metrics->logits;
      if (t.reference < 0 && !lm.argmax_b.empty()) t.reference = lm.argmax_b.back();
      if (t.engine < 0 && !lm.argmax_a.empty()) t.engine = lm.argmax_a.back();
    }
    c.tokens.push_back(t);
  }
}

Comparison compare_dumps(const DumpReader& engine, const DumpReader& reference, const ToleranceSet& tolerances,
                         const CompareOptions& opt) {
  Comparison c;
  c.engine_path = engine.path();
  c.reference_path = reference.path();
  c.engine_meta = engine.meta();
  c.reference_meta = reference.meta();
  c.tolerance_source = tolerances.source;
  c.tolerance_preset = tolerances.preset;

  std::vector<std::string> refused = incompatibilities(engine.meta(), reference.meta());
  std::vector<int> eng_steps = engine.steps(), ref_steps = reference.steps();
  if (!opt.steps.empty()) {
    std::set<int> held(eng_steps.begin(), eng_steps.end());
    held.insert(ref_steps.begin(), ref_steps.end());
    const auto unselected = [&](int step) { return std::find(opt.steps.begin(), opt.steps.end(), step) == opt.steps.end(); };
    std::erase_if(eng_steps, unselected);
    std::erase_if(ref_steps, unselected);
    if (eng_steps.empty() && ref_steps.empty()) {
      const std::set<int64_t> asked(opt.steps.begin(), opt.steps.end());
      throw InputError(fmt::format("--steps {}: {} and {} hold steps {}",
                                   format_ranges(std::vector<int64_t>(asked.begin(), asked.end())),
                                   engine.path(), reference.path(),
                                   format_ranges(std::vector<int64_t>(held.begin(), held.end()))));
    }
  }
  std::set<int> all_steps(eng_steps.begin(), eng_steps.end());
  all_steps.insert(ref_steps.begin(), ref_steps.end());
  for (int step : all_steps) {
    const bool in_e = std::count(eng_steps.begin(), eng_steps.end(), step) > 0;
    const bool in_r = std::count(ref_steps.begin(), ref_steps.end(), step) > 0;
    if (in_e && !has_tokens(engine, step)) {
      throw DumpError(fmt::format("{}: step {} has no \"tokens\" dataset: cannot check that both sides ran on the same tokens",
                                  engine.path(), step));
    }
    if (in_r && !has_tokens(reference, step)) {
      throw DumpError(fmt::format("{}: step {} has no \"tokens\" dataset: cannot check that both sides ran on the same tokens",
                                  reference.path(), step));
    }
    const std::string tokens(kTokensCheckpoint);
    if (in_e && in_r && engine.read_ids(step, tokens) != reference.read_ids(step, tokens)) {
      refused.push_back(fmt::format("different input tokens at step {} (the engine must be fed the reference's tokens)", step));
    }
  }
  if (!refused.empty()) {
    if (!opt.force) {
      throw InputError(fmt::format("{} and {} are not comparable: {} (--force compares anyway)", engine.path(),
                                   reference.path(), fmt::join(refused, "; ")));
    }
    for (const auto& r : refused) c.warnings.push_back("forced: " + r);
  }

  const DimSizes dims = dim_sizes(reference.meta().config);
  const std::vector<DatasetInfo> none;
  std::map<int, int64_t> positions;  // the KV length after each step: its tokens and every earlier step's
  int64_t n_kv = 0;
  for (int step : all_steps) {
    const bool in_e = std::count(eng_steps.begin(), eng_steps.end(), step) > 0;
    const bool in_r = std::count(ref_steps.begin(), ref_steps.end(), step) > 0;
    if (in_r && !in_e) c.coverage.missing_steps.push_back(step);
    const DumpReader& tokens_from = in_r ? reference : engine;
    if (const DatasetInfo* t = tokens_from.find(step, std::string(kTokensCheckpoint)); t && !t->shape.empty()) n_kv += t->shape[0];
    positions[step] = n_kv;
    std::vector<DatasetInfo> eng_ds = in_e ? engine.datasets(step) : none;
    std::vector<DatasetInfo> ref_ds = in_r ? reference.datasets(step) : none;
    if (!opt.checkpoints.all()) {
      const auto unselected = [&](const DatasetInfo& d) { return !d.is_int && !opt.checkpoints.matches(d.name); };
      std::erase_if(eng_ds, unselected);
      std::erase_if(ref_ds, unselected);
    }
    add_step_results(c, eng_ds, ref_ds, [&](const DatasetInfo* e, const DatasetInfo* r) {
      // A checkpoint merged from rank dumps keeps the reference's compared values for judge_ranks.
      const bool merged = e && r && !e->shards.empty() && !e->is_int;
      std::vector<float> b;
      CheckpointResult res = compare_checkpoint(
          step, e, r, tolerances, dims, n_kv,
          [&](std::vector<float>& x, std::vector<float>& y) {
            x = engine.read(step, e->name);
            y = reference.read(step, r->name);
          },
          nullptr, merged ? &b : nullptr);
      if (merged) judge_ranks(res, *e, engine, b, tolerances, dims);
      return res;
    }, tolerances);
  }
  if (c.coverage.compared == 0 && !opt.checkpoints.all()) {
    throw InputError(fmt::format("--checkpoints '{}' matches no checkpoint that {} and {} both hold (diffrun ls lists them)",
                                 opt.checkpoints.spec(), engine.path(), reference.path()));
  }
  if (c.coverage.compared == 0) {
    throw DumpError(fmt::format("{} and {} have no checkpoint in common", engine.path(), reference.path()));
  }
  finish_comparison(
      c, tolerances, opt,
      [&](size_t i, std::vector<float>& a, std::vector<float>& b) {
        // The same values compare_checkpoint compared (the rows both sides hold).
        const CheckpointResult& r = c.results[i];
        compare_checkpoint(r.step, engine.find(r.step, r.name), reference.find(r.step, r.name), tolerances, dims,
                           positions[r.step], [&](std::vector<float>& x, std::vector<float>& y) {
                             x = engine.read(r.step, r.name);
                             y = reference.read(r.step, r.name);
                           },
                           &a, &b);
      },
      ref_steps, engine.int_attribute(attr::argmax), reference.int_attribute(attr::argmax));
  c.step_fused = engine.int_attribute(attr::step_fused);
  c.step_graph = engine.int_attribute(attr::step_graph);
  return c;
}

namespace {

using ResultIndex = std::map<std::pair<int, std::string>, const CheckpointResult*>;

// Whether the replay could give the op that writes checkpoint `base` at `layer` the reference's values of
// everything it reads: every direct dataflow input (the vocabulary's) held by the reference at that
// step, whole (a replay replaces only those: ReplaySink, ReplacementRule). Two exceptions, both of the
// backends' design: a kind no later op reads back (the vocabulary's read_back: kq_soft_max, which
// attention recomputes) stands for its own inputs, and the cache's rows of earlier steps, which a
// dump keeps only where each step wrote them, are the replay's own rows (written by its own ops on the
// reference's inputs).
// `selected`: the checkpoints the comparison looked at (compare --checkpoints); of the others nothing
// is known, and they count as held.
bool inputs_replaced(int step, std::string_view base, int layer, int n_layer, const ResultIndex& reference,
                     const CheckpointFilter& selected, int depth = 0) {
  const auto held = [&](const std::string& name) { return reference.count({step, name}) > 0; };
  for (const std::string& in : checkpoint_inputs(base, layer, n_layer, held)) {
    const ParsedCheckpointName p = parse_checkpoint_name(in);
    if (const CheckpointKind* kind = find_checkpoint_kind(p.base); kind && !kind->read_back) {
      if (depth > 8 || !inputs_replaced(step, p.base, p.layer, n_layer, reference, selected, depth + 1)) return false;
      continue;
    }
    const auto it = reference.find({step, in});
    if (it == reference.end()) {
      if (selected.matches(in)) return false;
      continue;
    }
    if (it->second->row_offset > 0 && !is_cache_kind(p.base)) return false;
  }
  return true;
}

}  // namespace

RecordingCheck check_recording_dumps(const DumpReader& recorded, const DumpReader& unrecorded) {
  RecordingCheck check;
  check.unrecorded_source = unrecorded.path();
  const auto last_row = [](const DumpReader& d, int step) {
    const DatasetInfo* info = d.find(step, std::string(kLogitsCheckpoint));
    if (!info || info->is_int || info->shape.empty())
      throw InputError(fmt::format("{}: step {} has no result_output: the recording check compares each step's "
                                   "logits (record result_output in both runs)",
                                   d.path(), step));
    std::vector<float> v = d.read(step, std::string(kLogitsCheckpoint));
    const size_t V = static_cast<size_t>(info->shape.back());
    if (v.size() < V) throw InputError(fmt::format("{}: step {}: result_output holds no whole row", d.path(), step));
    return std::vector<float>(v.end() - static_cast<std::ptrdiff_t>(V), v.end());
  };
  for (int step : recorded.steps())
    if (add_recording_step(check, step, last_row(recorded, step), last_row(unrecorded, step))) break;
  return check;
}

bool add_recording_step(RecordingCheck& check, int step, std::span<const float> recorded,
                        std::span<const float> unrecorded) {
  ++check.steps;
  for (size_t i = 0; i < std::max(recorded.size(), unrecorded.size()); ++i) {
    if (i < recorded.size() && i < unrecorded.size() && std::memcmp(&recorded[i], &unrecorded[i], sizeof(float)) == 0)
      continue;
    check.same = false;
    check.step = step;
    check.index = static_cast<int64_t>(i);
    check.recorded = i < recorded.size() ? recorded[i] : std::nanf("");
    check.unrecorded = i < unrecorded.size() ? unrecorded[i] : std::nanf("");
    return true;
  }
  return false;
}

namespace {

// The "graph" entry of fused_kernel_checkpoints, as a bit outside the fused kernels'.
constexpr uint32_t kGraphBit = 1u << 31;

// fused_kernel_checkpoints ("1 embd,attn_norm-0; 2 Qrope,...; graph Qrope,..."): per fused-kernel bit (or
// "graph", kGraphBit), the checkpoint kinds (or names) whose values depend on it. Entries that do not
// parse are ignored (a fact is informative).
std::vector<std::pair<uint32_t, std::set<std::string>>> fused_kernel_checkpoints(const DumpMeta& m) {
  std::vector<std::pair<uint32_t, std::set<std::string>>> out;
  auto it = m.facts.find("fused_kernel_checkpoints");
  if (it == m.facts.end()) return out;
  std::string_view rest = it->second;
  while (!rest.empty()) {
    const size_t semi = rest.find(';');
    std::string_view entry = rest.substr(0, semi);
    rest = semi == std::string_view::npos ? std::string_view() : rest.substr(semi + 1);
    while (!entry.empty() && entry.front() == ' ') entry.remove_prefix(1);
    const size_t space = entry.find(' ');
    if (space == std::string_view::npos) continue;
    const std::string bit_text(entry.substr(0, space));
    char* end = nullptr;
    const unsigned long bit = bit_text == "graph" ? kGraphBit : std::strtoul(bit_text.c_str(), &end, 10);
    if ((bit != kGraphBit && *end != '\0') || bit == 0 || bit > 0xffffffffUL) continue;
    std::set<std::string> names;
    std::string_view list = entry.substr(space + 1);
    while (!list.empty()) {
      const size_t comma = list.find(',');
      std::string_view name = list.substr(0, comma);
      while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
      if (!name.empty()) names.emplace(name);
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    }
    out.emplace_back(static_cast<uint32_t>(bit), std::move(names));
  }
  return out;
}

}  // namespace

void add_isolation(Comparison& c, const Comparison& isolated, const CompareOptions& opt) {
  ResultIndex by_key, in_reference;
  for (const auto& r : isolated.results) {
    if (r.compared() || r.status == CheckpointStatus::shape_mismatch) by_key[{r.step, r.name}] = &r;
    if (r.status != CheckpointStatus::only_engine) in_reference[{r.step, r.name}] = &r;
  }
  const int n_layer = c.reference_meta.config.n_layer;
  int chained = 0;  // isolated errors that span more than their op: no local error
  std::string chained_example;
  // Fused kernels the engine's step ran and the replay's did not: their checkpoints get no local error.
  const auto fused_outputs = fused_kernel_checkpoints(c.engine_meta);
  const auto unfused_in_replay = [&](const CheckpointResult& r) {
    if (fused_outputs.empty() || r.step < 0) return false;
    const size_t s = static_cast<size_t>(r.step);
    // The step's path as bits (kGraphBit for a graph replay); a side that does not say: the same path.
    const auto path = [s](const Comparison& x, uint32_t otherwise) {
      if (s >= x.step_fused.size() && s >= x.step_graph.size()) return otherwise;
      uint32_t bits = s < x.step_fused.size() ? static_cast<uint32_t>(x.step_fused[s]) & ~kGraphBit : 0;
      if (s < x.step_graph.size() && x.step_graph[s] != 0) bits |= kGraphBit;
      return bits;
    };
    const uint32_t ran = path(c, 0);
    const uint32_t replayed = path(isolated, ran);
    for (const auto& [bit, names] : fused_outputs)
      if ((ran & bit) && !(replayed & bit) && (names.count(r.base) || names.count(r.name))) return true;
    return false;
  };
  int unfused = 0;
  std::string unfused_example;
  // Where the reference followed the engine's experts (RoutingSummary::followed), its ids and weights are not what
  // its op computes on its inputs, which the replayed engine's are: no local error there.
  const auto followed_routing = [&](const CheckpointResult& r) {
    if (r.base != kExpertIdsKind && r.base != kExpertWeightsKind && r.base != kExpertWeightsNormKind) return false;
    return std::any_of(c.routing.followed.begin(), c.routing.followed.end(),
                       [&](const RoutingFlip& f) { return f.step == r.step && f.layer == r.layer; });
  };
  int followed = 0;
  std::string followed_example;
  bool local_only_first = false;  // the first failure fails on its local error alone
  std::optional<size_t> first_local;
  for (size_t i = 0; i < c.results.size(); ++i) {
    CheckpointResult& r = c.results[i];
    auto it = by_key.find({r.step, r.name});
    if (it == by_key.end()) continue;
    if (!inputs_replaced(r.step, r.base, r.layer, n_layer, in_reference, opt.checkpoints)) {
      if (chained++ == 0) chained_example = fmt::format("{} at step {}", r.name, r.step);
      continue;
    }
    if (unfused_in_replay(r)) {
      if (unfused++ == 0) unfused_example = fmt::format("{} at step {}", r.name, r.step);
      continue;
    }
    if (followed_routing(r)) {
      if (followed++ == 0) followed_example = fmt::format("{} at step {}", r.name, r.step);
      continue;
    }
    const CheckpointResult& iso = *it->second;
    r.local = LocalError{iso.status, iso.metrics ? iso.metrics->rel_l2 : std::nan(""), iso.f16_fit};
    if (!opt.judge_local || !r.local->failed()) continue;
    for (const BoundCheck& k : iso.checks)
      if (!k.pass) r.checks.push_back({"local " + k.metric, k.bound, k.value, k.limit, false});
    if (!r.failed() && r.compared()) {
      r.status = CheckpointStatus::fail;
      --c.n_pass;
      ++c.n_fail;
      if (!first_local) first_local = i;
    }
  }
  c.isolated_path = isolated.engine_path;
  if (chained > 0) {
    c.warnings.push_back(fmt::format(
        "isolation: {} checkpoint(s) have no local error ({} the first): an input of their op is missing from the "
        "reference or holds only its last rows, so the replay ran it on the engine's own values and the isolated "
        "error spans several ops",
        chained, chained_example));
  }
  if (followed > 0 && (c.first_failure || first_local)) {  // a clean run needs no word of it
    c.warnings.push_back(fmt::format(
        "isolation: {} checkpoint(s) have no local error ({} the first): the reference followed the engine's experts "
        "there (routing followed), so its choice is not what its op computes on its inputs",
        followed, followed_example));
  }
  if (first_local && (!c.first_failure || *first_local < *c.first_failure)) {
    c.first_failure = first_local;
    local_only_first = true;
    c.preceding.clear();
    for (size_t i = *first_local; i-- > 0 && static_cast<int>(c.preceding.size()) < opt.preceding;) {
      if (c.results[i].status == CheckpointStatus::pass) c.preceding.insert(c.preceding.begin(), i);
    }
  }
  if (local_only_first) {
    // Where the error sits: the isolated run's own pattern at this checkpoint (the propagated
    // tensor is within its bounds, its pattern would say nothing).
    const CheckpointResult& f = c.results[*c.first_failure];
    c.pattern.reset();
    if (isolated.first_failure) {
      const CheckpointResult& g = isolated.results[*isolated.first_failure];
      if (g.step == f.step && g.name == f.name) c.pattern = isolated.pattern;
    }
  }
  if (unfused > 0 && c.first_failure) {  // a clean run needs no word of it
    c.warnings.push_back(fmt::format(
        "isolation: {} checkpoint(s) have no local error ({} the first): the engine's step computed them in a "
        "fused kernel or a CUDA graph replay, where the isolation replay, which replaces inputs between ops, ran "
        "the unfused twins one by one (fact fused_kernel_checkpoints, root attributes step_fused, step_graph)",
        unfused, unfused_example));
  }
  if (c.first_failure) {
    c.verdict = decide_verdict(c.results, *c.first_failure, c.reference_meta.config.n_layer, opt.jump_factor);
  }
  if (c.first_nonfinite) {
    c.nonfinite_verdict = decide_verdict(c.results, *c.first_nonfinite, c.reference_meta.config.n_layer, opt.jump_factor);
  }
}

}  // namespace diffrun::diff
