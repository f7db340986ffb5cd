// The dump schema (python/diffrun/dump_schema.json, embedded) against what C++ still spells itself: the format's
// constants, the architectures and the flags model/ sets for each, the dtype names, the attribute table's columns,
// and ModelConfig's fields under the config attributes' names.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoints/dump_schema.hpp"
#include "checkpoints/vocabulary.hpp"
#include "dump/dump_format.hpp"

namespace diffrun {
namespace {

TEST(DumpSchema, FormatConstantsAreTheSchemas) {
  const DumpSchema& s = dump_schema();
  EXPECT_EQ(s.format, kDumpFormat);
  EXPECT_EQ(s.format_version, kDumpFormatVersion);
  EXPECT_EQ(s.oldest_format_version, kDumpFormatOldestVersion);
  const auto doc = nlohmann::json::parse(dump_schema_text());
  EXPECT_EQ(doc.at("attribute_table").get<std::string>(), kAttributeTable);
}

TEST(DumpSchema, ArchitecturesAndTheirFeaturesAreModelsOwn) {
  const DumpSchema& s = dump_schema();
  ASSERT_EQ(s.archs.size(), all_archs().size());
  for (size_t i = 0; i < all_archs().size(); ++i) {
    const nlohmann::json& a = s.archs[i];
    EXPECT_EQ(a.at("name").get<std::string>(), arch_name(all_archs()[i]));
    ModelConfig c;
    c.arch = all_archs()[i];
    set_arch_features(c);
    const nlohmann::json features = config_features(c);
    for (const auto& f : s.features) {
      const std::string name = f.at("name").get<std::string>();
      EXPECT_EQ(a.at(name), features.at(name)) << arch_name(c.arch) << " " << name;
      if (f.contains("values")) {
        const auto values = f.at("values").get<std::vector<std::string>>();
        EXPECT_NE(std::find(values.begin(), values.end(), features.at(name).get<std::string>()), values.end()) << name;
      }
    }
    EXPECT_EQ(features.size(), s.features.size());
  }
}

TEST(DumpSchema, KindsApplyWhereTheirNeedsAreMet) {
  for (const SchemaKind& k : dump_schema().kinds) {
    const CheckpointKind* kind = find_checkpoint_kind(k.base);
    ASSERT_NE(kind, nullptr) << k.base;
    for (Arch a : all_archs()) {
      ModelConfig c;
      c.arch = a;
      set_arch_features(c);
      EXPECT_EQ(kind_applies(*kind, c), needs_met(k.needs, config_features(c))) << k.base << " " << arch_name(a);
    }
    for (const auto& letter : layout_dims(k.layout)) EXPECT_NE(find_dim(letter), nullptr) << k.base << " " << letter;
  }
}

TEST(DumpSchema, DtypeNamesAreTheNativeDtypeValues) {
  const std::vector<std::string>& values = dataset_attribute("native_dtype").values;
  std::set<std::string> native, stored;
  for (NativeDType d : {NativeDType::f16, NativeDType::bf16, NativeDType::f32, NativeDType::f64, NativeDType::i32})
    native.insert(native_dtype_name(d));
  for (StoredDType d : {StoredDType::f16, StoredDType::bf16, StoredDType::f32, StoredDType::f64, StoredDType::i32})
    stored.insert(stored_dtype_name(d));
  EXPECT_EQ(native, std::set<std::string>(values.begin(), values.end()));
  EXPECT_EQ(stored, native);
  EXPECT_EQ(dataset_attribute("dtype").values, std::vector<std::string>{stored_dtype_name(StoredDType::bf16)});
}

TEST(DumpSchema, ConfigAttributesRoundTripEveryField) {
  ModelConfig c;
  c.arch = all_archs().back();
  set_arch_features(c);
  c.n_layer = 3, c.n_embd = 64, c.n_head = 4, c.n_head_kv = 2, c.head_dim = 16, c.n_ff = 96, c.n_vocab = 300;
  c.n_ctx = 512, c.rope_theta = 12345.0, c.rms_eps = 1e-5, c.tied_output = true, c.qkv_bias = true, c.qk_norm = false;
  c.n_expert = 8, c.n_expert_used = 2, c.n_ff_exp = 32;  // qwen3moe (the last architecture) has experts
  const nlohmann::ordered_json attrs = config_attributes(c);
  std::vector<std::string> names, config;
  for (const auto& [name, value] : attrs.items()) names.push_back(name);
  for (const RootAttribute& a : root_attributes())
    if (a.config) config.push_back(a.name);
  EXPECT_EQ(names, config);
  const ModelConfig back = config_from_attributes(attrs);
  EXPECT_EQ(config_attributes(back), attrs);
  EXPECT_EQ(config_features(back), config_features(c));
  // Every letter of a layout that is not the step's is a config attribute's size.
  const auto sizes = dim_sizes(c, 5, 7);
  for (const DimLetter& d : dump_schema().dims) {
    ASSERT_TRUE(sizes.count(d.letter)) << d.letter;
    if (!d.attribute.empty()) {
      EXPECT_EQ(sizes.at(d.letter), attrs.at(d.attribute).get<int64_t>()) << d.letter;
    }
  }
  EXPECT_EQ(sizes.at(token_rows_dim()), 5);
  EXPECT_EQ(sizes.at(cache_rows_dim()), 7);
}

// The experts' sizes are optional config attributes: a dense model writes none of them and reads back as dense.
TEST(DumpSchema, DenseConfigsHaveNoExpertAttributes) {
  ModelConfig c;
  c.arch = Arch::llama;
  set_arch_features(c);
  c.n_layer = 3, c.n_embd = 64, c.n_head = 4, c.n_head_kv = 2, c.head_dim = 16, c.n_ff = 96, c.n_vocab = 300;
  c.n_ctx = 512;
  const nlohmann::ordered_json attrs = config_attributes(c);
  for (const RootAttribute& a : root_attributes()) {
    if (a.config) {
      EXPECT_EQ(attrs.contains(a.name), a.required) << a.name;
    }
  }
  const ModelConfig back = config_from_attributes(attrs);
  EXPECT_FALSE(back.moe);
  EXPECT_EQ(back.n_expert, 0);
  EXPECT_EQ(config_features(back)["moe"], false);
  // Mixtral: llama with experts, told apart by n_expert alone.
  c.n_expert = 4, c.n_expert_used = 2, c.n_ff_exp = 96;
  EXPECT_TRUE(config_from_attributes(config_attributes(c)).moe);
  EXPECT_TRUE(needs_met("ffn_act=silu&!moe", config_features(back)));
  EXPECT_FALSE(needs_met("moe", config_features(back)));
}

TEST(DumpSchema, TheAttributeTableHasTheSchemasColumns) {
  const std::string path = (std::filesystem::temp_directory_path() / "diffrun_test_dump_schema.h5").string();
  std::vector<std::string> columns;
  {
    DumpFile f(path);
    const float x[2] = {1, 2};
    const int64_t shape[1] = {2};
    DatasetAttributes a;
    a.order = 1, a.layer = 0, a.layout = "T", a.native_dtype = "f32", a.row_offset = 0;
    f.write(0, "x", StoredDType::bf16, shape, x, a);
    f.finish();
  }
  {
    h5::Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    h5::Hid ds(H5Dopen2(file.get(), (dump_step_group_name(0) + "/" + kAttributeTable).c_str(), H5P_DEFAULT), H5Dclose);
    h5::Hid t(H5Dget_type(ds.get()), H5Tclose);
    for (int i = 0; i < H5Tget_nmembers(t.get()); ++i) {
      char* n = H5Tget_member_name(t.get(), static_cast<unsigned>(i));
      columns.emplace_back(n);
      H5free_memory(n);
    }
  }
  std::filesystem::remove(path);
  std::set<std::string> want = {"name"};
  for (const RootAttribute& a : dump_schema().dataset) want.insert(a.name);
  EXPECT_EQ(std::set<std::string>(columns.begin(), columns.end()), want);
}

}  // namespace
}  // namespace diffrun
