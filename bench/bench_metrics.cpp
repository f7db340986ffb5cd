// Benchmark of diff::compute_metrics, the comparison's per-element pass: ns per element on checkpoint shapes of
// the SmolLM2 job (every pair of values finite, the two sides a few ulps apart), and a hash of every metric so that
// two builds can be checked to give the same bits. Prints figures; not a test.
//
//   bench_metrics [--reps N] [--tokens T] [--sse2]
//
// --sse2 keeps the pass to its SSE2 groups where the CPU has AVX2 (the hash must not change).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "diff/metrics.hpp"

namespace {

struct Case {
  const char* name;
  std::vector<int64_t> shape;
  const char* layout;
};

uint64_t mix(uint64_t h, double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return (h ^ bits) * 0x100000001b3ull;
}

uint64_t hash_metrics(const diffrun::diff::TensorMetrics& m) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (double v : {m.max_abs, m.mean_abs, m.rel_l2, m.nmse, m.cosine, m.sqnr_db, m.fail_frac, m.min_atol, m.min_rtol,
                   m.worst.a, m.worst.b, m.worst.abs_err, m.row.rel_l2, m.head.rel_l2, m.channel.rel_l2})
    h = mix(h, v);
  for (int64_t v : {m.n_fail, m.worst.flat, m.row.index, m.head.index, m.channel.index})
    h = mix(h, static_cast<double>(v));
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 21, T = 37;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) {
      T = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--sse2")) {
      diffrun::diff::allow_metrics_avx2(false);
    } else {
      std::fprintf(stderr, "usage: bench_metrics [--reps N] [--tokens T] [--sse2]\n");
      return 2;
    }
  }
  const diffrun::diff::DimSizes dims = {{"T", T}, {"S", T}, {"D", 576}, {"H", 9}, {"Hkv", 3}, {"Dh", 64}, {"F", 1536}};
  const std::vector<Case> cases = {{"Qcur [T, H, Dh]", {T, 9, 64}, "T,H,Dh"},
                                   {"attn_norm [T, D]", {T, 576}, "T,D"},
                                   {"ffn_gate [T, F]", {T, 1536}, "T,F"},
                                   {"kq_soft_max [H, T, T]", {9, T, T}, "H,T,S"}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  uint64_t all = 0;
  for (const Case& c : cases) {
    int64_t n = 1;
    for (int64_t e : c.shape) n *= e;
    std::vector<float> b(n), a(n);
    for (int64_t i = 0; i < n; ++i) {
      b[i] = normal(rng);
      a[i] = b[i] * (1.0f + 1e-6f * normal(rng));
    }
    const diffrun::diff::ElementTolerance tol{1e-6, 1e-5};
    std::vector<double> ns;
    uint64_t h = 0;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const diffrun::diff::TensorMetrics m = diffrun::diff::compute_metrics(a, b, c.shape, c.layout, dims, tol);
      ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
      h = hash_metrics(m);
    }
    all = mix(all, static_cast<double>(h));
    std::printf("%-24s %9lld elements  %6.2f ns/element (median of %d)  metrics hash %016llx\n", c.name,
                static_cast<long long>(n), diffrun::bench_util::median(ns), reps, static_cast<unsigned long long>(h));
  }
  std::printf("all metrics hash %016llx (%s groups)\n", static_cast<unsigned long long>(all),
              diffrun::diff::metrics_avx2() ? "AVX2" : "SSE2");
  return 0;
}
