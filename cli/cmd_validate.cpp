// `diffrun validate DUMP` lists every way a dump departs from docs/dump-format.md; `--skeleton MODEL.gguf` prints what a valid one holds.
// `diffrun validate DIR`: a tensor-parallel run's rank dumps, each dump, then the set as compare merges it.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "checkpoints/name_map.hpp"
#include "checkpoints/vocabulary.hpp"
#include "cli/command.hpp"
#include "cli/terminal.hpp"
#include "dump/dump.hpp"
#include "dump/dump_format.hpp"
#include "dump/dump_validate.hpp"
#include "dump/shards.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace diffrun::cli {
namespace {

struct ValidateCommand {
  std::string dump;
  std::string skeleton;  // a GGUF model
  std::string names;     // a name map for foreign names
  bool json = false;
};

int run_validate(const ValidateCommand& o);

// A directory of rank dumps (docs/dump-format.md, "Shards"): each dump as run_validate checks one, then, when every
// one is valid, the set as `diffrun compare DIR REF.h5` merges it (every rank once, one world size, the same model,
// steps, tokens and checkpoints, slices that tile each dimension). Exit 1 when a dump or the set has a problem.
int run_validate_set(const ValidateCommand& o) {
  if (o.json) throw InputError("validate --json takes one dump; check a directory of rank dumps without --json");
  const std::vector<std::string> paths = dump_set_paths({o.dump});
  if (paths.size() == 1 && paths[0] == o.dump) throw InputError(o.dump + ": a directory without .h5 dumps");
  int rc = 0;
  for (const std::string& p : paths) {
    ValidateCommand one = o;
    one.dump = p;
    rc = std::max(rc, run_validate(one));
  }
  if (rc != 0) {
    fmt::print("{}: the rank set is not checked until each dump is valid\n", printable(o.dump, 400, 0));
    return rc;
  }
  try {
    const std::unique_ptr<DumpReader> merged = open_dump_set(paths);
    fmt::print("{}: {} dump{} that compare reads as one\n", printable(o.dump, 400, 0), paths.size(),
               paths.size() == 1 ? "" : "s");
  } catch (const InputError& e) {
    fmt::print("{}: rank set: {}\n", printable(o.dump, 400, 0), terminal_safe(e.what()));
    return 1;
  }
  return 0;
}

int run_validate(const ValidateCommand& o) {
  if (std::filesystem::is_directory(o.dump)) return run_validate_set(o);
  ValidateOptions vopt;
  std::optional<NameMap> map;
  if (!o.names.empty()) {
    map = NameMap::load(o.names);
    vopt.mapped = [&map](const ForeignName& f) {
      if (!f.config) return false;
      const auto [base, k] = split_occurrence(f.name);
      int repeats = 0;
      for (const auto& n : f.step_names) {
        const auto [b, kk] = split_occurrence(n);
        if (b == base) repeats = std::max(repeats, kk);
      }
      return map->map(base, k, repeats, f.config->arch, f.facts).has_value();
    };
  }
  ValidateResult r = validate_dump(o.dump, vopt);
  if (map && r.problems.empty()) {
    // The mapped datasets, as compare sees them: the reader applies the map's renames and
    // reshapes, then each is checked against the vocabulary like a dataset stored under its name.
    try {
      const DumpReader reader(o.dump, &*map);
      const ModelConfig& cfg = reader.meta().config;
      int64_t n_kv = 0;
      for (int step : reader.steps()) {
        const int64_t n_tokens = static_cast<int64_t>(reader.read_ids(step, "tokens").size());
        n_kv += n_tokens;
        for (const DatasetInfo& d : reader.datasets(step)) {
          if (d.is_int) continue;
          const std::string p =
              check_checkpoint(cfg, d.name, parse_checkpoint_name(d.name).layer, d.shape, "", n_tokens, n_kv);
          if (!p.empty())
            r.problems.push_back({dump_step_group_name(step) + "/" + d.source + " (mapped to " + d.name + ")", p});
        }
      }
    } catch (const Error& e) {
      r.problems.push_back({"name map " + map->source(), e.what()});
    }
  }
  if (o.json) {
    nlohmann::ordered_json problems = nlohmann::ordered_json::array();
    for (const auto& p : r.problems) problems.push_back({{"where", p.where}, {"what", p.what}});
    nlohmann::ordered_json doc = {{"path", o.dump},
                                  {"valid", r.problems.empty()},
                                  {"steps", r.n_steps},
                                  {"datasets", r.n_datasets},
                                  {"problems", problems}};
    nlohmann::ordered_json warnings = nlohmann::ordered_json::array();
    for (const auto& w : r.warnings) warnings.push_back({{"where", w.where}, {"what", w.what}});
    doc["warnings"] = warnings;
    // Invalid UTF-8 from the dump is replaced, not an exception.
    fmt::print("{}\n", doc.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  } else {
    for (const auto& p : r.problems)
      fmt::print("{}: {}: {}\n", printable(o.dump, 400, 0), terminal_safe(printable(p.where, 300, 0)), terminal_safe(p.what));
    for (const auto& w : r.warnings)
      fmt::print("{}: {}: warning: {}\n", printable(o.dump, 400, 0), terminal_safe(printable(w.where, 300, 0)),
                 terminal_safe(w.what));
    if (r.problems.empty())
      fmt::print("{}: valid diffrun dump ({} steps, {} datasets)\n", o.dump, r.n_steps, r.n_datasets);
    else
      fmt::print("{}: {} problem{}\n", o.dump, r.problems.size(), r.problems.size() == 1 ? "" : "s");
  }
  return r.problems.empty() ? 0 : 1;
}

// One root attribute of the skeleton: its value for this model, or null where the writer fills it in.
nlohmann::ordered_json root_value(const RootAttribute& a, const ModelConfig& c, const GgufFile& file) {
  if (a.config) return config_attributes(c).at(a.name);
  if (a.skeleton == "format") return kDumpFormat;
  if (a.skeleton == "format version") return kDumpFormatVersion;
  if (a.skeleton == "model path") return file.path();
  if (a.skeleton == "model fingerprint") return file.fingerprint();
  return nullptr;
}

int run_skeleton(const ValidateCommand& o) {
  const auto file = GgufFile::open(o.skeleton);
  const ModelConfig cfg = config_from_gguf(*file);
  nlohmann::ordered_json attrs = nlohmann::ordered_json::array();
  const nlohmann::ordered_json config = config_attributes(cfg);
  for (const RootAttribute& a : root_attributes()) {
    if (a.config && !config.contains(a.name)) continue;  // an expert size of a dense model: not written
    if (a.shard) continue;  // a rank dump's (docs/dump-format.md, "Shards"); the skeleton is a whole dump's
    nlohmann::ordered_json e = {{"name", a.name},
                                {"type", dump_schema().skeleton_type.at(attr_type_name(a.type))},
                                {"required", a.required},
                                {"value", root_value(a, cfg, *file)}};
    if (e["value"].is_null()) e["fill"] = a.fill;
    attrs.push_back(e);
  }
  nlohmann::ordered_json datasets = nlohmann::ordered_json::array();
  for (const std::string& name : checkpoint_names(cfg)) {
    const ParsedCheckpointName p = parse_checkpoint_name(name);
    const CheckpointKind& k = *find_checkpoint_kind(p.base);
    const std::vector<int64_t> sizes = checkpoint_shape(cfg, k, -1, -2);  // T, S as markers
    nlohmann::ordered_json shape = nlohmann::ordered_json::array();
    for (int64_t d : sizes) {
      if (d == -1) shape.push_back(token_rows_dim());
      else if (d == -2) shape.push_back(cache_rows_dim());
      else shape.push_back(d);
    }
    datasets.push_back({{"name", name},
                        {column::order, checkpoint_order(cfg, p.base, p.layer)},
                        {column::layer, p.layer},
                        {column::layout, k.layout},
                        {"shape", shape},
                        {column::dtype, p.base == kTokensCheckpoint ? "int32" : "float32"}});
  }
  if (o.json) {
    nlohmann::ordered_json doc = {{attr::format, kDumpFormat},
                                  {attr::format_version, kDumpFormatVersion},
                                  {"root_attributes", attrs},
                                  {"step_group", "step_NNNN"},
                                  {"datasets", datasets}};
    fmt::print("{}\n", doc.dump(2));
    return 0;
  }
  fmt::print("# A minimal valid diffrun dump of {} (docs/dump-format.md)\n", o.skeleton);
  fmt::print("# root attributes\n");
  for (const auto& e : attrs) {
    const std::string value = e["value"].is_null() ? "<" + e["fill"].get<std::string>() + ">" : e["value"].dump();
    fmt::print("{:<18} {:<8} {:<9} {}\n", e["name"].get<std::string>(), e["type"].get<std::string>(),
               e["required"].get<bool>() ? "required" : "optional", value);
  }
  fmt::print("# datasets of each group /step_NNNN (T = tokens fed in the step, S = positions after it)\n");
  for (const auto& d : datasets) {
    std::string shape = "[";
    for (size_t i = 0; i < d["shape"].size(); ++i)
      shape += (i ? ", " : "") + (d["shape"][i].is_string() ? d["shape"][i].get<std::string>() : d["shape"][i].dump());
    shape += "]";
    fmt::print("{:<5} {:<18} {:<8} {:<16} {}\n", d[column::order].get<int>(), d["name"].get<std::string>(),
               d[column::dtype].get<std::string>(), shape, d[column::layout].get<std::string>());
  }
  return 0;
}

const CommandRegistrar reg("validate", "Check a dump against the format (every problem at once), or print a model's skeleton",
                           [](CLI::App& app) {
                             auto o = std::make_shared<ValidateCommand>();
                             app.add_option("dump", o->dump,
                                            "Dump file (HDF5) to check, or a directory of a tensor-parallel "
                                            "run's rank dumps (each, then the set)");
                             app.add_option("--skeleton", o->skeleton,
                                            "Print the root attributes and datasets a dump of this GGUF model holds");
                             app.add_option("--names", o->names,
                                            "Name map for foreign names: llamacpp, hf or a JSON file "
                                            "(fixtures/names/README.md)");
                             app.add_flag("--json", o->json, "As JSON");
                             return [o] {
                               if (o->dump.empty() == o->skeleton.empty())
                                 throw InputError("validate: give a DUMP to check, or --skeleton MODEL.gguf");
                               return o->skeleton.empty() ? run_validate(*o) : run_skeleton(*o);
                             };
                           });

}  // namespace
}  // namespace diffrun::cli
