// Benchmark: GGUF open and whole-model dequantization (f32 and f64); prints medians over repeats.
// Usage: bench_dequant [MODEL.gguf] [REPEATS=5]   (default model: SmolLM2 in the models cache)
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "model/dequant.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

std::string default_model() {
  if (const char* d = std::getenv("DIFFRUN_MODELS"); d && *d) return std::string(d) + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  const char* x = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string cache = (x && *x) ? std::string(x) : std::string(home ? home : ".") + "/.cache";
  return cache + "/diffrun/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

template <typename T>
double load_all(const diffrun::GgufFile& f, std::map<std::string, std::vector<double>>& per_type) {
  const auto t0 = clock_type::now();
  for (const auto& t : f.tensors()) {
    const auto t1 = clock_type::now();
    const std::vector<T> v = diffrun::dequantize_tensor<T>(f, t);
    per_type[diffrun::ggml_type_name(t.type)].push_back(static_cast<double>(v.size()) / seconds_since(t1));
  }
  return seconds_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : default_model();
  const int repeats = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  try {
    std::vector<double> open_s, f32_s, f64_s;
    std::map<std::string, std::vector<double>> per_type;
    int64_t elements = 0;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = clock_type::now();
      auto f = diffrun::GgufFile::open(path);
      open_s.push_back(seconds_since(t0));
      elements = 0;
      for (const auto& t : f->tensors()) elements += t.n_elements;
      f32_s.push_back(load_all<float>(*f, per_type));
      std::map<std::string, std::vector<double>> unused;
      f64_s.push_back(load_all<double>(*f, unused));
    }
    fmt::print("bench_dequant: {} ({} elements), median of {}\n", path, elements, repeats);
    fmt::print("  open + parse header:        {:8.2f} ms\n", 1e3 * median(open_s));
    fmt::print("  dequantize all to f32:      {:8.2f} ms  ({:.0f} M elements/s)\n", 1e3 * median(f32_s),
               elements / median(f32_s) / 1e6);
    fmt::print("  dequantize all to f64:      {:8.2f} ms  ({:.0f} M elements/s)\n", 1e3 * median(f64_s),
               elements / median(f64_s) / 1e6);
    for (const auto& [type, rates] : per_type)
      fmt::print("  {:<6} to f32 per tensor:    {:8.0f} M elements/s (median over {} tensors)\n", type,
                 median(rates) / 1e6, rates.size());
  } catch (const diffrun::Error& e) {
    fmt::print(stderr, "bench_dequant: {}\n", e.what());
    return 2;
  }
  return 0;
}
