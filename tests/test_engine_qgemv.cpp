// GPU test: the quantized kernels (engine/ops/qgemv) per format against the CPU dequantization
// (model/dequant.cpp) with f32 math: the GEMV (f32 and f16 activations, 1 and 4 warps per row, the
// K-quants' tensor-core kernel with f16 activations,
// parts, bias, a concatenation of two formats, the SwiGLU and RoPE epilogues, the grouped launch), the row
// dequantization (bit-exact)
// and the embedding.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include "engine/cuda_check.cuh"
#include "engine/ops/moe.cuh"
#include "engine/ops/qgemv.cuh"
#include "engine/ops/rope_qk.cuh"
#include "engine/ops/swiglu.cuh"
#include "model/dequant.hpp"
#include "model/error.hpp"
#include "tests/test_engine_common.hpp"

namespace diffrun {
namespace {

using test::DeviceArray;

struct Format {
  GgmlType type;
  std::vector<int> half_fields;  // byte offsets of the f16 scales inside a block
};

const std::vector<Format>& formats() {
  static const std::vector<Format> f = {
      {GgmlType::Q4_0, {0}}, {GgmlType::Q4_1, {0, 2}}, {GgmlType::Q5_0, {0}},    {GgmlType::Q5_1, {0, 2}},
      {GgmlType::Q8_0, {0}}, {GgmlType::Q4_K, {0, 2}}, {GgmlType::Q5_K, {0, 2}}, {GgmlType::Q6_K, {208}},
  };
  return f;
}

const Format& format_of(GgmlType t) {
  for (const Format& f : formats())
    if (f.type == t) return f;
  throw Error("no test format");
}

// rows × K/block random blocks; each f16 scale a finite half in [2^-10, 2^-6) of either sign (dmin
// too), so that products stay in a sane range and a wrong scale or nibble shows.
std::vector<uint8_t> random_rows(const Format& f, int64_t rows, int K, uint32_t seed) {
  const int64_t nb = rows * (K / ggml_block_elements(f.type)), bb = ggml_block_bytes(f.type);
  std::vector<uint8_t> raw(nb * bb);
  std::mt19937 rng(seed);
  for (auto& b : raw) b = static_cast<uint8_t>(rng());
  for (int64_t b = 0; b < nb; ++b)
    for (int off : f.half_fields) {
      const uint16_t h = static_cast<uint16_t>((rng() & 0x8000u) | ((5u + rng() % 4) << 10) | (rng() & 0x3FFu));
      raw[b * bb + off] = h & 0xFF;
      raw[b * bb + off + 1] = h >> 8;
    }
  return raw;
}

std::vector<float> cpu_dequant(GgmlType t, const std::vector<uint8_t>& raw, int64_t n) {
  std::vector<float> out(n);
  dequantize(t, raw.data(), out.data(), n);
  return out;
}

// y = w · x (+ bias) in f64 and Σ|w·x| per row (the scale of the f32 rounding error).
void reference_gemv(const std::vector<float>& w, const std::vector<float>& x, const std::vector<float>& bias,
                    int rows, int K, std::vector<double>& y, std::vector<double>& mag) {
  y.assign(rows, 0);
  mag.assign(rows, 0);
  for (int r = 0; r < rows; ++r) {
    for (int k = 0; k < K; ++k) {
      const double p = double(w[size_t(r) * K + k]) * double(x[k]);
      y[r] += p;
      mag[r] += std::fabs(p);
    }
    if (!bias.empty()) {
      y[r] += bias[r];
      mag[r] += std::fabs(bias[r]);
    }
  }
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& mag,
                  const char* what) {
  int bad = 0;
  for (size_t r = 0; r < want.size(); ++r) {
    const double err = std::fabs(double(got[r]) - want[r]);
    if (!(err <= 1e-5 * mag[r] + 1e-30) && bad++ < 5)
      ADD_FAILURE() << what << ": row " << r << " got " << got[r] << " want " << want[r] << " (Σ|w·x| " << mag[r]
                    << ")";
  }
  EXPECT_EQ(bad, 0) << what;
}

std::vector<float> random_floats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = nd(rng);
  return v;
}

// The outputs of a qkv GEMV with the RoPE epilogue twice: 1 for the unfused ops (qgemv, rope_qk), 2
// for the fused launch; q, k, v NaN-filled, both caches from cache0; parts with the biases at bias.
struct QkvOutputs {
  QkvOutputs(int Q, int KV, const std::vector<float>& cache0, const float* bias)
      : q1(std::vector<float>(Q, std::nanf(""))), k1(std::vector<float>(KV, std::nanf(""))),
        v1(std::vector<float>(KV, std::nanf(""))), q2(std::vector<float>(Q, std::nanf(""))),
        k2(std::vector<float>(KV, std::nanf(""))), v2(std::vector<float>(KV, std::nanf(""))), kc1(cache0),
        vc1(cache0), kc2(cache0), vc2(cache0),
        p1{{q1.get(), k1.get(), v1.get()}, {bias, bias + Q, bias + Q + KV}, {Q, Q + KV, Q + 2 * KV}, 3},
        p2{{q2.get(), k2.get(), v2.get()}, {bias, bias + Q, bias + Q + KV}, {Q, Q + KV, Q + 2 * KV}, 3} {}
  // Every output of the fused launch bit-identical to the unfused ops'.
  void expect_same() const {
    EXPECT_EQ(q2.download(), q1.download());
    EXPECT_EQ(k2.download(), k1.download());
    EXPECT_EQ(v2.download(), v1.download());
    EXPECT_EQ(kc2.download(), kc1.download());
    EXPECT_EQ(vc2.download(), vc1.download());
  }
  DeviceArray<float> q1, k1, v1, q2, k2, v2, kc1, vc1, kc2, vc2;
  engine::GemvParts p1, p2;
};

// One format, one shape: f32 and f16 activations, two parts (the split inside the rows), bias on
// the second part.
void check_gemv(const Format& f, int rows, int K, uint32_t seed) {
  SCOPED_TRACE(std::string(ggml_type_name(f.type)) + " rows " + std::to_string(rows) + " K " + std::to_string(K));
  const std::vector<uint8_t> raw = random_rows(f, rows, K, seed);
  const std::vector<float> w = cpu_dequant(f.type, raw, int64_t(rows) * K);
  const std::vector<float> x32 = random_floats(K, seed + 1, 1.0f);
  std::vector<__half> x16(K);
  std::vector<float> x16f(K);
  for (int k = 0; k < K; ++k) {
    x16[k] = __float2half_rn(x32[k]);
    x16f[k] = __half2float(x16[k]);
  }
  const int split = rows / 3;
  std::vector<float> bias(rows, 0.0f);
  const std::vector<float> b2 = random_floats(rows - split, seed + 2, 0.5f);
  for (int r = split; r < rows; ++r) bias[r] = b2[r - split];

  DeviceArray<uint8_t> d_raw(raw);
  DeviceArray<float> d_x32(x32), d_bias(b2), d_out(rows);
  DeviceArray<__half> d_x16(x16);
  engine::GemvParts parts{};
  parts.out[0] = d_out.get();
  parts.out[1] = d_out.get() + split;
  parts.bias[1] = d_bias.get();
  parts.end[0] = split;
  parts.end[1] = rows;
  parts.n_parts = 2;

  std::vector<double> want, mag;
  reference_gemv(w, x32, bias, rows, K, want, mag);
  engine::qgemv(f.type, parts, 0, rows, d_x32.get(), d_raw.get(), K, nullptr);
  expect_close(d_out.download(), want, mag, "f32 activations");
  TEST_CUDA_CHECK(cudaGetLastError());

  std::vector<float> w16(w.size());  // the f16 engine's weights: each rounded to f16
  for (size_t i = 0; i < w.size(); ++i) w16[i] = __half2float(__float2half_rn(w[i]));
  reference_gemv(w16, x16f, bias, rows, K, want, mag);
  engine::qgemv(f.type, parts, 0, rows, d_x16.get(), d_raw.get(), K, nullptr);
  expect_close(d_out.download(), want, mag, "f16 activations");
  TEST_CUDA_CHECK(cudaGetLastError());
}

TEST(EngineQgemv, EveryFormatAgainstCpuDequantization) {
  DIFFRUN_REQUIRE_CUDA();
  for (const Format& f : formats()) {
    ASSERT_TRUE(engine::qgemv_supported(f.type));
    const uint32_t seed = 100 + static_cast<uint32_t>(f.type);
    check_gemv(f, 70, 2048, seed);    // few rows, long K: 4 warps per row
    check_gemv(f, 4101, 256, seed);   // many rows: 1 warp per row, a partial last block
    check_gemv(f, 33, 768, seed + 7); // K not a power of two
    check_gemv(f, 40, 5632, seed + 9); // more super-blocks than the tensor-core kernel's warps
  }
}

// Rows [0, n1) in Q5_K and [n1, n) in Q6_K (Q5_K_M's attn_q|attn_k and attn_v), parts split inside
// the first segment, as matmul_cat launches a concatenation of two formats.
TEST(EngineQgemv, ConcatenationOfTwoFormats) {
  DIFFRUN_REQUIRE_CUDA();
  const int K = 512, n1 = 96, n2 = 32, rows = n1 + n2;
  const Format& fa = format_of(GgmlType::Q5_K);
  const Format& fb = format_of(GgmlType::Q6_K);
  const std::vector<uint8_t> ra = random_rows(fa, n1, K, 7), rb = random_rows(fb, n2, K, 8);
  std::vector<float> w = cpu_dequant(fa.type, ra, int64_t(n1) * K);
  const std::vector<float> wb = cpu_dequant(fb.type, rb, int64_t(n2) * K);
  w.insert(w.end(), wb.begin(), wb.end());
  const std::vector<float> x = random_floats(K, 9, 1.0f);
  const std::vector<float> bias = random_floats(rows, 10, 0.5f);
  DeviceArray<uint8_t> da(ra), db(rb);
  DeviceArray<float> dx(x), dbias(bias), q(64), k(32), v(32);
  engine::GemvParts parts{{q.get(), k.get(), v.get()}, {dbias.get(), dbias.get() + 64, dbias.get() + 96}, {64, 96, 128}, 3};
  engine::qgemv(fa.type, parts, 0, n1, dx.get(), da.get(), K, nullptr);
  engine::qgemv(fb.type, parts, n1, n2, dx.get(), db.get(), K, nullptr);
  std::vector<float> got = q.download();
  for (float f : k.download()) got.push_back(f);
  for (float f : v.download()) got.push_back(f);
  std::vector<double> want, mag;
  reference_gemv(w, x, bias, rows, K, want, mag);
  expect_close(got, want, mag, "Q5_K|Q6_K");
}

// The quantized gate|up GEMV with the SwiGLU epilogue against qgemv over the same 2F rows then the
// swiglu kernel: gate, up and act bit-identical, every format, f32 and f16 activations, 4-warp rows
// (2F < 4096, long K) and 1-warp rows, F odd (a half-filled last block); K = 4096 with few rows: the
// tensor-core kernel's 16-warp blocks.
TEST(EngineQgemv, SwigluEpilogueMatchesQgemvThenSwiglu) {
  DIFFRUN_REQUIRE_CUDA();
  for (const Format& f : formats())
    for (auto [F, K] : {std::pair{35, 2048}, std::pair{2051, 256}, std::pair{17, 768}, std::pair{40, 4096}}) {
      SCOPED_TRACE(std::string(ggml_type_name(f.type)) + " F " + std::to_string(F) + " K " + std::to_string(K));
      const int rows = 2 * F;
      const uint32_t seed = 300 + static_cast<uint32_t>(f.type);
      const std::vector<uint8_t> raw = random_rows(f, rows, K, seed);
      const std::vector<float> x32 = random_floats(K, seed + 1, 1.0f);
      std::vector<__half> x16(K);
      for (int k = 0; k < K; ++k) x16[k] = __float2half_rn(x32[k]);
      const std::vector<float> nan(F, std::nanf(""));
      std::vector<__half> nan16(F);
      for (__half& h : nan16) h = __float2half_rn(std::nanf(""));
      DeviceArray<uint8_t> d_raw(raw);
      DeviceArray<float> dx32(x32);
      DeviceArray<__half> dx16(x16);
      for (bool f16 : {false, true}) {
        SCOPED_TRACE(f16 ? "f16 activations" : "f32 activations");
        DeviceArray<float> g1(nan), u1(nan), g2(nan), u2(nan), a1(nan), a2(nan);
        DeviceArray<__half> a1h(nan16), a2h(nan16);
        const engine::GemvParts parts{{g1.get(), u1.get()}, {nullptr, nullptr}, {F, rows}, 2};
        if (f16) {
          engine::qgemv(f.type, parts, 0, rows, dx16.get(), d_raw.get(), K, nullptr);
          engine::swiglu(a1h.get(), g1.get(), u1.get(), F, nullptr);
          engine::qgemv_swiglu(f.type, g2.get(), u2.get(), a2h.get(), dx16.get(), d_raw.get(), K, F, nullptr);
          std::vector<float> got, want;
          for (__half h : a2h.download()) got.push_back(__half2float(h));
          for (__half h : a1h.download()) want.push_back(__half2float(h));
          EXPECT_EQ(got, want);
        } else {
          engine::qgemv(f.type, parts, 0, rows, dx32.get(), d_raw.get(), K, nullptr);
          engine::swiglu(a1.get(), g1.get(), u1.get(), F, nullptr);
          engine::qgemv_swiglu(f.type, g2.get(), u2.get(), a2.get(), dx32.get(), d_raw.get(), K, F, nullptr);
          EXPECT_EQ(a2.download(), a1.download());
        }
        EXPECT_EQ(g2.download(), g1.download());
        EXPECT_EQ(u2.download(), u1.download());
        TEST_CUDA_CHECK(cudaGetLastError());
      }
    }
}

// The grouped GEMV (a one-token MoE step's K down projections in one launch) against one qgemv per group: every
// row bit-identical, K-quant formats, group shapes on both warp counts (K = 768: 8 warps; K = 4096 with 2,048
// rows a group: 16); it refuses, launching nothing, what it has no kernel for.
TEST(EngineQgemv, GroupedMatchesQgemvPerGroup) {
  DIFFRUN_REQUIRE_CUDA();
  if (!engine::qgemv_mma_enabled()) GTEST_SKIP() << "the tensor-core GEMV is off on this device";
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K})
    for (auto [G, N, K] : {std::tuple{8, 2048, 768}, std::tuple{3, 48, 256}, std::tuple{2, 2048, 4096}}) {
      SCOPED_TRACE(std::string(ggml_type_name(t)) + " G " + std::to_string(G) + " N " + std::to_string(N) + " K " +
                   std::to_string(K));
      const uint32_t seed = 700 + static_cast<uint32_t>(t);
      const int rows = G * N;
      const std::vector<uint8_t> raw = random_rows(format_of(t), rows, K, seed);
      const std::vector<float> x32 = random_floats(size_t(G) * K, seed + 1, 1.0f);
      std::vector<__half> x16(x32.size());
      for (size_t i = 0; i < x32.size(); ++i) x16[i] = __float2half_rn(x32[i]);
      DeviceArray<uint8_t> d_raw(raw);
      DeviceArray<__half> dx(x16);
      const std::vector<float> nan(rows, std::nanf(""));
      DeviceArray<float> want(nan), got(nan);
      const int64_t group_bytes = int64_t(N) * (K / ggml_block_elements(t)) * ggml_block_bytes(t);
      for (int g = 0; g < G; ++g) {
        const engine::GemvParts part{{want.get() + size_t(g) * N}, {nullptr}, {N}, 1};
        engine::qgemv(t, part, 0, N, dx.get() + size_t(g) * K, d_raw.get() + g * group_bytes, K, nullptr);
      }
      ASSERT_TRUE(engine::qgemv_grouped(t, got.get(), dx.get(), d_raw.get(), rows, N, K, nullptr));
      EXPECT_EQ(got.download(), want.download());
      TEST_CUDA_CHECK(cudaGetLastError());
    }
  // No kernel: a legacy format, a group off the 16-row tiles, rows not a whole number of groups.
  const std::vector<uint8_t> raw = random_rows(format_of(GgmlType::Q8_0), 64, 256, 9);
  DeviceArray<uint8_t> d_raw(raw);
  DeviceArray<__half> dx(std::vector<__half>(4 * 256));
  const std::vector<float> nan(64, std::nanf(""));
  DeviceArray<float> out(nan);
  EXPECT_FALSE(engine::qgemv_grouped(GgmlType::Q8_0, out.get(), dx.get(), d_raw.get(), 64, 16, 256, nullptr));
  EXPECT_FALSE(engine::qgemv_grouped(GgmlType::Q4_K, out.get(), dx.get(), d_raw.get(), 24, 8, 256, nullptr));
  EXPECT_FALSE(engine::qgemv_grouped(GgmlType::Q4_K, out.get(), dx.get(), d_raw.get(), 40, 16, 256, nullptr));
  for (float v : out.download()) EXPECT_TRUE(std::isnan(v)) << "a refused launch wrote " << v;
}

// The in-place expert launches (a one-token MoE step's selected experts read where they lie, by ids on the device)
// against the same launches on the experts gathered in slot order: gate, up, act and the down rows bit-identical
// (the in-place gate|up launch's warps each taking two warps' sums, against the gathered one's warps); the down rows with their weighted
// sum in one launch against the grouped launch and moe_combine; an id repeated, and one past E - 1 (clamped to
// E - 1, as gather_experts clamps).
TEST(EngineQgemv, ExpertsInPlaceMatchGatheredExperts) {
  DIFFRUN_REQUIRE_CUDA();
  if (!engine::qgemv_mma_enabled()) GTEST_SKIP() << "the tensor-core GEMV is off on this device";
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    SCOPED_TRACE(ggml_type_name(t));
    const int E = 6, n_slots = 4, F = 48, D = 512;  // gate/up [F, D], down [D, F]: F a multiple of 16, not of 256
    const int Fk = 256;                              // the down projection's K: F rounded to a super-block
    const Format& f = format_of(t);
    const int64_t gu_bytes = int64_t(F) * (D / 256) * ggml_block_bytes(t);
    const int64_t dn_bytes = int64_t(D) * (Fk / 256) * ggml_block_bytes(t);
    const std::vector<uint8_t> gate = random_rows(f, int64_t(E) * F, D, 810 + static_cast<uint32_t>(t));
    const std::vector<uint8_t> up = random_rows(f, int64_t(E) * F, D, 820 + static_cast<uint32_t>(t));
    const std::vector<uint8_t> down = random_rows(f, int64_t(E) * D, Fk, 830 + static_cast<uint32_t>(t));
    const std::vector<float> ids = {3.0f, 0.0f, 3.0f, 9.0f};  // 9 reads expert E - 1
    const std::vector<int> chosen = {3, 0, 3, E - 1};
    std::vector<uint8_t> g_gathered, u_gathered, d_gathered;
    for (int e : chosen) {
      g_gathered.insert(g_gathered.end(), gate.begin() + e * gu_bytes, gate.begin() + (e + 1) * gu_bytes);
      u_gathered.insert(u_gathered.end(), up.begin() + e * gu_bytes, up.begin() + (e + 1) * gu_bytes);
      d_gathered.insert(d_gathered.end(), down.begin() + e * dn_bytes, down.begin() + (e + 1) * dn_bytes);
    }
    std::vector<uint8_t> gu_gathered = g_gathered;  // [K gates][K ups], as the engine's scratch
    gu_gathered.insert(gu_gathered.end(), u_gathered.begin(), u_gathered.end());
    DeviceArray<uint8_t> d_gate(gate), d_up(up), d_down(down), d_gu(gu_gathered), d_dn(d_gathered);
    std::vector<uint64_t> tables(3 * E);
    for (int e = 0; e < E; ++e) {
      tables[e] = reinterpret_cast<uint64_t>(d_gate.get() + e * gu_bytes);
      tables[E + e] = reinterpret_cast<uint64_t>(d_up.get() + e * gu_bytes);
      tables[2 * E + e] = reinterpret_cast<uint64_t>(d_down.get() + e * dn_bytes);
    }
    DeviceArray<uint64_t> d_tables(tables);
    DeviceArray<float> d_ids(ids);
    const std::vector<float> x32 = random_floats(D, 840, 1.0f);
    std::vector<__half> x16(D);
    for (int i = 0; i < D; ++i) x16[i] = __float2half_rn(x32[i]);
    DeviceArray<__half> dx(x16);
    const int SF = n_slots * F;
    const std::vector<float> nan(SF, std::nanf(""));
    std::vector<__half> nan16(SF, __float2half_rn(std::nanf("")));
    DeviceArray<float> g1(nan), u1(nan), g2(nan), u2(nan);
    DeviceArray<__half> a1(nan16), a2(nan16);
    engine::qgemv_swiglu(t, g1.get(), u1.get(), a1.get(), dx.get(), d_gu.get(), D, SF, nullptr);
    ASSERT_TRUE(engine::qgemv_experts_swiglu(t, g2.get(), u2.get(), a2.get(), dx.get(), d_tables.get(),
                                             d_tables.get() + E, d_ids.get(), E, n_slots, F, D, nullptr));
    EXPECT_EQ(g2.download(), g1.download());
    EXPECT_EQ(u2.download(), u1.download());
    std::vector<float> want, got;
    for (__half h : a1.download()) want.push_back(__half2float(h));
    for (__half h : a2.download()) got.push_back(__half2float(h));
    EXPECT_EQ(got, want);
    // The down projections: slot s on its own act row (F values, zero-padded to Fk).
    std::vector<__half> act(size_t(n_slots) * Fk, __float2half_rn(0.0f));
    const std::vector<float> a_rows = random_floats(size_t(n_slots) * F, 850, 1.0f);
    for (int s = 0; s < n_slots; ++s)
      for (int i = 0; i < F; ++i) act[size_t(s) * Fk + i] = __float2half_rn(a_rows[size_t(s) * F + i]);
    DeviceArray<__half> d_act(act);
    const std::vector<float> nan_d(size_t(n_slots) * D, std::nanf(""));
    DeviceArray<float> o1(nan_d), o2(nan_d);
    ASSERT_TRUE(engine::qgemv_grouped(t, o1.get(), d_act.get(), d_dn.get(), n_slots * D, D, Fk, nullptr));
    ASSERT_TRUE(engine::qgemv_experts_grouped(t, o2.get(), d_act.get(), d_tables.get() + 2 * E, d_ids.get(), E,
                                              n_slots, D, Fk, nullptr));
    EXPECT_EQ(o2.download(), o1.download());
    // The down projections and their weighted sum in one launch: the same rows, and moe_combine's sum of them.
    const std::vector<float> slot_weights = {0.375f, 0.1f, -0.25f, 0.6f};
    DeviceArray<float> d_w(slot_weights), o3(nan_d), sum1(std::vector<float>(D, std::nanf(""))),
        sum2(std::vector<float>(D, std::nanf("")));
    engine::moe_combine(sum1.get(), o1.get(), d_w.get(), 1, n_slots, D, nullptr);
    ASSERT_TRUE(engine::qgemv_experts_down_combine(t, o3.get(), sum2.get(), d_act.get(), d_tables.get() + 2 * E,
                                                   d_ids.get(), d_w.get(), E, n_slots, D, Fk, nullptr));
    EXPECT_EQ(o3.download(), o1.download());
    EXPECT_EQ(sum2.download(), sum1.download());
    TEST_CUDA_CHECK(cudaGetLastError());
  }
}

// The one-token downs+sum at the K of real experts (qgemv_experts_down_combine: a warp for each of the grouped launch's
// warps that holds super-blocks where they fit a block, else a warp a slot) against the grouped launch on the
// gathered experts and moe_combine: rows and sum bit-identical. Qwen3-30B-A3B's 8 slots at K 768 (3 warps a slot),
// 4 slots, 3 slots at K 2304 (8 warps a slot, one of them with two super-blocks), 8 slots of K 2304 or 4096 (a warp
// a slot), and one slot at N and K 4096 (a 16-warp grouped launch: 16 warps).
TEST(EngineQgemv, DownCombineMatchesGroupedThenCombine) {
  DIFFRUN_REQUIRE_CUDA();
  if (!engine::qgemv_mma_enabled()) GTEST_SKIP() << "the tensor-core GEMV is off on this device";
  struct Case {
    int n_slots, D, Fk;
  };
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K})
    for (const Case& c : {Case{8, 2048, 768}, Case{4, 512, 768}, Case{3, 256, 2304}, Case{8, 256, 2304},
                          Case{8, 512, 4096}, Case{1, 4096, 4096}}) {
      SCOPED_TRACE(std::string(ggml_type_name(t)) + " slots " + std::to_string(c.n_slots) + " D " +
                   std::to_string(c.D) + " K " + std::to_string(c.Fk));
      const int E = 5, D = c.D, Fk = c.Fk, n_slots = c.n_slots;
      const int64_t dn_bytes = int64_t(D) * (Fk / 256) * ggml_block_bytes(t);
      const std::vector<uint8_t> down = random_rows(format_of(t), int64_t(E) * D, Fk, 860 + static_cast<uint32_t>(t));
      std::vector<float> ids(n_slots);
      std::vector<uint8_t> gathered;
      for (int s = 0; s < n_slots; ++s) {
        const int e = (s * 3 + 1) % E;
        ids[s] = static_cast<float>(e);
        gathered.insert(gathered.end(), down.begin() + e * dn_bytes, down.begin() + (e + 1) * dn_bytes);
      }
      DeviceArray<uint8_t> d_down(down), d_gathered(gathered);
      std::vector<uint64_t> table(E);
      for (int e = 0; e < E; ++e) table[e] = reinterpret_cast<uint64_t>(d_down.get() + e * dn_bytes);
      DeviceArray<uint64_t> d_table(table);
      DeviceArray<float> d_ids(ids);
      const std::vector<float> a32 = random_floats(size_t(n_slots) * Fk, 870, 1.0f);
      std::vector<__half> act(a32.size());
      for (size_t i = 0; i < a32.size(); ++i) act[i] = __float2half_rn(a32[i]);
      DeviceArray<__half> d_act(act);
      std::vector<float> w(n_slots);
      for (int s = 0; s < n_slots; ++s) w[s] = 0.125f * float(s + 1) - 0.3f;
      DeviceArray<float> d_w(w);
      const std::vector<float> nan_d(size_t(n_slots) * D, std::nanf("")), nan_1(D, std::nanf(""));
      DeviceArray<float> o1(nan_d), o2(nan_d), sum1(nan_1), sum2(nan_1);
      ASSERT_TRUE(engine::qgemv_grouped(t, o1.get(), d_act.get(), d_gathered.get(), n_slots * D, D, Fk, nullptr));
      engine::moe_combine(sum1.get(), o1.get(), d_w.get(), 1, n_slots, D, nullptr);
      ASSERT_TRUE(engine::qgemv_experts_down_combine(t, o2.get(), sum2.get(), d_act.get(), d_table.get(), d_ids.get(),
                                                     d_w.get(), E, n_slots, D, Fk, nullptr));
      EXPECT_EQ(o2.download(), o1.download());
      EXPECT_EQ(sum2.download(), sum1.download());
      TEST_CUDA_CHECK(cudaGetLastError());
    }
}

// A step of several tokens' experts in one launch on the slots' rows in place (qgemm_experts) against the one-token
// qgemv of each slot's expert on its row alone: bit-identical, every K-quant format, shapes whose warps take one
// super-block each (decoded once for a whole group) and more (K 2304: 9 super-blocks on 8 warps), 8- and 16-warp
// launches, groups of 1 to 17 slots in any expert order, slots read their own row (div 1) or their token's (div 2);
// a slot in no group untouched.
TEST(EngineQgemv, ExpertRowsMatchOneTokenGemv) {
  DIFFRUN_REQUIRE_CUDA();
  if (!engine::qgemv_mma_enabled()) GTEST_SKIP() << "the tensor-core GEMV is off on this device";
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K})
    for (auto [N, K] : {std::pair{48, 768}, std::pair{2048, 768}, std::pair{64, 4096}, std::pair{32, 2304}})
      for (int div : {1, 2}) {
        SCOPED_TRACE(std::string(ggml_type_name(t)) + " N " + std::to_string(N) + " K " + std::to_string(K) + " div " +
                     std::to_string(div));
        const int E = 5, slots = 80;  // the slot at the last position is in no group
        const uint32_t seed = 900 + static_cast<uint32_t>(t);
        const int64_t bytes = int64_t(N) * (K / ggml_block_elements(t)) * ggml_block_bytes(t);
        const std::vector<uint8_t> raw = random_rows(format_of(t), int64_t(E) * N, K, seed);
        // The grouped order: a permutation of the slots. Expert 3 twice over (groups of 41 and 1); groups longer than a
        // round of the kernel (32 slots), of exactly one, of a part of one, and of one slot.
        std::vector<int32_t> rows(slots);
        for (int i = 0; i < slots; ++i) rows[i] = (i * 7 + 3) % slots;
        const std::vector<engine::ExpertRows> groups = {
            {3, 0, 41, 0}, {0, 41, 32, 0}, {4, 73, 5, 0}, {3, 78, 1, 0}};
        const std::vector<float> x32 = random_floats(size_t(slots) * K, seed + 1, 1.0f);
        std::vector<__half> x16(x32.size());
        for (size_t i = 0; i < x32.size(); ++i) x16[i] = __float2half_rn(x32[i]);
        DeviceArray<uint8_t> d_raw(raw);
        DeviceArray<__half> dx(x16);
        DeviceArray<int32_t> d_rows(rows);
        std::vector<uint64_t> table(E);
        for (int e = 0; e < E; ++e) table[e] = reinterpret_cast<uint64_t>(d_raw.get() + e * bytes);
        DeviceArray<uint64_t> d_table(table);
        DeviceArray<engine::ExpertRows> d_groups(groups);
        const std::vector<float> nan(size_t(slots) * N, std::nanf(""));
        DeviceArray<float> want(nan), got(nan);
        for (const engine::ExpertRows& gr : groups)
          for (int i = gr.first; i < gr.first + gr.count; ++i) {
            const int s = rows[i];
            const engine::GemvParts part{{want.get() + size_t(s) * N}, {nullptr}, {N}, 1};
            engine::qgemv(t, part, 0, N, dx.get() + size_t(s / div) * K, d_raw.get() + gr.expert * bytes, K, nullptr);
          }
        ASSERT_TRUE(engine::qgemm_experts(t, got.get(), dx.get(), d_rows.get(), div, d_table.get(), d_groups.get(),
                                          static_cast<int>(groups.size()), N, K, nullptr));
        const std::vector<float> w = want.download(), g = got.download();
        ASSERT_EQ(g.size(), w.size());
        int mismatched = 0;
        for (size_t i = 0; i < w.size(); ++i) {
          const bool same = std::isnan(w[i]) ? std::isnan(g[i]) : std::memcmp(&w[i], &g[i], sizeof(float)) == 0;
          if (!same && mismatched++ < 3)
            ADD_FAILURE() << "slot " << i / N << " output " << i % N << ": " << g[i] << " against qgemv's " << w[i];
        }
        EXPECT_EQ(mismatched, 0);
        for (int n = 0; n < N; ++n)
          EXPECT_TRUE(std::isnan(g[size_t(rows[slots - 1]) * N + n]))
              << "slot " << rows[slots - 1] << " (in no group) was written";
        TEST_CUDA_CHECK(cudaGetLastError());
      }
  // No kernel: a legacy format, N off the 16-row tiles.
  DeviceArray<float> out(std::vector<float>(64, std::nanf("")));
  DeviceArray<__half> dx(std::vector<__half>(256));
  DeviceArray<int32_t> d_rows(std::vector<int32_t>{0});
  DeviceArray<uint64_t> d_table(std::vector<uint64_t>{0});
  DeviceArray<engine::ExpertRows> d_groups(std::vector<engine::ExpertRows>{{0, 0, 1, 0}});
  EXPECT_FALSE(engine::qgemm_experts(GgmlType::Q8_0, out.get(), dx.get(), d_rows.get(), 1, d_table.get(),
                                     d_groups.get(), 1, 64, 256, nullptr));
  EXPECT_FALSE(engine::qgemm_experts(GgmlType::Q4_K, out.get(), dx.get(), d_rows.get(), 1, d_table.get(),
                                     d_groups.get(), 1, 40, 256, nullptr));
  for (float v : out.download()) EXPECT_TRUE(std::isnan(v)) << "a refused launch wrote " << v;
}

// The quantized qkv GEMV with the RoPE epilogue against qgemv over the same rows then rope_qk: q, k,
// v and both caches bit-identical, every format, f32 and f16 activations, 4-warp rows (N < 4096,
// long K) and 1-warp rows, neox and norm pairing, with biases.
TEST(EngineQgemv, RopeEpilogueMatchesQgemvThenRopeQk) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    int H, Hkv, Dh, K;
    bool neox;
  };
  for (const Format& f : formats())
    for (const Case c : {Case{9, 3, 64, 2048, true}, Case{32, 4, 128, 256, false}, Case{6, 2, 32, 768, false}}) {
      SCOPED_TRACE(std::string(ggml_type_name(f.type)) + " H " + std::to_string(c.H) + " Dh " + std::to_string(c.Dh) +
                   " K " + std::to_string(c.K) + (c.neox ? " neox" : " norm"));
      const int Q = c.H * c.Dh, KV = c.Hkv * c.Dh, N = Q + 2 * KV, K = c.K, ctx = 64, pos = 41;
      const uint32_t seed = 500 + static_cast<uint32_t>(f.type);
      const std::vector<uint8_t> raw = random_rows(f, N, K, seed);
      const std::vector<float> x32 = random_floats(K, seed + 1, 1.0f), bias = random_floats(N, seed + 2, 0.5f);
      const std::vector<float> cache0 = random_floats(size_t(ctx) * KV, seed + 3, 1.0f);
      std::vector<__half> x16(K);
      for (int k = 0; k < K; ++k) x16[k] = __float2half_rn(x32[k]);
      DeviceArray<uint8_t> d_raw(raw);
      DeviceArray<float> dx32(x32), dbias(bias);
      DeviceArray<__half> dx16(x16);
      DeviceArray<int32_t> dpos(std::vector<int32_t>{pos});
      for (bool f16 : {false, true}) {
        SCOPED_TRACE(f16 ? "f16 activations" : "f32 activations");
        QkvOutputs o(Q, KV, cache0, dbias.get());
        const engine::GemvRope rope{o.kc2.get(), o.vc2.get(), dpos.get(), dpos.get(), nullptr, 10000.0f,
                                    c.H,         c.Hkv,       c.Dh,       c.neox};
        if (f16) {
          engine::qgemv(f.type, o.p1, 0, N, dx16.get(), d_raw.get(), K, nullptr);
          engine::qgemv_rope(f.type, o.p2, rope, dx16.get(), d_raw.get(), K, nullptr);
        } else {
          engine::qgemv(f.type, o.p1, 0, N, dx32.get(), d_raw.get(), K, nullptr);
          engine::qgemv_rope(f.type, o.p2, rope, dx32.get(), d_raw.get(), K, nullptr);
        }
        engine::rope_qk(o.q1.get(), o.k1.get(), o.kc1.get(), o.vc1.get(), o.q1.get(), o.k1.get(), o.v1.get(), 1, c.H,
                        c.Hkv, c.Dh, dpos.get(), dpos.get(), 10000.0f, nullptr, c.neox, nullptr);
        o.expect_same();
        TEST_CUDA_CHECK(cudaGetLastError());
      }
    }
}

// Wq|Wk and Wv in two K-quant formats (Q4_K_M, Q5_K_M files) in one tensor-core launch with the RoPE
// epilogue (qgemv_rope2) against qgemv on each segment then rope_qk: q, k, v and both caches
// bit-identical, for each format pair, neox and norm pairing, Dh 32 to 128, 8- and 16-warp tiles
// (K 4,096: the segments' own launches take 16 warps too). Other pairs and Dh not a multiple of 16 are
// declined, and so is every pair while the tensor-core kernel is off (DIFFRUN_QGEMV_MMA=0: the
// test_engine_qgemv_simt run).
TEST(EngineQgemv, RopeOverTwoFormatsMatchesQgemvThenRopeQk) {
  DIFFRUN_REQUIRE_CUDA();
  const bool mma = engine::qgemv_mma_enabled();
  struct Case {
    int H, Hkv, Dh, K;
    bool neox;
  };
  for (auto [ta, tb] : {std::pair{GgmlType::Q4_K, GgmlType::Q5_K}, std::pair{GgmlType::Q4_K, GgmlType::Q6_K},
                        std::pair{GgmlType::Q5_K, GgmlType::Q6_K}})
    for (const Case c : {Case{32, 4, 64, 2048, true}, Case{8, 2, 128, 512, false}, Case{4, 2, 32, 256, true},
                         Case{6, 2, 64, 4096, false}}) {
      SCOPED_TRACE(std::string(ggml_type_name(ta)) + "|" + ggml_type_name(tb) + " H " + std::to_string(c.H) + " Dh " +
                   std::to_string(c.Dh) + " K " + std::to_string(c.K));
      const int Q = c.H * c.Dh, KV = c.Hkv * c.Dh, rows_a = Q + KV, K = c.K, ctx = 16, pos = 9;
      const uint32_t seed = 900 + static_cast<uint32_t>(ta) * 7 + static_cast<uint32_t>(tb);
      const std::vector<uint8_t> ra = random_rows(format_of(ta), rows_a, K, seed);
      const std::vector<uint8_t> rb = random_rows(format_of(tb), KV, K, seed + 1);
      const std::vector<float> x32 = random_floats(K, seed + 2, 1.0f);
      const std::vector<float> bias = random_floats(rows_a + KV, seed + 3, 0.5f);
      const std::vector<float> cache0 = random_floats(size_t(ctx) * KV, seed + 4, 1.0f);
      std::vector<__half> x16(K);
      for (int k = 0; k < K; ++k) x16[k] = __float2half_rn(x32[k]);
      DeviceArray<uint8_t> dra(ra), drb(rb);
      DeviceArray<float> dbias(bias);
      DeviceArray<__half> dx16(x16);
      DeviceArray<int32_t> dpos(std::vector<int32_t>{pos});
      QkvOutputs o(Q, KV, cache0, dbias.get());
      engine::qgemv(ta, o.p1, 0, rows_a, dx16.get(), dra.get(), K, nullptr);
      engine::qgemv(tb, o.p1, rows_a, KV, dx16.get(), drb.get(), K, nullptr);
      engine::rope_qk(o.q1.get(), o.k1.get(), o.kc1.get(), o.vc1.get(), o.q1.get(), o.k1.get(), o.v1.get(), 1, c.H,
                      c.Hkv, c.Dh, dpos.get(), dpos.get(), 10000.0f, nullptr, c.neox, nullptr);
      const engine::GemvRope rope{o.kc2.get(), o.vc2.get(), dpos.get(), dpos.get(), nullptr, 10000.0f,
                                  c.H,         c.Hkv,       c.Dh,       c.neox};
      if (!mma) {  // declined, nothing launched
        EXPECT_FALSE(engine::qgemv_rope2(ta, dra.get(), rows_a, tb, drb.get(), o.p2, rope, dx16.get(), K, nullptr));
        EXPECT_EQ(o.kc2.download(), cache0);
        continue;
      }
      ASSERT_TRUE(engine::qgemv_rope2(ta, dra.get(), rows_a, tb, drb.get(), o.p2, rope, dx16.get(), K, nullptr));
      o.expect_same();
      // Declined, nothing launched: the formats the other way round, Dh not a multiple of 16.
      EXPECT_FALSE(engine::qgemv_rope2(tb, drb.get(), rows_a, ta, dra.get(), o.p2, rope, dx16.get(), K, nullptr));
      engine::GemvRope odd = rope;
      odd.Dh = c.Dh - 8;
      EXPECT_FALSE(engine::qgemv_rope2(ta, dra.get(), rows_a, tb, drb.get(), o.p2, odd, dx16.get(), K, nullptr));
      EXPECT_EQ(o.q2.download(), o.q1.download());
      TEST_CUDA_CHECK(cudaGetLastError());
    }
}

TEST(EngineQgemv, DequantRowsBitExactAndEmbedding) {
  DIFFRUN_REQUIRE_CUDA();
  for (const Format& f : formats()) {
    SCOPED_TRACE(ggml_type_name(f.type));
    const int rows = 37, K = 512;
    const int64_t n = int64_t(rows) * K;
    const std::vector<uint8_t> raw = random_rows(f, rows, K, 55 + static_cast<uint32_t>(f.type));
    const std::vector<float> cpu = cpu_dequant(f.type, raw, n);
    DeviceArray<uint8_t> d_raw(raw);
    DeviceArray<float> d32(n);
    DeviceArray<__half> d16(n);
    engine::dequant_rows(f.type, d_raw.get(), rows, K, d32.get(), nullptr);
    engine::dequant_rows(f.type, d_raw.get(), rows, K, d16.get(), nullptr);
    const std::vector<float> g32 = d32.download();
    const std::vector<__half> g16 = d16.download();
    int64_t bad32 = 0, bad16 = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (std::memcmp(&g32[i], &cpu[i], 4) != 0 && bad32++ == 0)
        ADD_FAILURE() << "f32: element " << i << " gpu " << g32[i] << " cpu " << cpu[i];
      uint16_t h;
      std::memcpy(&h, &g16[i], 2);
      if (h != f32_to_f16(cpu[i]) && bad16++ == 0) ADD_FAILURE() << "f16: element " << i << " cpu " << cpu[i];
    }
    EXPECT_EQ(bad32, 0);
    EXPECT_EQ(bad16, 0);

    // Embedding: tokens 5, 36, 0 and one outside the table (a NaN row).
    const std::vector<int32_t> ids = {5, 36, 0, rows};
    DeviceArray<int32_t> d_ids(ids);
    DeviceArray<float> out(ids.size() * K);
    for (bool round : {false, true}) {
      engine::embedding_quantized(out.get(), d_ids.get(), f.type, d_raw.get(), int(ids.size()), K, rows, round,
                                  nullptr);
      const std::vector<float> e = out.download();
      for (size_t t = 0; t < ids.size(); ++t)
        for (int k = 0; k < K; ++k) {
          const float got = e[t * K + k];
          if (ids[t] >= rows) {
            ASSERT_TRUE(std::isnan(got)) << "row of an id outside the table";
            continue;
          }
          const float c = cpu[size_t(ids[t]) * K + k];
          const float want = round ? f16_to_f32(f32_to_f16(c)) : c;
          ASSERT_EQ(got, want) << "token " << ids[t] << " column " << k << (round ? " (f16)" : "");
        }
    }
    TEST_CUDA_CHECK(cudaGetLastError());
  }
}

TEST(EngineQgemv, RejectsBadShapesAndFormats) {
  DIFFRUN_REQUIRE_CUDA();
  DeviceArray<float> x(512), out(4);
  engine::GemvParts parts{{out.get()}, {nullptr}, {4}, 1};
  EXPECT_THROW(engine::qgemv(GgmlType::Q4_K, parts, 0, 4, x.get(), x.get(), 320, nullptr), Error);  // 320 % 256
  EXPECT_THROW(engine::qgemv(GgmlType::Q2_K, parts, 0, 4, x.get(), x.get(), 256, nullptr), Error);  // no kernel
  EXPECT_THROW(engine::qgemv(GgmlType::Q4_0, parts, 0, 4, x.get() + 1, x.get(), 256, nullptr), Error);  // unaligned x
  const auto* off4 = reinterpret_cast<const unsigned char*>(x.get()) + 4;  // Q4_K blocks are read 16 bytes at a time
  EXPECT_THROW(engine::qgemv(GgmlType::Q4_K, parts, 0, 1, x.get(), off4, 256, nullptr), Error);
  EXPECT_FALSE(engine::qgemv_supported(GgmlType::F16));
}

}  // namespace
}  // namespace diffrun
