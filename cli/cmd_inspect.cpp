// `diffrun inspect MODEL.gguf`: metadata, the derived ModelConfig and the tensor table with totals.
#include <map>
#include <string>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "cli/command.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace diffrun::cli {
namespace {

std::string human_bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(b) / (1 << 30));
  if (b >= (uint64_t{1} << 20)) return fmt::format("{:.2f} MiB", static_cast<double>(b) / (1 << 20));
  if (b >= (uint64_t{1} << 10)) return fmt::format("{:.2f} KiB", static_cast<double>(b) / (1 << 10));
  return fmt::format("{} B", b);
}

int run_inspect(const std::string& path, size_t max_items) {
  auto file = GgufFile::open(path);
  fmt::print("file: {}\n", file->path());
  fmt::print("GGUF v{}, {} bytes, alignment {}, data at byte {}, fingerprint {}\n\n", file->version(),
             file->file_size(), file->alignment(), file->data_offset(), file->fingerprint());

  fmt::print("metadata ({} keys):\n", file->metadata().size());
  for (const GgufKv& kv : file->metadata()) fmt::print("  {} = {}\n", kv.key, kv.value.to_display(max_items));

  fmt::print("\nconfig:\n");
  int rc = 0;
  try {
    ModelConfig cfg = config_from_gguf(*file);
    fmt::print("  {}\n", describe(cfg));
    validate_tensors(*file, cfg);
    fmt::print("  all {} expected tensors present, dequantizable, with the expected shapes\n",
               expected_tensors(cfg).size());
  } catch (const ModelError& e) {
    fmt::print("  not runnable: {}\n", e.what());
    fmt::print(stderr, "diffrun: error: {}\n", e.what());
    rc = 2;
  }

  size_t name_w = 4;
  for (const TensorInfo& t : file->tensors()) name_w = std::max(name_w, t.name.size());
  fmt::print("\ntensors ({}):\n", file->tensors().size());
  fmt::print("  {:<{}}  {:<7}  {:<22}  {:>12}\n", "name", name_w, "dtype", "dims (ne[0] first)", "bytes");
  uint64_t total_bytes = 0;
  int64_t total_elements = 0;
  std::map<std::string, int> per_type;
  for (const TensorInfo& t : file->tensors()) {
    fmt::print("  {:<{}}  {:<7}  {:<22}  {:>12}\n", t.name, name_w, ggml_type_name(t.type),
               fmt::format("[{}]", fmt::join(t.ne, ", ")), t.n_bytes);
    total_bytes += t.n_bytes;
    total_elements += t.n_elements;
    ++per_type[ggml_type_name(t.type)];
  }
  std::string types;
  for (const auto& [name, count] : per_type) types += fmt::format("{}{} {}", types.empty() ? "" : ", ", count, name);
  fmt::print("total: {} tensors ({}), {} elements, {} bytes ({})\n", file->tensors().size(), types, total_elements,
             total_bytes, human_bytes(total_bytes));
  return rc;
}

const CommandRegistrar registrar{
    "inspect", "Print a GGUF file's metadata, model config and tensor table",
    [](CLI::App& sub) -> std::function<int()> {
      auto path = std::make_shared<std::string>(default_model_path());
      auto max_items = std::make_shared<size_t>(8);
      sub.add_option("model", *path, "GGUF file (default: the SmolLM2 model in the models cache)");
      sub.add_option("--max-items", *max_items, "array items shown before abbreviating")->capture_default_str();
      return [path, max_items] { return run_inspect(*path, *max_items); };
    }};

}  // namespace
}  // namespace diffrun::cli
