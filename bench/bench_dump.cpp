// Dump write benchmark: a full checkpoint set of a SmolLM2-135M- or Qwen2.5-0.5B-shaped config (a prompt-token
// prefill plus 8 decode steps, random values), written several times; prints the median write MB/s and file size.
// Usage: bench_dump [--shape smollm2|0.5b] [--cache-rows step|all] [--compress LEVEL] [DIR] [RUNS] [PROMPT]
//   (shape smollm2, cache rows step (DumpWriter's default), not compressed, DIR the system temp directory,
//   RUNS 7, PROMPT 32 tokens)
// MB/s counts the values written (DumpWriter::bytes_written) over the wall time from opening the writer to
// finish() returning (the file renamed: everything on its way to disk); "caller" is the time spent inside
// record() alone, what a backend waits for; "finish" the time inside finish(). Before the clock starts the
// previous run's file is removed and sync() called, so that each run writes one dump as a fresh run would:
// the rename over the old file would drop its 116 MB (0.5b) inside finish() (about 55 ms on the
// workstation: the cost of deleting an old dump, not of writing one), and the writeback of the earlier
// runs' pages would compete for the cores.
// Dims: T tokens of the step, S cached positions after it.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <unistd.h>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "dump/dump.hpp"

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

ModelConfig qwen05b_config() {
  ModelConfig c;
  c.arch = Arch::qwen2;
  c.n_layer = 24;
  c.n_embd = 896;
  c.n_head = 14;
  c.n_head_kv = 2;
  c.head_dim = 64;
  c.n_ff = 4864;
  c.n_vocab = 151936;
  c.n_ctx = 32768;
  c.rope_theta = 1000000.0;
  c.rope_type = RopeType::neox;
  c.tied_output = true;
  c.qkv_bias = true;
  return c;
}

struct RunResult {
  double seconds;      // wall clock
  double cpu_seconds;  // process CPU time (user + system)
  double caller_seconds;  // inside record() and record_ids()
  double finish_seconds;  // inside finish(): the queued values written, the attribute tables, close, rename
  uint64_t bytes;      // checkpoint values written
  uint64_t file_size;  // bytes on disk
  size_t datasets;
};

RunResult write_once(const std::string& path, const ModelConfig& cfg, const std::vector<float>& noise, int prompt,
                     const DumpWriterOptions& options) {
  using Clock = std::chrono::steady_clock;
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
  std::filesystem::remove(path);
  ::sync();  // the removed file's blocks freed and earlier runs' pages written back before the clock starts
  const auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  double caller = 0;
  DumpWriter w(path, meta, {}, options);
  int n_past = 0;
  for (int step = 0; step <= kDecode; ++step) {
    const int T = step == 0 ? prompt : 1;
    const int S = n_past + T;
    const std::vector<int32_t> ids(T, 1);
    size_t offset = 0;
    for (const auto& name : names) {
      const auto parsed = parse_checkpoint_name(name);
      const CheckpointKind& kind = *find_checkpoint_kind(parsed.base);
      const auto put0 = Clock::now();
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
      caller += std::chrono::duration<double>(Clock::now() - put0).count();
      ++datasets;
    }
    n_past = S;
  }
  const auto f0 = Clock::now();
  w.finish();
  const double finish = std::chrono::duration<double>(Clock::now() - f0).count();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu_seconds = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  return {seconds, cpu_seconds, caller, finish, w.bytes_written(), std::filesystem::file_size(path), datasets};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string shape = "smollm2";
  DumpWriterOptions options;
  for (size_t i = 0; i < args.size();) {
    if (args[i] == "--shape" && i + 1 < args.size()) {
      shape = args[i + 1];
    } else if (args[i] == "--cache-rows" && i + 1 < args.size()) {
      options.cache_all_rows = args[i + 1] == "all";
    } else if (args[i] == "--compress" && i + 1 < args.size()) {
      options.compress = std::stoi(args[i + 1]);
    } else {
      ++i;
      continue;
    }
    args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
  }
  if (shape != "smollm2" && shape != "0.5b") {
    fmt::print(stderr, "bench_dump: --shape is smollm2 or 0.5b\n");
    return 2;
  }
  const std::string dir = !args.empty() ? args[0] : std::filesystem::temp_directory_path().string();
  const int runs = args.size() > 1 ? std::max(1, std::stoi(args[1])) : 7;
  const int prompt = args.size() > 2 ? std::max(1, std::stoi(args[2])) : 32;
  const ModelConfig cfg = shape == "0.5b" ? qwen05b_config() : smollm2_config();
  // Large enough for the biggest checkpoint (result_output of the prefill: prompt x V).
  std::vector<float> noise(static_cast<size_t>(prompt) * cfg.n_vocab + static_cast<size_t>(prompt) * prompt * cfg.n_head);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : noise) x = normal(rng);

  const std::string path = dir + "/bench_dump.h5";
  std::vector<double> rates, cpu_rates, caller_rates, finish_ms;
  RunResult last{};
  try {
    for (int i = 0; i < runs; ++i) {
      last = write_once(path, cfg, noise, prompt, options);
      caller_rates.push_back(static_cast<double>(last.bytes) / 1e6 / last.caller_seconds);
      rates.push_back(static_cast<double>(last.bytes) / 1e6 / last.seconds);
      cpu_rates.push_back(static_cast<double>(last.bytes) / 1e6 / last.cpu_seconds);
      finish_ms.push_back(last.finish_seconds * 1e3);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_dump: {}\n", e.what());
    return 2;
  }
  std::filesystem::remove(path);
  std::sort(rates.begin(), rates.end());
  std::sort(cpu_rates.begin(), cpu_rates.end());
  std::sort(caller_rates.begin(), caller_rates.end());
  std::sort(finish_ms.begin(), finish_ms.end());
  const double cpu_median = cpu_rates[cpu_rates.size() / 2];
  fmt::print("dump write, {} shape ({} layers, D={}, F={}, V={}), {}-token prefill + 8 decode steps; cache rows {}, "
             "{}\n",
             shape == "0.5b" ? "Qwen2.5-0.5B" : "SmolLM2-135M", cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_vocab, prompt,
             options.cache_all_rows ? "all" : "of the step",
             options.compress > 0 ? fmt::format("gzip level {}", options.compress) : std::string("not compressed"));
  fmt::print("  datasets       {}\n", last.datasets);
  fmt::print("  values         {:.1f} MB\n", static_cast<double>(last.bytes) / 1e6);
  fmt::print("  file size      {:.1f} MB ({:+.2f}% over the values)\n", static_cast<double>(last.file_size) / 1e6,
             100.0 * (static_cast<double>(last.file_size) / static_cast<double>(last.bytes) - 1.0));
  fmt::print("  write          {:.0f} MB/s median of {} runs (min {:.0f}, max {:.0f}), {:.1f} ms per dump\n",
             rates[rates.size() / 2], runs, rates.front(), rates.back(),
             static_cast<double>(last.bytes) / 1e3 / rates[rates.size() / 2]);
  fmt::print("  caller         {:.0f} MB/s median ({:.1f} ms inside record() per dump)\n",
             caller_rates[caller_rates.size() / 2],
             static_cast<double>(last.bytes) / 1e3 / caller_rates[caller_rates.size() / 2]);
  fmt::print("  finish         {:.1f} ms median (values still queued, attribute tables, close, rename)\n",
             finish_ms[finish_ms.size() / 2]);
  // On a busy machine the wall clock includes time spent waiting for a core; CPU time does not.
  fmt::print("  write per CPU  {:.0f} MB/s median ({:.1f} ms CPU per dump)\n", cpu_median,
             static_cast<double>(last.bytes) / 1e3 / cpu_median);
  return 0;
}
