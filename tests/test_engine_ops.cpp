// GPU test: each engine op against its reference twin (reference_cpu/ops) on random inputs with odd
// sizes, and the GEMM layout (non-square, non-symmetric shapes that a transposed operand or a wrong
// leading dimension would fail).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include "engine/gemm.cuh"
#include "engine/ops/add.cuh"
#include "engine/ops/argmax.cuh"
#include "engine/ops/attention.cuh"
#include "engine/ops/embedding.cuh"
#include "engine/ops/kv_store.cuh"
#include "engine/ops/matmul.cuh"
#include "engine/ops/rms_norm.cuh"
#include "engine/ops/rope_neox.cuh"
#include "engine/ops/rope_norm.cuh"
#include "engine/ops/swiglu.cuh"
#include "model/dequant.hpp"
#include "reference_cpu/ops/add.hpp"
#include "reference_cpu/ops/attention.hpp"
#include "reference_cpu/ops/embedding.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/ops/rms_norm.hpp"
#include "reference_cpu/ops/rope.hpp"
#include "reference_cpu/ops/swiglu.hpp"
#include "tests/test_engine_common.hpp"

namespace diffrun {
namespace {

using test::DeviceArray;
using test::rel_l2;

std::vector<float> random_vec(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::vector<float> narrow(const std::vector<double>& v) { return {v.begin(), v.end()}; }

// Values rounded to f16 and back (what an f16 buffer holds).
std::vector<float> f16_round(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = f16_to_f32(f32_to_f16(v[i]));
  return r;
}

std::vector<__half> to_half(const std::vector<float>& v) {
  std::vector<__half> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = __float2half_rn(v[i]);
  return h;
}

std::vector<float> from_half(const std::vector<__half>& h) {
  std::vector<float> v(h.size());
  for (size_t i = 0; i < h.size(); ++i) v[i] = __half2float(h[i]);
  return v;
}

TEST(EngineOps, GemmLayoutNonSquare) {
  DIFFRUN_REQUIRE_CUDA();
  // y[T, N] = x[T, K] · W[N, K]ᵀ with T, K, N all different and W not symmetric.
  const int T = 3, K = 7, N = 5;
  std::vector<float> x(T * K), w(N * K);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) x[t * K + k] = float(t + 1) * 0.5f + float(k) * 0.25f;
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) w[n * K + k] = float((n * 3 + k * 5) % 11) - 4.0f;
  std::vector<float> expected(T * N, 0.0f);
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) expected[t * N + n] += x[t * K + k] * w[n * K + k];

  for (auto precision : {engine::EnginePrecision::f32, engine::EnginePrecision::f16}) {
    SCOPED_TRACE(precision == engine::EnginePrecision::f32 ? "f32" : "f16");
    engine::CublasHandle handle(precision);
    DeviceArray<float> y(T * N);
    if (precision == engine::EnginePrecision::f32) {
      DeviceArray<float> dx(x), dw(w);
      engine::gemm(y.get(), dx.get(), dw.get(), T, K, N, handle, nullptr);
    } else {
      DeviceArray<__half> dx(to_half(x)), dw(to_half(w));  // all values exact in f16
      engine::gemm(y.get(), dx.get(), dw.get(), T, K, N, handle, nullptr);
    }
    const std::vector<float> got = y.download();
    for (int i = 0; i < T * N; ++i) EXPECT_FLOAT_EQ(got[i], expected[i]) << "y[" << i / N << ", " << i % N << "]";
  }
}

TEST(EngineOps, MatmulWithBiasMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  const int T = 5, K = 67, N = 43;
  const auto x = random_vec(T * K, 1), w = random_vec(N * K, 2, 0.2f), b = random_vec(N, 3);
  std::vector<double> ref(T * N);
  ref::matmul(ref.data(), widen(x).data(), widen(w).data(), widen(b).data(), T, K, N);

  engine::CublasHandle h32(engine::EnginePrecision::f32);
  DeviceArray<float> dx(x), dw(w), db(b), y(T * N);
  engine::matmul(y.get(), dx.get(), dw.get(), db.get(), T, K, N, h32, nullptr);
  EXPECT_LT(rel_l2(y.download(), narrow(ref)), 1e-6);

  // f16 inputs, f32 accumulation: against the reference on the same f16-rounded inputs.
  std::vector<double> ref16(T * N);
  ref::matmul(ref16.data(), widen(f16_round(x)).data(), widen(f16_round(w)).data(), widen(b).data(), T, K, N);
  engine::CublasHandle h16(engine::EnginePrecision::f16);
  DeviceArray<__half> hx(to_half(x)), hw(to_half(w));
  engine::matmul(y.get(), hx.get(), hw.get(), db.get(), T, K, N, h16, nullptr);
  EXPECT_LT(rel_l2(y.download(), narrow(ref16)), 1e-5);
}

TEST(EngineOps, EmbeddingMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  const int V = 37, D = 29, T = 6;
  const auto table = random_vec(V * D, 4);
  const std::vector<int32_t> tokens = {0, 36, 5, 5, 17, 1};
  std::vector<float> ref(T * D);
  ref::embedding(ref.data(), tokens.data(), table.data(), T, D, V);

  DeviceArray<int32_t> dt(tokens);
  DeviceArray<float> dtab(table), out(T * D);
  engine::embedding(out.get(), dt.get(), dtab.get(), T, D, V, nullptr);
  EXPECT_EQ(out.download(), ref);

  DeviceArray<__half> htab(to_half(table));
  engine::embedding(out.get(), dt.get(), htab.get(), T, D, V, nullptr);
  std::vector<float> ref16(T * D);
  const auto table16 = f16_round(table);
  ref::embedding(ref16.data(), tokens.data(), table16.data(), T, D, V);
  EXPECT_EQ(out.download(), ref16);
}

TEST(EngineOps, RmsNormMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  for (auto [rows, D] : {std::pair{7, 97}, std::pair{15, 18}, std::pair{2, 896}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " D " + std::to_string(D));
    const auto x = random_vec(rows * D, 5, 3.0f), w = random_vec(D, 6);
    std::vector<double> ref(rows * D);
    ref::rms_norm(ref.data(), widen(x).data(), widen(w).data(), rows, D, 1e-6);
    DeviceArray<float> dx(x), dw(w), out(rows * D);
    engine::rms_norm(out.get(), dx.get(), dw.get(), rows, D, 1e-6f, nullptr);
    EXPECT_LT(rel_l2(out.download(), narrow(ref)), 1e-6);
    DeviceArray<__half> out16(rows * D);
    engine::rms_norm(out16.get(), dx.get(), dw.get(), rows, D, 1e-6f, nullptr);
    EXPECT_LT(rel_l2(from_half(out16.download()), narrow(ref)), 1e-3);
    engine::rms_norm(dx.get(), dx.get(), dw.get(), rows, D, 1e-6f, nullptr);  // in place
    EXPECT_LT(rel_l2(dx.download(), narrow(ref)), 1e-6);
  }
}

TEST(EngineOps, RopeMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  const int T = 5, nh = 3, Dh = 18, pos0 = 7;  // Dh/2 = 9 pairs: odd
  for (double theta : {10000.0, 1e6}) {
    const auto x = random_vec(T * nh * Dh, 7);
    DeviceArray<int32_t> dpos(std::vector<int32_t>{pos0});
    for (bool neox : {false, true}) {
      SCOPED_TRACE(std::string(neox ? "neox" : "norm") + " theta " + std::to_string(theta));
      std::vector<double> ref(x.size());
      if (neox)
        ref::rope_neox(ref.data(), widen(x).data(), T, nh, Dh, pos0, theta);
      else
        ref::rope_norm(ref.data(), widen(x).data(), T, nh, Dh, pos0, theta);
      DeviceArray<float> dx(x), out(x.size());
      if (neox)
        engine::rope_neox(out.get(), dx.get(), T, nh, Dh, dpos.get(), float(theta), nullptr);
      else
        engine::rope_norm(out.get(), dx.get(), T, nh, Dh, dpos.get(), float(theta), nullptr);
      EXPECT_LT(rel_l2(out.download(), narrow(ref)), 1e-6);
      // The pairing matters: the other pairing must not pass.
      std::vector<double> other(x.size());
      if (neox)
        ref::rope_norm(other.data(), widen(x).data(), T, nh, Dh, pos0, theta);
      else
        ref::rope_neox(other.data(), widen(x).data(), T, nh, Dh, pos0, theta);
      EXPECT_GT(rel_l2(out.download(), narrow(other)), 1e-2);
    }
  }
}

TEST(EngineOps, AttentionMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  for (auto [T, n_past, H, Hkv, Dh] : {std::tuple{5, 4, 6, 2, 40}, std::tuple{1, 37, 14, 2, 64},
                                       std::tuple{9, 0, 4, 4, 128}, std::tuple{3, 2, 8, 1, 256}}) {
    SCOPED_TRACE("T " + std::to_string(T) + " n_past " + std::to_string(n_past) + " H " + std::to_string(H) +
                 " Hkv " + std::to_string(Hkv) + " Dh " + std::to_string(Dh));
    const int S = n_past + T, Q = H * Dh, KV = Hkv * Dh;
    const auto q = random_vec(T * Q, 8), kc = random_vec(S * KV, 9), vc = random_vec(S * KV, 10);
    std::vector<double> out_ref(T * Q), probs_ref(size_t(H) * T * S);
    ref::attention(out_ref.data(), probs_ref.data(), widen(q).data(), widen(kc).data(), widen(vc).data(), T, n_past,
                   H, Hkv, Dh);

    DeviceArray<float> dq(q), dk(kc), dv(vc), out(T * Q), probs(size_t(H) * T * S);
    DeviceArray<int32_t> dnp(std::vector<int32_t>{n_past});
    engine::attention(out.get(), probs.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, nullptr);
    const auto got = out.download();
    EXPECT_LT(rel_l2(got, narrow(out_ref)), 1e-5);
    EXPECT_LT(rel_l2(probs.download(), narrow(probs_ref)), 1e-5);

    // Without probs the output is bit-identical (the same kernel runs).
    DeviceArray<float> out2(T * Q);
    engine::attention(out2.get(), nullptr, dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, nullptr);
    EXPECT_EQ(out2.download(), got);

    DeviceArray<__half> out16(T * Q);
    engine::attention(out16.get(), nullptr, dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, nullptr);
    EXPECT_LT(rel_l2(from_half(out16.download()), narrow(out_ref)), 1e-3);
  }
}

TEST(EngineOps, SwigluAndAddMatchReference) {
  DIFFRUN_REQUIRE_CUDA();
  const int64_t n = 1001;
  const auto g = random_vec(n, 11, 4.0f), u = random_vec(n, 12);
  std::vector<double> ref(n);
  ref::swiglu(ref.data(), widen(g).data(), widen(u).data(), n);
  DeviceArray<float> dg(g), du(u), out(n);
  engine::swiglu(out.get(), dg.get(), du.get(), n, nullptr);
  EXPECT_LT(rel_l2(out.download(), narrow(ref)), 1e-6);
  DeviceArray<__half> out16(n);
  engine::swiglu(out16.get(), dg.get(), du.get(), n, nullptr);
  EXPECT_LT(rel_l2(from_half(out16.download()), narrow(ref)), 1e-3);

  std::vector<float> sum(n);
  ref::add(sum.data(), g.data(), u.data(), n);
  engine::add(out.get(), dg.get(), du.get(), n, nullptr);
  EXPECT_EQ(out.download(), sum);
}

TEST(EngineOps, ArgmaxLowestIndexOnTiesSkipsNaN) {
  DIFFRUN_REQUIRE_CUDA();
  const int V = 151936;
  auto logits = random_vec(V, 13);
  logits[1000] = NAN;
  logits[77777] = 50.0f;
  logits[150001] = 50.0f;  // tie: the lower index wins
  logits[5] = NAN;
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> out(1);
  engine::argmax(out.get(), dl.get(), V, nullptr);
  EXPECT_EQ(out.download()[0], 77777);
  engine::argmax(out.get(), dl.get() + 100000, V - 100000, nullptr);  // a row not starting at 0
  EXPECT_EQ(out.download()[0], 50001);
  const std::vector<float> all_nan(33, NAN);
  DeviceArray<float> dn(all_nan);
  engine::argmax(out.get(), dn.get(), 33, nullptr);
  EXPECT_EQ(out.download()[0], -1);
}

TEST(EngineOps, KvStoreWritesRowsAtNPast) {
  DIFFRUN_REQUIRE_CUDA();
  const int C = 11, T = 4, width = 24, n_past = 3;
  const auto k = random_vec(T * width, 14), v = random_vec(T * width, 15);
  std::vector<float> zeros(C * width, 0.0f);
  DeviceArray<float> kc(zeros), vc(zeros), dk(k), dv(v);
  DeviceArray<int32_t> dnp(std::vector<int32_t>{n_past});
  engine::kv_store(kc.get(), vc.get(), dk.get(), dv.get(), T, dnp.get(), width, nullptr);
  const auto hk = kc.download(), hv = vc.download();
  for (int s = 0; s < C; ++s)
    for (int j = 0; j < width; ++j) {
      const bool written = s >= n_past && s < n_past + T;
      EXPECT_EQ(hk[s * width + j], written ? k[(s - n_past) * width + j] : 0.0f);
      EXPECT_EQ(hv[s * width + j], written ? v[(s - n_past) * width + j] : 0.0f);
    }
}

}  // namespace
}  // namespace diffrun
