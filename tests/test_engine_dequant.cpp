// GPU test: device dequantization is bit-exact against model/dequant.cpp for every format (random blocks).
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include "engine/dequant.cuh"
#include "model/dequant.hpp"
#include "model/error.hpp"
#include "tests/test_engine_common.hpp"

namespace diffrun {
namespace {

using test::DeviceArray;

struct Format {
  GgmlType type;
  std::vector<int> half_fields;  // byte offsets of f16 scale fields inside a block
};

const std::vector<Format>& formats() {
  static const std::vector<Format> f = {
      {GgmlType::F32, {}},        {GgmlType::F16, {0}},        {GgmlType::BF16, {}},
      {GgmlType::Q4_0, {0}},      {GgmlType::Q4_1, {0, 2}},    {GgmlType::Q5_0, {0}},
      {GgmlType::Q5_1, {0, 2}},   {GgmlType::Q8_0, {0}},       {GgmlType::Q2_K, {80, 82}},
      {GgmlType::Q3_K, {108}},    {GgmlType::Q4_K, {0, 2}},    {GgmlType::Q5_K, {0, 2}},
      {GgmlType::Q6_K, {208}},
  };
  return f;
}

void put_u16(uint8_t* p, uint16_t v) {
  p[0] = v & 0xFF;
  p[1] = v >> 8;
}

// Random blocks whose f16 scales are finite (NaN payloads are not what this test is about), with
// -0, subnormal, smallest and largest halves forced into the first blocks' scales.
std::vector<uint8_t> random_blocks(const Format& f, int64_t nb, uint32_t seed) {
  const int64_t bb = ggml_block_bytes(f.type);
  std::vector<uint8_t> raw(nb * bb);
  std::mt19937 rng(seed);
  for (auto& b : raw) b = static_cast<uint8_t>(rng());
  const uint16_t specials[] = {0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x0000};
  if (f.type == GgmlType::F32) {
    for (int64_t i = 0; i < nb; ++i) {
      uint32_t v;
      std::memcpy(&v, &raw[4 * i], 4);
      if ((v & 0x7f800000u) == 0x7f800000u && (v & 0x7fffffu) != 0) v &= 0xff800000u;  // NaN → ±Inf
      std::memcpy(&raw[4 * i], &v, 4);
    }
    return raw;
  }
  if (f.type == GgmlType::BF16) {
    for (int64_t i = 0; i < nb; ++i) {
      uint16_t v = raw[2 * i] | (raw[2 * i + 1] << 8);
      if ((v & 0x7f80) == 0x7f80 && (v & 0x7f) != 0) v &= 0xff80;
      put_u16(&raw[2 * i], v);
    }
    return raw;
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int off : f.half_fields) {
      uint8_t* p = &raw[b * bb + off];
      uint16_t v = p[0] | (p[1] << 8);
      if ((v & 0x7C00) == 0x7C00) v &= 0xBFFF;  // exponent 31 (Inf/NaN) → a finite half
      if (b < 8) v = specials[(b + off) % 8];
      put_u16(p, v);
    }
  }
  return raw;
}

TEST(EngineDequant, BitExactAgainstCpuForEveryFormat) {
  DIFFRUN_REQUIRE_CUDA();
  for (const Format& f : formats()) {
    SCOPED_TRACE(ggml_type_name(f.type));
    ASSERT_TRUE(engine::device_dequant_supported(f.type));
    const int64_t be = ggml_block_elements(f.type);
    const int64_t nb = be == 1 ? 4099 : (be == 32 ? 1031 : 263);  // odd counts: partial thread blocks
    const int64_t n = nb * be;
    const std::vector<uint8_t> raw = random_blocks(f, nb, 1234 + static_cast<uint32_t>(f.type));

    std::vector<float> cpu(n);
    dequantize(f.type, raw.data(), cpu.data(), n);

    DeviceArray<uint8_t> d_raw(raw);
    DeviceArray<float> d_f32(n);
    DeviceArray<__half> d_f16(n);
    engine::dequantize_device(f.type, d_raw.get(), d_f32.get(), n, nullptr);
    engine::dequantize_device(f.type, d_raw.get(), d_f16.get(), n, nullptr);
    const std::vector<float> gpu = d_f32.download();
    const std::vector<__half> gpu16 = d_f16.download();
    TEST_CUDA_CHECK(cudaGetLastError());

    int64_t mismatches = 0, first = -1;
    for (int64_t i = 0; i < n; ++i)
      if (std::memcmp(&cpu[i], &gpu[i], sizeof(float)) != 0 && mismatches++ == 0) first = i;
    EXPECT_EQ(mismatches, 0) << "first mismatch at element " << first << " (block " << first / be
                             << "): cpu " << cpu[first] << " gpu " << gpu[first];

    int64_t mismatches16 = 0, first16 = -1;
    for (int64_t i = 0; i < n; ++i) {
      uint16_t g;
      std::memcpy(&g, &gpu16[i], 2);
      if (g != f32_to_f16(cpu[i]) && mismatches16++ == 0) first16 = i;
    }
    EXPECT_EQ(mismatches16, 0) << "f16 output: first mismatch at element " << first16 << ": cpu value "
                               << cpu[first16];
  }
}

TEST(EngineDequant, RejectsAnUnsupportedFormat) {
  DIFFRUN_REQUIRE_CUDA();
  EXPECT_FALSE(engine::device_dequant_supported(GgmlType::IQ2_XXS));
  DeviceArray<float> out(256);
  EXPECT_THROW(engine::dequantize_device(GgmlType::IQ2_XXS, out.get(), out.get(), 256, nullptr), ModelError);
}

}  // namespace
}  // namespace diffrun
