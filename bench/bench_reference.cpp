// Benchmark of the CPU reference: prefill tok/s on a 32-token prompt (median of 3), decode tok/s (median), peak RSS,
// and dump write MB/s for a full checkpoint set; weights streamed against dense, in turns within one run.
// Usage: bench_reference [MODEL.gguf ...] [--precision f32|f64|...] [--decode N] [--dir D] [--streamed-only]
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

#include "dump/dump.hpp"
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int32_t argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Prefill then decode with weights streamed from the GGUF bytes (the reference's way) and, unless only_streamed,
// with every matrix dequantized at load (the former way, the baseline): the two backends take turns on the same
// tokens, step by step, so a loaded machine slows both alike; their logits must agree bit for bit.
void bench_model(const std::string& path, const std::string& precision, int n_decode, const std::string& dir,
                 bool only_streamed) {
  const int n_prompt = 32;
  const auto file = GgufFile::open(path);
  const ModelConfig cfg = config_from_gguf(*file);
  const int ctx = n_prompt + n_decode + 1;
  auto t0 = Clock::now();
  auto streamed = make_cpu_backend(*file, cfg, precision, ctx, {}, WeightHolding::streamed);
  const double load_streamed = seconds(t0, Clock::now());
  std::vector<int32_t> prompt(n_prompt);
  for (int i = 0; i < n_prompt; ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % cfg.n_vocab);

  // The streamed backend alone first, so that the peak RSS it reaches is its own.
  NullSink none;
  std::vector<double> prefill_s[2], decode_s[2], ratio;
  std::vector<float> logits = streamed->forward(0, prompt, none);
  streamed->forward(1, std::vector<int32_t>{argmax(logits)}, none);
  const double rss_streamed = peak_rss_mb();
  double load_dense = 0;
  std::unique_ptr<Backend> dense;
  if (!only_streamed) {
    t0 = Clock::now();
    dense = make_cpu_backend(*file, cfg, precision, ctx, {}, WeightHolding::dense);
    load_dense = seconds(t0, Clock::now());
  }
  Backend* backends[2] = {streamed.get(), dense.get()};
  const int n_backends = only_streamed ? 1 : 2;

  std::vector<float> out[2];
  for (int rep = 0; rep < 3; ++rep) {
    for (int b = 0; b < n_backends; ++b) {
      backends[b]->reset();
      const auto t = Clock::now();
      out[b] = backends[b]->forward(0, prompt, none);
      prefill_s[b].push_back(seconds(t, Clock::now()));
    }
  }
  for (int i = 0; i < n_decode; ++i) {
    if (n_backends == 2 && out[0] != out[1]) {
      throw InputError(fmt::format("{}: streamed and dense logits differ at step {}", path, i));
    }
    const int32_t next = argmax(out[0]);
    for (int b = 0; b < n_backends; ++b) {
      const auto t = Clock::now();
      out[b] = backends[b]->forward(i + 1, std::span<const int32_t>(&next, 1), none);
      decode_s[b].push_back(seconds(t, Clock::now()));
    }
    if (n_backends == 2) ratio.push_back(decode_s[0].back() / decode_s[1].back());
  }

  // A full checkpoint set for the prefill and two decode steps, written through the HDF5 writer.
  streamed->reset();
  const std::string dump_path = dir + "/bench_reference_dump.h5";
  DumpMeta meta;
  meta.backend = streamed->name();
  meta.precision = streamed->precision();
  meta.model_path = path;
  meta.config = cfg;
  meta.token_ids = prompt;
  double write_s = 0;
  uint64_t bytes = 0;
  {
    DumpWriter writer(dump_path, meta);
    TimedSink timed(writer);
    logits = streamed->forward(0, prompt, timed);
    for (int i = 0; i < 2; ++i) logits = streamed->forward(i + 1, std::vector<int32_t>{argmax(logits)}, timed);
    const auto tf = Clock::now();
    writer.finish();
    write_s = timed.spent + seconds(tf, Clock::now());
    bytes = writer.bytes_written();
  }
  std::filesystem::remove(dump_path);

  fmt::print("{} ({})\n", path, precision);
  fmt::print("  {} layers, D {}, H {}/{}, F {}, V {}; {} threads\n", cfg.n_layer, cfg.n_embd, cfg.n_head,
             cfg.n_head_kv, cfg.n_ff, cfg.n_vocab, omp_get_max_threads());
  // One column per backend: streamed, then dense unless only_streamed.
  auto row = [&](const std::string& label, double streamed_value, double dense_value, const char* unit) {
    std::string line = fmt::format("  {:<25}{:9.2f} {:<6}", label, streamed_value, unit);
    if (n_backends == 2) line += fmt::format("{:9.2f} {}", dense_value, unit);
    fmt::print("{}\n", line);
  };
  auto rate = [&](int b, const std::vector<double>* s, int tokens) {
    return b < n_backends ? tokens / median(s[b]) : 0.0;
  };
  fmt::print("  {:<25}{:>16}{}\n", "", "streamed", n_backends == 2 ? "            dense" : "");
  row("load", load_streamed, load_dense, "s");
  row(fmt::format("prefill {} tokens (med.)", n_prompt), rate(0, prefill_s, n_prompt), rate(1, prefill_s, n_prompt),
      "tok/s");
  row(fmt::format("decode (median of {})", n_decode), rate(0, decode_s, 1), rate(1, decode_s, 1), "tok/s");
  if (n_backends == 2) {
    fmt::print("  decode time streamed/dense, median of per-step ratios: {:.3f}\n", median(ratio));
  }
  fmt::print("  peak RSS streamed        {:8.0f} MB (prefill and a decode step, before the dense load)\n",
             rss_streamed);
  if (n_backends == 2) fmt::print("  peak RSS with dense too  {:8.0f} MB\n", peak_rss_mb());
  fmt::print("  dump write               {:8.0f} MB/s ({:.1f} MB in {:.2f} s)\n", bytes / 1e6 / write_s, bytes / 1e6,
             write_s);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models;
  int n_decode = 32;
  std::string precision = "f32";
  bool only_streamed = false;
  std::string dir = std::filesystem::temp_directory_path().string();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--decode" && i + 1 < argc) {
      n_decode = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--precision" && i + 1 < argc) {
      precision = argv[++i];
    } else if (a == "--streamed-only") {
      only_streamed = true;
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
    for (const std::string& m : models) bench_model(m, precision, n_decode, dir, only_streamed);
  } catch (const diffrun::Error& e) {
    fmt::print(stderr, "bench_reference: {}\n", e.what());
    return 2;
  }
  return 0;
}
