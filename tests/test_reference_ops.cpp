// Unit tests of the reference's ops against naive double loops on odd shapes (T=3, D=37, H=3, Hkv=1, Dh=10, S=5).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "model/error.hpp"
#include "reference_cpu/ops/add.hpp"
#include "reference_cpu/ops/attention.hpp"
#include "reference_cpu/ops/embedding.hpp"
#include "reference_cpu/ops/geglu.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/ops/rms_norm.hpp"
#include "reference_cpu/ops/rope.hpp"
#include "reference_cpu/ops/scale.hpp"
#include "reference_cpu/ops/swiglu.hpp"

namespace diffrun::ref {
namespace {

std::vector<double> random_values(size_t n, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

template <typename T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

template <typename T>
void expect_near_all(const std::vector<T>& got, const std::vector<double>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(static_cast<double>(got[i]), want[i], rel * (1.0 + std::abs(want[i]))) << "element " << i;
  }
}

template <typename T>
class ReferenceOps : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ReferenceOps, Scalars);

constexpr int kT = 3, kD = 37, kH = 3, kHkv = 1, kDh = 10, kF = 23, kV = 11;

TYPED_TEST(ReferenceOps, EmbeddingCopiesRowsAndRejectsBadIds) {
  using T = TypeParam;
  const auto table = random_values(static_cast<size_t>(kV) * kD, 1);
  const std::vector<int32_t> ids = {7, 0, 10};
  std::vector<T> out(kT * kD);
  embedding(out.data(), ids.data(), as<T>(table).data(), kT, kD, kV);
  std::vector<double> want(kT * kD);
  for (int t = 0; t < kT; ++t)
    for (int d = 0; d < kD; ++d) want[t * kD + d] = static_cast<T>(table[ids[t] * kD + d]);
  expect_near_all(out, want, 0.0);
  const std::vector<int32_t> bad = {3, kV};
  EXPECT_THROW(embedding(out.data(), bad.data(), as<T>(table).data(), 2, kD, kV), InputError);
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(embedding(out.data(), negative.data(), as<T>(table).data(), 1, kD, kV), InputError);
}

TYPED_TEST(ReferenceOps, RmsNormMatchesNaiveWithEps) {
  using T = TypeParam;
  const auto x = random_values(kT * kD, 2);
  const auto w = random_values(kD, 3, 0.5, 1.5);
  for (double eps : {1e-5, 1e-6, 0.5}) {
    std::vector<T> out(kT * kD);
    rms_norm(out.data(), as<T>(x).data(), as<T>(w).data(), kT, kD, T(eps));
    std::vector<double> want(kT * kD);
    for (int t = 0; t < kT; ++t) {
      double ss = 0;
      for (int d = 0; d < kD; ++d) ss += x[t * kD + d] * x[t * kD + d];
      const double scale = 1.0 / std::sqrt(ss / kD + eps);
      for (int d = 0; d < kD; ++d) want[t * kD + d] = x[t * kD + d] * scale * w[d];
    }
    expect_near_all(out, want, tolerance<T>());
  }
  // Tiny inputs: eps dominates, so a missing or misplaced eps shows.
  std::vector<double> tiny(kD, 1e-4);
  std::vector<T> out(kD);
  rms_norm(out.data(), as<T>(tiny).data(), as<T>(w).data(), 1, kD, T(1e-5));
  for (int d = 0; d < kD; ++d) EXPECT_NEAR(out[d], 1e-4 / std::sqrt(1e-8 + 1e-5) * w[d], 1e-5);
}

TYPED_TEST(ReferenceOps, MatmulMatchesNaiveForPrefillAndDecode) {
  using T = TypeParam;
  const int K = kD, N = kF;
  const auto x = random_values(kT * K, 4);
  const auto W = random_values(N * K, 5);
  const auto b = random_values(N, 6);
  for (int n_tokens : {kT, 1}) {
    for (bool with_bias : {false, true}) {
      std::vector<T> out(n_tokens * N);
      matmul(out.data(), as<T>(x).data(), as<T>(W).data(), with_bias ? as<T>(b).data() : nullptr, n_tokens, K, N);
      std::vector<double> want(n_tokens * N);
      for (int t = 0; t < n_tokens; ++t)
        for (int n = 0; n < N; ++n) {
          double acc = with_bias ? b[n] : 0.0;
          for (int k = 0; k < K; ++k) acc += x[t * K + k] * W[n * K + k];
          want[t * N + n] = acc;
        }
      expect_near_all(out, want, tolerance<T>());
    }
  }
}

// Naive rope: pair (a, b) of pair index i rotates by pos * theta^(-2i/Dh).
std::vector<double> naive_rope(const std::vector<double>& x, int n_tokens, int n_head, int Dh, int pos0,
                               double theta, bool neox) {
  std::vector<double> y = x;
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < n_head; ++h)
      for (int i = 0; i < Dh / 2; ++i) {
        const double angle = (pos0 + t) * std::pow(theta, -2.0 * i / Dh);
        const int base = (t * n_head + h) * Dh;
        const int a = neox ? base + i : base + 2 * i;
        const int b = neox ? base + i + Dh / 2 : base + 2 * i + 1;
        y[a] = x[a] * std::cos(angle) - x[b] * std::sin(angle);
        y[b] = x[a] * std::sin(angle) + x[b] * std::cos(angle);
      }
  return y;
}

TYPED_TEST(ReferenceOps, RopeNormAndNeoxMatchNaivePairings) {
  using T = TypeParam;
  const auto x = random_values(kT * kH * kDh, 7);
  const int pos0 = 5;
  const double theta = 10000.0;
  std::vector<T> norm(x.size()), neox(x.size());
  rope_norm(norm.data(), as<T>(x).data(), kT, kH, kDh, pos0, T(theta));
  rope_neox(neox.data(), as<T>(x).data(), kT, kH, kDh, pos0, T(theta));
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  expect_near_all(norm, naive_rope(x, kT, kH, kDh, pos0, theta, false), tol);
  expect_near_all(neox, naive_rope(x, kT, kH, kDh, pos0, theta, true), tol);
  // The two pairings differ: a swapped pairing would not pass both checks.
  EXPECT_GT(std::abs(static_cast<double>(norm[1]) - static_cast<double>(neox[1])), 1e-3);
  // In place, position 0: identity.
  std::vector<T> y = as<T>(x);
  rope_neox(y.data(), y.data(), 1, kH, kDh, 0, T(theta));
  for (int i = 0; i < kH * kDh; ++i) EXPECT_EQ(y[i], static_cast<T>(x[i]));
}

TYPED_TEST(ReferenceOps, AttentionMatchesNaiveWithCausalMaskAndGqa) {
  using T = TypeParam;
  // (H, Hkv, scale, window): llama's 1/sqrt(Dh) over every position, and a gemma3-like scale with a
  // sliding window of 2 positions (the query and the one before it).
  struct Case { int H, Hkv; double scale; int window; };
  for (Case c : {Case{kH, kHkv, 0, 0}, Case{4, 2, 0, 0}, Case{4, 2, 0.3, 2}}) {
    const int H = c.H, Hkv = c.Hkv;
    const int n_past = 2, S = n_past + kT, Dh = kDh;  // S = 5
    const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(Dh));
    const auto q = random_values(kT * H * Dh, 8, -2, 2);
    const auto k = random_values(S * Hkv * Dh, 9, -2, 2);
    const auto v = random_values(S * Hkv * Dh, 10);
    std::vector<T> out(kT * H * Dh), probs(H * kT * S, T(-7));
    attention(out.data(), probs.data(), as<T>(q).data(), as<T>(k).data(), as<T>(v).data(), kT, n_past, H, Hkv, Dh,
              T(scale), c.window);
    std::vector<double> want_out(out.size()), want_probs(probs.size(), 0.0);
    for (int h = 0; h < H; ++h) {
      const int kvh = h / (H / Hkv);
      for (int t = 0; t < kT; ++t) {
        const int first = c.window > 0 ? std::max(0, n_past + t + 1 - c.window) : 0;
        std::vector<double> score(S, -INFINITY);
        double mx = -INFINITY;
        for (int s = first; s <= n_past + t; ++s) {
          double dot = 0;
          for (int d = 0; d < Dh; ++d) dot += q[(t * H + h) * Dh + d] * k[(s * Hkv + kvh) * Dh + d];
          score[s] = dot * scale;
          mx = std::max(mx, score[s]);
        }
        double sum = 0;
        for (int s = first; s <= n_past + t; ++s) sum += std::exp(score[s] - mx);
        for (int s = first; s <= n_past + t; ++s) {
          const double p = std::exp(score[s] - mx) / sum;
          want_probs[(h * kT + t) * S + s] = p;
          for (int d = 0; d < Dh; ++d) want_out[(t * H + h) * Dh + d] += p * v[(s * Hkv + kvh) * Dh + d];
        }
      }
    }
    expect_near_all(probs, want_probs, tolerance<T>());
    expect_near_all(out, want_out, tolerance<T>());
    // Masked positions are exactly zero: the first new token sees n_past + 1 positions.
    for (int h = 0; h < H; ++h) EXPECT_EQ(probs[(h * kT + 0) * S + n_past + 1], T(0));
    // Outside the window too: the last token (position 4) with a window of 2 sees positions 3 and 4 only.
    if (c.window == 2) {
      for (int h = 0; h < H; ++h) EXPECT_EQ(probs[(h * kT + kT - 1) * S + 2], T(0));
    }
  }
}

TYPED_TEST(ReferenceOps, GegluScaleAndSoftcapMatchTheirFormulas) {
  using T = TypeParam;
  const auto gate = random_values(64, 21, -4, 4);
  const auto up = random_values(64, 22, -2, 2);
  std::vector<T> out(64), scaled(64), capped(64);
  geglu(out.data(), as<T>(gate).data(), as<T>(up).data(), 64);
  scale(scaled.data(), as<T>(gate).data(), T(25.298221281347036), 64);  // sqrt(640)
  softcap(capped.data(), as<T>(gate).data(), T(3), 64);
  std::vector<double> want(64), want_scaled(64), want_capped(64);
  for (int i = 0; i < 64; ++i) {
    const double g = gate[i];
    // GELU's tanh approximation (transformers' gelu_pytorch_tanh, ggml_gelu).
    want[i] = 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) * up[i];
    want_scaled[i] = g * std::sqrt(640.0);
    want_capped[i] = 3 * std::tanh(g / 3);
  }
  expect_near_all(out, want, tolerance<T>());
  expect_near_all(scaled, want_scaled, tolerance<T>() * 30);
  expect_near_all(capped, want_capped, tolerance<T>());
  // gelu_tanh(0) = 0, and it is close to the identity for large inputs.
  const std::vector<double> edge_gate = {0, 6}, edge_up = {1, 1};
  std::vector<T> edge(2);
  geglu(edge.data(), as<T>(edge_gate).data(), as<T>(edge_up).data(), 2);
  EXPECT_EQ(edge[0], T(0));
  EXPECT_NEAR(static_cast<double>(edge[1]), 6.0, 1e-6);
}

TYPED_TEST(ReferenceOps, AttentionSoftmaxIsStableForLargeScores) {
  using T = TypeParam;
  const int Dh = 4;
  const std::vector<double> q = {100, 100, 100, 100};
  const std::vector<double> k = {100, 100, 100, 100, 99, 99, 99, 99};
  const std::vector<double> v = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<T> out(Dh), probs(2);
  attention(out.data(), probs.data(), as<T>(q).data(), as<T>(k).data(), as<T>(v).data(), 1, 1, 1, 1, Dh, T(0.5), 0);
  // scores 20000 and 19800 (after 1/sqrt(4)): without max subtraction exp overflows.
  EXPECT_NEAR(static_cast<double>(probs[0]), 1.0, 1e-6);
  EXPECT_TRUE(std::isfinite(static_cast<double>(out[0])));
  EXPECT_NEAR(static_cast<double>(out[0]), 1.0, 1e-5);
}

TYPED_TEST(ReferenceOps, SwigluAndAddMatchNaive) {
  using T = TypeParam;
  const auto g = random_values(kT * kF, 11, -6, 6);
  const auto u = random_values(kT * kF, 12);
  std::vector<T> out(kT * kF), sum(kT * kF);
  swiglu(out.data(), as<T>(g).data(), as<T>(u).data(), kT * kF);
  add(sum.data(), as<T>(g).data(), as<T>(u).data(), kT * kF);
  std::vector<double> want(kT * kF), want_sum(kT * kF);
  for (int i = 0; i < kT * kF; ++i) {
    want[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    want_sum[i] = g[i] + u[i];
  }
  expect_near_all(out, want, tolerance<T>());
  expect_near_all(sum, want_sum, tolerance<T>());
}

}  // namespace
}  // namespace diffrun::ref
