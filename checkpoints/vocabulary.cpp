// The checkpoint vocabulary of DESIGN.md: the kinds of the dump schema (python/diffrun/dump_schema.json), their
// order per config, and the name filter. The dimension letters and their sizes are the schema's (dump_schema.hpp).
#include "checkpoints/vocabulary.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "checkpoints/dump_schema.hpp"
#include "model/error.hpp"

namespace diffrun {

const char* native_dtype_name(NativeDType d) {
  switch (d) {
    case NativeDType::f16: return "f16";
    case NativeDType::bf16: return "bf16";
    case NativeDType::f32: return "f32";
    case NativeDType::f64: return "f64";
    case NativeDType::i32: return "i32";
  }
  return "unknown";
}

namespace {

// A kind's `needs` in the schema ("qk_norm", "ffn_act=silu") as the config flag kind_applies checks.
KindNeeds parse_needs(const std::string& needs) {
  static const std::pair<const char*, KindNeeds> known[] = {
      {"", KindNeeds::none},           {"qk_norm", KindNeeds::qk_norm},          {"embd_scale", KindNeeds::embd_scale},
      {"post_norms", KindNeeds::post_norms}, {"ffn_act=silu", KindNeeds::ffn_silu}, {"ffn_act=gelu_tanh", KindNeeds::ffn_gelu},
      {"!moe", KindNeeds::dense_ffn},        {"ffn_act=silu&!moe", KindNeeds::dense_silu},
      {"ffn_act=gelu_tanh&!moe", KindNeeds::dense_gelu}, {"moe", KindNeeds::moe},
      {"moe&!moe_shexp", KindNeeds::moe_norm},         {"moe_shexp", KindNeeds::moe_shexp},
      {"!moe|moe_shexp", KindNeeds::ffn_out}};
  for (const auto& [text, n] : known)
    if (needs == text) return n;
  throw std::logic_error("dump_schema.json: a kind needs '" + needs + "', which kind_applies does not know");
}

}  // namespace

const std::vector<CheckpointKind>& checkpoint_kinds() {
  // The schema's kinds (python/diffrun/dump_schema.json), in its order; the strings are the schema's, which
  // lives as long as the program.
  static const std::vector<CheckpointKind> kinds = [] {
    std::vector<CheckpointKind> out;
    for (const SchemaKind& k : dump_schema().kinds)
      out.push_back({k.base.c_str(), k.per_layer, k.layout.c_str(), k.what.c_str(), k.inputs.c_str(),
                     parse_needs(k.needs), k.read_back});
    return out;
  }();
  return kinds;
}

const CheckpointKind* find_checkpoint_kind(std::string_view base) {
  for (const auto& k : checkpoint_kinds())
    if (base == k.base) return &k;
  return nullptr;
}

bool kind_applies(const CheckpointKind& k, const ModelConfig& cfg) {
  switch (k.needs) {
    case KindNeeds::none: return true;
    case KindNeeds::qk_norm: return cfg.qk_norm;
    case KindNeeds::embd_scale: return cfg.embd_scale;
    case KindNeeds::post_norms: return cfg.post_norms;
    case KindNeeds::ffn_silu: return cfg.ffn_act == FfnAct::silu;
    case KindNeeds::ffn_gelu: return cfg.ffn_act == FfnAct::gelu_tanh;
    case KindNeeds::dense_ffn: return !cfg.moe;
    case KindNeeds::dense_silu: return !cfg.moe && cfg.ffn_act == FfnAct::silu;
    case KindNeeds::dense_gelu: return !cfg.moe && cfg.ffn_act == FfnAct::gelu_tanh;
    case KindNeeds::moe: return cfg.moe;
    case KindNeeds::moe_norm: return cfg.moe && !cfg.moe_shexp;
    case KindNeeds::moe_shexp: return cfg.moe_shexp;
    case KindNeeds::ffn_out: return !cfg.moe || cfg.moe_shexp;
  }
  return true;
}

std::vector<Arch> kind_archs(const CheckpointKind& k) {
  std::vector<Arch> out;
  for (Arch a : all_archs()) {
    ModelConfig c;
    c.arch = a;
    set_arch_features(c);
    if (kind_applies(k, c)) out.push_back(a);
  }
  return out;
}

std::vector<std::string> checkpoint_inputs(std::string_view base, int layer, int n_layer,
                                           const std::function<bool(const std::string&)>& recorded) {
  const CheckpointKind* kind = find_checkpoint_kind(base);
  if (!kind) return {};
  // One name of an `inputs` list as a checkpoint name at this layer.
  const auto resolve = [&](std::string_view name) {
    int at = layer;
    if (const size_t a = name.find('@'); a != std::string_view::npos) {
      at = name.substr(a + 1) == "prev" ? layer - 1 : n_layer - 1;
      name = name.substr(0, a);
      if (at < 0) return std::string(recorded("inp_scaled") ? "inp_scaled" : "embd");  // the stream before layer 0
    }
    const CheckpointKind* k = find_checkpoint_kind(name);
    return checkpoint_name(name, k && k->per_layer ? at : -1);
  };
  std::vector<std::string> out;
  std::string_view list = kind->inputs;
  while (!list.empty()) {
    const size_t comma = std::min(list.find(','), list.size());
    std::string_view operand = list.substr(0, comma);
    list.remove_prefix(std::min(comma + 1, list.size()));
    if (operand.starts_with('?')) {  // an operand only where it was recorded
      if (std::string name = resolve(operand.substr(1)); recorded(name)) out.push_back(std::move(name));
      continue;
    }
    std::string chosen;
    while (true) {  // the first recorded alternative, else the last
      const size_t bar = operand.find('|');
      chosen = resolve(operand.substr(0, bar));
      if (bar == std::string_view::npos || recorded(chosen)) break;
      operand.remove_prefix(bar + 1);
    }
    out.push_back(std::move(chosen));
  }
  return out;
}

namespace {

// Whether a kind outside layers runs before the layers (tokens, embd, inp_scaled): it comes before the
// first per-layer kind in the table.
bool leading_kind(const CheckpointKind& k) {
  for (const auto& kk : checkpoint_kinds()) {
    if (kk.per_layer) return false;
    if (&kk == &k) return true;
  }
  return false;
}

// Applicable kinds outside layers that run before the layers.
int leading_count(const ModelConfig& cfg) {
  int n = 0;
  for (const auto& k : checkpoint_kinds())
    if (!k.per_layer && leading_kind(k) && kind_applies(k, cfg)) ++n;
  return n;
}

// Index of a per-layer kind within a layer for this config, or -1.
int index_in_layer(const ModelConfig& cfg, std::string_view base) {
  int i = 0;
  for (const auto& k : checkpoint_kinds()) {
    if (!k.per_layer || !kind_applies(k, cfg)) continue;
    if (base == k.base) return i;
    ++i;
  }
  return -1;
}

}  // namespace

int checkpoints_per_layer(const ModelConfig& cfg) {
  int n = 0;
  for (const auto& k : checkpoint_kinds())
    if (k.per_layer && kind_applies(k, cfg)) ++n;
  return n;
}

std::string checkpoint_name(std::string_view base, int layer) {
  std::string name(base);
  if (layer >= 0) {
    name.push_back('-');
    name += std::to_string(layer);
  }
  return name;
}

ParsedCheckpointName parse_checkpoint_name(std::string_view name) {
  const size_t dash = name.rfind('-');
  if (dash != std::string_view::npos && dash > 0 && dash + 1 < name.size()) {
    std::string_view digits = name.substr(dash + 1);
    int layer = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
    if (ec == std::errc() && end == digits.data() + digits.size() && digits.front() != '+')
      return {std::string(name.substr(0, dash)), layer};
  }
  return {std::string(name), -1};
}

int checkpoint_order(const ModelConfig& cfg, std::string_view base, int layer) {
  const CheckpointKind* k = find_checkpoint_kind(base);
  const std::string name = checkpoint_name(base, layer);
  if (!k) throw InputError("unknown checkpoint '" + name + "' (not in the checkpoint vocabulary)");
  if (!kind_applies(*k, cfg))
    throw InputError("checkpoint '" + name + "' does not exist for architecture " + arch_name(cfg.arch) +
                     (k->needs == KindNeeds::qk_norm ? " without per-head q/k norms"
                      : k->needs == KindNeeds::moe   ? " without experts"
                      : k->needs == KindNeeds::moe_shexp ? " without a shared expert"
                                                     : ""));
  const int per_layer = checkpoints_per_layer(cfg);
  const int lead = leading_count(cfg);
  if (k->per_layer) {
    if (layer < 0 || layer >= cfg.n_layer)
      throw InputError("checkpoint '" + name + "': layer " + std::to_string(layer) + " outside 0.." +
                       std::to_string(cfg.n_layer - 1));
    return lead + layer * per_layer + index_in_layer(cfg, base);
  }
  if (layer >= 0) throw InputError("checkpoint '" + std::string(base) + "' is not per-layer (got '" + name + "')");
  const bool leading = leading_kind(*k);
  int i = 0;
  for (const auto& kk : checkpoint_kinds()) {
    if (kk.per_layer || leading_kind(kk) != leading || !kind_applies(kk, cfg)) continue;
    if (base == kk.base) return leading ? i : lead + cfg.n_layer * per_layer + i;
    ++i;
  }
  return -1;  // unreachable: k was found above
}

std::vector<std::string> checkpoint_names(const ModelConfig& cfg) {
  std::vector<std::string> names;
  const auto& kinds = checkpoint_kinds();
  auto non_layer = [&](bool leading) {
    for (const auto& k : kinds)
      if (!k.per_layer && leading_kind(k) == leading && kind_applies(k, cfg)) names.emplace_back(k.base);
  };
  non_layer(true);
  for (int l = 0; l < cfg.n_layer; ++l)
    for (const auto& k : kinds)
      if (k.per_layer && kind_applies(k, cfg)) names.push_back(checkpoint_name(k.base, l));
  non_layer(false);
  return names;
}

namespace {

// The pieces of s between separators: "a,b" -> {"a", "b"}, "" -> {""}.
std::vector<std::string> split_at(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string_view::npos) end = s.size();
    out.emplace_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> layout_dims(std::string_view layout) { return split_at(layout, ','); }

int32_t checked_expert_id(double value, int n_expert, int layer) {
  if (!(value >= 0 && value < n_expert && value == std::floor(value)))
    throw InputError(checkpoint_name("ffn_moe_topk", layer) + " holds " + std::to_string(value) +
                     ", not an expert id in 0.." + std::to_string(n_expert - 1));
  return static_cast<int32_t>(value);
}

std::vector<std::vector<std::string>> layout_factors(std::string_view layout) {
  std::vector<std::vector<std::string>> out;
  if (layout.empty()) return out;
  for (const std::string& dim : layout_dims(layout)) out.push_back(split_at(dim, '*'));
  return out;
}

std::vector<int64_t> checkpoint_shape(const ModelConfig& cfg, const CheckpointKind& k, int64_t n_tokens,
                                      int64_t n_kv) {
  std::vector<int64_t> shape;
  for (const auto& d : layout_dims(k.layout)) {
    if (!find_dim(d)) throw InputError(std::string("checkpoint '") + k.base + "': unknown layout dimension '" + d + "'");
    shape.push_back(dim_size(cfg, d, n_tokens, n_kv));
  }
  return shape;
}

std::string vocabulary_json() {
  nlohmann::ordered_json kinds = nlohmann::ordered_json::array();
  for (const auto& k : checkpoint_kinds()) {
    nlohmann::ordered_json archs = nlohmann::ordered_json::array();
    for (Arch a : kind_archs(k)) archs.push_back(arch_name(a));
    kinds.push_back({{"base", k.base},
                     {"per_layer", k.per_layer},
                     {"layout", k.layout},
                     {"what", k.what},
                     {"archs", archs}});
  }
  nlohmann::ordered_json doc = {{"kinds", kinds}};
  return doc.dump(2);
}

CheckpointFilter::CheckpointFilter(std::string_view spec) : spec_(spec) {
  if (spec.empty()) return;  // the whole spec empty: record everything
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    if (comma == std::string_view::npos) comma = spec.size();
    std::string_view pat = spec.substr(start, comma - start);
    while (!pat.empty() && pat.front() == ' ') pat.remove_prefix(1);
    while (!pat.empty() && pat.back() == ' ') pat.remove_suffix(1);
    if (pat.empty())
      throw InputError("--checkpoints '" + std::string(spec) + "': empty pattern at character " +
                       std::to_string(start + 1) + " (expected comma-separated globs such as 'attn_*,result_*')");
    patterns_.emplace_back(pat);
    start = comma + 1;
  }
}

bool CheckpointFilter::matches(std::string_view name) const {
  if (patterns_.empty()) return true;
  return std::any_of(patterns_.begin(), patterns_.end(), [&](const std::string& p) { return glob_match(p, name); });
}

bool glob_match(std::string_view pattern, std::string_view text) {
  // Iterative matcher with one backtrack point for the last '*': linear in practice, no recursion.
  size_t p = 0, t = 0, star = std::string_view::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p;
      ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

KindReduction kind_reduction(std::string_view base) {
  static constexpr std::string_view kOverD[] = {
      "attn_norm",  "Qcur",    "Kcur",    "Vcur",           "Qnorm",    "Knorm",     "Qrope",
      "Krope",      "cache_k", "cache_v", "kq_soft_max",    "kqv_out",  "attn_post_norm", "ffn_norm",
      "ffn_gate",   "ffn_up",  "ffn_swiglu", "ffn_geglu",   "ffn_post_norm", "result_norm", "result_output",
      "ffn_moe_logits", "ffn_moe_probs", "ffn_moe_weights", "ffn_moe_weights_norm", "ffn_moe_gate", "ffn_moe_up",
      "ffn_moe_swiglu", "ffn_shexp_gate_inp", "ffn_shexp_gate"};
  if (std::find(std::begin(kOverD), std::end(kOverD), base) != std::end(kOverD)) return KindReduction::n_embd;
  if (base == "attn_out") return KindReduction::attn_width;
  if (base == "ffn_out" || base == "ffn_shexp" || base == "ffn_shexp_out") return KindReduction::ffn;
  if (base == "ffn_moe_down" || base == "ffn_moe_out") return KindReduction::expert_ffn;
  if (base == "ffn_inp" || base == "l_out") return KindReduction::residual;
  return KindReduction::none;
}

}  // namespace diffrun
