// The dump format as data: python/diffrun/dump_schema.json, embedded at build time (checkpoints/CMakeLists.txt)
// and parsed once. Its root and dataset attributes, dimension letters, architectures and checkpoint kinds are the
// ones every C++ reader, writer and validator uses; the Python package reads the same file.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoints/dump_schema_names.hpp"  // generated from the schema (checkpoints/CMakeLists.txt)
#include "model/config.hpp"

namespace diffrun {

// How a root attribute is stored (docs/dump-format.md, "Types").
enum class AttrType { string, integer, real, boolean, int_array };
const char* attr_type_name(AttrType t);  // "string", "integer", "real", "boolean", "integer array"

// One attribute the format defines: a root attribute, or a dataset attribute (a column of a step's table).
struct RootAttribute {
  std::string name;
  AttrType type = AttrType::string;
  bool required = false;
  std::vector<std::string> values;  // the allowed strings of an enum string; empty: any
  bool config = false;              // part of the model config (`arch` .. `qk_norm`)
  bool shard = false;               // says where a rank dump's data lie (rank, world_size; split, shard_offset, partial)
  int64_t max = 0;                  // > 0: the largest value readers accept
  std::string max_why;              // said with a value over max
  bool positive = false;            // a real that must be > 0
  std::string divides;              // an integer that must divide this other attribute
  bool ids = false;                 // token ids, within 0..n_vocab-1
  std::string nonempty;             // why it must not be empty; "": it may
  std::string fill;                 // what a writer puts there (validate --skeleton)
  std::string skeleton;             // where validate --skeleton takes its value: "format", "format version",
                                    // "model path", "model fingerprint"; "" (config attributes aside): filled
};

// One dimension letter of a layout: T and S are the step's (tokens, cache length), the others a config attribute's.
struct DimLetter {
  std::string letter;
  std::string what;
  std::string attribute;  // "n_embd"; "" for T and S
  bool heads = false;     // H, Hkv: a head axis
  bool head_dim = false;  // Dh
};

// One kind of checkpoint (checkpoints/vocabulary.hpp, CheckpointKind).
struct SchemaKind {
  std::string base, layout, what, inputs;
  std::string needs;  // the feature it exists for: "", "qk_norm", "ffn_act=silu"
  bool per_layer = false;
  bool read_back = true;
};

struct DumpSchema {
  std::string format;
  int format_version = 0;
  int oldest_format_version = 0;
  std::map<std::string, std::string> expected;  // attribute type name -> what a validator says it expected
  std::map<std::string, std::string> skeleton_type;  // attribute type name -> the type validate --skeleton prints
  std::vector<DimLetter> dims;
  nlohmann::ordered_json features;  // [{name, values?, attribute?, absent?}]
  nlohmann::ordered_json archs;     // [{name, <feature>: value, ...}]
  std::vector<RootAttribute> root;
  std::vector<RootAttribute> dataset;
  std::vector<SchemaKind> kinds;
};

// The embedded schema, parsed on first use.
const DumpSchema& dump_schema();
// The JSON text as embedded.
std::string_view dump_schema_text();

const DimLetter* find_dim(std::string_view letter);  // nullptr for a letter the format does not define
const std::string& token_rows_dim();  // "T"
const std::string& cache_rows_dim();  // "S"
const RootAttribute& dataset_attribute(std::string_view name);  // throws std::out_of_range for an unknown one

// The model config as its root attributes ({"arch": "llama", "n_layer": 2, ...}, the schema's config attributes in
// its order), and back: the one place that ties ModelConfig's fields to the format's names.
nlohmann::ordered_json config_attributes(const ModelConfig& cfg);
// From every config attribute (arch and rope_type already known to be allowed values). The features the
// attributes do not carry (post-norms, FFN activation, ...) are the architecture's (set_arch_features).
ModelConfig config_from_attributes(const nlohmann::json& values);
// The features of a config as the schema names them ({"rope_type": "neox", "qk_norm": true, ...}).
nlohmann::json config_features(const ModelConfig& cfg);
// Whether a kind's `needs` holds for these features.
bool needs_met(std::string_view needs, const nlohmann::json& features);

// The size of one layout letter (T: n_tokens, S: n_kv, passed through as given); throws InputError for a letter
// the format does not define.
int64_t dim_size(const ModelConfig& cfg, const std::string& letter, int64_t n_tokens, int64_t n_kv);
// The sizes of the layout letters for a config and a step's T and S (each left out when < 0).
std::map<std::string, int64_t> dim_sizes(const ModelConfig& cfg, int64_t n_tokens, int64_t n_kv);

}  // namespace diffrun
