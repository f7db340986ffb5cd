// Tolerance rules: JSON parsing with errors that name the line, rule lookup, bound checks, presets.
#include "diff/tolerances.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "checkpoints/vocabulary.hpp"
#include "diff/presets_embedded.hpp"
#include "model/error.hpp"

namespace diffrun::diff {
namespace {

using json = nlohmann::json;

// Maps JSON pointers ("/rules/2/max_rel_l2") to the line where the key (or array element) starts.
// Runs over text nlohmann has already accepted, so it only has to follow the structure.
class LineLocator {
 public:
  explicit LineLocator(std::string_view text) : text_(text) { value(""); }

  int line_of(std::string path) const {
    while (true) {
      if (auto it = lines_.find(path); it != lines_.end()) return it->second;
      if (path.empty()) return 1;
      path.resize(path.rfind('/'));
    }
  }

 private:
  void skip_ws() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      if (text_[pos_] == '\n') ++line_;
      ++pos_;
    }
  }
  std::string string_token() {
    std::string out;
    ++pos_;  // opening quote
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out += text_[pos_++];
    }
    ++pos_;  // closing quote
    return out;
  }
  void value(const std::string& path) {
    skip_ws();
    lines_.emplace(path, line_);
    if (pos_ >= text_.size()) return;
    char c = text_[pos_];
    if (c == '{') {
      ++pos_;
      while (true) {
        skip_ws();
        if (pos_ >= text_.size() || text_[pos_] == '}') break;
        if (text_[pos_] == ',') { ++pos_; continue; }
        int key_line = line_;
        std::string key = string_token();
        lines_.emplace(path + "/" + key, key_line);
        skip_ws();
        ++pos_;  // ':'
        value(path + "/" + key);
      }
      ++pos_;
    } else if (c == '[') {
      ++pos_;
      for (int i = 0;; ++i) {
        skip_ws();
        if (pos_ >= text_.size() || text_[pos_] == ']') break;
        if (text_[pos_] == ',') { ++pos_; --i; continue; }
        value(path + "/" + std::to_string(i));
      }
      ++pos_;
    } else if (c == '"') {
      string_token();
    } else {
      while (pos_ < text_.size() && !std::isspace(static_cast<unsigned char>(text_[pos_])) &&
             text_[pos_] != ',' && text_[pos_] != '}' && text_[pos_] != ']') {
        ++pos_;
      }
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
  int line_ = 1;
  std::map<std::string, int> lines_;
};

enum class Range { non_negative, fraction, cosine, any };

struct BoundKey {
  const char* key;
  std::optional<double> ToleranceRule::*field;
  Range range;
};

const std::vector<BoundKey>& bound_keys() {
  static const std::vector<BoundKey> keys = {
      {"max_abs", &ToleranceRule::max_abs, Range::non_negative},
      {"max_mean_abs", &ToleranceRule::max_mean_abs, Range::non_negative},
      {"max_rel_l2", &ToleranceRule::max_rel_l2, Range::non_negative},
      {"max_nmse", &ToleranceRule::max_nmse, Range::non_negative},
      {"min_cosine", &ToleranceRule::min_cosine, Range::cosine},
      {"min_sqnr_db", &ToleranceRule::min_sqnr_db, Range::any},
      {"max_fail_frac", &ToleranceRule::max_fail_frac, Range::fraction},
      {"min_top1", &ToleranceRule::min_top1, Range::fraction},
      {"min_top5", &ToleranceRule::min_top5, Range::fraction},
      {"max_kl", &ToleranceRule::max_kl, Range::non_negative},
  };
  return keys;
}

std::string known_rule_keys(bool with_match) {
  std::string s = with_match ? "match, reason, atol, rtol" : "reason, atol, rtol";
  for (const auto& k : bound_keys()) s += std::string(", ") + k.key;
  return s;
}

bool valid_pattern_chars(std::string_view p) {
  for (char c : p) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.' && c != '*' &&
        c != '?') {
      return false;
    }
  }
  return !p.empty();
}

// A pattern must match some name of the checkpoint vocabulary (any layer up to 255), so a typo
// such as "Qcurr-*" is an error rather than a rule that silently never applies.
bool matches_some_checkpoint(std::string_view pattern) {
  for (const auto& kind : checkpoint_kinds()) {
    if (!kind.per_layer) {
      if (glob_match(pattern, kind.base)) return true;
      continue;
    }
    for (int layer = 0; layer < 256; ++layer) {
      if (glob_match(pattern, checkpoint_name(kind.base, layer))) return true;
    }
  }
  return false;
}

class Parser {
 public:
  Parser(std::string_view text, const std::string& source) : text_(text), source_(source), lines_(text) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw InputError(fmt::format("{}:{}: {}", source_, lines_.line_of(path), what));
  }

  double number(const json& v, const std::string& path, const std::string& key, Range range) const {
    if (!v.is_number()) fail(path, fmt::format("\"{}\" must be a number, not {}", key, v.dump()));
    double x = v.get<double>();
    if (!std::isfinite(x)) fail(path, fmt::format("\"{}\" must be finite", key));
    switch (range) {
      case Range::non_negative:
        if (x < 0) fail(path, fmt::format("\"{}\" must be >= 0, got {}", key, v.dump()));
        break;
      case Range::fraction:
        if (x < 0 || x > 1) fail(path, fmt::format("\"{}\" must be in [0, 1], got {}", key, v.dump()));
        break;
      case Range::cosine:
        if (x < -1 || x > 1) fail(path, fmt::format("\"{}\" must be in [-1, 1], got {}", key, v.dump()));
        break;
      case Range::any:
        break;
    }
    return x;
  }

  std::string string(const json& v, const std::string& path, const std::string& key) const {
    if (!v.is_string()) fail(path, fmt::format("\"{}\" must be a string, not {}", key, v.dump()));
    return v.get<std::string>();
  }

  ToleranceRule rule(const json& obj, const std::string& path, bool is_default) const {
    if (!obj.is_object()) fail(path, "a rule must be an object");
    ToleranceRule r;
    r.line = lines_.line_of(path);
    for (const auto& [key, v] : obj.items()) {
      const std::string kpath = path + "/" + key;
      if (key == "match" && !is_default) {
        r.match = string(v, kpath, key);
        if (!valid_pattern_chars(r.match)) {
          fail(kpath, fmt::format("bad pattern \"{}\": use checkpoint names with * and ? (letters, digits, _ - .)",
                                  r.match));
        }
        if (!matches_some_checkpoint(r.match)) {
          fail(kpath, fmt::format("pattern \"{}\" matches no checkpoint name", r.match));
        }
      } else if (key == "reason") {
        r.reason = string(v, kpath, key);
      } else if (key == "atol") {
        r.element.atol = number(v, kpath, key, Range::non_negative);
      } else if (key == "rtol") {
        r.element.rtol = number(v, kpath, key, Range::non_negative);
      } else {
        bool found = false;
        for (const auto& b : bound_keys()) {
          if (key == b.key) {
            r.*(b.field) = number(v, kpath, key, b.range);
            found = true;
          }
        }
        if (!found) {
          fail(kpath, fmt::format("unknown key \"{}\" in {} (known: {})", key,
                                  is_default ? "the default rule" : "a rule", known_rule_keys(!is_default)));
        }
      }
    }
    if (!is_default && r.match.empty()) fail(path, "a rule needs \"match\"");
    if (r.reason.empty()) fail(path, "a rule needs a one-line \"reason\"");
    return r;
  }

  ToleranceSet parse() const {
    json doc;
    try {
      doc = json::parse(text_);
    } catch (const json::parse_error& e) {
      size_t byte = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text_.size());
      int line = 1 + static_cast<int>(std::count(text_.begin(), text_.begin() + static_cast<std::ptrdiff_t>(byte), '\n'));
      std::string what = e.what();
      if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
      throw InputError(fmt::format("{}:{}: invalid JSON: {}", source_, line, what));
    } catch (const json::out_of_range& e) {
      // A number too large for a double; the message quotes it, so find it in the text.
      std::string what = e.what();
      if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
      size_t q0 = what.find('\''), q1 = what.rfind('\'');
      size_t at = q0 < q1 ? text_.find(what.substr(q0 + 1, q1 - q0 - 1)) : std::string_view::npos;
      int line = 1 + static_cast<int>(std::count(text_.begin(), text_.begin() + static_cast<std::ptrdiff_t>(
                                                                                 at == std::string_view::npos ? 0 : at), '\n'));
      throw InputError(fmt::format("{}:{}: {}", source_, line, what));
    }
    if (!doc.is_object()) fail("", "a tolerance file must be a JSON object with \"rules\" and \"default\"");
    ToleranceSet set;
    set.source = source_;
    bool have_default = false;
    for (const auto& [key, v] : doc.items()) {
      const std::string path = "/" + key;
      if (key == "preset") {
        set.preset = string(v, path, key);
      } else if (key == "description") {
        set.description = string(v, path, key);
      } else if (key == "rules") {
        if (!v.is_array()) fail(path, "\"rules\" must be an array of rules");
        for (size_t i = 0; i < v.size(); ++i) set.rules.push_back(rule(v[i], path + "/" + std::to_string(i), false));
      } else if (key == "default") {
        set.default_rule = rule(v, path, true);
        have_default = true;
      } else {
        fail(path, fmt::format("unknown key \"{}\" (known: preset, description, rules, default)", key));
      }
    }
    if (!have_default) fail("", "missing \"default\" rule");
    return set;
  }

 private:
  std::string_view text_;
  std::string source_;
  LineLocator lines_;
};

}  // namespace

const ToleranceRule& ToleranceSet::rule_for(std::string_view checkpoint) const {
  for (const auto& r : rules) {
    if (glob_match(r.match, checkpoint)) return r;
  }
  return default_rule;
}

ToleranceSet parse_tolerances(std::string_view text, const std::string& source) {
  return Parser(text, source).parse();
}

ToleranceSet load_tolerances(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot read the tolerance file", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw InputError(fmt::format("{}: cannot read the tolerance file", path));
  return parse_tolerances(ss.str(), path);
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : embedded_presets()) names.emplace_back(p.name);
  return names;
}

ToleranceSet preset_tolerances(std::string_view name) {
  for (const auto& p : embedded_presets()) {
    if (p.name == name) return parse_tolerances(p.text, "fixtures/tolerances/" + std::string(name) + ".json");
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw InputError(fmt::format("no tolerance preset \"{}\" (presets: {}); pass --tolerances FILE", name, known));
}

std::string preset_name(std::string_view engine_precision, std::string_view reference_precision) {
  return fmt::format("{}_vs_{}", engine_precision, reference_precision);
}

std::vector<BoundCheck> check_bounds(const TensorMetrics& m, const ToleranceRule& rule) {
  std::vector<BoundCheck> out;
  if (!m.finite()) {
    // A NaN or Inf on either side fails, also the same one on both sides; the metric bounds are
    // not checked: their metrics are undefined over non-finite data.
    out.push_back({"nonfinite", "finite", static_cast<double>(m.nonfinite()), 0.0, false});
    return out;
  }
  auto upper = [&](const char* metric, const char* bound, double value, const std::optional<double>& limit) {
    if (limit) out.push_back({metric, bound, value, *limit, value <= *limit});
  };
  auto lower = [&](const char* metric, const char* bound, double value, const std::optional<double>& limit) {
    if (limit) out.push_back({metric, bound, value, *limit, value >= *limit});
  };
  upper("max_abs", "max_abs", m.max_abs, rule.max_abs);
  upper("mean_abs", "max_mean_abs", m.mean_abs, rule.max_mean_abs);
  upper("rel_l2", "max_rel_l2", m.rel_l2, rule.max_rel_l2);
  upper("nmse", "max_nmse", m.nmse, rule.max_nmse);
  lower("cosine", "min_cosine", m.cosine, rule.min_cosine);
  lower("sqnr_db", "min_sqnr_db", m.sqnr_db, rule.min_sqnr_db);
  upper("fail_frac", "max_fail_frac", m.fail_frac, rule.max_fail_frac);
  if (m.logits) {
    lower("top1", "min_top1", m.logits->top1, rule.min_top1);
    lower("top5_overlap", "min_top5", m.logits->top5_overlap, rule.min_top5);
    upper("kl_max", "max_kl", m.logits->kl_max, rule.max_kl);
  }
  return out;
}

}  // namespace diffrun::diff
