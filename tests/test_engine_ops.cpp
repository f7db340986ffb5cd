// GPU test: each engine op against its reference twin (reference_cpu/ops) on random inputs with odd
// sizes, and the GEMM layout (non-square, non-symmetric shapes that a transposed operand or a wrong
// leading dimension would fail).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include "engine/checkpoint_stager.cuh"
#include "engine/cuda_check.cuh"
#include "engine/device_buffer.cuh"
#include "engine/gemm.cuh"
#include "engine/ops/add_rms_norm.cuh"
#include "engine/ops/argmax.cuh"
#include "engine/ops/attention.cuh"
#include "engine/ops/embedding.cuh"
#include "engine/ops/embedding_rms_norm.cuh"
#include "engine/ops/step_inputs.cuh"
#include "engine/ops/geglu.cuh"
#include "engine/ops/matmul.cuh"
#include "engine/ops/moe.cuh"
#include "engine/ops/qk_norm_rope.cuh"
#include "engine/ops/rms_norm.cuh"
#include "engine/ops/rope_qk.cuh"
#include "engine/ops/scale.cuh"
#include "engine/ops/swiglu.cuh"
#include "model/dequant.hpp"
#include "model/error.hpp"
#include "reference_cpu/ops/add.hpp"
#include "reference_cpu/ops/attention.hpp"
#include "reference_cpu/ops/embedding.hpp"
#include "reference_cpu/ops/geglu.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/ops/moe.hpp"
#include "reference_cpu/ops/rms_norm.hpp"
#include "reference_cpu/ops/rope.hpp"
#include "reference_cpu/ops/scale.hpp"
#include "reference_cpu/ops/swiglu.hpp"
#include "engine/ops/add.cuh"
#include "tests/engine_ops/kv_store.cuh"
#include "tests/engine_ops/rope.cuh"
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

// The bit patterns of v (vectors with NaNs compare equal when their bits do).
std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
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

// One token: the GEMV kernel (16-byte path when K·sizeof(W) is a multiple of 16, else the scalar
// path), against the CPU matmul twin, within f32 rounding of the sum; every output written.
TEST(EngineOps, MatmulOneTokenGemvMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  // N below 4096: four warps per row; from 4096: a warp per row.
  for (auto [K, N] : {std::pair{67, 43}, std::pair{896, 131}, std::pair{4864, 37}, std::pair{8, 1}, std::pair{260, 5},
                      std::pair{264, 4101}, std::pair{67, 4097}}) {
    SCOPED_TRACE("K " + std::to_string(K) + " N " + std::to_string(N));
    const auto x = random_vec(K, 11), w = random_vec(size_t(N) * K, 12, 0.2f), b = random_vec(N, 13);
    for (bool with_bias : {false, true}) {
      const float* bias = with_bias ? b.data() : nullptr;
      std::vector<double> ref(N), ref16(N);
      const std::vector<double> wb = widen(b);
      ref::matmul(ref.data(), widen(x).data(), widen(w).data(), with_bias ? wb.data() : nullptr, 1, K, N);
      ref::matmul(ref16.data(), widen(f16_round(x)).data(), widen(f16_round(w)).data(),
                  with_bias ? wb.data() : nullptr, 1, K, N);
      DeviceArray<float> dx(x), dw(w), db(b), y(std::vector<float>(N, std::nanf("")));
      engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
      engine::matmul(y.get(), dx.get(), dw.get(), bias ? db.get() : nullptr, 1, K, N, h32, nullptr);
      EXPECT_LT(rel_l2(y.download(), narrow(ref)), 1e-6);
      DeviceArray<__half> hx(to_half(x)), hw(to_half(w));
      DeviceArray<float> y16(std::vector<float>(N, std::nanf("")));
      engine::matmul(y16.get(), hx.get(), hw.get(), bias ? db.get() : nullptr, 1, K, N, h16, nullptr);
      EXPECT_LT(rel_l2(y16.download(), narrow(ref16)), 1e-6);
      // and against cuBLAS on the same inputs (two tokens take the GEMM path; row 0 is x)
      std::vector<float> x2 = x;
      x2.insert(x2.end(), x.begin(), x.end());
      DeviceArray<float> dx2(x2), y2(2 * N);
      engine::matmul(y2.get(), dx2.get(), dw.get(), bias ? db.get() : nullptr, 2, K, N, h32, nullptr);
      std::vector<float> row0 = y2.download();
      row0.resize(N);
      EXPECT_LT(rel_l2(y.download(), row0), 1e-6);
    }
  }
}

// The fused projections: parts of one concatenated weight, each to its own output, against one
// CPU matmul per part; one token (the GEMV) and several (cuBLAS per part).
TEST(EngineOps, MatmulCatMatchesReferencePerPart) {
  DIFFRUN_REQUIRE_CUDA();
  const int K = 72;
  const int Ns[3] = {40, 16, 16};
  const int N = Ns[0] + Ns[1] + Ns[2];
  const auto w = random_vec(size_t(N) * K, 14, 0.2f), b = random_vec(N, 15);
  engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
  for (int T : {1, 3}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const auto x = random_vec(size_t(T) * K, 16 + T);
    DeviceArray<float> dx(x), dw(w), db(b);
    DeviceArray<__half> hx(to_half(x)), hw(to_half(w));
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(f16 ? "f16" : "f32");
      DeviceArray<float> o0(std::vector<float>(size_t(T) * Ns[0], std::nanf(""))),
          o1(std::vector<float>(size_t(T) * Ns[1], std::nanf(""))), o2(std::vector<float>(size_t(T) * Ns[2], std::nanf("")));
      const DeviceArray<float>* outs[3] = {&o0, &o1, &o2};
      const float* db1 = db.get() + Ns[0];
      const float* db2 = db1 + Ns[1];
      if (f16)
        engine::matmul_cat({{o0.get(), db.get(), Ns[0]}, {o1.get(), db1, Ns[1]}, {o2.get(), db2, Ns[2]}},
                           hx.get(), hw.get(), T, K, h16, nullptr);
      else
        engine::matmul_cat({{o0.get(), db.get(), Ns[0]}, {o1.get(), db1, Ns[1]}, {o2.get(), db2, Ns[2]}},
                           dx.get(), dw.get(), T, K, h32, nullptr);
      const std::vector<float> xs = f16 ? f16_round(x) : x, ws = f16 ? f16_round(w) : w;
      int row = 0;
      for (int p = 0; p < 3; ++p) {
        std::vector<double> ref(size_t(T) * Ns[p]);
        const std::vector<double> wp(ws.begin() + size_t(row) * K, ws.begin() + size_t(row + Ns[p]) * K);
        const std::vector<double> bp(b.begin() + row, b.begin() + row + Ns[p]);
        ref::matmul(ref.data(), widen(xs).data(), wp.data(), bp.data(), T, K, Ns[p]);
        EXPECT_LT(rel_l2(outs[p]->download(), narrow(ref)), 1e-5) << "part " << p;
        row += Ns[p];
      }
    }
  }
}

// The gate|up GEMV with the SwiGLU epilogue (one token, dense Wgate|Wup) against matmul_cat then
// swiglu: gate, up and act bit-identical, f32 and f16, 4-warp rows (2F < 4096 with long K, or odd K)
// and whole rows a warp, 16-byte rows and rows of odd K (the scalar loop), F odd (a half-filled last
// block).
TEST(EngineOps, MatmulGateUpSwigluMatchesMatmulCatThenSwiglu) {
  DIFFRUN_REQUIRE_CUDA();
  engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
  for (auto [F, K] : {std::pair{37, 96}, std::pair{2051, 64}, std::pair{45, 97}, std::pair{2049, 33},
                      std::pair{40, 1088}}) {
    SCOPED_TRACE("F " + std::to_string(F) + " K " + std::to_string(K));
    const auto w = random_vec(size_t(2 * F) * K, 60, 0.3f), x = random_vec(K, 61);
    DeviceArray<float> dx(x), dw(w);
    DeviceArray<__half> hx(to_half(x)), hw(to_half(w));
    engine::DeviceMatrix<float> m32;
    m32.dense = dw.get();
    m32.K = K;
    m32.rows = 2 * F;
    engine::DeviceMatrix<__half> m16;
    m16.dense = hw.get();
    m16.K = K;
    m16.rows = 2 * F;
    const std::vector<float> nan(F, std::nanf(""));
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(f16 ? "f16" : "f32");
      DeviceArray<float> g1(nan), u1(nan), g2(nan), u2(nan), a1(nan), a2(nan);
      DeviceArray<__half> a1h(to_half(nan)), a2h(to_half(nan));
      if (f16) {
        engine::matmul_cat({{g1.get(), nullptr, F}, {u1.get(), nullptr, F}}, hx.get(), m16, 1, K, h16, nullptr);
        engine::swiglu(a1h.get(), g1.get(), u1.get(), F, nullptr);
        ASSERT_TRUE(engine::matmul_gate_up_swiglu(g2.get(), u2.get(), a2h.get(), hx.get(), m16, K, F, nullptr));
        EXPECT_EQ(from_half(a2h.download()), from_half(a1h.download()));
      } else {
        engine::matmul_cat({{g1.get(), nullptr, F}, {u1.get(), nullptr, F}}, dx.get(), m32, 1, K, h32, nullptr);
        engine::swiglu(a1.get(), g1.get(), u1.get(), F, nullptr);
        ASSERT_TRUE(engine::matmul_gate_up_swiglu(g2.get(), u2.get(), a2.get(), dx.get(), m32, K, F, nullptr));
        EXPECT_EQ(a2.download(), a1.download());
      }
      EXPECT_EQ(g2.download(), g1.download());
      EXPECT_EQ(u2.download(), u1.download());
      TEST_CUDA_CHECK(cudaGetLastError());
    }
  }
}

// The qkv GEMV with the RoPE epilogue (one token, dense Wq|Wk|Wv) against matmul_cat then rope_qk:
// q, k, v and both caches (every row, the written one and the others) bit-identical, f32 and f16,
// neox and norm pairing, biases or none, freq factors or none, 4-warp rows (N < 4096 with long K, or
// odd K) and whole rows a warp, 16-byte rows and odd K, a cache row apart from the position
// (kv_cache_pos0's write_pos).
TEST(EngineOps, MatmulQkvRopeMatchesMatmulCatThenRopeQk) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    int H, Hkv, Dh, K, pos, write_pos;
    bool neox, bias, factors;
  };
  engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
  for (const Case c : {Case{14, 2, 64, 96, 37, 37, true, true, false}, Case{4, 2, 18, 97, 5, 5, false, false, true},
                       Case{32, 4, 128, 64, 300, 300, true, false, true}, Case{9, 3, 64, 33, 7, 0, false, true, false},
                       Case{4, 2, 64, 1088, 9, 9, true, true, false}}) {
    SCOPED_TRACE("H " + std::to_string(c.H) + " Hkv " + std::to_string(c.Hkv) + " Dh " + std::to_string(c.Dh) +
                 " K " + std::to_string(c.K) + (c.neox ? " neox" : " norm"));
    const int Q = c.H * c.Dh, KV = c.Hkv * c.Dh, N = Q + 2 * KV, K = c.K, ctx = 320;
    const auto w = random_vec(size_t(N) * K, 70, 0.3f), x = random_vec(K, 71), b = random_vec(N, 72);
    const auto factors = random_vec(c.Dh / 2, 73);
    std::vector<float> ff(factors.size());
    for (size_t i = 0; i < ff.size(); ++i) ff[i] = 1.0f + std::fabs(factors[i]);
    const auto cache0 = random_vec(size_t(ctx) * KV, 74);
    DeviceArray<float> dx(x), dw(w), db(b), dff(ff);
    DeviceArray<__half> hx(to_half(x)), hw(to_half(w));
    DeviceArray<int32_t> dpos(std::vector<int32_t>{c.pos}), dwpos(std::vector<int32_t>{c.write_pos});
    engine::DeviceMatrix<float> m32;
    m32.dense = dw.get();
    m32.K = K;
    m32.rows = N;
    engine::DeviceMatrix<__half> m16;
    m16.dense = hw.get();
    m16.K = K;
    m16.rows = N;
    const float* bq = c.bias ? db.get() : nullptr;
    const float* bk = c.bias ? db.get() + Q : nullptr;
    const float* bv = c.bias ? db.get() + Q + KV : nullptr;
    const float* dfactors = c.factors ? dff.get() : nullptr;
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(f16 ? "f16" : "f32");
      const std::vector<float> nq(Q, std::nanf("")), nkv(KV, std::nanf(""));
      DeviceArray<float> q1(nq), k1(nkv), v1(nkv), q2(nq), k2(nkv), v2(nkv);
      DeviceArray<float> kc1(cache0), vc1(cache0), kc2(cache0), vc2(cache0);
      if (f16)
        engine::matmul_cat({{q1.get(), bq, Q}, {k1.get(), bk, KV}, {v1.get(), bv, KV}}, hx.get(), m16, 1, K, h16, nullptr);
      else
        engine::matmul_cat({{q1.get(), bq, Q}, {k1.get(), bk, KV}, {v1.get(), bv, KV}}, dx.get(), m32, 1, K, h32, nullptr);
      engine::rope_qk(q1.get(), k1.get(), kc1.get(), vc1.get(), q1.get(), k1.get(), v1.get(), 1, c.H, c.Hkv, c.Dh,
                      dpos.get(), dwpos.get(), 10000.0f, dfactors, c.neox, nullptr);
      const engine::GemvRope rope{kc2.get(), vc2.get(), dpos.get(), dwpos.get(), dfactors, 10000.0f,
                                  c.H,       c.Hkv,     c.Dh,       c.neox};
      if (f16)
        ASSERT_TRUE(engine::matmul_qkv_rope(q2.get(), k2.get(), v2.get(), bq, bk, bv, hx.get(), m16, K, rope, nullptr));
      else
        ASSERT_TRUE(engine::matmul_qkv_rope(q2.get(), k2.get(), v2.get(), bq, bk, bv, dx.get(), m32, K, rope, nullptr));
      EXPECT_EQ(q2.download(), q1.download());
      EXPECT_EQ(k2.download(), k1.download());
      EXPECT_EQ(v2.download(), v1.download());
      EXPECT_EQ(kc2.download(), kc1.download());
      EXPECT_EQ(vc2.download(), vc1.download());
      TEST_CUDA_CHECK(cudaGetLastError());
    }
  }
}

// A dense DeviceMatrix over the device rows w [rows, K].
template <typename W>
engine::DeviceMatrix<W> dense_matrix(const W* w, int K, int rows) {
  engine::DeviceMatrix<W> m;
  m.dense = w;
  m.K = K;
  m.rows = rows;
  return m;
}

// A one-token GEMV's operands on the device, in f32 and f16: x [K] (random_vec seed), w [N, K] (seed + 1, scale
// 0.2), a bias [N] (seed + 2), and the position 3 for the RoPE epilogue.
struct GemvOperands {
  GemvOperands(int N, int K, uint32_t seed)
      : x(random_vec(K, seed)), w(random_vec(size_t(N) * K, seed + 1, 0.2f)), b(random_vec(N, seed + 2)), dx(x),
        dw(w), db(b), hx(to_half(x)), hw(to_half(w)), dpos(std::vector<int32_t>{3}) {}
  std::vector<float> x, w, b;
  DeviceArray<float> dx, dw, db;
  DeviceArray<__half> hx, hw;
  DeviceArray<int32_t> dpos;
};

// The one-warp-per-row GEMV (N >= 4096) with 1, 2 or 4 rows per warp (DIFFRUN_GEMV_ROWS_PER_WARP):
// every output bit-identical across the three, for the plain launch with a bias, the SwiGLU epilogue
// and the RoPE epilogue (with its cache rows); f32 and f16; K of 896 (the 0.5B shape, one round of
// loads), 2048 (several rounds) and 72 (a partial round); N not a multiple of the block's rows.
TEST(EngineOps, GemvRowsPerWarpGiveTheSameBits) {
  DIFFRUN_REQUIRE_CUDA();
  engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
  for (auto [N, K] : {std::pair{4102, 896}, std::pair{9728, 72}, std::pair{4096, 2048}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(K));
    const int F = N / 2, H = 32, Hkv = 16, Dh = 64, Q = H * Dh, KV = Hkv * Dh, ctx = 4;  // qkv: 4096 rows
    const GemvOperands op(N, K, 90);
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(f16 ? "f16" : "f32");
      std::vector<std::vector<uint32_t>> first;
      for (const char* rows : {"1", "2", "4"}) {
        SCOPED_TRACE(std::string("rows per warp ") + rows);
        setenv("DIFFRUN_GEMV_ROWS_PER_WARP", rows, 1);
        const std::vector<float> nan_n(N, std::nanf("")), nan_f(F, std::nanf(""));
        const std::vector<float> zq(Q, 0.0f), zkv(KV, 0.0f), zc(size_t(ctx) * KV, 0.0f);
        DeviceArray<float> y(nan_n), g(nan_f), u(nan_f), act(nan_f), q(zq), k(zkv), v(zkv), kc(zc), vc(zc);
        DeviceArray<__half> act16(to_half(nan_f));
        const engine::GemvRope rope{kc.get(), vc.get(), op.dpos.get(), op.dpos.get(), nullptr, 10000.0f,
                                    H,        Hkv,      Dh,            true};
        // The three launches for weights and activations of one type (W), the act of that type.
        const auto run = [&](const auto* xw, const auto* ww, auto* act_w, const engine::CublasHandle& h) {
          const auto m = dense_matrix(ww, K, N);
          engine::matmul(y.get(), xw, ww, op.db.get(), 1, K, N, h, nullptr);
          EXPECT_TRUE(engine::matmul_gate_up_swiglu(g.get(), u.get(), act_w, xw, m, K, F, nullptr));
          EXPECT_TRUE(engine::matmul_qkv_rope(q.get(), k.get(), v.get(), op.db.get(), op.db.get() + Q,
                                              op.db.get() + Q + KV, xw, m, K, rope, nullptr));
        };
        if (f16) run(op.hx.get(), op.hw.get(), act16.get(), h16);
        else run(op.dx.get(), op.dw.get(), act.get(), h32);
        std::vector<std::vector<uint32_t>> got;
        for (auto* d : {&y, &g, &u, &act, &q, &k, &v, &kc, &vc}) got.push_back(bits(d->download()));
        got.push_back(bits(from_half(act16.download())));
        TEST_CUDA_CHECK(cudaGetLastError());
        const auto y_host = y.download();
        EXPECT_TRUE(std::none_of(y_host.begin(), y_host.end(), [](float f) { return std::isnan(f); }));
        if (first.empty()) {
          first = got;
        } else {
          for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], first[i]) << "output " << i;
        }
      }
      unsetenv("DIFFRUN_GEMV_ROWS_PER_WARP");
    }
  }
}

// DIFFRUN_GEMV_WARPS_PER_ROW=W[xB] (2, 4 or 8 warps a row; 4 or 8 loads a round): each setting's plain launch
// within f32 rounding of the rows kernel's (another summation order), and its paired launches computing its plain
// rows bit for bit (the SwiGLU epilogue against matmul_cat then swiglu, the RoPE epilogue against matmul_cat then
// rope_qk, both caches included); f32 and f16, K of 2056 (several rounds, a partial last one), N not a multiple of
// the block's rows. A value that is not one is refused (exit 2 at the command line).
TEST(EngineOps, GemvWarpsPerRowSettings) {
  DIFFRUN_REQUIRE_CUDA();
  engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
  const int N = 4102, K = 2056, F = N / 2, H = 32, Hkv = 16, Dh = 64, Q = H * Dh, KV = Hkv * Dh, ctx = 4;
  const GemvOperands op(N, K, 93);
  for (bool f16 : {false, true}) {
    SCOPED_TRACE(f16 ? "f16" : "f32");
    std::vector<float> rows_kernel;
    for (const char* setting : {"1", "2", "2x8", "4", "4x8", "8", "8x8"}) {
      SCOPED_TRACE(std::string("DIFFRUN_GEMV_WARPS_PER_ROW=") + setting);
      setenv("DIFFRUN_GEMV_WARPS_PER_ROW", setting, 1);
      const std::vector<float> nan_n(N, std::nanf("")), nan_f(F, std::nanf(""));
      const std::vector<float> zq(Q, 0.0f), zkv(KV, 0.0f), zc(size_t(ctx) * KV, 0.0f);
      DeviceArray<float> y(nan_n), g1(nan_f), u1(nan_f), a1(nan_f), g2(nan_f), u2(nan_f), a2(nan_f);
      DeviceArray<float> q1(zq), k1(zkv), v1(zkv), kc1(zc), vc1(zc), q2(zq), k2(zkv), v2(zkv), kc2(zc), vc2(zc);
      DeviceArray<__half> a1h(to_half(nan_f)), a2h(to_half(nan_f));
      const engine::GemvRope rope{kc2.get(), vc2.get(), op.dpos.get(), op.dpos.get(), nullptr, 10000.0f,
                                  H,         Hkv,       Dh,            true};
      const auto run = [&](const auto* xw, const auto* ww, auto* act1, auto* act2, const engine::CublasHandle& h) {
        const auto m = dense_matrix(ww, K, N);
        engine::matmul(y.get(), xw, ww, op.db.get(), 1, K, N, h, nullptr);
        engine::matmul_cat({{g1.get(), nullptr, F}, {u1.get(), nullptr, F}}, xw, m, 1, K, h, nullptr);
        engine::swiglu(act1, g1.get(), u1.get(), F, nullptr);
        EXPECT_TRUE(engine::matmul_gate_up_swiglu(g2.get(), u2.get(), act2, xw, m, K, F, nullptr));
        engine::matmul_cat(
            {{q1.get(), op.db.get(), Q}, {k1.get(), op.db.get() + Q, KV}, {v1.get(), op.db.get() + Q + KV, KV}}, xw, m,
            1, K, h, nullptr);
        engine::rope_qk(q1.get(), k1.get(), kc1.get(), vc1.get(), q1.get(), k1.get(), v1.get(), 1, H, Hkv, Dh,
                        op.dpos.get(), op.dpos.get(), 10000.0f, nullptr, true, nullptr);
        EXPECT_TRUE(engine::matmul_qkv_rope(q2.get(), k2.get(), v2.get(), op.db.get(), op.db.get() + Q,
                                            op.db.get() + Q + KV, xw, m, K, rope, nullptr));
      };
      if (f16) run(op.hx.get(), op.hw.get(), a1h.get(), a2h.get(), h16);
      else run(op.dx.get(), op.dw.get(), a1.get(), a2.get(), h32);
      TEST_CUDA_CHECK(cudaGetLastError());
      const auto y_host = y.download();
      ASSERT_TRUE(std::none_of(y_host.begin(), y_host.end(), [](float f) { return std::isnan(f); }));
      if (rows_kernel.empty()) rows_kernel = y_host;
      else EXPECT_LT(rel_l2(y_host, rows_kernel), 1e-6);
      EXPECT_EQ(bits(g2.download()), bits(g1.download()));
      EXPECT_EQ(bits(u2.download()), bits(u1.download()));
      if (f16) EXPECT_EQ(bits(from_half(a2h.download())), bits(from_half(a1h.download())));
      else EXPECT_EQ(bits(a2.download()), bits(a1.download()));
      for (auto [a, b2] : {std::pair{&q2, &q1}, std::pair{&k2, &k1}, std::pair{&v2, &v1}, std::pair{&kc2, &kc1},
                           std::pair{&vc2, &vc1}})
        EXPECT_EQ(bits(a->download()), bits(b2->download()));
    }
  }
  setenv("DIFFRUN_GEMV_WARPS_PER_ROW", "3", 1);
  EXPECT_THROW(engine::gemv_warps_per_row(), InputError);
  setenv("DIFFRUN_GEMV_WARPS_PER_ROW", "2x2", 1);
  EXPECT_THROW(engine::gemv_warps_per_row(), InputError);
  unsetenv("DIFFRUN_GEMV_WARPS_PER_ROW");
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
  // D ≤ 8192 rows are held in registers (8, 16 or 32 elements a thread), longer ones read back from memory.
  for (auto [rows, D] : {std::pair{7, 97}, std::pair{15, 18}, std::pair{2, 896}, std::pair{3, 2048},
                         std::pair{2, 2049}, std::pair{2, 4096}, std::pair{2, 5000}, std::pair{1, 8192},
                         std::pair{2, 8193}}) {
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
  // Llama 3-style frequency factors (1 at high frequencies, 8 at low, smooth between).
  const std::vector<float> factors = {1.0f, 1.0f, 1.0f, 1.4f, 2.5f, 5.0f, 8.0f, 8.0f, 8.0f};  // [Dh/2]
  const std::vector<double> factors_d(factors.begin(), factors.end());
  DeviceArray<float> dfactors(factors);
  for (double theta : {10000.0, 1e6})
  for (bool scaled : {false, true}) {
    const auto x = random_vec(T * nh * Dh, 7);
    DeviceArray<int32_t> dpos(std::vector<int32_t>{pos0});
    const double* ff = scaled ? factors_d.data() : nullptr;
    const float* dff = scaled ? dfactors.get() : nullptr;
    for (bool neox : {false, true}) {
      SCOPED_TRACE(std::string(neox ? "neox" : "norm") + " theta " + std::to_string(theta) +
                   (scaled ? " freq factors" : ""));
      std::vector<double> ref(x.size());
      if (neox)
        ref::rope_neox(ref.data(), widen(x).data(), T, nh, Dh, pos0, theta, ff);
      else
        ref::rope_norm(ref.data(), widen(x).data(), T, nh, Dh, pos0, theta, ff);
      DeviceArray<float> dx(x), out(x.size());
      if (neox)
        engine::rope_neox(out.get(), dx.get(), T, nh, Dh, dpos.get(), float(theta), dff, nullptr);
      else
        engine::rope_norm(out.get(), dx.get(), T, nh, Dh, dpos.get(), float(theta), dff, nullptr);
      if (scaled) {  // the factors matter: the unscaled rotation is far outside the 1e-6 below
        std::vector<double> plain(x.size());
        (neox ? ref::rope_neox<double> : ref::rope_norm<double>)(plain.data(), widen(x).data(), T, nh, Dh, pos0,
                                                                 theta, nullptr);
        EXPECT_GT(rel_l2(out.download(), narrow(plain)), 1e-3);  // 8e-3 at theta 1e6, where low pairs turn little
      }
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

// q and k and the cache write in one launch: q and k the same as the rope twins applied to each, bit
// for bit against the single-tensor kernels, and within f32 rounding of the CPU twins; the cache rows
// bit-identical to kv_store of the rotated k and of v, written at write_pos (not pos0, as the
// kv_cache_pos0 fault passes), with the other rows untouched.
TEST(EngineOps, RopeQkMatchesRopeTwinsAndKvStore) {
  DIFFRUN_REQUIRE_CUDA();
  const int T = 3, H = 5, Hkv = 2, Dh = 18, pos0 = 11, write_pos = 4, C = 17, KV = Hkv * Dh;
  const double theta = 1e6;
  const std::vector<float> factors = {1.0f, 1.0f, 1.0f, 1.4f, 2.5f, 5.0f, 8.0f, 8.0f, 8.0f};  // [Dh/2]
  const std::vector<double> factors_d(factors.begin(), factors.end());
  DeviceArray<float> dff(factors);
  const auto q = random_vec(T * H * Dh, 30), k = random_vec(T * KV, 31), v = random_vec(T * KV, 35);
  DeviceArray<int32_t> dpos(std::vector<int32_t>{pos0}), dwrite(std::vector<int32_t>{write_pos});
  for (bool neox : {false, true}) {
    SCOPED_TRACE(neox ? "neox" : "norm");
    std::vector<double> rq(q.size()), rk(k.size());
    const auto rope_ref = neox ? ref::rope_neox<double> : ref::rope_norm<double>;
    rope_ref(rq.data(), widen(q).data(), T, H, Dh, pos0, theta, factors_d.data());
    rope_ref(rk.data(), widen(k).data(), T, Hkv, Dh, pos0, theta, factors_d.data());
    const std::vector<float> canary(size_t(C) * KV, -7.0f);
    DeviceArray<float> dq(q), dk(k), dv(v), oq(q.size()), ok(k.size()), kc(canary), vc(canary);
    engine::rope_qk(oq.get(), ok.get(), kc.get(), vc.get(), dq.get(), dk.get(), dv.get(), T, H, Hkv, Dh, dpos.get(),
                    dwrite.get(), float(theta), dff.get(), neox, nullptr);
    EXPECT_LT(rel_l2(oq.download(), narrow(rq)), 1e-6);
    EXPECT_LT(rel_l2(ok.download(), narrow(rk)), 1e-6);
    const auto rope_one = neox ? engine::rope_neox : engine::rope_norm;
    DeviceArray<float> sq(q.size()), sk(k.size()), kc2(canary), vc2(canary);
    rope_one(sq.get(), dq.get(), T, H, Dh, dpos.get(), float(theta), dff.get(), nullptr);
    rope_one(sk.get(), dk.get(), T, Hkv, Dh, dpos.get(), float(theta), dff.get(), nullptr);
    engine::kv_store(kc2.get(), vc2.get(), sk.get(), dv.get(), T, dwrite.get(), KV, nullptr);
    EXPECT_EQ(oq.download(), sq.download());
    EXPECT_EQ(ok.download(), sk.download());
    const auto hk = kc.download(), hv = vc.download();
    EXPECT_EQ(hk, kc2.download());
    EXPECT_EQ(hv, vc2.download());
    EXPECT_EQ(hk[size_t(write_pos) * KV], sk.download()[0]);  // row write_pos holds token 0's k
    EXPECT_EQ(hv[size_t(write_pos + T - 1) * KV + KV - 1], v[size_t(T) * KV - 1]);
    EXPECT_EQ(hk[size_t(pos0) * KV], -7.0f);  // pos0's row untouched when write_pos differs
  }

  // In place (q_out = q, k_out = k), as the engine calls it.
  DeviceArray<float> iq(q), ik(k), dv(v), kc(size_t(C) * KV), vc(size_t(C) * KV), sq(q.size()), sk(k.size());
  engine::rope_qk(iq.get(), ik.get(), kc.get(), vc.get(), iq.get(), ik.get(), dv.get(), T, H, Hkv, Dh, dpos.get(),
                  dpos.get(), float(theta), nullptr, true, nullptr);
  DeviceArray<float> dq(q), dk(k);
  engine::rope_neox(sq.get(), dq.get(), T, H, Dh, dpos.get(), float(theta), nullptr, nullptr);
  engine::rope_neox(sk.get(), dk.get(), T, Hkv, Dh, dpos.get(), float(theta), nullptr, nullptr);
  EXPECT_EQ(iq.download(), sq.download());
  EXPECT_EQ(ik.download(), sk.download());
}

// The q/k norms with the RoPE and the cache write in one launch: q and k normalised in place, the rotated q and k and
// both caches bit-identical to rms_norm on each then rope_qk, heads of 64, 128, 192 and 256 elements, neox and norm
// pairing, frequency factors, a write position apart from the position; its rotation alone (qk_norm_rope_rotation)
// bit-identical to rope_qk; other head sizes refused.
TEST(EngineOps, QkNormRopeMatchesRmsNormsThenRopeQk) {
  DIFFRUN_REQUIRE_CUDA();
  const int T = 3, H = 5, Hkv = 2, pos0 = 11, write_pos = 4, C = 17;
  const float theta = 1e6f, eps = 1e-6f;
  for (int Dh : {64, 128, 192, 256})
    for (bool neox : {false, true}) {
      SCOPED_TRACE("Dh " + std::to_string(Dh) + (neox ? " neox" : " norm"));
      const int KV = Hkv * Dh;
      std::vector<float> factors(Dh / 2);
      for (int i = 0; i < Dh / 2; ++i) factors[i] = 1.0f + 0.25f * float(i % 7);
      DeviceArray<float> dff(factors);
      const auto q = random_vec(size_t(T) * H * Dh, 40, 3.0f), k = random_vec(size_t(T) * KV, 41, 3.0f);
      const auto v = random_vec(size_t(T) * KV, 42), qw = random_vec(Dh, 43), kw = random_vec(Dh, 44);
      DeviceArray<int32_t> dpos(std::vector<int32_t>{pos0}), dwrite(std::vector<int32_t>{write_pos});
      DeviceArray<float> dv(v), dqw(qw), dkw(kw);
      const std::vector<float> canary(size_t(C) * KV, -7.0f);
      // The unfused ops, as the engine runs them: the norms in place, then rope_qk out of place.
      DeviceArray<float> q1(q), k1(k), oq1(q.size()), ok1(k.size()), kc1(canary), vc1(canary);
      engine::rms_norm(q1.get(), q1.get(), dqw.get(), T * H, Dh, eps, nullptr);
      engine::rms_norm(k1.get(), k1.get(), dkw.get(), T * Hkv, Dh, eps, nullptr);
      engine::rope_qk(oq1.get(), ok1.get(), kc1.get(), vc1.get(), q1.get(), k1.get(), dv.get(), T, H, Hkv, Dh,
                      dpos.get(), dwrite.get(), theta, dff.get(), neox, nullptr);
      DeviceArray<float> q2(q), k2(k), oq2(q.size()), ok2(k.size()), kc2(canary), vc2(canary);
      ASSERT_TRUE(engine::qk_norm_rope(oq2.get(), ok2.get(), kc2.get(), vc2.get(), q2.get(), k2.get(), dv.get(),
                                       dqw.get(), dkw.get(), eps, T, H, Hkv, Dh, dpos.get(), dwrite.get(), theta,
                                       dff.get(), neox, nullptr));
      EXPECT_EQ(q2.download(), q1.download());  // Qnorm, in place
      EXPECT_EQ(k2.download(), k1.download());  // Knorm
      EXPECT_EQ(oq2.download(), oq1.download());
      EXPECT_EQ(ok2.download(), ok1.download());
      const auto hk = kc2.download();
      EXPECT_EQ(hk, kc1.download());
      EXPECT_EQ(vc2.download(), vc1.download());
      EXPECT_EQ(hk[size_t(pos0) * KV], -7.0f);  // pos0's row untouched when write_pos differs
      EXPECT_NE(q2.download(), q);              // normalised (the weights are not all one)
      // The rotation alone (isolation replay) on the normalised q and k: rope_qk's outputs, q and k left as they are.
      const std::vector<float> qn = q1.download(), kn = k1.download();
      DeviceArray<float> oq3(q.size()), ok3(k.size()), kc3(canary), vc3(canary);
      ASSERT_TRUE(engine::qk_norm_rope_rotation(oq3.get(), ok3.get(), kc3.get(), vc3.get(), q1.get(), k1.get(),
                                                dv.get(), T, H, Hkv, Dh, dpos.get(), dwrite.get(), theta, dff.get(),
                                                neox, nullptr));
      EXPECT_EQ(oq3.download(), oq1.download());
      EXPECT_EQ(ok3.download(), ok1.download());
      EXPECT_EQ(kc3.download(), kc1.download());
      EXPECT_EQ(vc3.download(), vc1.download());
      EXPECT_EQ(q1.download(), qn);
      EXPECT_EQ(k1.download(), kn);
      TEST_CUDA_CHECK(cudaGetLastError());
    }
  DeviceArray<float> buf(size_t(4) * 96);
  for (int Dh : {96, 18, 320})
    EXPECT_FALSE(engine::qk_norm_rope(buf.get(), buf.get(), buf.get(), buf.get(), buf.get(), buf.get(), buf.get(),
                                      buf.get(), buf.get(), 1e-6f, 1, 1, 1, Dh, nullptr, nullptr, 1e6f, nullptr, true,
                                      nullptr))
        << "Dh " << Dh;
}

// Residual add then RMSNorm in one launch: both outputs bit-identical to add followed by rms_norm,
// with rows held in registers (D ≤ 8192: 8, 16 or 32 elements a thread) and read back from memory (longer).
TEST(EngineOps, AddRmsNormMatchesAddThenRmsNorm) {
  DIFFRUN_REQUIRE_CUDA();
  for (auto [rows, D] : {std::pair{1, 896}, std::pair{7, 97}, std::pair{1, 2048}, std::pair{2, 2049},
                         std::pair{1, 4096}, std::pair{1, 5000}, std::pair{1, 8192}, std::pair{2, 8193}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " D " + std::to_string(D));
    const auto a = random_vec(rows * D, 32, 2.0f), b = random_vec(rows * D, 33), w = random_vec(D, 34);
    std::vector<double> sum_ref(rows * D), norm_ref(rows * D);
    ref::add(sum_ref.data(), widen(a).data(), widen(b).data(), int64_t(rows) * D);
    ref::rms_norm(norm_ref.data(), sum_ref.data(), widen(w).data(), rows, D, 1e-6);
    DeviceArray<float> da(a), db(b), dw(w), sum(rows * D), norm(rows * D), sum2(rows * D), norm2(rows * D);
    engine::add_rms_norm(sum.get(), norm.get(), da.get(), db.get(), dw.get(), rows, D, 1e-6f, nullptr);
    EXPECT_LT(rel_l2(sum.download(), narrow(sum_ref)), 1e-6);
    EXPECT_LT(rel_l2(norm.download(), narrow(norm_ref)), 1e-6);
    engine::add(sum2.get(), da.get(), db.get(), int64_t(rows) * D, nullptr);
    engine::rms_norm(norm2.get(), sum2.get(), dw.get(), rows, D, 1e-6f, nullptr);
    EXPECT_EQ(sum.download(), sum2.download());
    EXPECT_EQ(norm.download(), norm2.download());
    DeviceArray<__half> n16(rows * D), n16b(rows * D);
    engine::add_rms_norm(sum.get(), n16.get(), da.get(), db.get(), dw.get(), rows, D, 1e-6f, nullptr);
    engine::rms_norm(n16b.get(), sum2.get(), dw.get(), rows, D, 1e-6f, nullptr);
    EXPECT_EQ(from_half(n16.download()), from_half(n16b.download()));
    engine::add_rms_norm(da.get(), norm.get(), da.get(), db.get(), dw.get(), rows, D, 1e-6f, nullptr);  // sum = a
    EXPECT_EQ(da.download(), sum2.download());
    EXPECT_EQ(norm.download(), norm2.download());
  }
}

// The gather and the norm in one launch, ids read from mapped pinned host memory: both outputs
// bit-identical to embedding then rms_norm (f32 and f16 tables and norms; an id outside the vocabulary
// gives a NaN row as embedding does), and step_inputs copies the ids and n_past from that memory.
TEST(EngineOps, EmbeddingRmsNormMatchesEmbeddingThenRmsNorm) {
  DIFFRUN_REQUIRE_CUDA();
  for (auto [V, D] : {std::pair{37, 29}, std::pair{50, 896}, std::pair{11, 2048}, std::pair{9, 4096},
                      std::pair{7, 8192}}) {
    SCOPED_TRACE("V " + std::to_string(V) + " D " + std::to_string(D));
    const std::vector<int32_t> tokens = {0, V - 1, 5, 5, V, 1};
    const int T = static_cast<int>(tokens.size());
    engine::PinnedBuffer<int32_t> host_ids(tokens.size(), "test ids"), host_n_past(1, "test n_past");
    std::copy(tokens.begin(), tokens.end(), host_ids.get());
    *host_n_past.get() = 123;
    DeviceArray<int32_t> ids(std::vector<int32_t>(tokens.size(), -7)), n_past(std::vector<int32_t>{-7});
    engine::step_inputs(ids.get(), n_past.get(), host_ids.device(), host_n_past.device(), T, nullptr);
    EXPECT_EQ(ids.download(), tokens);
    EXPECT_EQ(n_past.download(), std::vector<int32_t>{123});

    const auto table = random_vec(size_t(V) * D, 60, 2.0f), w = random_vec(D, 61);
    DeviceArray<float> dtab(table), dw(w), x(T * D), xn(T * D), x2(T * D), xn2(T * D);
    engine::embedding_rms_norm(x.get(), xn.get(), host_ids.device(), dtab.get(), dw.get(), T, D, V, 1e-6f, nullptr);
    engine::embedding(x2.get(), ids.get(), dtab.get(), T, D, V, nullptr);
    engine::rms_norm(xn2.get(), x2.get(), dw.get(), T, D, 1e-6f, nullptr);
    const auto got_x = x.download(), want_x = x2.download();
    EXPECT_EQ(0, std::memcmp(got_x.data(), want_x.data(), got_x.size() * sizeof(float)));  // NaN rows too
    const auto got_n = xn.download(), want_n = xn2.download();
    EXPECT_EQ(0, std::memcmp(got_n.data(), want_n.data(), got_n.size() * sizeof(float)));
    EXPECT_TRUE(std::isnan(got_x[size_t(4) * D]));  // the id V

    DeviceArray<__half> htab(to_half(table)), h16(T * D), h16b(T * D);
    engine::embedding_rms_norm(x.get(), h16.get(), host_ids.device(), htab.get(), dw.get(), T, D, V, 1e-6f, nullptr);
    engine::embedding(x2.get(), ids.get(), htab.get(), T, D, V, nullptr);
    engine::rms_norm(h16b.get(), x2.get(), dw.get(), T, D, 1e-6f, nullptr);
    const auto got_x16 = x.download(), want_x16 = x2.download();
    EXPECT_EQ(0, std::memcmp(got_x16.data(), want_x16.data(), got_x16.size() * sizeof(float)));
    const auto got_h = h16.download(), want_h = h16b.download();
    EXPECT_EQ(0, std::memcmp(got_h.data(), want_h.data(), got_h.size() * sizeof(__half)));
  }
  DeviceArray<float> x(8193), xn(8193), tab(8193), w(8193);
  DeviceArray<int32_t> ids(std::vector<int32_t>{0});
  EXPECT_THROW(engine::embedding_rms_norm(x.get(), xn.get(), ids.get(), tab.get(), w.get(), 1, 8193, 1, 1e-6f, nullptr),
               Error);
}

TEST(EngineOps, AttentionMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  // window > 0: a sliding window (gemma3's local layers) with its own scale, in prefill and past it in decode.
  for (auto [T, n_past, H, Hkv, Dh, window] :
       {std::tuple{5, 4, 6, 2, 40, 0}, std::tuple{1, 37, 14, 2, 64, 0}, std::tuple{9, 0, 4, 4, 128, 0},
        std::tuple{3, 2, 8, 1, 256, 0}, std::tuple{9, 3, 4, 1, 256, 5}, std::tuple{1, 40, 4, 1, 256, 16}}) {
    SCOPED_TRACE("T " + std::to_string(T) + " n_past " + std::to_string(n_past) + " H " + std::to_string(H) +
                 " Hkv " + std::to_string(Hkv) + " Dh " + std::to_string(Dh) + " window " + std::to_string(window));
    const int S = n_past + T, Q = H * Dh, KV = Hkv * Dh;
    const float scale = window > 0 ? 0.0625f : 1.0f / std::sqrt(float(Dh));
    const auto q = random_vec(T * Q, 8), kc = random_vec(S * KV, 9), vc = random_vec(S * KV, 10);
    std::vector<double> out_ref(T * Q), probs_ref(size_t(H) * T * S);
    ref::attention(out_ref.data(), probs_ref.data(), widen(q).data(), widen(kc).data(), widen(vc).data(), T, n_past,
                   H, Hkv, Dh, double(scale), window);

    DeviceArray<float> dq(q), dk(kc), dv(vc), out(T * Q), probs(size_t(H) * T * S);
    DeviceArray<int32_t> dnp(std::vector<int32_t>{n_past});
    engine::attention(out.get(), probs.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                      nullptr);
    const auto got = out.download();
    EXPECT_LT(rel_l2(got, narrow(out_ref)), 1e-5);
    EXPECT_LT(rel_l2(probs.download(), narrow(probs_ref)), 1e-5);

    // Without probs the output is bit-identical (the same kernel runs).
    DeviceArray<float> out2(T * Q);
    engine::attention(out2.get(), nullptr, dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                      nullptr);
    EXPECT_EQ(out2.download(), got);

    DeviceArray<__half> out16(T * Q);
    engine::attention(out16.get(), nullptr, dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                      nullptr);
    EXPECT_LT(rel_l2(from_half(out16.download()), narrow(out_ref)), 1e-3);
  }
}

// The split (flash-decoding) kernel: against the CPU twin and the one-block kernel, with S not a
// multiple of the splits, splits left empty (S < splits), one split, GQA and T > 1 causal; the
// scratch tickets left at zero (a second launch on the same scratch gives the same bits). Each case
// runs with the default min_keys (short queries in one block, long ones over several splits) and
// with min_keys 1 (every query over all its splits, the combine and empty chunks at small S).
TEST(EngineOps, AttentionSplitMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    int T, n_past, H, Hkv, Dh, splits, window = 0, min_keys = engine::kAttentionSplitMinKeys;
  };
  std::vector<Case> cases;
  for (const Case c : {Case{1, 37, 14, 2, 64, 19}, Case{1, 0, 14, 2, 64, 19}, Case{1, 200, 6, 3, 40, 7},
                       Case{1, 5, 4, 4, 128, 1}, Case{3, 2, 8, 1, 256, 5}, Case{4, 300, 6, 2, 40, 64},
                       Case{2, 1, 5, 5, 18, 3}, Case{1, 600, 4, 1, 256, 64, 512}, Case{3, 20, 4, 1, 256, 7, 8},
                       Case{1, 1000, 14, 2, 64, 19}, Case{2, 5000, 4, 1, 64, 19}, Case{1, 3000, 32, 4, 64, 9},
                       Case{4, 700, 3, 1, 100, 64, 0, 50}}) {
    cases.push_back(c);
    cases.push_back(c);
    cases.back().min_keys = 1;
  }
  for (const Case c : cases) {
    const int T = c.T, n_past = c.n_past, H = c.H, Hkv = c.Hkv, Dh = c.Dh, window = c.window;
    const float scale = window > 0 ? 0.0625f : 1.0f / std::sqrt(float(Dh));
    SCOPED_TRACE("T " + std::to_string(T) + " n_past " + std::to_string(n_past) + " H " + std::to_string(H) +
                 " Hkv " + std::to_string(Hkv) + " Dh " + std::to_string(Dh) + " splits " + std::to_string(c.splits) +
                 " window " + std::to_string(window) + " min_keys " + std::to_string(c.min_keys));
    const int S = n_past + T, Q = H * Dh, KV = Hkv * Dh;
    const auto q = random_vec(T * Q, 40, 2.0f), kc = random_vec(S * KV, 41), vc = random_vec(S * KV, 42);
    std::vector<double> out_ref(T * Q), probs_ref(size_t(H) * T * S);
    ref::attention(out_ref.data(), probs_ref.data(), widen(q).data(), widen(kc).data(), widen(vc).data(), T, n_past,
                   H, Hkv, Dh, double(scale), window);

    DeviceArray<float> dq(q), dk(kc), dv(vc), out(T * Q), probs(std::vector<float>(size_t(H) * T * S, NAN));
    DeviceArray<float> partial(size_t(T) * H * c.splits * (Dh + 2));
    DeviceArray<uint32_t> counters(std::vector<uint32_t>(size_t(T) * H, 0u));
    DeviceArray<int32_t> dnp(std::vector<int32_t>{n_past});
    const engine::AttentionSplitScratch scratch{partial.get(), counters.get(), c.splits, c.min_keys};
    engine::attention_split(out.get(), probs.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale,
                            window, scratch, nullptr);
    const auto got = out.download(), got_probs = probs.download();
    EXPECT_LT(rel_l2(got, narrow(out_ref)), 1e-5);
    EXPECT_LT(rel_l2(got_probs, narrow(probs_ref)), 1e-5);
    for (int h = 0; h < H; ++h)  // exact zeros above the diagonal, every row sums to 1
      for (int t = 0; t < T; ++t) {
        double row = 0;
        for (int s = 0; s < S; ++s) {
          const float p = got_probs[(size_t(h) * T + t) * S + s];
          if (s > n_past + t || (window > 0 && s <= n_past + t - window)) {
            EXPECT_EQ(p, 0.0f) << "h " << h << " t " << t << " s " << s;
          }
          row += p;
        }
        EXPECT_NEAR(row, 1.0, 1e-5) << "h " << h << " t " << t;
      }
    EXPECT_EQ(counters.download(), std::vector<uint32_t>(size_t(T) * H, 0u));

    DeviceArray<float> out_one(T * Q), probs_one(size_t(H) * T * S);
    engine::attention(out_one.get(), probs_one.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale,
                      window, nullptr);
    EXPECT_LT(rel_l2(got, out_one.download()), 1e-5);
    EXPECT_LT(rel_l2(got_probs, probs_one.download()), 1e-5);

    DeviceArray<float> out2(T * Q), probs2(size_t(H) * T * S);
    engine::attention_split(out2.get(), probs2.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale,
                            window, scratch, nullptr);
    EXPECT_EQ(out2.download(), got);
    EXPECT_EQ(probs2.download(), got_probs);

    DeviceArray<__half> out16(T * Q);
    engine::attention_split(out16.get(), probs2.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale,
                            window, scratch, nullptr);
    EXPECT_LT(rel_l2(from_half(out16.download()), narrow(out_ref)), 1e-3);
  }
}

// The q/k norms and RoPE of a one-token step in the attention launch (attention_split_qk_norm_rope) against the two
// launches the engine runs without it, qk_norm_rope then attention_split: Qnorm, Knorm, Qrope, Krope, the cache
// (its row write_pos written, no other), the output (f32 and f16) and the probabilities all bit-identical. Heads of
// 64, 128 and 256, GQA and not, one split and many (the current key in the last one; min_keys 1 puts it alone in a
// split of its own at short lengths), a sliding window, a write row other than the position, Llama 3's frequency
// factors. Not taken: several tokens, another head width, the norm (non-neox) rotation.
TEST(EngineOps, AttentionSplitQkNormRopeMatchesTheTwoLaunches) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    int n_past, H, Hkv, Dh, splits, min_keys, window, write_pos;
    bool factors;
  };
  const float theta = 1e6f, eps = 1e-6f;
  for (const Case c : {Case{37, 32, 4, 128, 9, 16, 0, 37, false}, Case{0, 32, 4, 128, 9, 16, 0, 0, false},
                       Case{300, 16, 2, 64, 19, 16, 0, 300, true}, Case{5, 8, 8, 128, 5, 1, 0, 5, false},
                       Case{700, 8, 1, 256, 64, 16, 512, 700, false}, Case{40, 4, 1, 256, 7, 1, 8, 40, true},
                       Case{90, 12, 4, 128, 9, 16, 0, 17, false}}) {
    const int n_past = c.n_past, H = c.H, Hkv = c.Hkv, Dh = c.Dh, window = c.window, S = n_past + 1;
    const int Q = H * Dh, KV = Hkv * Dh, C = S + 8;
    const float scale = 1.0f / std::sqrt(float(Dh));
    SCOPED_TRACE("n_past " + std::to_string(n_past) + " H " + std::to_string(H) + " Hkv " + std::to_string(Hkv) +
                 " Dh " + std::to_string(Dh) + " splits " + std::to_string(c.splits) + " min_keys " +
                 std::to_string(c.min_keys) + " window " + std::to_string(window) + " write_pos " +
                 std::to_string(c.write_pos));
    const auto q = random_vec(Q, 50, 3.0f), k = random_vec(KV, 51, 3.0f), v = random_vec(KV, 52);
    const auto qw = random_vec(Dh, 53), kw = random_vec(Dh, 54);
    std::vector<float> cache_k = random_vec(size_t(C) * KV, 55), cache_v = random_vec(size_t(C) * KV, 56);
    std::vector<float> factors(Dh / 2);
    for (int i = 0; i < Dh / 2; ++i) factors[i] = 1.0f + 0.25f * float(i % 7);
    DeviceArray<float> dv(v), dqw(qw), dkw(kw), dff(factors);
    DeviceArray<int32_t> dpos(std::vector<int32_t>{n_past}), dwrite(std::vector<int32_t>{c.write_pos}),
        dnp(std::vector<int32_t>{n_past});
    const float* ff = c.factors ? dff.get() : nullptr;
    const std::vector<float> nan_probs(size_t(H) * S, NAN);
    DeviceArray<float> partial(size_t(H) * c.splits * (Dh + 2));
    DeviceArray<uint32_t> counters(std::vector<uint32_t>(size_t(H), 0u));
    const engine::AttentionSplitScratch scratch{partial.get(), counters.get(), c.splits, c.min_keys};
    // The two launches: qk_norm_rope (norms in place), then attention_split over the cache.
    DeviceArray<float> q1(q), k1(k), oq1(Q), ok1(KV), kc1(cache_k), vc1(cache_v), out1(Q), probs1(nan_probs);
    DeviceArray<__half> out1h(Q);
    ASSERT_TRUE(engine::qk_norm_rope(oq1.get(), ok1.get(), kc1.get(), vc1.get(), q1.get(), k1.get(), dv.get(),
                                     dqw.get(), dkw.get(), eps, 1, H, Hkv, Dh, dpos.get(), dwrite.get(), theta, ff,
                                     true, nullptr));
    engine::attention_split(out1.get(), probs1.get(), oq1.get(), kc1.get(), vc1.get(), 1, dnp.get(), H, Hkv, Dh,
                            scale, window, scratch, nullptr);
    engine::attention_split(out1h.get(), probs1.get(), oq1.get(), kc1.get(), vc1.get(), 1, dnp.get(), H, Hkv, Dh,
                            scale, window, scratch, nullptr);
    // One launch, q and k left as they are.
    DeviceArray<float> q2(q), k2(k), qn2(Q), kn2(KV), oq2(Q), ok2(KV), kc2(cache_k), vc2(cache_v), out2(Q),
        probs2(nan_probs);
    DeviceArray<__half> out2h(Q);
    const engine::AttentionQkPrep prep{q2.get(), k2.get(), dv.get(), dqw.get(), dkw.get(), eps, qn2.get(), kn2.get(),
                                       oq2.get(), ok2.get(), kc2.get(), vc2.get(), dpos.get(), dwrite.get(), theta,
                                       ff, true};
    ASSERT_TRUE(engine::attention_split_qk_norm_rope(out2.get(), probs2.get(), prep, 1, dnp.get(), H, Hkv, Dh, scale,
                                                     window, scratch, nullptr));
    DeviceArray<float> kc3(cache_k), vc3(cache_v), probs3(nan_probs);  // the f16 output, on a fresh cache
    engine::AttentionQkPrep prep16 = prep;
    prep16.k_cache = kc3.get();
    prep16.v_cache = vc3.get();
    ASSERT_TRUE(engine::attention_split_qk_norm_rope(out2h.get(), probs3.get(), prep16, 1, dnp.get(), H, Hkv, Dh,
                                                     scale, window, scratch, nullptr));
    EXPECT_EQ(qn2.download(), q1.download());  // Qnorm
    EXPECT_EQ(kn2.download(), k1.download());  // Knorm
    EXPECT_EQ(oq2.download(), oq1.download());  // Qrope
    EXPECT_EQ(ok2.download(), ok1.download());  // Krope
    EXPECT_EQ(kc2.download(), kc1.download());
    EXPECT_EQ(vc2.download(), vc1.download());
    EXPECT_EQ(kc3.download(), kc1.download());
    EXPECT_EQ(out2.download(), out1.download());
    EXPECT_EQ(probs2.download(), probs1.download());
    EXPECT_EQ(probs3.download(), probs1.download());
    const auto h1 = out1h.download(), h2 = out2h.download();
    EXPECT_EQ(0, std::memcmp(h1.data(), h2.data(), h1.size() * sizeof(__half)));
    EXPECT_EQ(q2.download(), q);  // Qcur and Kcur kept
    EXPECT_EQ(k2.download(), k);
    EXPECT_EQ(counters.download(), std::vector<uint32_t>(size_t(H), 0u));
    TEST_CUDA_CHECK(cudaGetLastError());
  }
  EXPECT_FALSE(engine::attention_split_qk_norm_rope_supported(2, 128, true));
  EXPECT_FALSE(engine::attention_split_qk_norm_rope_supported(1, 192, true));
  EXPECT_FALSE(engine::attention_split_qk_norm_rope_supported(1, 128, false));
  EXPECT_TRUE(engine::attention_split_qk_norm_rope_supported(1, 64, true));
}

// The tiled prefill kernel against the one-block-per-(token, head) kernel and the CPU twin: GQA, sliding
// windows, T up to 600 with and without cached rows, head widths of every template (18 .. 256), f32 and
// f16 outputs, every element written (the output starts as NaN). attention with out null writes the
// same probabilities as with out.
TEST(EngineOps, AttentionTiledMatchesAttention) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    int T, n_past, H, Hkv, Dh, window = 0;
  };
  uint32_t seed = 100;
  for (const Case c : {Case{512, 0, 14, 2, 64}, Case{600, 0, 8, 2, 64, 100}, Case{33, 7, 6, 3, 40}, Case{5, 0, 4, 4, 18},
                       Case{97, 300, 4, 1, 128}, Case{200, 0, 4, 1, 256, 64}, Case{64, 40, 8, 8, 256, 17},
                       Case{450, 150, 6, 2, 128, 512}, Case{1, 9, 2, 1, 64}, Case{31, 0, 3, 1, 96, 1}}) {
    const int T = c.T, n_past = c.n_past, H = c.H, Hkv = c.Hkv, Dh = c.Dh, window = c.window;
    SCOPED_TRACE("T " + std::to_string(T) + " n_past " + std::to_string(n_past) + " H " + std::to_string(H) +
                 " Hkv " + std::to_string(Hkv) + " Dh " + std::to_string(Dh) + " window " + std::to_string(window));
    const float scale = window > 0 ? 0.0625f : 1.0f / std::sqrt(float(Dh));
    const int S = n_past + T, Q = H * Dh, KV = Hkv * Dh;
    const auto q = random_vec(size_t(T) * Q, seed++, 2.0f), kc = random_vec(size_t(S) * KV, seed++),
               vc = random_vec(size_t(S) * KV, seed++);
    DeviceArray<float> dq(q), dk(kc), dv(vc), probs(size_t(H) * T * S), probs_only(size_t(H) * T * S);
    DeviceArray<int32_t> dnp(std::vector<int32_t>{n_past});
    DeviceArray<float> want(size_t(T) * Q), got(std::vector<float>(size_t(T) * Q, NAN));
    engine::attention(want.get(), probs.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                      nullptr);
    engine::attention_tiled(got.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window, nullptr);
    const auto w = want.download(), g = got.download();
    double max_abs = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      ASSERT_TRUE(std::isfinite(g[i])) << "element " << i << " not written or not finite";
      max_abs = std::max(max_abs, double(std::fabs(g[i] - w[i])));
    }
    EXPECT_LT(rel_l2(g, w), 1e-6);
    EXPECT_LT(max_abs, 1e-5);
    if (T <= 100) {  // the CPU twin (quadratic in T on the host)
      std::vector<double> out_ref(size_t(T) * Q), probs_ref(size_t(H) * T * S);
      ref::attention(out_ref.data(), probs_ref.data(), widen(q).data(), widen(kc).data(), widen(vc).data(), T, n_past,
                     H, Hkv, Dh, double(scale), window);
      EXPECT_LT(rel_l2(g, narrow(out_ref)), 2e-6);
    }

    engine::attention(static_cast<float*>(nullptr), probs_only.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H,
                      Hkv, Dh, scale, window, nullptr);
    EXPECT_EQ(probs_only.download(), probs.download());

    DeviceArray<__half> want16(size_t(T) * Q), got16(std::vector<__half>(size_t(T) * Q, __float2half(NAN)));
    engine::attention(want16.get(), nullptr, dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                      nullptr);
    engine::attention_tiled(got16.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                            nullptr);
    const auto w16 = from_half(want16.download()), g16 = from_half(got16.download());
    size_t flips = 0;
    for (size_t i = 0; i < g16.size(); ++i) {
      ASSERT_TRUE(std::isfinite(g16[i])) << "f16 element " << i << " not written or not finite";
      if (g16[i] != w16[i]) {
        ++flips;
        // f32 results within 1e-5 of each other (above) round to f16 values within that plus one f16 step
        EXPECT_LE(std::fabs(g16[i] - w16[i]), std::fabs(w16[i]) * 1e-3f + 1e-5f) << "f16 element " << i;
      }
    }
    EXPECT_LT(rel_l2(g16, w16), 1e-3);
    EXPECT_LT(double(flips), 0.02 * double(g16.size()) + 1) << "f16 outputs that differ by a rounding step";
    std::printf("  T %d Dh %d: f32 rel_l2 %.3g, max abs %.3g; f16 elements that differ %.3f%%\n", T, Dh, rel_l2(g, w),
                max_abs, 100.0 * double(flips) / double(g16.size()));
  }
}

// The split count: two blocks per SM for one token, within 1..kAttentionSplitMaxSplits.

// attention_tiled moves its K/V tiles as float4s when Dh is a multiple of 4 and the caches are 16-byte
// aligned, else one float at a time: the same tile values either way, so the same output bits. The
// caches one float past an aligned address take the scalar path.
TEST(EngineOps, AttentionTiledFloat4TilesMatchScalarTiles) {
  DIFFRUN_REQUIRE_CUDA();
  struct Case {
    int T, n_past, H, Hkv, Dh, window = 0;
  };
  uint32_t seed = 300;
  for (const Case c : {Case{512, 0, 14, 2, 64}, Case{33, 7, 6, 3, 40}, Case{97, 300, 4, 1, 128},
                       Case{200, 0, 4, 1, 256, 64}, Case{450, 150, 6, 2, 128, 512}, Case{1, 9, 2, 1, 64}}) {
    const int T = c.T, n_past = c.n_past, H = c.H, Hkv = c.Hkv, Dh = c.Dh, window = c.window;
    SCOPED_TRACE("T " + std::to_string(T) + " n_past " + std::to_string(n_past) + " Dh " + std::to_string(Dh));
    const float scale = 1.0f / std::sqrt(float(Dh));
    const int S = n_past + T, Q = H * Dh, KV = Hkv * Dh;
    const auto q = random_vec(size_t(T) * Q, seed++, 2.0f), kc = random_vec(size_t(S) * KV, seed++),
               vc = random_vec(size_t(S) * KV, seed++);
    std::vector<float> kc1(kc.size() + 1, 0.0f), vc1(vc.size() + 1, 0.0f);  // the same values one float on
    std::copy(kc.begin(), kc.end(), kc1.begin() + 1);
    std::copy(vc.begin(), vc.end(), vc1.begin() + 1);
    DeviceArray<float> dq(q), dk(kc), dv(vc), dk1(kc1), dv1(vc1);
    DeviceArray<int32_t> dnp(std::vector<int32_t>{n_past});
    DeviceArray<float> vec_out(size_t(T) * Q), scalar_out(size_t(T) * Q);
    engine::attention_tiled(vec_out.get(), dq.get(), dk.get(), dv.get(), T, dnp.get(), H, Hkv, Dh, scale, window,
                            nullptr);
    engine::attention_tiled(scalar_out.get(), dq.get(), dk1.get() + 1, dv1.get() + 1, T, dnp.get(), H, Hkv, Dh, scale,
                            window, nullptr);
    const auto a = vec_out.download(), b = scalar_out.download();
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u) << "of " << a.size() << " outputs";
  }
}
TEST(EngineOps, AttentionSplitCount) {
  EXPECT_EQ(engine::attention_split_count(14, 132), 19);
  EXPECT_EQ(engine::attention_split_count(64, 16), 1);
  EXPECT_EQ(engine::attention_split_count(1, 132), engine::kAttentionSplitMaxSplits);
  // Splits used per query: one per min_keys keys, at least 1, at most the grid's.
  EXPECT_EQ(engine::attention_splits_used(37, 19, 128), 1);
  EXPECT_EQ(engine::attention_splits_used(255, 19, 128), 1);
  EXPECT_EQ(engine::attention_splits_used(256, 19, 128), 2);
  EXPECT_EQ(engine::attention_splits_used(100000, 19, 128), 19);
  EXPECT_EQ(engine::attention_splits_used(37, 19, 1), 19);
  EXPECT_EQ(engine::attention_splits_used(5, 19, 1), 5);
  EXPECT_EQ(engine::attention_splits_used(1, 1, 128), 1);
}

// gemma3's ops: GeGLU (f32 and f16 out), the embedding scale and the logit softcap against their CPU twins.
TEST(EngineOps, GegluScaleSoftcapMatchReference) {
  DIFFRUN_REQUIRE_CUDA();
  const int64_t n = 1001;
  const auto g = random_vec(n, 13, 4.0f), u = random_vec(n, 14);
  std::vector<double> ref(n), scaled(n), capped(n);
  ref::geglu(ref.data(), widen(g).data(), widen(u).data(), n);
  ref::scale(scaled.data(), widen(g).data(), std::sqrt(640.0), n);
  ref::softcap(capped.data(), widen(g).data(), 3.0, n);
  DeviceArray<float> dg(g), du(u), out(n), out2(n);
  engine::geglu(out.get(), dg.get(), du.get(), n, nullptr);
  EXPECT_LT(rel_l2(out.download(), narrow(ref)), 1e-6);
  DeviceArray<__half> out16(n);
  engine::geglu(out16.get(), dg.get(), du.get(), n, nullptr);
  EXPECT_LT(rel_l2(from_half(out16.download()), narrow(ref)), 1e-3);
  engine::scale(out.get(), dg.get(), std::sqrt(640.0f), n, nullptr);
  EXPECT_LT(rel_l2(out.download(), narrow(scaled)), 1e-7);
  engine::softcap(out2.get(), dg.get(), 3.0f, n, nullptr);
  EXPECT_LT(rel_l2(out2.download(), narrow(capped)), 1e-6);
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

// Multi-block argmax: ties across blocks, NaNs, the winner in the last partial block, negative
// values, -0 tying with +0, all NaN; every launch reuses one scratch, which each leaves at zero.
TEST(EngineOps, ArgmaxLowestIndexOnTiesSkipsNaN) {
  DIFFRUN_REQUIRE_CUDA();
  const int V = 151936;
  auto logits = random_vec(V, 13);
  logits[1000] = NAN;
  logits[77777] = 50.0f;
  logits[150001] = 50.0f;  // tie in another block: the lower index wins
  logits[5] = NAN;
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> out(1);
  DeviceArray<unsigned long long> scratch(std::vector<unsigned long long>{0, 0});
  engine::argmax(out.get(), dl.get(), V, scratch.get(), nullptr);
  EXPECT_EQ(out.download()[0], 77777);
  engine::argmax(out.get(), dl.get() + 100000, V - 100000, scratch.get(), nullptr);  // a row not starting at 0
  EXPECT_EQ(out.download()[0], 50001);

  auto tail = random_vec(V, 16);
  tail[V - 1] = 9.0f;  // the last element, in the grid's last, partial block
  DeviceArray<float> dt(tail);
  engine::argmax(out.get(), dt.get(), V, scratch.get(), nullptr);
  EXPECT_EQ(out.download()[0], V - 1);

  std::vector<float> negative(4099);
  for (size_t i = 0; i < negative.size(); ++i) negative[i] = -1.0f - float(i % 97);
  negative[3000] = -0.5f;
  negative[4098] = -0.5f;
  DeviceArray<float> dneg(negative);
  engine::argmax(out.get(), dneg.get(), int(negative.size()), scratch.get(), nullptr);
  EXPECT_EQ(out.download()[0], 3000);

  std::vector<float> zeros(5000, -1.0f);
  zeros[4500] = 0.0f;
  zeros[2100] = -0.0f;  // equal to +0: the lower index wins
  DeviceArray<float> dz(zeros);
  engine::argmax(out.get(), dz.get(), int(zeros.size()), scratch.get(), nullptr);
  EXPECT_EQ(out.download()[0], 2100);

  const std::vector<float> all_nan(33, NAN);
  DeviceArray<float> dn(all_nan);
  engine::argmax(out.get(), dn.get(), 33, scratch.get(), nullptr);
  EXPECT_EQ(out.download()[0], -1);
  std::vector<float> big_nan(20000, NAN);
  big_nan[19999] = -INFINITY;  // comparable: wins over NaNs
  DeviceArray<float> dbn(big_nan);
  engine::argmax(out.get(), dbn.get(), int(big_nan.size()), scratch.get(), nullptr);
  EXPECT_EQ(out.download()[0], 19999);
  EXPECT_EQ(scratch.download(), (std::vector<unsigned long long>{0, 0}));

  for (int i = 0; i < 3; ++i) {  // repeated launches on one scratch
    engine::argmax(out.get(), dl.get(), V, scratch.get(), nullptr);
    EXPECT_EQ(out.download()[0], 77777);
  }
}

// The lm head with argmax in one launch (matmul_argmax) against matmul (T = 1) then argmax: the
// outputs bit-identical and the same token, f32 and f16; N of more row blocks than the grid holds (its
// blocks loop), fewer, and not a multiple of a block's 16 rows; K of one round (896), several (2,048)
// and a partial one (72); a tie between two rows far apart (the lower index), a NaN row (never wins),
// every output NaN (-1); repeated launches on one scratch. Where matmul would run 4 warps a row (N <
// 4096 with long K) or a quantized matrix is given, it launches nothing and says so.
// moe_route (one warp a token) against the f64 reference twin: the same experts in the same order, the
// probabilities and weights within f32 rounding; E a multiple of 32 or not (Mixtral's 8, qwen2moe's 60, 128, 256);
// ties to the lower id; a token of NaN logits takes experts 0..K-1; probs may alias the logits.
TEST(EngineOps, MoeRouteMatchesReference) {
  DIFFRUN_REQUIRE_CUDA();
  for (auto [E, K] : {std::pair{8, 2}, std::pair{60, 4}, std::pair{128, 8}, std::pair{256, 8}})
    for (bool renormalise : {true, false}) {
      SCOPED_TRACE("E " + std::to_string(E) + " K " + std::to_string(K) + (renormalise ? " renormalised" : ""));
      const int T = 37;
      // Token t: the E values 0.05·i in a shuffled order (no near-ties), but token 1 all equal, token 2 pairs of
      // equal values, token 3 NaN at one expert.
      std::vector<float> logits(size_t(T) * E);
      std::mt19937 rng(static_cast<uint32_t>(E * 31 + K));
      for (int t = 0; t < T; ++t) {
        std::vector<int> order(E);
        for (int i = 0; i < E; ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), rng);
        for (int e = 0; e < E; ++e) logits[size_t(t) * E + e] = 0.05f * float(order[e]) - 2.0f;
      }
      for (int e = 0; e < E; ++e) {
        logits[size_t(1) * E + e] = 0.25f;
        logits[size_t(2) * E + e] = 0.1f * float((E - 1 - e) / 2);
      }
      logits[size_t(3) * E + E / 2] = std::nanf("");
      std::vector<double> p_ref(logits.size()), w_ref(size_t(T) * K), wn_ref(size_t(T) * K);
      std::vector<int32_t> ids_ref(size_t(T) * K);
      ref::moe_route<double>(p_ref.data(), ids_ref.data(), w_ref.data(), wn_ref.data(), widen(logits).data(), T, E, K,
                             renormalise);
      for (bool alias : {false, true}) {
        SCOPED_TRACE(alias ? "probs in place of the logits" : "probs apart");
        DeviceArray<float> d_logits(logits), d_probs(std::vector<float>(logits.size(), std::nanf("")));
        DeviceArray<int32_t> d_ids(std::vector<int32_t>(size_t(T) * K, -7));
        DeviceArray<float> d_w(std::vector<float>(size_t(T) * K)), d_wn(std::vector<float>(size_t(T) * K));
        float* probs = alias ? d_logits.get() : d_probs.get();
        engine::moe_route(probs, d_ids.get(), d_w.get(), d_wn.get(), d_logits.get(), T, E, K, renormalise, nullptr);
        TEST_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<int32_t> ids = d_ids.download();
        const std::vector<float> p = alias ? d_logits.download() : d_probs.download();
        const std::vector<float> w = d_w.download(), wn = d_wn.download();
        for (int t = 0; t < T; ++t) {
          SCOPED_TRACE("token " + std::to_string(t));
          for (int j = 0; j < K; ++j) {
            const size_t s = size_t(t) * K + j;
            if (t == 3) {  // every probability NaN: experts in id order
              EXPECT_EQ(ids[s], j);
              EXPECT_TRUE(std::isnan(w[s]));
              continue;
            }
            EXPECT_EQ(ids[s], ids_ref[s]) << "slot " << j;
            EXPECT_NEAR(w[s], w_ref[s], 1e-6 * std::max(1.0, std::abs(w_ref[s])));
            EXPECT_NEAR(wn[s], wn_ref[s], 2e-6 * std::max(1.0, std::abs(wn_ref[s])));
          }
          if (t != 3) {
            EXPECT_LT(rel_l2(std::vector<float>(p.begin() + size_t(t) * E, p.begin() + size_t(t + 1) * E),
                             narrow(std::vector<double>(p_ref.begin() + size_t(t) * E,
                                                        p_ref.begin() + size_t(t + 1) * E))),
                      1e-6);
          }
        }
        // moe_route_ids: every output bit-identical to moe_route's, and the ids also as values.
        DeviceArray<float> l2(logits), p2(std::vector<float>(logits.size(), std::nanf("")));
        DeviceArray<int32_t> ids2(std::vector<int32_t>(size_t(T) * K, -7));
        DeviceArray<float> v2(std::vector<float>(size_t(T) * K, -7.0f)), w2(std::vector<float>(size_t(T) * K)),
            wn2(std::vector<float>(size_t(T) * K));
        float* probs2 = alias ? l2.get() : p2.get();
        engine::moe_route_ids(probs2, ids2.get(), v2.get(), w2.get(), wn2.get(), l2.get(), T, E, K, renormalise,
                              nullptr);
        const std::vector<int32_t> fused_ids = ids2.download();
        EXPECT_EQ(fused_ids, ids);
        const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {  // NaN included
          return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        };
        EXPECT_TRUE(same_bits(alias ? l2.download() : p2.download(), p));
        EXPECT_TRUE(same_bits(w2.download(), w));
        EXPECT_TRUE(same_bits(wn2.download(), wn));
        const std::vector<float> values = v2.download();
        for (size_t s = 0; s < values.size(); ++s) EXPECT_EQ(values[s], static_cast<float>(fused_ids[s])) << "slot " << s;
      }
    }
}

// A buffer let go on another thread while a stream is capturing (one engine's buffers growing beside another's first
// decode step): the free waits until the capture ends (cudaFree is documented as synchronizing, and a device
// synchronization invalidates a capture: cudaErrorStreamCaptureInvalidated), and then runs.
TEST(EngineOps, FreesWaitOutAnotherThreadsCapture) {
  DIFFRUN_REQUIRE_CUDA();
  cudaStream_t s = nullptr;
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  engine::DeviceBuffer<float> work(256, "a captured memset's target");
  auto doomed = std::make_unique<engine::DeviceBuffer<float>>(size_t(1) << 20, "a buffer let go mid-capture");
  void* const doomed_ptr = doomed->get();
  cudaGraph_t graph = nullptr;
  cudaError_t end_err = cudaSuccess;
  cudaMemoryType during = cudaMemoryTypeUnregistered;
  {
    engine::CaptureInFlight in_flight;
    TEST_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TEST_CUDA_CHECK(cudaMemsetAsync(work.get(), 0, work.bytes(), s));
    std::thread other([&] {
      doomed.reset();
      cudaPointerAttributes a{};
      if (cudaPointerGetAttributes(&a, doomed_ptr) == cudaSuccess) during = a.type;
      else (void)cudaGetLastError();
    });
    other.join();
    end_err = cudaStreamEndCapture(s, &graph);
  }
  EXPECT_EQ(end_err, cudaSuccess) << cudaGetErrorString(end_err);
  EXPECT_EQ(during, cudaMemoryTypeDevice) << "the buffer was freed during the capture";
  cudaPointerAttributes after{};
  const cudaError_t q = cudaPointerGetAttributes(&after, doomed_ptr);
  if (q != cudaSuccess) (void)cudaGetLastError();
  EXPECT_TRUE(q != cudaSuccess || after.type != cudaMemoryTypeDevice) << "the deferred free did not run";
  if (graph) cudaGraphDestroy(graph);
  TEST_CUDA_CHECK(cudaStreamDestroy(s));
}

// An engine let go on another thread while a stream is capturing (one pair's engine done beside another's first
// decode step or recording check): its cuBLAS handle's cublasDestroy synchronizes the device, which invalidated every
// such capture before it waited for the capture to end (after_captures).
TEST(EngineOps, CublasDestroyWaitsOutAnotherThreadsCapture) {
  DIFFRUN_REQUIRE_CUDA();
  cudaStream_t s = nullptr;
  TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  engine::DeviceBuffer<float> work(256, "a captured memset's target");
  auto doomed = std::make_unique<engine::CublasHandle>(engine::EnginePrecision::f32);
  cudaGraph_t graph = nullptr;
  cudaError_t launch_err = cudaSuccess, end_err = cudaSuccess;
  {
    engine::CaptureInFlight in_flight;
    TEST_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TEST_CUDA_CHECK(cudaMemsetAsync(work.get(), 0, work.bytes(), s));
    std::thread other([&] {
      engine::CublasHandle created_and_gone(engine::EnginePrecision::f16);
      doomed.reset();
    });
    other.join();
    launch_err = cudaMemsetAsync(work.get(), 1, work.bytes(), s);
    end_err = cudaStreamEndCapture(s, &graph);
  }
  EXPECT_EQ(launch_err, cudaSuccess) << cudaGetErrorString(launch_err);
  EXPECT_EQ(end_err, cudaSuccess) << cudaGetErrorString(end_err);
  (void)cudaGetLastError();
  if (graph) {
    cudaGraphExec_t exec = nullptr;
    TEST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    TEST_CUDA_CHECK(cudaGraphLaunch(exec, s));
    TEST_CUDA_CHECK(cudaStreamSynchronize(s));
    TEST_CUDA_CHECK(cudaGraphExecDestroy(exec));
    cudaGraphDestroy(graph);
  }
  TEST_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(EngineOps, MatmulArgmaxMatchesMatmulThenArgmax) {
  DIFFRUN_REQUIRE_CUDA();
  engine::CublasHandle h32(engine::EnginePrecision::f32), h16(engine::EnginePrecision::f16);
  for (auto [N, K] : {std::pair{40003, 896}, std::pair{4101, 2048}, std::pair{9731, 72}, std::pair{37, 64}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(K));
    auto w = random_vec(size_t(N) * K, 70, 0.2f);
    const auto x = random_vec(K, 71);
    const int top = N / 3, twin = N - 2;  // equal rows, aligned with x: the largest outputs, tied
    for (int k = 0; k < K; ++k) w[size_t(top) * K + k] = w[size_t(twin) * K + k] = x[k] > 0 ? 0.5f : -0.5f;
    w[size_t(1) * K + K / 2] = NAN;  // row 1's output is NaN
    for (bool all_nan : {false, true}) {
      SCOPED_TRACE(all_nan ? "x with a NaN: every output NaN" : "finite x");
      std::vector<float> xs = x;
      if (all_nan) xs[K - 1] = NAN;
      DeviceArray<float> dx(xs), dw(w);
      DeviceArray<__half> hx(to_half(xs)), hw(to_half(w));
      for (bool f16 : {false, true}) {
        SCOPED_TRACE(f16 ? "f16" : "f32");
        const std::vector<float> nan(N, std::nanf(""));
        DeviceArray<float> y1(nan), y2(nan);
        DeviceArray<int32_t> t1(std::vector<int32_t>{-7}), t2(std::vector<int32_t>{-7});
        DeviceArray<unsigned long long> s1(std::vector<unsigned long long>{0, 0}), s2(s1.download());
        // matmul into y1 and matmul_argmax into y2, t2 for weights and activations of one type (W).
        const auto run = [&](const auto* xw, const auto* ww, const engine::CublasHandle& h) {
          using W = std::remove_cv_t<std::remove_pointer_t<decltype(ww)>>;
          engine::DeviceMatrix<W> m;
          m.dense = ww;
          m.K = K;
          m.rows = N;
          engine::matmul(y1.get(), xw, ww, nullptr, 1, K, N, h, nullptr);
          return engine::matmul_argmax(y2.get(), t2.get(), xw, m, K, N, s2.get(), nullptr);
        };
        for (int rep = 0; rep < 2; ++rep) {
          ASSERT_TRUE(f16 ? run(hx.get(), hw.get(), h16) : run(dx.get(), dw.get(), h32));
          engine::argmax(t1.get(), y1.get(), N, s1.get(), nullptr);
          TEST_CUDA_CHECK(cudaGetLastError());
          EXPECT_EQ(bits(y2.download()), bits(y1.download()));
          EXPECT_EQ(t2.download()[0], t1.download()[0]);
          EXPECT_EQ(t2.download()[0], all_nan ? -1 : top);
          EXPECT_EQ(s2.download(), (std::vector<unsigned long long>{0, 0}));
        }
      }
    }
  }
  // Not run: 4 warps a row in matmul (N < 4096, K of more than 128 chunks), and a quantized matrix.
  const auto w = random_vec(size_t(37) * 4864, 72), x = random_vec(4864, 73);
  DeviceArray<float> dx(x), dw(w), y(37);
  DeviceArray<int32_t> t(std::vector<int32_t>{-7});
  DeviceArray<unsigned long long> s(std::vector<unsigned long long>{0, 0});
  engine::DeviceMatrix<float> m;
  m.dense = dw.get();
  m.K = 4864;
  m.rows = 37;
  EXPECT_FALSE(engine::matmul_argmax(y.get(), t.get(), dx.get(), m, 4864, 37, s.get(), nullptr));
  m.dense = nullptr;  // quantized
  m.n_segments = 1;
  m.segments[0].type = GgmlType::Q8_0;
  m.segments[0].rows = 37;
  EXPECT_FALSE(engine::matmul_argmax(y.get(), t.get(), dx.get(), m, 4864, 37, s.get(), nullptr));
  EXPECT_EQ(t.download()[0], -7);
  EXPECT_THROW(engine::matmul_argmax(y.get(), t.get(), dx.get(), m, 4863, 37, s.get(), nullptr), Error);
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


// The checkpoint stager on its own: 24 tensors of ~6 MB (f32, and f16 widened), more than its 32 MiB
// device arena holds (it fills and waits for its copies out mid-step) and spread over several 16 MiB
// pinned chunks (two may be adjacent in memory: one copy out must not span them), staged in two
// flushes; every value delivered as staged, in order, in both copy modes. Then a second step on the
// same memory.
TEST(EngineOps, CheckpointStagerDeliversWhatWasStaged) {
  DIFFRUN_REQUIRE_CUDA();
  auto tensor_name = [](int i) {
    std::string name = "t";
    name += std::to_string(i);
    return name;
  };
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  const size_t N = 1536 * 1024;
  std::vector<float> host(N);
  for (float& v : host) v = dist(rng);
  DeviceArray<float> d32(host);
  DeviceArray<__half> d16(to_half(host));
  for (const char* mode : {"gather", "memcpy"}) {
    SCOPED_TRACE(mode);
    setenv("DIFFRUN_CHECKPOINT_COPY", mode, 1);
    engine::CheckpointStager stager;
    unsetenv("DIFFRUN_CHECKPOINT_COPY");
    EXPECT_EQ(stager.gathers(), std::string(mode) == "gather");
    for (int step = 0; step < 2; ++step) {
      test::MemorySink sink;
      for (int i = 0; i < 24; ++i) {
        const int64_t n = int64_t(N) - 4099 * i;
        const std::string name = tensor_name(i);
        if (i % 2 == 0)
          stager.stage(step, name, -1, "T,D", {n}, d32.get() + i, nullptr);
        else
          stager.stage(step, name, -1, "T,D", {n}, d16.get() + i, nullptr);
        if (i == 11) stager.flush(nullptr);
      }
      stager.finish(nullptr);
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
      stager.deliver(sink);
      ASSERT_EQ(sink.order[step].size(), 24u);
      for (int i = 0; i < 24; ++i) {
        const test::Recorded& r = sink.tensors[step].at(tensor_name(i));
        const int64_t n = int64_t(N) - 4099 * i;
        ASSERT_EQ(int64_t(r.data.size()), n);
        EXPECT_EQ(r.native, i % 2 == 0 ? NativeDType::f32 : NativeDType::f16);
        int64_t wrong = 0;
        for (int64_t j = 0; j < n; ++j) {
          const float want = i % 2 == 0 ? host[i + j] : __half2float(__float2half_rn(host[i + j]));
          wrong += r.data[j] != want;
        }
        EXPECT_EQ(wrong, 0) << "t" << i << " step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace diffrun
