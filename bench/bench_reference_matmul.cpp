// Benchmark of the CPU reference's streamed matmul on one layer's matrices of a GGUF (Wq, Wgate, Wdown: the three
// shapes of a llama layer), one token and a prefill's group of tokens, f64 and f32 (weights rounded to f16, as
// f32-f16store holds them): median wall and CPU seconds per matmul, and a hash of the outputs' bits, which any
// change to the kernels must leave as it is (the values depend on K alone: kernels.hpp).
// Usage: bench_reference_matmul MODEL.gguf [--layer L] [--tokens T] [--threads N] [--reps N]
//                               [--kernels vector|portable]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <omp.h>

#include "model/error.hpp"
#include "model/gguf.hpp"
#include "bench/bench_util.hpp"
#include "reference_cpu/kernels.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/storage.hpp"
#include "reference_cpu/weights.hpp"

namespace {

using namespace diffrun;
using Clock = std::chrono::steady_clock;

using bench_util::cpu_seconds;
using bench_util::median;

template <typename T>
uint64_t hash_bits(const std::vector<T>& v) {  // FNV-1a over the bytes
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

template <typename T>
void bench(const GgufFile& file, const std::string& name, int n_tokens, int reps, bool f16) {
  const TensorInfo& info = file.tensor(name);
  const int K = static_cast<int>(info.ne[0]);
  const int N = static_cast<int>(info.rows());
  const ref::WeightMatrix<T> w(info.type, file.tensor_data(info).data(), N, K, f16);
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  std::vector<T> x(static_cast<size_t>(n_tokens) * K);
  for (T& v : x) v = static_cast<T>(normal(rng));
  if (f16) ref::round_f16(x.data(), static_cast<int64_t>(x.size()));
  std::vector<T> out(static_cast<size_t>(n_tokens) * N);
  std::vector<double> wall, cpu;
  for (int r = 0; r < reps; ++r) {
    const auto t = Clock::now();
    const double c = cpu_seconds();
    ref::matmul(out.data(), x.data(), w, static_cast<const T*>(nullptr), n_tokens, K, N);
    cpu.push_back(cpu_seconds() - c);
    wall.push_back(std::chrono::duration<double>(Clock::now() - t).count());
  }
  fmt::print("  {:<24} {:<4} {:>2} tokens [{} x {}] {:8.4f} s (cpu {:8.4f} s)  hash {:016x}\n", name,
             f16 ? "f32h" : (sizeof(T) == 8 ? "f64" : "f32"), n_tokens, N, K, median(wall), median(cpu),
             hash_bits(out));
}

int usage() {
  fmt::print(stderr, "usage: bench_reference_matmul MODEL.gguf [--layer L] [--tokens T] [--threads N] [--reps N] "
                     "[--kernels vector|portable]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model;
  int layer = 0, tokens = 32, threads = 0, reps = 3;
  bool portable = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--layer" && has_value) {
      layer = std::atoi(argv[++i]);
    } else if (a == "--tokens" && has_value) {
      tokens = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--threads" && has_value) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--reps" && has_value) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--kernels" && has_value) {
      const std::string k = argv[++i];
      if (k != "vector" && k != "portable") return usage();
      portable = k == "portable";
    } else if (!a.empty() && a[0] != '-' && model.empty()) {
      model = a;
    } else {
      return usage();
    }
  }
  if (model.empty()) return usage();
  if (threads > 0) omp_set_num_threads(threads);
  ref::set_portable_kernels(portable);
  try {
    const auto file = GgufFile::open(model);
    fmt::print("{}: layer {}; {} threads; {} kernels\n", model, layer, omp_get_max_threads(), ref::kernels_name());
    const std::string blk = "blk." + std::to_string(layer) + ".";
    for (const char* m : {"attn_q.weight", "ffn_gate.weight", "ffn_down.weight"}) {
      for (int t : {1, tokens}) {
        bench<double>(*file, blk + m, t, reps, false);
        bench<float>(*file, blk + m, t, reps, true);
      }
    }
  } catch (const diffrun::Error& e) {
    fmt::print(stderr, "bench_reference_matmul: {}\n", e.what());
    return 2;
  }
  return 0;
}
