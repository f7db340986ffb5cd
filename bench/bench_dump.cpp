// Dump write benchmark: a full checkpoint set of a SmolLM2-135M-shaped config (32-token prefill plus
// 8 decode steps, random values), written several times; prints the median write MB/s and file size.
// Usage: bench_dump [DIR] [RUNS] [PROMPT]   (DIR: the system temp directory, RUNS: 7, PROMPT: 32 tokens)
// Dims: T tokens of the step, S cached positions after it.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "checkpoints/dump.hpp"

namespace {

using namespace diffrun;

ModelConfig smollm2_config() {
  ModelConfig c;
  c.arch = Arch::llama;
  c.n_layer = 30;
  c.n_embd = 576;
  c.n_head = 9;
  c.n_head_kv = 3;
  c.head_dim = 64;
  c.n_ff = 1536;
  c.n_vocab = 49152;
  c.n_ctx = 8192;
  c.rope_theta = 100000.0;
  c.rope_type = RopeType::norm;
  c.tied_output = true;
  return c;
}

struct RunResult {
  double seconds;      // wall clock
  double cpu_seconds;  // process CPU time (user + system)
  uint64_t bytes;      // checkpoint values written
  uint64_t file_size;  // bytes on disk
  size_t datasets;
};

RunResult write_once(const std::string& path, const ModelConfig& cfg, const std::vector<float>& noise, int prompt) {
  constexpr int kDecode = 8;
  DumpMeta meta;
  meta.backend = "bench";
  meta.precision = "f32";
  meta.model_path = "SmolLM2-135M-Instruct.Q4_1.gguf";
  meta.model_fingerprint = "bench";
  meta.config = cfg;
  meta.prompt = "bench";
  meta.token_ids.assign(prompt, 1);
  const auto names = checkpoint_names(cfg);
  size_t datasets = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  DumpWriter w(path, meta);
  int n_past = 0;
  for (int step = 0; step <= kDecode; ++step) {
    const int T = step == 0 ? prompt : 1;
    const int S = n_past + T;
    const std::vector<int32_t> ids(T, 1);
    size_t offset = 0;
    for (const auto& name : names) {
      const auto parsed = parse_checkpoint_name(name);
      const CheckpointKind& kind = *find_checkpoint_kind(parsed.base);
      if (name == "tokens") {
        w.record_ids(step, name, ids);
      } else {
        const auto shape = checkpoint_shape(cfg, kind, T, S);
        size_t n = 1;
        for (auto d : shape) n *= static_cast<size_t>(d);
        if (offset + n > noise.size()) offset = 0;
        w.record(step, name, parsed.layer, kind.layout, shape, NativeDType::f32,
                 std::span<const float>(noise.data() + offset, n));
        offset += 4099;  // different values per checkpoint without copying
      }
      ++datasets;
    }
    n_past = S;
  }
  w.finish();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu_seconds = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  return {seconds, cpu_seconds, w.bytes_written(), std::filesystem::file_size(path), datasets};
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : std::filesystem::temp_directory_path().string();
  const int runs = argc > 2 ? std::max(1, std::stoi(argv[2])) : 7;
  const int prompt = argc > 3 ? std::max(1, std::stoi(argv[3])) : 32;
  const ModelConfig cfg = smollm2_config();
  // Large enough for the biggest checkpoint (result_output of the prefill: prompt x V).
  std::vector<float> noise(static_cast<size_t>(prompt) * cfg.n_vocab + static_cast<size_t>(prompt) * prompt * 9);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : noise) x = normal(rng);

  const std::string path = dir + "/bench_dump.h5";
  std::vector<double> rates, cpu_rates;
  RunResult last{};
  try {
    for (int i = 0; i < runs; ++i) {
      last = write_once(path, cfg, noise, prompt);
      rates.push_back(static_cast<double>(last.bytes) / 1e6 / last.seconds);
      cpu_rates.push_back(static_cast<double>(last.bytes) / 1e6 / last.cpu_seconds);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_dump: {}\n", e.what());
    return 2;
  }
  std::filesystem::remove(path);
  std::sort(rates.begin(), rates.end());
  std::sort(cpu_rates.begin(), cpu_rates.end());
  const double cpu_median = cpu_rates[cpu_rates.size() / 2];
  fmt::print("dump write, SmolLM2-135M shape (30 layers, D=576, F=1536, V=49152), {}-token prefill + 8 decode steps\n",
             prompt);
  fmt::print("  datasets       {}\n", last.datasets);
  fmt::print("  values         {:.1f} MB\n", static_cast<double>(last.bytes) / 1e6);
  fmt::print("  file size      {:.1f} MB ({:+.2f}% over the values)\n", static_cast<double>(last.file_size) / 1e6,
             100.0 * (static_cast<double>(last.file_size) / static_cast<double>(last.bytes) - 1.0));
  fmt::print("  write          {:.0f} MB/s median of {} runs (min {:.0f}, max {:.0f}), {:.1f} ms per dump\n",
             rates[rates.size() / 2], runs, rates.front(), rates.back(),
             static_cast<double>(last.bytes) / 1e3 / rates[rates.size() / 2]);
  // On a busy machine the wall clock includes time spent waiting for a core; CPU time does not.
  fmt::print("  write per CPU  {:.0f} MB/s median ({:.1f} ms CPU per dump)\n", cpu_median,
             static_cast<double>(last.bytes) / 1e3 / cpu_median);
  return 0;
}
