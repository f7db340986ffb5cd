// Name maps: foreign checkpoint names (llama.cpp graph nodes, Hugging Face modules) to the vocabulary's.
//
// A map is JSON data (format in fixtures/names/README.md); the maps of fixtures/names/*.json are
// compiled in and chosen by name (`--names llamacpp`), any other spec is a file path. The reader
// (DumpReader) applies a map to every dataset of a dump: rename, drop, or rename and reshape
// (a layout naming the stored dimensions, a transpose of the last two, a crop to the step's extent).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"

namespace diffrun {

struct NameRule {
  std::string match;       // foreign name, "{L}" standing for the layer index ("model.layers.{L}.mlp.up_proj"),
                           // or a glob with * and ? ("* (view)")
  std::string occurrence;  // "" any; "1", "2", ...: the k-th repeat (suffix "#k", none for 1); "last", "last-1", ...
  std::vector<std::string> archs;  // empty: every architecture
  std::map<std::string, std::string> when;  // root string attributes (backend facts) the dump must have
  bool drop = false;       // not compared (no vocabulary equivalent)
  std::string to;          // vocabulary name, "{L}" replaced by the layer ("Qrope-{L}")
  std::string layout;      // the stored dimensions, e.g. "S,Hkv*Dh" ('*' joins dims merged into one); "" = the vocabulary's
  bool transpose = false;  // the stored bytes are the transpose of the stored shape's last two dims
  std::vector<std::string> crop;  // dimension letters cut to the step's extent (llama.cpp pads S)
  std::string why;         // one line: what the foreign node is
};

// What a rule does to one dataset.
struct NameMapping {
  bool drop = false;
  std::string name;  // the vocabulary name (empty when dropped)
  const NameRule* rule = nullptr;
};

class NameMap {
 public:
  // `spec`: the name of a built-in map ("llamacpp", "hf") or a JSON file. Throws InputError naming
  // the map (and the rule) for bad JSON, unknown keys, a rule without `to` or `drop`.
  static NameMap load(const std::string& spec);
  static NameMap parse(std::string_view json, const std::string& source);
  static std::vector<std::string> builtin_names();

  const std::string& source() const { return source_; }
  const std::vector<NameRule>& rules() const { return rules_; }

  // The first rule matching `base` (a dataset name without its "#k" suffix) at repeat `occurrence`
  // (1 = unsuffixed) of `count` repeats in the step, for `arch` and the dump's backend `facts`;
  // nullopt when none does.
  std::optional<NameMapping> map(std::string_view base, int occurrence, int count, Arch arch,
                                 const std::map<std::string, std::string>& facts = {}) const;

 private:
  std::string source_;
  std::vector<NameRule> rules_;
};

// "Qcur-0#3" -> {"Qcur-0", 3}; a name without a valid "#k" suffix (k >= 2) -> {name, 1}.
std::pair<std::string, int> split_occurrence(std::string_view name);

}  // namespace diffrun
