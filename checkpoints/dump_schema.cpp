// The dump schema (python/diffrun/dump_schema.json, embedded) parsed into the structs of dump_schema.hpp, and the
// one mapping between ModelConfig's fields and the format's config attributes.
#include "checkpoints/dump_schema.hpp"

#include <stdexcept>

#include "checkpoints/dump_schema_embedded.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

const std::vector<std::pair<AttrType, const char*>>& type_names() {
  static const std::vector<std::pair<AttrType, const char*>> names = {{AttrType::string, "string"},
                                                                      {AttrType::integer, "integer"},
                                                                      {AttrType::real, "real"},
                                                                      {AttrType::boolean, "boolean"},
                                                                      {AttrType::int_array, "integer array"}};
  return names;
}

AttrType parse_type(const std::string& name) {
  for (const auto& [t, n] : type_names())
    if (name == n) return t;
  throw std::logic_error("dump_schema.json: unknown attribute type '" + name + "'");
}

// "values": a list, "archs" (the architectures' names) or "features.<name>" (that feature's values).
std::vector<std::string> parse_values(const nlohmann::json& spec, const nlohmann::json& doc) {
  std::vector<std::string> out;
  if (spec.is_array()) return spec.get<std::vector<std::string>>();
  const std::string s = spec.get<std::string>();
  if (s == "archs") {
    for (const auto& a : doc.at("archs")) out.push_back(a.at("name").get<std::string>());
    return out;
  }
  for (const auto& f : doc.at("features"))
    if ("features." + f.at("name").get<std::string>() == s) return f.at("values").get<std::vector<std::string>>();
  throw std::logic_error("dump_schema.json: unknown values '" + s + "'");
}

RootAttribute parse_attribute(const nlohmann::json& a, const nlohmann::json& doc) {
  RootAttribute r;
  r.name = a.at("name").get<std::string>();
  r.type = parse_type(a.at("type").get<std::string>());
  r.required = a.value("required", false);
  if (a.contains("values")) r.values = parse_values(a.at("values"), doc);
  r.config = a.value("config", false);
  r.shard = a.value("shard", false);
  r.max = a.value("max", int64_t(0));
  r.max_why = a.value("max_why", "");
  r.positive = a.value("positive", false);
  r.divides = a.value("divides", "");
  r.ids = a.value("ids", false);
  r.nonempty = a.value("nonempty", "");
  r.fill = a.value("fill", "");
  r.skeleton = a.value("skeleton", "");
  return r;
}

DumpSchema parse_schema() {
  const auto& files = embedded_dump_schema();
  if (files.size() != 1) throw std::logic_error("expected one embedded dump schema");
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(files.front().text);
  DumpSchema s;
  s.format = doc.at("format").get<std::string>();
  s.format_version = doc.at("format_version").get<int>();
  s.oldest_format_version = doc.at("oldest_format_version").get<int>();
  for (const auto& [name, t] : doc.at("types").items()) {
    s.expected[name] = t.at("expected").get<std::string>();
    s.skeleton_type[name] = t.at("skeleton").get<std::string>();
  }
  for (const auto& d : doc.at("dims"))
    s.dims.push_back({d.at("letter").get<std::string>(), d.at("what").get<std::string>(), d.value("attribute", ""),
                      d.value("heads", false), d.value("head_dim", false)});
  s.features = doc.at("features");
  s.archs = doc.at("archs");
  for (const auto& a : doc.at("root_attributes")) s.root.push_back(parse_attribute(a, doc));
  for (const auto& a : doc.at("dataset_attributes")) s.dataset.push_back(parse_attribute(a, doc));
  for (const auto& k : doc.at("kinds"))
    s.kinds.push_back({k.at("base").get<std::string>(), k.at("layout").get<std::string>(),
                       k.at("what").get<std::string>(), k.value("inputs", ""), k.value("needs", ""),
                       k.at("per_layer").get<bool>(), k.value("read_back", true)});
  return s;
}

}  // namespace

const char* attr_type_name(AttrType t) {
  for (const auto& [tt, n] : type_names())
    if (tt == t) return n;
  return "?";
}

const DumpSchema& dump_schema() {
  static const DumpSchema s = parse_schema();
  return s;
}

std::string_view dump_schema_text() { return embedded_dump_schema().front().text; }

const DimLetter* find_dim(std::string_view letter) {
  for (const auto& d : dump_schema().dims)
    if (d.letter == letter) return &d;
  return nullptr;
}

namespace {

// The step's letters, in the schema's order: the token rows, then the cache rows.
const std::vector<std::string>& step_dims() {
  static const std::vector<std::string> letters = [] {
    std::vector<std::string> out;
    for (const auto& d : dump_schema().dims)
      if (d.attribute.empty()) out.push_back(d.letter);
    if (out.size() != 2) throw std::logic_error("dump_schema.json: expected two step dims (T, S)");
    return out;
  }();
  return letters;
}

}  // namespace

const std::string& token_rows_dim() { return step_dims()[0]; }
const std::string& cache_rows_dim() { return step_dims()[1]; }

const RootAttribute& dataset_attribute(std::string_view name) {
  for (const auto& a : dump_schema().dataset)
    if (a.name == name) return a;
  throw std::out_of_range("dump_schema.json: no dataset attribute '" + std::string(name) + "'");
}

namespace {

// ModelConfig's integer fields under their attribute names.
const std::vector<std::pair<std::string, int ModelConfig::*>>& int_fields() {
  static const std::vector<std::pair<std::string, int ModelConfig::*>> fields = {
      {attr::n_layer, &ModelConfig::n_layer},     {attr::n_embd, &ModelConfig::n_embd},
      {attr::n_head, &ModelConfig::n_head},       {attr::n_head_kv, &ModelConfig::n_head_kv},
      {attr::head_dim, &ModelConfig::head_dim},   {attr::n_ff, &ModelConfig::n_ff},
      {attr::n_vocab, &ModelConfig::n_vocab},     {attr::n_ctx, &ModelConfig::n_ctx},
      {attr::n_expert, &ModelConfig::n_expert},   {attr::n_expert_used, &ModelConfig::n_expert_used},
      {attr::n_ff_exp, &ModelConfig::n_ff_exp}};
  return fields;
}
// ModelConfig's boolean and real fields under their attribute names.
const std::vector<std::pair<std::string, bool ModelConfig::*>>& bool_fields() {
  static const std::vector<std::pair<std::string, bool ModelConfig::*>> fields = {
      {attr::tied_output, &ModelConfig::tied_output}, {attr::qkv_bias, &ModelConfig::qkv_bias},
      {attr::qk_norm, &ModelConfig::qk_norm}};
  return fields;
}
const std::vector<std::pair<std::string, double ModelConfig::*>>& real_fields() {
  static const std::vector<std::pair<std::string, double ModelConfig::*>> fields = {
      {attr::rope_theta, &ModelConfig::rope_theta}, {attr::rms_eps, &ModelConfig::rms_eps}};
  return fields;
}

// The integer field a dimension letter's attribute names, by letter.
const std::map<std::string, int ModelConfig::*>& dim_fields() {
  static const std::map<std::string, int ModelConfig::*> m = [] {
    std::map<std::string, int ModelConfig::*> out;
    for (const auto& d : dump_schema().dims) {
      if (d.attribute.empty()) continue;
      for (const auto& [name, field] : int_fields())
        if (name == d.attribute) out[d.letter] = field;
      if (!out.count(d.letter)) throw std::logic_error("dump_schema.json: dim " + d.letter + " has no integer attribute");
    }
    return out;
  }();
  return m;
}

}  // namespace

nlohmann::ordered_json config_attributes(const ModelConfig& c) {
  nlohmann::ordered_json all = {{attr::arch, arch_name(c.arch)}, {attr::rope_type, rope_type_name(c.rope_type)}};
  for (const auto& [name, field] : int_fields()) all[name] = c.*field;
  for (const auto& [name, field] : real_fields()) all[name] = c.*field;
  for (const auto& [name, field] : bool_fields()) all[name] = c.*field;
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& a : dump_schema().root) {
    if (!a.config) continue;
    // An optional one (the experts' sizes) is written only where it applies: a dense model has none.
    if (!a.required && a.type == AttrType::integer && all.at(a.name).get<int64_t>() == 0) continue;
    out[a.name] = all.at(a.name);  // throws for a config attribute ModelConfig lacks
  }
  return out;
}

ModelConfig config_from_attributes(const nlohmann::json& v) {
  ModelConfig c;
  if (const std::optional<Arch> a = arch_from_name(v.at(attr::arch).get<std::string>())) c.arch = *a;
  set_arch_features(c);  // the flags the attributes do not carry (post-norms, FFN activation, ...)
  for (const auto& [name, field] : int_fields())  // an absent optional one (a dense model's experts) is 0
    c.*field = v.contains(name) ? static_cast<int>(v.at(name).get<int64_t>()) : 0;
  c.moe = c.moe || c.n_expert > 0;
  for (const auto& [name, field] : real_fields()) c.*field = v.at(name).get<double>();
  for (const auto& [name, field] : bool_fields())
    c.*field = v.at(name).is_boolean() ? v.at(name).get<bool>() : v.at(name).get<int64_t>() != 0;
  c.rope_type = v.at(attr::rope_type).get<std::string>() == rope_type_name(RopeType::neox) ? RopeType::neox
                                                                                                : RopeType::norm;
  return c;
}

int64_t dim_size(const ModelConfig& cfg, const std::string& letter, int64_t n_tokens, int64_t n_kv) {
  if (letter == token_rows_dim()) return n_tokens;
  if (letter == cache_rows_dim()) return n_kv;
  const auto& fields = dim_fields();
  const auto it = fields.find(letter);
  if (it == fields.end()) throw InputError("unknown layout dimension '" + letter + "'");
  return cfg.*(it->second);
}

nlohmann::json config_features(const ModelConfig& c) {
  return {{"rope_type", rope_type_name(c.rope_type)}, {"qkv_bias", c.qkv_bias},
          {"qk_norm", c.qk_norm},                     {"embd_scale", c.embd_scale},
          {"post_norms", c.post_norms},               {"ffn_act", c.ffn_act == FfnAct::silu ? "silu" : "gelu_tanh"},
          {"moe", c.moe},                             {"moe_shexp", c.moe_shexp}};
}

bool needs_met(std::string_view needs, const nlohmann::json& features) {
  if (needs.empty()) return true;
  // "a|b": either (binds loosest); "a&b": both; "!a": a feature that is false or absent.
  if (const size_t bar = needs.find('|'); bar != std::string_view::npos)
    return needs_met(needs.substr(0, bar), features) || needs_met(needs.substr(bar + 1), features);
  if (const size_t amp = needs.find('&'); amp != std::string_view::npos)
    return needs_met(needs.substr(0, amp), features) && needs_met(needs.substr(amp + 1), features);
  if (needs.front() == '!') return !needs_met(needs.substr(1), features);
  const size_t eq = needs.find('=');
  const std::string name(needs.substr(0, eq));
  if (!features.contains(name)) return false;
  const nlohmann::json& f = features.at(name);
  if (eq == std::string_view::npos) return f.is_boolean() ? f.get<bool>() : !f.is_null();
  return f.is_string() && f.get<std::string>() == needs.substr(eq + 1);
}

std::map<std::string, int64_t> dim_sizes(const ModelConfig& cfg, int64_t n_tokens, int64_t n_kv) {
  std::map<std::string, int64_t> out;
  for (const auto& [letter, field] : dim_fields()) out[letter] = cfg.*field;
  if (n_tokens >= 0) out[token_rows_dim()] = n_tokens;
  if (n_kv >= 0) out[cache_rows_dim()] = n_kv;
  return out;
}

}  // namespace diffrun
