// Dequantization checked bit for bit against vectors the gguf package produced (scripts/gen_dequant_vectors.py).
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/dequant.hpp"
#include "model/error.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

std::string data_dir() { return test::source_dir() + "/tests/data/dequant"; }

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename T>
std::vector<T> read_array(const std::string& path) {
  std::vector<uint8_t> b = read_bytes(path);
  std::vector<T> out(b.size() / sizeof(T));
  std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
  return out;
}

nlohmann::json manifest() {
  std::ifstream in(data_dir() + "/manifest.json");
  if (!in) throw std::runtime_error("cannot read " + data_dir() + "/manifest.json");
  return nlohmann::json::parse(in);
}

// Conversions (F32, F16, BF16) must keep every bit, NaN payloads included. Arithmetic formats produce
// NaN from inf*0 or NaN scales, whose payload depends on operand order only: there, NaN must meet NaN.
bool same_value(float got, float want, bool nan_payload_matters) {
  if (std::isnan(want) && !nan_payload_matters) return std::isnan(got);
  return std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want);
}

class DequantVectors : public ::testing::TestWithParam<std::string> {};

TEST_P(DequantVectors, MatchesGgufPackageBitForBit) {
  const nlohmann::json m = manifest();
  nlohmann::json entry;
  for (const auto& e : m["formats"])
    if (e["format"] == GetParam()) entry = e;
  ASSERT_FALSE(entry.is_null()) << "format " << GetParam() << " missing from the manifest";
  const auto type = static_cast<GgmlType>(entry["ggml_type"].get<uint32_t>());
  const int64_t n = entry["n_elements"].get<int64_t>();
  ASSERT_STREQ(ggml_type_name(type), GetParam().c_str());
  ASSERT_TRUE(dequant_supported(type));

  const std::vector<uint8_t> blocks = read_bytes(data_dir() + "/" + GetParam() + ".blocks");
  const std::vector<float> want = read_array<float>(data_dir() + "/" + GetParam() + ".f32");
  ASSERT_EQ(static_cast<int64_t>(want.size()), n);
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), n / ggml_block_elements(type) * ggml_block_bytes(type));

  std::vector<float> got(n);
  std::vector<double> got64(n);
  dequantize(type, blocks.data(), got.data(), n);
  dequantize(type, blocks.data(), got64.data(), n);
  const bool conversion = type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16;
  int64_t mismatches = 0, special = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(want[i]) || want[i] == 0.0f) ++special;
    if (!same_value(got[i], want[i], conversion)) {
      if (++mismatches <= 5)
        ADD_FAILURE() << GetParam() << " element " << i << " (block " << i / ggml_block_elements(type)
                      << "): got " << got[i] << " (0x" << std::hex << std::bit_cast<uint32_t>(got[i])
                      << "), want " << want[i] << " (0x" << std::bit_cast<uint32_t>(want[i]) << std::dec << ")";
    }
    // The f64 path is the f32 value widened, exactly.
    const double widened = static_cast<double>(got[i]);
    if (std::isnan(widened) ? !std::isnan(got64[i]) : std::bit_cast<uint64_t>(widened) != std::bit_cast<uint64_t>(got64[i])) {
      if (++mismatches <= 5) ADD_FAILURE() << GetParam() << " f64 element " << i << " is not the f32 value widened";
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(special, 0) << "the vectors should include zeros, infinities or NaNs";
}

INSTANTIATE_TEST_SUITE_P(AllFormats, DequantVectors,
                         ::testing::Values("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                                           "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(Dequant, ManifestCoversEverySupportedFormat) {
  const nlohmann::json m = manifest();
  int n = 0;
  for (const auto& e : m["formats"]) {
    EXPECT_TRUE(dequant_supported(static_cast<GgmlType>(e["ggml_type"].get<uint32_t>()))) << e["format"];
    ++n;
  }
  EXPECT_EQ(n, 13);
}

TEST(Dequant, HalfConversionsKeepSubnormalsAndNegativeZero) {
  EXPECT_EQ(std::bit_cast<uint32_t>(f16_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>(bf16_to_f32(0x8001)), 0x80010000u);
}

TEST(Dequant, F32ToF16MatchesNumpyRounding) {
  const std::vector<float> in = read_array<float>(data_dir() + "/f32_to_f16.in");
  const std::vector<uint16_t> want = read_array<uint16_t>(data_dir() + "/f32_to_f16.out");
  ASSERT_EQ(in.size(), want.size());
  ASSERT_GT(in.size(), 1000u);
  int mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t got = f32_to_f16(in[i]);
    if (got != want[i] && ++mismatches <= 5)
      ADD_FAILURE() << "f32_to_f16(" << in[i] << " = 0x" << std::hex << std::bit_cast<uint32_t>(in[i]) << ") = 0x"
                    << got << ", numpy says 0x" << want[i] << std::dec;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Dequant, F32ToF16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f)))) << h;
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(Dequant, RejectsUnsupportedTypeAndPartialBlocks) {
  std::vector<uint8_t> src(1024);
  std::vector<float> dst(1024);
  EXPECT_THROW(dequantize(GgmlType::IQ2_XXS, src.data(), dst.data(), 256), ModelError);
  EXPECT_THROW(dequantize(GgmlType::Q4_0, src.data(), dst.data(), 31), ModelError);
  EXPECT_FALSE(dequant_supported(GgmlType::Q8_K));
  EXPECT_FALSE(dequant_supported(GgmlType::I32));
  try {
    dequantize(GgmlType::IQ4_XS, src.data(), dst.data(), 256);
    FAIL() << "no error";
  } catch (const ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("IQ4_XS"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace diffrun
