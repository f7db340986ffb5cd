// The CPU reference (f64) against goldens from Hugging Face transformers (tests/data/reference/*.json, written by
// scripts/compare_transformers.py --write-goldens): top-5 logits, per-layer l_out, result_norm at a few positions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoints/sink.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/reference.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;
constexpr double kRel = 1e-3;

// Keeps l_out-*, result_norm and result_output of step 0.
class OutputsSink final : public Sink {
 public:
  bool wants(std::string_view name) const override {
    return name.starts_with("l_out-") || name == "result_norm" || name == "result_output";
  }
  void record(int, std::string_view name, int, std::string_view, std::span<const int64_t> shape, NativeDType,
              std::span<const float> data) override {
    values[std::string(name)] = {data.begin(), data.end()};
    widths[std::string(name)] = shape.back();
  }
  void record_ids(int, std::string_view, std::span<const int32_t>) override {}
  // Row `pos` of a recorded [T, W] checkpoint.
  std::vector<double> row(const std::string& name, int pos) const {
    const auto& v = values.at(name);
    const int64_t w = widths.at(name);
    return {v.begin() + pos * w, v.begin() + (pos + 1) * w};
  }
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, int64_t> widths;
};

double norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

std::string model_path_for(const std::string& name) {
  if (name == fs::path(test::smollm2_path()).filename().string()) return test::smollm2_path();
  return test::fixture_path(name);
}

std::vector<fs::path> golden_files() {
  std::vector<fs::path> files;
  const fs::path dir = fs::path(test::source_dir()) / "tests/data/reference";
  if (!fs::is_directory(dir)) return files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".json") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

void check_golden(const fs::path& golden_path) {
  std::ifstream in(golden_path);
  const nlohmann::json g = nlohmann::json::parse(in);
  // A golden made on a slice (the first n_layer blocks of a larger file) runs those blocks of the full file.
  const nlohmann::json& source = g.contains("slice_of") ? g.at("slice_of") : g;
  const std::string model = model_path_for(source.at("model").get<std::string>());
  if (!fs::exists(model)) GTEST_SKIP() << golden_path.filename() << ": model " << model << " not present";
  auto file = GgufFile::open(model);
  ASSERT_EQ(file->fingerprint(), source.at("model_fingerprint").get<std::string>())
      << model << " is not the file the golden " << golden_path.filename() << " was made from";
  ModelConfig cfg = config_from_gguf(*file);
  const int n_layer = g.at("n_layer").get<int>();
  if (g.contains("slice_of")) {
    ASSERT_LE(n_layer, cfg.n_layer);
    cfg.n_layer = n_layer;
  }
  ASSERT_EQ(n_layer, cfg.n_layer);
  const std::vector<int32_t> ids = g.at("token_ids").get<std::vector<int32_t>>();

  // One prefill of every position gives, row for row, what the stepped run computed (causal attention).
  auto backend = make_cpu_backend(*file, cfg, "f64", static_cast<int>(ids.size()));
  OutputsSink sink;
  backend->forward(0, ids, sink);

  for (const auto& pos_entry : g.at("positions")) {
    const int p = pos_entry.at("position").get<int>();
    SCOPED_TRACE(golden_path.filename().string() + " position " + std::to_string(p));
    const std::vector<double> logits = sink.row("result_output", p);
    const auto top_ids = pos_entry.at("top5_ids").get<std::vector<int>>();
    const auto top_logits = pos_entry.at("top5_logits").get<std::vector<double>>();
    EXPECT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), top_ids[0]) << "top-1 differs";
    const double logit_scale = norm(logits) / std::sqrt(static_cast<double>(logits.size()));
    for (size_t i = 0; i < top_ids.size(); ++i) {
      EXPECT_NEAR(logits[top_ids[i]], top_logits[i], kRel * (std::abs(top_logits[i]) + logit_scale))
          << "logit of id " << top_ids[i];
    }
    const auto l_norms = pos_entry.at("l_out_norm").get<std::vector<double>>();
    const auto l_first = pos_entry.at("l_out_first").get<std::vector<std::vector<double>>>();
    for (int l = 0; l < cfg.n_layer; ++l) {
      const std::vector<double> row = sink.row("l_out-" + std::to_string(l), p);
      EXPECT_NEAR(norm(row), l_norms[l], kRel * l_norms[l]) << "l_out-" << l << " norm";
      const double scale = l_norms[l] / std::sqrt(static_cast<double>(row.size()));
      for (size_t i = 0; i < l_first[l].size(); ++i) {
        EXPECT_NEAR(row[i], l_first[l][i], kRel * (std::abs(l_first[l][i]) + scale)) << "l_out-" << l << "[" << i << "]";
      }
    }
    const std::vector<double> rn = sink.row("result_norm", p);
    const double rn_norm = pos_entry.at("result_norm_norm").get<double>();
    EXPECT_NEAR(norm(rn), rn_norm, kRel * rn_norm) << "result_norm norm";
    const auto rn_first = pos_entry.at("result_norm_first").get<std::vector<double>>();
    const double rn_scale = rn_norm / std::sqrt(static_cast<double>(rn.size()));
    for (size_t i = 0; i < rn_first.size(); ++i) {
      EXPECT_NEAR(rn[i], rn_first[i], kRel * (std::abs(rn_first[i]) + rn_scale)) << "result_norm[" << i << "]";
    }
  }
}

TEST(ReferenceGoldens, AgreeWithTransformers) {
  const std::vector<fs::path> files = golden_files();
  if (files.empty()) {
    GTEST_SKIP() << "no goldens in tests/data/reference yet: run scripts/compare_transformers.py --write-goldens "
                    "where torch and transformers are installed";
  }
  for (const fs::path& f : files) {
    SCOPED_TRACE(f.string());
    check_golden(f);
  }
}

}  // namespace
}  // namespace diffrun
