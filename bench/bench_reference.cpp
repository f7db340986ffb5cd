// Benchmark of the CPU reference (f32): prefill tok/s on a 32-token prompt (median of 3), decode tok/s (median), peak RSS,
// and dump write MB/s for a full checkpoint set. Usage: bench_reference [MODEL.gguf ...] [--decode N] [--dir D]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <omp.h>

#include "checkpoints/dump.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/reference.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace diffrun;

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double peak_rss_mb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024.0;  // kilobytes on Linux
}

// Forwards to a DumpWriter and accumulates the time spent inside it.
class TimedSink final : public Sink {
 public:
  explicit TimedSink(DumpWriter& w) : w_(w) {}
  bool wants(std::string_view name) const override { return w_.wants(name); }
  void record(int step, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override {
    const auto t0 = Clock::now();
    w_.record(step, name, layer, layout, shape, native, data);
    spent += seconds(t0, Clock::now());
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    const auto t0 = Clock::now();
    w_.record_ids(step, name, ids);
    spent += seconds(t0, Clock::now());
  }
  double spent = 0;

 private:
  DumpWriter& w_;
};

void bench_model(const std::string& path, int n_decode, const std::string& dir) {
  const int n_prompt = 32;
  const auto t0 = Clock::now();
  const auto file = GgufFile::open(path);
  const ModelConfig cfg = config_from_gguf(*file);
  auto backend = make_cpu_backend(*file, cfg, "f32", n_prompt + n_decode + 1);
  const auto t1 = Clock::now();
  std::vector<int32_t> prompt(n_prompt);
  for (int i = 0; i < n_prompt; ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % cfg.n_vocab);

  NullSink none;
  std::vector<double> prefill_s;
  std::vector<float> logits;
  for (int rep = 0; rep < 3; ++rep) {
    backend->reset();
    const auto t = Clock::now();
    logits = backend->forward(0, prompt, none);
    prefill_s.push_back(seconds(t, Clock::now()));
  }
  std::sort(prefill_s.begin(), prefill_s.end());
  std::vector<double> decode_s;
  for (int i = 0; i < n_decode; ++i) {
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const auto t = Clock::now();
    logits = backend->forward(i + 1, std::span<const int32_t>(&next, 1), none);
    decode_s.push_back(seconds(t, Clock::now()));
  }
  std::sort(decode_s.begin(), decode_s.end());
  const double median = decode_s[decode_s.size() / 2];

  // A full checkpoint set for the prefill and two decode steps, written through the HDF5 writer.
  backend->reset();
  const std::string out = dir + "/bench_reference_dump.h5";
  DumpMeta meta;
  meta.backend = backend->name();
  meta.precision = backend->precision();
  meta.model_path = path;
  meta.config = cfg;
  meta.token_ids = prompt;
  double write_s = 0;
  uint64_t bytes = 0;
  {
    DumpWriter writer(out, meta);
    TimedSink timed(writer);
    logits = backend->forward(0, prompt, timed);
    for (int i = 0; i < 2; ++i) {
      const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      logits = backend->forward(i + 1, std::span<const int32_t>(&next, 1), timed);
    }
    const auto tf = Clock::now();
    writer.finish();
    write_s = timed.spent + seconds(tf, Clock::now());
    bytes = writer.bytes_written();
  }
  std::filesystem::remove(out);

  fmt::print("{}\n", path);
  fmt::print("  {} layers, D {}, H {}/{}, F {}, V {}; {} threads\n", cfg.n_layer, cfg.n_embd, cfg.n_head,
             cfg.n_head_kv, cfg.n_ff, cfg.n_vocab, omp_get_max_threads());
  fmt::print("  load + dequantize (f32)  {:8.2f} s\n", seconds(t0, t1));
  fmt::print("  prefill {:3d} tokens (med.) {:8.1f} tok/s\n", n_prompt, n_prompt / prefill_s[1]);
  fmt::print("  decode (median of {:3d})   {:8.1f} tok/s\n", n_decode, 1.0 / median);
  fmt::print("  peak RSS (process)       {:8.0f} MB\n", peak_rss_mb());
  fmt::print("  dump write               {:8.0f} MB/s ({:.1f} MB in {:.2f} s)\n", bytes / 1e6 / write_s, bytes / 1e6,
             write_s);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models;
  int n_decode = 32;
  std::string dir = std::filesystem::temp_directory_path().string();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--decode" && i + 1 < argc) {
      n_decode = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      models.push_back(a);
    }
  }
  if (models.empty()) {
    const char* home = std::getenv("HOME");
    models.push_back(std::string(home ? home : ".") + "/.cache/diffrun/models/SmolLM2-135M-Instruct.Q4_1.gguf");
  }
  try {
    for (const std::string& m : models) bench_model(m, n_decode, dir);
  } catch (const diffrun::Error& e) {
    fmt::print(stderr, "bench_reference: {}\n", e.what());
    return 2;
  }
  return 0;
}
