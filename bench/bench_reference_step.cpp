// Benchmark of the CPU reference's two kinds of step on one GGUF: the prefill of a prompt and a one-token decode
// step, per precision (f64 and f32-f16store unless told), medians in seconds, at a given thread count; with each
// median, the process's CPU time of that step (on a shared machine, the figure less disturbed by other work at one
// thread; at several it includes OpenMP's spinning).
// Usage: bench_reference_step MODEL.gguf [--threads N] [--precision P]... [--prompt T] [--steps N] [--reps N]
//                             [--kernels vector|portable]
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <omp.h>

#include "checkpoints/sink.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "bench/bench_util.hpp"
#include "reference_cpu/kernels.hpp"
#include "reference_cpu/reference.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace diffrun;

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

using bench_util::cpu_seconds;
using bench_util::median;

int32_t argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

struct Options {
  std::string model;
  std::vector<std::string> precisions;
  int threads = 0;  // 0: OpenMP's default
  int prompt = 32;
  int steps = 8;
  int reps = 3;
  bool portable = false;
};

// Prefills `reps` times (the backend reset between) and then decodes `steps` one-token steps after the last prefill;
// prints the medians and the spread.
void bench_precision(const GgufFile& file, const ModelConfig& cfg, const Options& o, const std::string& precision) {
  const auto t0 = Clock::now();
  auto backend = make_cpu_backend(file, cfg, precision, o.prompt + o.steps + 1);
  const double load = seconds(t0, Clock::now());
  std::vector<int32_t> prompt(o.prompt);
  for (int i = 0; i < o.prompt; ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % cfg.n_vocab);
  NullSink none;
  std::vector<double> prefill, decode, prefill_cpu, decode_cpu;
  std::vector<float> logits;
  for (int r = 0; r < o.reps; ++r) {
    backend->reset();
    const auto t = Clock::now();
    const double c = cpu_seconds();
    logits = backend->forward(0, prompt, none);
    prefill.push_back(seconds(t, Clock::now()));
    prefill_cpu.push_back(cpu_seconds() - c);
  }
  for (int s = 0; s < o.steps; ++s) {
    const int32_t next = argmax(logits);
    const auto t = Clock::now();
    const double c = cpu_seconds();
    logits = backend->forward(s + 1, std::span<const int32_t>(&next, 1), none);
    decode.push_back(seconds(t, Clock::now()));
    decode_cpu.push_back(cpu_seconds() - c);
  }
  const auto [pmin, pmax] = std::minmax_element(prefill.begin(), prefill.end());
  const auto [dmin, dmax] = std::minmax_element(decode.begin(), decode.end());
  fmt::print("  {:<14} load {:5.2f} s | prefill {} tokens {:7.3f} s (median of {}, {:.3f}-{:.3f}; cpu {:.3f} s) | "
             "decode step {:7.3f} s (median of {}, {:.3f}-{:.3f}; cpu {:.3f} s)\n",
             precision, load, o.prompt, median(prefill), o.reps, *pmin, *pmax, median(prefill_cpu), median(decode),
             o.steps, *dmin, *dmax, median(decode_cpu));
}

int usage() {
  fmt::print(stderr,
             "usage: bench_reference_step MODEL.gguf [--threads N] [--precision P]... [--prompt T] [--steps N] "
             "[--reps N] [--kernels vector|portable]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--threads" && has_value) {
      o.threads = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--precision" && has_value) {
      o.precisions.push_back(argv[++i]);
    } else if (a == "--prompt" && has_value) {
      o.prompt = std::max(2, std::atoi(argv[++i]));
    } else if (a == "--steps" && has_value) {
      o.steps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--reps" && has_value) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--kernels" && has_value) {
      const std::string k = argv[++i];
      if (k != "vector" && k != "portable") return usage();
      o.portable = k == "portable";
    } else if (!a.empty() && a[0] != '-' && o.model.empty()) {
      o.model = a;
    } else {
      return usage();
    }
  }
  if (o.model.empty()) return usage();
  if (o.precisions.empty()) o.precisions = {"f64", "f32-f16store"};
  if (o.threads > 0) omp_set_num_threads(o.threads);
  ref::set_portable_kernels(o.portable);
  try {
    const auto file = GgufFile::open(o.model);
    const ModelConfig cfg = config_from_gguf(*file);
    fmt::print("{}: {} layers, D {}, F {}, V {}; {} threads; {} kernels\n", o.model, cfg.n_layer, cfg.n_embd,
               cfg.n_ff, cfg.n_vocab, omp_get_max_threads(), ref::kernels_name());
    for (const std::string& p : o.precisions) bench_precision(*file, cfg, o, p);
  } catch (const diffrun::Error& e) {
    fmt::print(stderr, "bench_reference_step: {}\n", e.what());
    return 2;
  }
  return 0;
}
