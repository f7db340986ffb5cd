// Tolerance rules: JSON parsing with errors that name the line, rule lookup, bound checks, presets.
#include "diff/tolerances.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "checkpoints/dump_schema_names.hpp"
#include "checkpoints/vocabulary.hpp"
#include "diff/presets_embedded.hpp"
#include "model/error.hpp"
#include "model/file_check.hpp"

namespace diffrun::diff {
namespace {

using json = nlohmann::json;

// Deepest nesting a tolerance file may use; the format itself needs 3 levels ({"rules": [{...}]}).
constexpr int kMaxDepth = 32;
// Largest tolerance file read; the presets are ~10 KB.
constexpr uint64_t kMaxFileBytes = uint64_t{16} << 20;

int line_at(std::string_view text, size_t byte) {
  byte = std::min(byte, text.size());
  return 1 + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(byte), '\n'));
}

// Rejects nesting deeper than kMaxDepth before any parser recurses into it. Runs on any text (valid
// JSON or not) in one pass with constant memory.
void check_depth(std::string_view text, const std::string& source) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) {
        throw InputError(fmt::format("{}:{}: JSON nested deeper than {} levels", source, line_at(text, i), kMaxDepth));
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

// Where each value of a JSON text starts: a tree with the line of every key and array element,
// built in one pass over text nlohmann has already accepted (and check_depth has bounded), so it
// only follows the structure. Memory is linear in the text. Also rejects duplicate keys, which
// nlohmann would silently merge (the last one winning).
class LineTree {
 public:
  LineTree(std::string_view text, const std::string& source) : text_(text), source_(source) { value(root_); }

  struct Node {
    int line = 1;
    std::vector<std::string> keys;  // object members (empty for arrays)
    std::vector<Node> kids;         // members or elements, in text order

    // The member `key` (or this node when absent, so errors fall back to the enclosing value).
    const Node& member(std::string_view key) const {
      for (size_t i = 0; i < keys.size(); ++i)
        if (keys[i] == key) return kids[i];
      return *this;
    }
    const Node& element(size_t i) const { return keys.empty() && i < kids.size() ? kids[i] : *this; }
  };

  const Node& root() const { return root_; }

 private:
  void skip_ws() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      if (text_[pos_] == '\n') ++line_;
      ++pos_;
    }
  }
  // The decoded string token at pos_ (escapes resolved by nlohmann, exactly as in the parsed doc).
  std::string string_token() {
    size_t begin = pos_++;
    while (pos_ < text_.size() && text_[pos_] != '"') pos_ += text_[pos_] == '\\' ? 2 : 1;
    ++pos_;
    return json::parse(text_.substr(begin, pos_ - begin)).get<std::string>();
  }
  void value(Node& node) {
    skip_ws();
    node.line = line_;
    if (pos_ >= text_.size()) return;
    char c = text_[pos_];
    if (c == '{' || c == '[') {
      const bool object = c == '{';
      const char close = object ? '}' : ']';
      ++pos_;
      while (true) {
        skip_ws();
        if (pos_ >= text_.size()) return;
        if (text_[pos_] == close) break;
        if (text_[pos_] == ',') { ++pos_; continue; }
        Node kid;
        if (object) {
          int key_line = line_;
          std::string key = string_token();
          for (size_t i = 0; i < node.keys.size(); ++i) {
            if (node.keys[i] == key) {
              throw InputError(fmt::format("{}:{}: duplicate key \"{}\" (first on line {})", source_, key_line,
                                           printable(key, 80, '"'), node.kids[i].line));
            }
          }
          skip_ws();
          ++pos_;  // ':'
          value(kid);
          kid.line = key_line;
          node.keys.push_back(std::move(key));
        } else {
          value(kid);
        }
        node.kids.push_back(std::move(kid));
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
  const std::string& source_;
  size_t pos_ = 0;
  int line_ = 1;
  Node root_;
};

using Node = LineTree::Node;

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
      {"max_row_rel_l2", &ToleranceRule::max_row_rel_l2, Range::non_negative},
      {"max_head_rel_l2", &ToleranceRule::max_head_rel_l2, Range::non_negative},
      {"min_top1", &ToleranceRule::min_top1, Range::fraction},
      {"min_top5", &ToleranceRule::min_top5, Range::fraction},
      {"max_kl", &ToleranceRule::max_kl, Range::non_negative},
  };
  return keys;
}

std::string known_rule_keys(bool with_match) {
  std::string s = with_match ? "match, reason, atol, rtol, rel_l2_per_position" : "reason, atol, rtol, rel_l2_per_position";
  for (const auto& k : bound_keys()) s += std::string(", ") + k.key;
  return s;
}

constexpr size_t kMaxPatternChars = 64;

bool valid_pattern_chars(std::string_view p) {
  for (char c : p) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.' && c != '*' &&
        c != '?') {
      return false;
    }
  }
  return !p.empty();
}

// The glob of glob_match ('*' any run, '?' one character) as a set of pattern positions reached
// after some text, advanced one character at a time: a name's prefix is matched once for all its
// continuations, and the cost is linear in the pattern (glob_match's backtracking is not, and a
// fuzzed file of long "*a*a*..." patterns took minutes over the 7,700 names below).
struct GlobState {
  std::string_view pattern;
  std::vector<char> at;  // at[i]: pattern[0, i) can have matched the text so far
  explicit GlobState(std::string_view p) : pattern(p), at(p.size() + 1, 0) {
    at[0] = 1;
    close();
  }
  void close() {
    for (size_t i = 0; i < pattern.size(); ++i)
      if (at[i] && pattern[i] == '*') at[i + 1] = 1;
  }
  bool alive() const { return std::find(at.begin(), at.end(), 1) != at.end(); }
  bool accepts() const { return at.back() != 0; }
  GlobState step(char c) const {
    GlobState next(*this);
    std::fill(next.at.begin(), next.at.end(), 0);
    for (size_t i = 0; i < pattern.size(); ++i) {
      if (!at[i]) continue;
      if (pattern[i] == '*') next.at[i] = 1;
      else if (pattern[i] == '?' || pattern[i] == c) next.at[i + 1] = 1;
    }
    next.close();
    return next;
  }
  GlobState step(std::string_view text) const {
    GlobState s(*this);
    for (char c : text) {
      if (!s.alive()) break;
      s = s.step(c);
    }
    return s;
  }
};

// A pattern must match some name of the checkpoint vocabulary (any layer up to 255), so a typo
// such as "Qcurr-*" is an error rather than a rule that silently never applies.
bool matches_some_checkpoint(std::string_view pattern) {
  const GlobState start(pattern);
  for (const auto& kind : checkpoint_kinds()) {
    const GlobState base = start.step(kind.base);
    if (!kind.per_layer) {
      if (base.accepts()) return true;
      continue;
    }
    const GlobState dash = base.step('-');
    if (!dash.alive()) continue;
    for (int layer = 0; layer < 256; ++layer) {
      if (dash.step(std::to_string(layer)).accepts()) return true;
    }
  }
  return false;
}

class Parser {
 public:
  Parser(std::string_view text, const std::string& source) : text_(text), source_(source) {}

  [[noreturn]] void fail(const Node& at, const std::string& what) const {
    throw InputError(fmt::format("{}:{}: {}", source_, at.line, what));
  }

  double number(const json& v, const Node& at, const std::string& key, Range range) const {
    if (!v.is_number()) fail(at, fmt::format("\"{}\" must be a number, not {}", key, printable(v.dump(), 80)));
    double x = v.get<double>();
    if (!std::isfinite(x)) fail(at, fmt::format("\"{}\" must be finite", key));
    switch (range) {
      case Range::non_negative:
        if (x < 0) fail(at, fmt::format("\"{}\" must be >= 0, got {}", key, printable(v.dump(), 80)));
        break;
      case Range::fraction:
        if (x < 0 || x > 1) fail(at, fmt::format("\"{}\" must be in [0, 1], got {}", key, printable(v.dump(), 80)));
        break;
      case Range::cosine:
        if (x < -1 || x > 1) fail(at, fmt::format("\"{}\" must be in [-1, 1], got {}", key, printable(v.dump(), 80)));
        break;
      case Range::any:
        break;
    }
    return x;
  }

  std::string string(const json& v, const Node& at, const std::string& key) const {
    if (!v.is_string()) fail(at, fmt::format("\"{}\" must be a string, not {}", key, printable(v.dump(), 80)));
    return v.get<std::string>();
  }

  ToleranceRule rule(const json& obj, const Node& node, bool is_default) const {
    if (!obj.is_object()) fail(node, "a rule must be an object");
    ToleranceRule r;
    r.line = node.line;
    bool bounded = false;
    for (const auto& [key, v] : obj.items()) {
      const Node& at = node.member(key);
      if (key == "match" && !is_default) {
        r.match = string(v, at, key);
        if (r.match.size() > kMaxPatternChars) {
          fail(at, fmt::format("pattern of {} characters is longer than {} (checkpoint names are short)",
                               r.match.size(), kMaxPatternChars));
        }
        if (!valid_pattern_chars(r.match)) {
          fail(at, fmt::format("bad pattern \"{}\": use checkpoint names with * and ? (letters, digits, _ - .)",
                               printable(r.match, 80, '"')));
        }
        if (!matches_some_checkpoint(r.match)) {
          fail(at, fmt::format("pattern \"{}\" matches no checkpoint name", printable(r.match, 80, '"')));
        }
      } else if (key == "reason") {
        r.reason = string(v, at, key);
      } else if (key == "atol") {
        r.element.atol = number(v, at, key, Range::non_negative);
      } else if (key == "rtol") {
        r.element.rtol = number(v, at, key, Range::non_negative);
      } else if (key == "rel_l2_per_position") {
        r.rel_l2_per_position = number(v, at, key, Range::non_negative);
      } else {
        bool found = false;
        for (const auto& b : bound_keys()) {
          if (key == b.key) {
            r.*(b.field) = number(v, at, key, b.range);
            found = bounded = true;
          }
        }
        if (!found) {
          fail(at, fmt::format("unknown key \"{}\" in {} (known: {})", printable(key, 80, '"'),
                               is_default ? "the default rule" : "a rule", known_rule_keys(!is_default)));
        }
      }
    }
    if (!is_default && r.match.empty()) fail(node, "a rule needs \"match\"");
    if (r.reason.empty()) fail(node, "a rule needs a one-line \"reason\"");
    if (!bounded) {
      std::string bounds;
      for (const auto& b : bound_keys()) bounds += (bounds.empty() ? "" : ", ") + std::string(b.key);
      fail(node, fmt::format("{} has no bound, so it would check nothing (give one of: {})",
                             is_default ? "the default rule" : fmt::format("the rule for \"{}\"", r.match), bounds));
    }
    return r;
  }

  ToleranceSet parse() const {
    check_depth(text_, source_);
    json doc;
    try {
      doc = json::parse(text_);
    } catch (const json::parse_error& e) {
      int line = line_at(text_, e.byte > 0 ? e.byte - 1 : 0);
      std::string what = e.what();
      if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
      throw InputError(fmt::format("{}:{}: invalid JSON: {}", source_, line, what));
    } catch (const json::out_of_range& e) {
      // A number too large for a double; the message quotes it, so find it in the text.
      std::string what = e.what();
      if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
      size_t q0 = what.find('\''), q1 = what.rfind('\'');
      size_t at = q0 < q1 ? text_.find(what.substr(q0 + 1, q1 - q0 - 1)) : std::string_view::npos;
      throw InputError(fmt::format("{}:{}: {}", source_, line_at(text_, at == std::string_view::npos ? 0 : at), what));
    }
    const LineTree lines(text_, source_);
    const Node& root = lines.root();
    if (!doc.is_object()) fail(root, "a tolerance file must be a JSON object with \"rules\" and \"default\"");
    ToleranceSet set;
    set.source = source_;
    bool have_default = false;
    for (const auto& [key, v] : doc.items()) {
      const Node& at = root.member(key);
      if (key == "preset") {
        set.preset = string(v, at, key);
      } else if (key == "description") {
        set.description = string(v, at, key);
      } else if (key == "rules") {
        if (!v.is_array()) fail(at, "\"rules\" must be an array of rules");
        for (size_t i = 0; i < v.size(); ++i) set.rules.push_back(rule(v[i], at.element(i), false));
      } else if (key == "default") {
        set.default_rule = rule(v, at, true);
        have_default = true;
      } else if (key == "calibrated_reduction") {
        if (!v.is_object()) fail(at, "\"calibrated_reduction\" must be an object {n_embd, n_ff, attn_width, exponent}");
        ToleranceSet::Reduction red;
        bool seen[4] = {false, false, false, false};
        for (const auto& [k, x] : v.items()) {
          const Node& kat = at.member(k);
          const double n = number(x, kat, k, Range::non_negative);
          const bool whole = n >= 1 && n == std::floor(n) && n <= 1e9;
          if (k == "exponent") {
            if (n <= 0 || n > 4) fail(kat, fmt::format("\"exponent\" must be in (0, 4], got {}", printable(x.dump(), 80)));
            red.exponent = n, seen[3] = true;
            continue;
          }
          int64_t* slot = k == "n_embd" ? &red.n_embd : k == "n_ff" ? &red.n_ff : k == "attn_width" ? &red.attn_width : nullptr;
          if (!slot)
            fail(kat, fmt::format("unknown key \"{}\" in calibrated_reduction (known: n_embd, n_ff, attn_width, exponent)",
                                  printable(k, 80, '"')));
          if (!whole) fail(kat, fmt::format("\"{}\" must be a whole number >= 1, got {}", k, printable(x.dump(), 80)));
          *slot = static_cast<int64_t>(n);
          seen[k == "n_embd" ? 0 : k == "n_ff" ? 1 : 2] = true;
        }
        if (!(seen[0] && seen[1] && seen[2] && seen[3]))
          fail(at, "\"calibrated_reduction\" needs n_embd, n_ff, attn_width and exponent");
        set.calibrated_reduction = red;
      } else if (key == "calibrated_positions") {
        const double n = number(v, at, key, Range::non_negative);
        if (n < 1 || n != std::floor(n) || n > 1e12) {
          fail(at, fmt::format("\"calibrated_positions\" must be a whole number >= 1, got {}", printable(v.dump(), 80)));
        }
        set.calibrated_positions = static_cast<int64_t>(n);
      } else {
        fail(at, fmt::format("unknown key \"{}\" (known: preset, description, calibrated_positions, "
                             "calibrated_reduction, rules, default)",
                             printable(key, 80, '"')));
      }
    }
    if (!have_default) fail(root, "missing \"default\" rule");
    return set;
  }

 private:
  std::string_view text_;
  std::string source_;
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
  // A FIFO or a device would block or never end; a huge file is not a tolerance file.
  if (std::string problem = regular_file_problem(path, kMaxFileBytes); !problem.empty()) {
    throw InputError(fmt::format("{}: cannot read the tolerance file: it {}", path, problem));
  }
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

double ToleranceSet::length_scale(int64_t positions) const {
  if (!calibrated_positions || positions <= *calibrated_positions) return 1.0;
  return std::sqrt(static_cast<double>(positions) / static_cast<double>(*calibrated_positions));
}

double ToleranceSet::reduction_scale(std::string_view base, const DimSizes& dims) const {
  if (!calibrated_reduction) return 1.0;
  const Reduction& c = *calibrated_reduction;
  const auto size = [&](const char* d) -> int64_t {
    const auto it = dims.find(d);
    return it == dims.end() ? 0 : it->second;
  };
  // (K / K_cal)^exponent for a reduction of length K calibrated at K_cal; 1 where K is not longer.
  const auto scale = [&](int64_t k, int64_t k_cal) {
    if (k_cal <= 0 || k <= k_cal) return 1.0;
    return std::pow(static_cast<double>(k) / static_cast<double>(k_cal), c.exponent);
  };
  const double attn = scale(size(dim_letter::H) * size(dim_letter::Dh), c.attn_width);
  const double ffn = scale(size(dim_letter::F), c.n_ff);
  switch (kind_reduction(base)) {
    case KindReduction::n_embd: return scale(size(dim_letter::D), c.n_embd);
    case KindReduction::attn_width: return attn;
    case KindReduction::ffn: return ffn;
    case KindReduction::expert_ffn: return scale(size(dim_letter::Fe), c.n_ff);  // one expert's FFN, as ffn_out's
    case KindReduction::residual: return std::max(attn, ffn);  // every attention and FFN output before it
    case KindReduction::none: break;
  }
  return 1.0;
}

std::vector<BoundCheck> check_bounds(const TensorMetrics& m, const ToleranceRule& rule, int64_t positions,
                                     double length_scale) {
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
  // The rel L2 bounds grow with the positions the step reaches (rel_l2_per_position): an f32 RoPE
  // angle, pos times a rounded frequency, is off by an amount proportional to pos.
  const double grow = rule.rel_l2_per_position.value_or(0.0) * static_cast<double>(std::max<int64_t>(positions, 0));
  const auto grown = [&](const std::optional<double>& limit) {
    return limit ? std::optional<double>((*limit + grow) * length_scale) : std::nullopt;
  };
  upper("rel_l2", "max_rel_l2", m.rel_l2, grown(rule.max_rel_l2));
  upper("nmse", "max_nmse", m.nmse, rule.max_nmse);
  lower("cosine", "min_cosine", m.cosine, rule.min_cosine);
  lower("sqnr_db", "min_sqnr_db", m.sqnr_db, rule.min_sqnr_db);
  upper("fail_frac", "max_fail_frac", m.fail_frac, rule.max_fail_frac);
  if (m.row.extent > 0) upper("row_rel_l2", "max_row_rel_l2", m.row.rel_l2, grown(rule.max_row_rel_l2));
  if (m.head.extent > 0) upper("head_rel_l2", "max_head_rel_l2", m.head.rel_l2, grown(rule.max_head_rel_l2));
  if (m.logits) {
    lower("top1", "min_top1", m.logits->top1, rule.min_top1);
    lower("top5_overlap", "min_top5", m.logits->top5_overlap, rule.min_top5);
    upper("kl_max", "max_kl", m.logits->kl_max,
          rule.max_kl ? std::optional<double>(*rule.max_kl * length_scale * length_scale) : std::nullopt);
  }
  return out;
}

}  // namespace diffrun::diff
