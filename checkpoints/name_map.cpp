// Name maps: parsing (built-in maps from fixtures/names/, or a file) and matching foreign names to rules.
#include "checkpoints/name_map.hpp"

#include "checkpoints/dump_schema.hpp"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoints/names_embedded.hpp"
#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

namespace diffrun {
namespace {

// Matches `text` against `pattern` with at most one "{L}" (one or more digits); -2 when it does not
// match, -1 when it matches and the pattern has no "{L}", else the layer.
int match_pattern(std::string_view pattern, std::string_view text) {
  if (pattern.find_first_of("*?") != std::string_view::npos) return glob_match(pattern, text) ? -1 : -2;
  const size_t at = pattern.find("{L}");
  if (at == std::string_view::npos) return pattern == text ? -1 : -2;
  const std::string_view head = pattern.substr(0, at), tail = pattern.substr(at + 3);
  if (text.size() <= head.size() + tail.size()) return -2;
  if (text.substr(0, head.size()) != head || text.substr(text.size() - tail.size()) != tail) return -2;
  const std::string_view digits = text.substr(head.size(), text.size() - head.size() - tail.size());
  int layer = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.front() == '+' || layer < 0) return -2;
  return layer;
}

// The largest repeat an occurrence names (a step holds far fewer datasets).
constexpr int kMaxOccurrence = 1000000;
// A name map file is a few kB; a larger one is refused before it is read.
constexpr uintmax_t kMaxNameMapBytes = 1 << 20;

// "123" -> 123 when it is digits only and at most kMaxOccurrence; -1 otherwise.
int small_number(std::string_view s) {
  int v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || s.front() == '-' || s.front() == '+' || ec != std::errc() || end != s.data() + s.size() ||
      v > kMaxOccurrence)
    return -1;
  return v;
}

// Does `occurrence` ("", "k", "last", "last-k"; checked by valid_occurrence) select repeat `k` of `count`?
bool occurrence_matches(const std::string& occurrence, int k, int count) {
  if (occurrence.empty()) return true;
  if (occurrence.rfind("last", 0) == 0) {
    const int back = occurrence.size() > 4 ? small_number(std::string_view(occurrence).substr(5)) : 0;
    return back >= 0 && k == count - back;
  }
  return k == small_number(occurrence);
}

bool valid_occurrence(const std::string& o) {
  if (o.empty() || o == "last") return true;
  if (o.rfind("last-", 0) == 0) return small_number(std::string_view(o).substr(5)) >= 0;
  return small_number(o) >= 1;
}

// The JSON with every object's keys checked for repeats (nlohmann keeps the last one silently).
nlohmann::json parse_unique_keys(std::string_view json, const std::string& source) {
  std::vector<std::set<std::string>> keys;
  auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) keys.emplace_back();
    else if (event == E::object_end && !keys.empty()) keys.pop_back();
    else if (event == E::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
      throw InputError(source + ": the key \"" + printable(parsed.get<std::string>(), 64, '"') +
                       "\" is given twice in one object");
    return true;
  };
  return nlohmann::json::parse(json, callback);
}

}  // namespace

std::pair<std::string, int> split_occurrence(std::string_view name) {
  const size_t hash = name.rfind('#');
  if (hash != std::string_view::npos && hash > 0 && hash + 1 < name.size()) {
    const std::string_view digits = name.substr(hash + 1);
    int k = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), k);
    if (ec == std::errc() && end == digits.data() + digits.size() && digits.front() != '+' && k >= 2)
      return {std::string(name.substr(0, hash)), k};
  }
  return {std::string(name), 1};
}

std::vector<std::string> NameMap::builtin_names() {
  std::vector<std::string> names;
  for (const auto& m : embedded_name_maps()) names.emplace_back(m.name);
  return names;
}

NameMap NameMap::load(const std::string& spec) {
  for (const auto& m : embedded_name_maps())
    if (spec == m.name) return parse(m.text, "built-in name map '" + spec + "'");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(spec, ec)) {
    std::string known;
    for (const auto& n : builtin_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError("--names '" + printable(spec) + "': neither a built-in name map (" + known + ") nor a file");
  }
  if (const uintmax_t size = std::filesystem::file_size(spec, ec); !ec && size > kMaxNameMapBytes)
    throw InputError(printable(spec) + ": the name map is " + std::to_string(size) + " bytes, more than the " +
                     std::to_string(kMaxNameMapBytes >> 20) + " MiB a name map may hold");
  std::ifstream in(spec, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in && !in.eof()) throw InputError(printable(spec) + ": cannot read the name map");
  if (text.str().size() > kMaxNameMapBytes)
    throw InputError(printable(spec) + ": the name map holds more than the " + std::to_string(kMaxNameMapBytes >> 20) +
                     " MiB a name map may hold");
  return parse(text.str(), printable(spec));
}

NameMap NameMap::parse(std::string_view json, const std::string& source) {
  NameMap m;
  m.source_ = source;
  nlohmann::json doc;
  if (json.size() > kMaxNameMapBytes)
    throw InputError(source + ": the name map holds " + std::to_string(json.size()) + " bytes, more than the " +
                     std::to_string(kMaxNameMapBytes >> 20) + " MiB a name map may hold");
  try {
    doc = parse_unique_keys(json, source);
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(source + ": not valid JSON: " + printable(e.what()));
  }
  if (!doc.is_object() || !doc.contains("rules") || !doc["rules"].is_array())
    throw InputError(source + ": expected an object with a \"rules\" array");
  static const std::set<std::string> top_keys = {"name", "description", "rules"};
  for (const auto& [key, value] : doc.items())
    if (!top_keys.count(key)) throw InputError(source + ": unknown key \"" + printable(key, 64, '"') + "\"");
  static const std::set<std::string> rule_keys = {"match", "occurrence", "archs", "when", "drop", "to",
                                                  "layout", "transpose", "crop", "why"};
  size_t index = 0;
  for (const auto& r : doc["rules"]) {
    ++index;
    const std::string where = source + ": rule " + std::to_string(index);
    if (!r.is_object()) throw InputError(where + ": not an object");
    for (const auto& [key, value] : r.items())
      if (!rule_keys.count(key)) throw InputError(where + ": unknown key \"" + printable(key, 64, '"') + "\"");
    NameRule rule;
    try {
      rule.match = r.at("match").get<std::string>();
      if (r.contains("occurrence")) {
        const auto& o = r["occurrence"];
        // Integers outside 1..kMaxOccurrence (2^40 once became 0) are refused, not truncated.
        if (o.is_number_integer() && !(o.is_number_unsigned() && o.get<uint64_t>() >= 1 &&
                                       o.get<uint64_t>() <= uint64_t(kMaxOccurrence)))
          throw InputError(where + ": occurrence " + o.dump() + " is not k >= 1 (at most " +
                           std::to_string(kMaxOccurrence) + "), \"last\" or \"last-k\"");
        rule.occurrence = o.is_number_integer() ? std::to_string(o.get<int64_t>()) : o.get<std::string>();
      }
      if (r.contains("archs")) rule.archs = r["archs"].get<std::vector<std::string>>();
      if (r.contains("when")) rule.when = r["when"].get<std::map<std::string, std::string>>();
      rule.drop = r.value("drop", false);
      rule.to = r.value("to", std::string());
      rule.layout = r.value("layout", std::string());
      rule.transpose = r.value("transpose", false);
      if (r.contains("crop")) rule.crop = r["crop"].get<std::vector<std::string>>();
      rule.why = r.value("why", std::string());
    } catch (const nlohmann::json::exception& e) {
      throw InputError(where + ": " + printable(e.what()));
    }
    const std::string label = where + " (\"" + printable(rule.match, 64, '"') + "\")";
    if (rule.match.empty()) throw InputError(where + ": empty \"match\"");
    if (rule.match.find("{L}") != rule.match.rfind("{L}")) throw InputError(label + ": more than one {L}");
    if (rule.match.find("{L}") != std::string::npos && rule.match.find_first_of("*?") != std::string::npos)
      throw InputError(label + ": a pattern is either a glob or has {L}, not both");
    if (!valid_occurrence(rule.occurrence))
      throw InputError(label + ": occurrence \"" + printable(rule.occurrence, 64, '"') + "\" is not k >= 1 (at most " +
                       std::to_string(kMaxOccurrence) + "), \"last\" or \"last-k\"");
    if (rule.drop == !rule.to.empty()) throw InputError(label + ": give exactly one of \"to\" and \"drop\"");
    if (rule.to.find("{L}") != std::string::npos && rule.match.find("{L}") == std::string::npos)
      throw InputError(label + ": \"to\" uses {L} but \"match\" has none");
    for (const auto& a : rule.archs) {
      if (!arch_from_name(a)) throw InputError(label + ": unknown arch \"" + printable(a, 64, '"') + "\"");
    }
    for (const auto& c : rule.crop)
      if (!find_dim(c)) {
        std::string letters;
        for (const auto& d : dump_schema().dims) letters += (letters.empty() ? "" : ", ") + d.letter;
        throw InputError(label + ": crop letter \"" + printable(c, 64, '"') + "\" is not a layout letter (" + letters + ")");
      }
    m.rules_.push_back(std::move(rule));
  }
  return m;
}

std::optional<NameMapping> NameMap::map(std::string_view base, int occurrence, int count, Arch arch,
                                        const std::map<std::string, std::string>& facts) const {
  for (const auto& rule : rules_) {
    bool when = true;
    for (const auto& [key, value] : rule.when) {
      auto it = facts.find(key);
      when &= it != facts.end() && it->second == value;
    }
    if (!when) continue;
    if (!rule.archs.empty()) {
      bool ok = false;
      for (const auto& a : rule.archs) ok |= a == arch_name(arch);
      if (!ok) continue;
    }
    const int layer = match_pattern(rule.match, base);
    if (layer == -2 || !occurrence_matches(rule.occurrence, occurrence, count)) continue;
    NameMapping out;
    out.rule = &rule;
    out.drop = rule.drop;
    if (!rule.drop) {
      out.name = rule.to;
      if (const size_t at = out.name.find("{L}"); at != std::string::npos)
        out.name.replace(at, 3, std::to_string(layer));
    }
    return out;
  }
  return std::nullopt;
}

}  // namespace diffrun
