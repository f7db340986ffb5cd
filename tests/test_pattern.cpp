// Unit tests of diff/pattern: crafted tensors for each error pattern (heads, cache rows, one token, channels, cosine, causal mask).
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "diff/pattern.hpp"

using namespace diffrun::diff;

namespace {

// Smooth values in [-1, 1], never zero in bulk.
std::vector<float> values(size_t n, double phase = 0.0) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i) + phase) * 0.9 + 0.05);
  return v;
}

const AxisPattern* axis(const ErrorPattern& p, const std::string& dim) {
  for (const auto& a : p.axes) {
    if (a.dim == dim) return &a;
  }
  return nullptr;
}

using V = std::vector<int64_t>;

}  // namespace

TEST(Pattern, Ranges) {
  EXPECT_EQ(format_ranges({0, 1, 2, 3, 4, 6, 9, 10, 11}), "0-4,6,9-11");
  EXPECT_EQ(format_ranges({5}), "5");
  EXPECT_EQ(format_ranges({}), "");
}

TEST(Pattern, IdenticalTensorsHaveNoPattern) {
  std::vector<float> b = values(2 * 3 * 4);
  ErrorPattern p = error_pattern(b, b, std::vector<int64_t>{2, 3, 4}, "T,H,Dh", {}, "Qcur", 1e-6);
  EXPECT_EQ(p.summary, "");
  EXPECT_EQ(p.hint, "");
  EXPECT_DOUBLE_EQ(p.cosine, 1.0);
}

// A wrong GQA mapping: in attention [H, T, S] heads 0, 4 and 8 of 12 read the right KV head.
TEST(Pattern, SomeHeadsExactInAttentionIsTheHeadMapping) {
  const int64_t H = 12, T = 3, S = 3;
  std::vector<float> b = values(H * T * S), a = b;
  for (int64_t h = 0; h < H; ++h) {
    if (h % 4 == 0) continue;
    for (int64_t i = 0; i < T * S; ++i) a[h * T * S + i] += 0.1f;
  }
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{H, T, S}, "H,T,S", {}, "kq_soft_max", 1e-6);
  const AxisPattern* heads = axis(p, "H");
  ASSERT_NE(heads, nullptr);
  EXPECT_EQ(heads->exact, (V{0, 4, 8}));
  EXPECT_EQ(heads->wrong.size(), 9u);
  EXPECT_EQ(p.summary.rfind("heads 0,4,8 exact, 1-3,5-7,9-11 wrong", 0), 0u) << p.summary;
  EXPECT_NE(p.hint.find("head mapping"), std::string::npos) << p.hint;
}

// The K/V of the step written at cache row 0 instead of n_past = 5: rows 0 and 5 differ, row 5 is zero.
TEST(Pattern, ZeroCacheRowIsTheWritePosition) {
  const int64_t S = 6, Hkv = 2, Dh = 4;
  std::vector<float> b = values(S * Hkv * Dh), a = b;
  for (int64_t i = 0; i < Hkv * Dh; ++i) {
    a[i] = b[5 * Hkv * Dh + i];  // row 0 overwritten with the new K
    a[5 * Hkv * Dh + i] = 0.0f;  // row 5 never written
  }
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{S, Hkv, Dh}, "S,Hkv,Dh", {}, "cache_k", 1e-6);
  const AxisPattern* rows = axis(p, "S");
  ASSERT_NE(rows, nullptr);
  EXPECT_EQ(rows->label, "cache rows");
  EXPECT_EQ(rows->exact, (V{1, 2, 3, 4}));
  EXPECT_EQ(rows->wrong, (V{0, 5}));
  EXPECT_EQ(rows->zero_engine, (V{5}));
  EXPECT_NE(p.summary.find("cache rows 1-4 exact, 0,5 wrong (5 all zero in engine)"), std::string::npos) << p.summary;
  EXPECT_NE(p.hint.find("cache row 5 never written"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("write position"), std::string::npos) << p.hint;
}

TEST(Pattern, OneTokenRowWrongNamesThatToken) {
  const int64_t T = 5, D = 8;
  std::vector<float> b = values(T * D), a = b;
  for (int64_t d = 0; d < D; ++d) a[3 * D + d] *= 1.5f;
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "embd", 1e-6);
  EXPECT_EQ(axis(p, "T")->wrong, (V{3}));
  EXPECT_NE(p.summary.find("token rows 0-2,4 exact, 3 wrong"), std::string::npos) << p.summary;
  EXPECT_NE(p.hint.find("that token (T=3)"), std::string::npos) << p.hint;
}

// One weight row of an output projection scaled: one channel wrong in every token.
TEST(Pattern, AFewChannelsWrongPointAtAWeightRow) {
  const int64_t T = 4, D = 16;
  std::vector<float> b = values(T * D), a = b;
  for (int64_t t = 0; t < T; ++t) a[t * D + 11] *= 1.01f;
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "ffn_out", 1e-6);
  EXPECT_EQ(axis(p, "D")->wrong, (V{11}));
  EXPECT_NE(p.summary.find("channels D 0-10,12-15 exact, 11 wrong"), std::string::npos) << p.summary;
  EXPECT_NE(p.hint.find("weight row"), std::string::npos) << p.hint;
  // The same inside one head of a per-head tensor [T, H*Dh], the sizes known: head 1, channel 3.
  std::vector<float> q = values(T * 8), r = q;
  for (int64_t t = 0; t < T; ++t) r[t * 8 + 4 + 3] += 0.2f;
  ErrorPattern ph = error_pattern(r, q, std::vector<int64_t>{T, 8}, "T,H*Dh", {{"H", 2}, {"Dh", 4}}, "Qcur", 1e-6);
  EXPECT_EQ(axis(ph, "H")->wrong, (V{1}));
  EXPECT_EQ(axis(ph, "Dh")->wrong, (V{3}));
}

// A transposed read: the same values in another order, uncorrelated.
TEST(Pattern, CosineNearZeroIsALayoutOrTranspose) {
  const int64_t T = 16, D = 32;
  std::vector<float> b(T * D), a(T * D);
  for (int64_t i = 0; i < T * D; ++i) b[i] = static_cast<float>(std::sin(1.3 * static_cast<double>(i * i % 97)));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < D; ++d) a[t * D + d] = static_cast<float>(std::cos(2.1 * static_cast<double>(d * 31 + t * 7)));
  }
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "attn_out", 1e-6);
  EXPECT_LT(std::abs(p.cosine), 0.1);
  EXPECT_NE(p.summary.find("spread over the tensor"), std::string::npos) << p.summary;
  EXPECT_NE(p.hint.find("a layout, a transpose or the wrong tensor"), std::string::npos) << p.hint;
}

// A scaled copy (values 1e6x too large) is no transpose: the hint names the factor.
TEST(Pattern, ScaledCopyIsAScaleNotATranspose) {
  const int64_t T = 4, D = 16;
  std::vector<float> b = values(T * D), a = b;
  for (float& x : a) x *= 1e6f;
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "attn_out", 1e-6);
  EXPECT_EQ(p.hint.find("transpose"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("the engine's values are the reference's x 1e+06"), std::string::npos) << p.hint;
}

// RMSNorm weight applied twice: every channel times its own weight, the same in every token.
TEST(Pattern, PerChannelFactorIsANormWeightTwice) {
  const int64_t T = 5, D = 16;
  std::vector<float> b = values(T * D), a = b;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) a[t * D + d] *= 0.5f + 0.1f * static_cast<float>(d % 7);
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "attn_norm", 1e-6);
  EXPECT_NE(p.hint.find("each channel scaled by its own factor"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("RMSNorm weight"), std::string::npos) << p.hint;
}

TEST(Pattern, ProbabilityOnFuturePositionsIsTheCausalMask) {
  // Prefill, H=1, T=S=3: the reference attends causally, the engine uniformly.
  std::vector<float> b = {1, 0, 0, 0.5f, 0.5f, 0, 1.f / 3, 1.f / 3, 1.f / 3};
  std::vector<float> a = {1.f / 3, 1.f / 3, 1.f / 3, 1.f / 3, 1.f / 3, 1.f / 3, 1.f / 3, 1.f / 3, 1.f / 3};
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{1, 3, 3}, "H,T,S", {}, "kq_soft_max", 1e-6);
  EXPECT_EQ(p.future_nonzero, 3);
  EXPECT_EQ(axis(p, "T")->exact, (V{2}));
  EXPECT_NE(p.hint.find("causal mask"), std::string::npos) << p.hint;
}

TEST(Pattern, SlicesWithNaNAreWrongAndTheThresholdDecidesExact) {
  const int64_t T = 4, D = 4;
  std::vector<float> b = values(T * D), a = b;
  a[2 * D + 1] = std::numeric_limits<float>::quiet_NaN();
  a[0] *= 1.0f + 1e-5f;  // row 0: rel ~1e-5, exact under 1e-4, wrong under 1e-7
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "l_out", 1e-4);
  EXPECT_EQ(axis(p, "T")->wrong, (V{2}));
  ErrorPattern strict = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "l_out", 1e-7);
  EXPECT_EQ(axis(strict, "T")->wrong, (V{0, 2}));
}

// Over non-finite data the pattern names the slices holding NaN/Inf, and no finite-error hint.
TEST(Pattern, NaNSlicesAreNamedAndOnlyTheirHintsApply) {
  // A NaN weight row of W_q: channel 0 of head 0 in every token of [T=3, H=2, Dh=8].
  std::vector<float> b = values(3 * 2 * 8), a = b;
  for (int t = 0; t < 3; ++t) a[t * 16] = std::numeric_limits<float>::quiet_NaN();
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{3, 2, 8}, "T,H,Dh", {}, "Qcur", 1e-6);
  EXPECT_EQ(p.summary, "NaN/Inf only in heads 0; channels Dh 0") << p.summary;
  EXPECT_NE(p.hint.find("weight row"), std::string::npos) << p.hint;
  // Softmax rows overflowing in some heads and tokens: no head-mapping hint.
  std::vector<float> q = values(4 * 3 * 3), r = q;
  r[0 * 9 + 1 * 3 + 0] = std::numeric_limits<float>::quiet_NaN();
  r[2 * 9 + 1 * 3 + 0] = std::numeric_limits<float>::infinity();
  r[3 * 9 + 2 * 3 + 0] *= 2.0f;  // a finite difference beside them
  ErrorPattern s = error_pattern(r, q, std::vector<int64_t>{4, 3, 3}, "H,T,S", {}, "kq_soft_max", 1e-6);
  EXPECT_EQ(s.summary, "NaN/Inf only in heads 0,2; token rows 1; positions 0") << s.summary;
  EXPECT_NE(s.hint.find("that token (T=1)"), std::string::npos) << s.hint;
}

namespace {

// RoPE of q [T, H, Dh] at positions first_pos.. : pairs (2i, 2i+1), or (i, i+Dh/2) with `neox`, turned by
// pos · theta^(-2i/Dh).
std::vector<float> rope(const std::vector<float>& q, int64_t T, int64_t H, int64_t Dh, int64_t first_pos, double theta,
                        bool neox) {
  std::vector<float> out = q;
  const int64_t half = Dh / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t o = (t * H + h) * Dh, x = neox ? i : 2 * i, y = neox ? i + half : 2 * i + 1;
        const double ang = static_cast<double>(first_pos + t) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(Dh));
        const double c = std::cos(ang), s = std::sin(ang);
        out[o + x] = static_cast<float>(q[o + x] * c - q[o + y] * s);
        out[o + y] = static_cast<float>(q[o + x] * s + q[o + y] * c);
      }
  return out;
}

// Deterministic noise in [-1, 1].
std::vector<float> noise(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(seed >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
  }
  return v;
}

PatternContext rope_context(int64_t first_pos, double theta, bool neox) {
  PatternContext cx;
  cx.first_position = first_pos;
  cx.rope_theta = theta;
  cx.rope_neox = neox;
  return cx;
}

}  // namespace

// rope_pairing_swapped: the model pairs (2i, 2i+1), the engine (i, i+Dh/2); position 0 is unchanged.
TEST(Pattern, RopePairingSwappedKeepsHeadLengths) {
  const int64_t T = 5, H = 4, Dh = 16;
  const std::vector<float> q = noise(T * H * Dh, 7);
  const std::vector<float> b = rope(q, T, H, Dh, 0, 10000.0, false), a = rope(q, T, H, Dh, 0, 10000.0, true);
  const std::vector<int64_t> shape{T, H, Dh};
  ErrorPattern p = error_pattern(a, b, shape, "T,H,Dh", {}, "Qrope", 1e-6, rope_context(0, 10000.0, false));
  EXPECT_NE(p.hint.find("RoPE pairing"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("the engine seems to pair (i, i+Dh/2)"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("position 0 exact"), std::string::npos) << p.hint;
  // The reverse (a NEOX model paired as NORM), and without the config: still the pairing, named both ways.
  ErrorPattern r = error_pattern(b, a, shape, "T,H,Dh", {}, "Krope", 1e-6);
  EXPECT_NE(r.hint.find("RoPE pairing ((2i, 2i+1) against (i, i+Dh/2))"), std::string::npos) << r.hint;
}

// rope_theta_10000: the model's base 1e6, the engine's 10000: pair 0 exact, the base named.
TEST(Pattern, RopeBaseWrongNamesTheBase) {
  const int64_t T = 6, H = 2, Dh = 32;
  const std::vector<float> q = noise(T * H * Dh, 11);
  const std::vector<float> b = rope(q, T, H, Dh, 0, 1e6, true), a = rope(q, T, H, Dh, 0, 10000.0, true);
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, H * Dh}, "T,H*Dh", {{"H", H}, {"Dh", Dh}}, "Qrope",
                                 1e-6, rope_context(0, 1e6, true));
  EXPECT_NE(p.hint.find("pair 0 exact at every position"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("the RoPE base (the engine's looks like 1e+04, the model's is 1e+06)"), std::string::npos)
      << p.hint;
  EXPECT_EQ(p.hint.find("pairing"), std::string::npos) << p.hint;
}

// A decode step rotated at position n_past + 1: every pair off by one position's angle.
TEST(Pattern, RopePositionOffByOneAtADecodeStep) {
  const int64_t H = 4, Dh = 64;
  const std::vector<float> q = noise(H * Dh, 3);
  const std::vector<float> b = rope(q, 1, H, Dh, 9, 500000.0, false), a = rope(q, 1, H, Dh, 10, 500000.0, false);
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{1, H, Dh}, "T,H,Dh", {}, "Qrope", 1e-6,
                                 rope_context(9, 500000.0, false));
  EXPECT_NE(p.hint.find("the position is off by +1"), std::string::npos) << p.hint;
  // Two positions behind in a prefill of 3 tokens.
  const std::vector<float> q3 = noise(3 * H * Dh, 5);
  const std::vector<float> b3 = rope(q3, 3, H, Dh, 4, 10000.0, true), a3 = rope(q3, 3, H, Dh, 2, 10000.0, true);
  ErrorPattern p3 = error_pattern(a3, b3, std::vector<int64_t>{3, H, Dh}, "T,H,Dh", {}, "Qrope", 1e-6,
                                  rope_context(4, 10000.0, true));
  EXPECT_NE(p3.hint.find("the position is off by -2"), std::string::npos) << p3.hint;
}

// Q4_1 dequantized with its min subtracted: embd rows d·q - m instead of d·q + m.
TEST(Pattern, Q41MinSignIsAPerBlockOffset) {
  const int64_t T = 3, D = 128;
  std::vector<float> a(T * D), b(T * D);
  const std::vector<float> u = noise(T * D, 13), blocks = noise(T * D / 32 * 2, 17);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t j = 0; j < D / 32; ++j) {
      const int64_t k = r * (D / 32) + j;
      const float d = 0.01f + 0.01f * std::abs(blocks[2 * k]), m = -0.08f + 0.05f * blocks[2 * k + 1];
      for (int64_t e = 0; e < 32; ++e) {
        const float q = std::floor((u[r * D + j * 32 + e] + 1.0f) * 7.99f);  // 0..15
        b[r * D + j * 32 + e] = d * q + m;
        a[r * D + j * 32 + e] = d * q - m;
      }
    }
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, D}, "T,D", {}, "embd", 1e-6);
  EXPECT_NE(p.hint.find("constant within each block of 32 elements"), std::string::npos) << p.hint;
  EXPECT_NE(p.hint.find("Q4_1"), std::string::npos) << p.hint;
}

// Plain noise on a rotated q and on an embedding gets none of these hints.
TEST(Pattern, NoiseGetsNoRopeOrBlockHint) {
  const int64_t T = 4, H = 2, Dh = 64;
  const std::vector<float> q = noise(T * H * Dh, 23);
  const std::vector<float> b = rope(q, T, H, Dh, 0, 10000.0, false), e = noise(T * H * Dh, 29);
  std::vector<float> a = b;
  for (size_t i = 0; i < a.size(); ++i) a[i] += 0.05f * e[i];
  ErrorPattern p = error_pattern(a, b, std::vector<int64_t>{T, H, Dh}, "T,H,Dh", {}, "Qrope", 1e-6,
                                 rope_context(0, 10000.0, false));
  EXPECT_EQ(p.hint, "") << p.hint;
  ErrorPattern bare = error_pattern(a, b, std::vector<int64_t>{T, H, Dh}, "T,H,Dh", {}, "Qrope", 1e-6);
  EXPECT_EQ(bare.hint, "") << bare.hint;
  ErrorPattern emb = error_pattern(a, b, std::vector<int64_t>{T, H * Dh}, "T,D", {}, "embd", 1e-6);
  EXPECT_EQ(emb.hint, "") << emb.hint;
}
