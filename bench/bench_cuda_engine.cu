// Benchmark of the CUDA engine: prefill and decode tokens/s, hooks off and on, and the fraction of the
// memory-bandwidth roofline that decode reaches. Prints figures; not a test.
//
//   bench_cuda_engine [--precision f16|f32] [--steps N] [--tp N] [--json FILE] MODEL.gguf [MODEL.gguf ...]
//   bench_cuda_engine [--precision f16|f32] --profile-prefill T MODEL.gguf
//   bench_cuda_engine [--precision f16|f32] --profile-decode N [--profile-hooks] MODEL.gguf
//   bench_cuda_engine --cold-start T [--keep-context] [--warm-cublas] MODEL.gguf
//
// --profile-prefill T runs one warm-up prefill of T tokens, then one between cudaProfilerStart and
// cudaProfilerStop (for `ncu --profile-from-start off`), and prints nothing else.
// --profile-decode N runs a 32-token prefill and 4 warm-up decode steps (the CUDA graph captured), then
// N decode steps (hooks off, argmax only) inside the profiler's range: with `ncu --graph-profiling node`
// every node of the decode graph is one profiled kernel. With --profile-hooks those steps record every
// checkpoint (to a sink that discards them) and copy the logits: the recorded graph's nodes.
// --cold-start T times what a process pays once, as the main job's engines pay it: the device's context,
// then for an f32 and an f16 engine in turn its load, its first T-token prefill with hooks off (the
// kernels' and cuBLAS's first use), its first with every checkpoint recorded (the stager's first buffers)
// and a warm one, then the engines' release and cudaDeviceReset (the context's teardown; not with
// --keep-context, which leaves it to the process's exit). Seconds, and the wall clock at the return.
// --warm-cublas first runs the main job's GEMM warm-up (cuda_warm_up_gemms) for both precisions, before any engine.
// --json FILE appends one JSON object per model and line (scripts/bench_vs_llamacpp.sh reads it).
// --tp N runs the tensor-parallel engine over N GPUs (engine/tp_engine.hpp); its roofline is one GPU's: the
// weights one rank reads per token over one GPU's copy bandwidth.
//
// Roofline: a decode step reads every weight once, so its floor is weight_bytes / bandwidth. The
// bandwidth is measured here with a device-to-device cudaMemcpy of 1 GiB (read + write bytes
// counted), and the fraction printed is (weight_bytes / median decode step time) / that bandwidth.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "bench/bench_cuda_util.cuh"
#include "checkpoints/sink.hpp"
#include "engine/engine.hpp"
#include "engine/tp_engine.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace {

using Clock = std::chrono::steady_clock;


// Records every checkpoint (or every one but those whose name starts with one of `skip`) and throws
// the values away: the engine's hook cost without a writer's.
class DiscardingSink final : public diffrun::Sink {
 public:
  explicit DiscardingSink(std::vector<std::string> skip = {}) : skip_(std::move(skip)) {}
  bool wants(std::string_view name) const override {
    for (const std::string& s : skip_)
      if (name.starts_with(s)) return false;
    return true;
  }
  void record(int, std::string_view, int, std::string_view, std::span<const int64_t>, diffrun::NativeDType,
              std::span<const float> data) override {
    bytes += data.size() * sizeof(float);
  }
  void record_ids(int, std::string_view, std::span<const int32_t>) override {}
  uint64_t bytes = 0;

 private:
  std::vector<std::string> skip_;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

using diffrun::bench_util::copy_bandwidth;

std::vector<int32_t> prompt(int n, int n_vocab) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (11 + 97 * i) % n_vocab;
  return ids;
}

// Median seconds of a T-token prefill (step 0 on an empty cache).
double time_prefill(diffrun::CudaEngine& eng, int T, diffrun::Sink& sink) {
  const std::vector<int32_t> ids = prompt(T, eng.config().n_vocab);
  std::vector<double> times;
  for (int r = 0; r < 6; ++r) {
    eng.reset();
    const auto t0 = Clock::now();
    eng.forward_argmax(0, ids, sink);
    if (r > 0) times.push_back(seconds_since(t0));
  }
  return median(times);
}

// Median seconds of a batch-1 decode step after a 32-token prefill, over `steps` steps.
double time_decode(diffrun::CudaEngine& eng, int steps, diffrun::Sink& sink, bool with_logits) {
  eng.reset();
  diffrun::NullSink none;
  int32_t next = eng.forward_argmax(0, prompt(32, eng.config().n_vocab), none);
  std::vector<double> times;
  for (int s = 1; s <= steps; ++s) {
    const std::vector<int32_t> tok = {std::max(next, 0)};
    const auto t0 = Clock::now();
    if (with_logits) {
      eng.forward(s, tok, sink);
      next = eng.last_argmax();
    } else {
      next = eng.forward_argmax(s, tok, sink);
    }
    times.push_back(seconds_since(t0));
  }
  return median(times);
}

// The engine: one GPU, or tensor-parallel over tp GPUs.
std::unique_ptr<diffrun::CudaEngine> make_engine(const diffrun::GgufFile& file, const diffrun::ModelConfig& cfg,
                                                 const std::string& precision, int ctx, int tp) {
  if (tp > 1) return diffrun::make_tp_cuda_engine(file, cfg, precision, ctx, tp);
  return diffrun::make_cuda_engine(file, cfg, precision, ctx);
}

void bench_model(const std::string& path, const std::string& precision, int steps, double bandwidth,
                 const std::string& json, int tp) {
  auto file = diffrun::GgufFile::open(path);
  const diffrun::ModelConfig cfg = diffrun::config_from_gguf(*file);
  const int ctx = 512 + steps + 64;
  auto t0 = Clock::now();
  auto eng = make_engine(*file, cfg, precision, ctx, tp);
  const double load_s = seconds_since(t0);
  setenv("DIFFRUN_CUDA_GRAPHS", "0", 1);
  auto eng_nograph = make_engine(*file, cfg, precision, ctx, tp);
  unsetenv("DIFFRUN_CUDA_GRAPHS");

  diffrun::NullSink none;
  DiscardingSink all;
  const double wb = double(eng->weight_bytes());
  std::printf("\n%s\n  %s, precision %s, tp %d, weights on (each) device %.1f MiB, load %.2f s\n", path.c_str(),
              diffrun::describe(cfg).c_str(), precision.c_str(), tp, wb / (1 << 20), load_s);
  for (const auto& [k, v] : eng->facts()) std::printf("  %s: %s\n", k.c_str(), v.c_str());

  double prefill_off[2] = {0, 0};
  for (int T : {32, 512}) {
    const double off = time_prefill(*eng, T, none);
    prefill_off[T == 512] = off;
    all.bytes = 0;
    const double on = time_prefill(*eng, T, all);
    std::printf("  prefill %3d tokens: %9.1f tok/s hooks off (%.3f ms), %9.1f tok/s hooks on (%.3f ms, %.1f MiB "
                "recorded per run)\n",
                T, T / off, off * 1e3, T / on, on * 1e3, double(all.bytes) / 6 / (1 << 20));
  }
  const double dec = time_decode(*eng, steps, none, false);
  // A mixture of experts' decode reads only the chosen experts' weights (no roofline for it).
  const bool graph = eng->last_step_path().graph;
  const double dec_logits = time_decode(*eng, steps, none, true);
  const double dec_nograph = time_decode(*eng_nograph, steps, none, false);
  // Hooks on: the sink receives every checkpoint, the logits as result_output, and the step returns
  // its argmax; a second run also returns the logits as a vector (the host copy "logits copied" adds).
  all.bytes = 0;
  const double dec_hooks = time_decode(*eng, steps, all, false);
  const double hooks_bytes = double(all.bytes) / steps;
  const double dec_hooks_logits = time_decode(*eng, steps, all, true);
  const double roof = wb / dec / bandwidth;
  std::printf("  decode batch 1, PDL %s (DIFFRUN_PDL), median of %d steps after a 32-token prefill:\n",
              eng->facts().at("pdl").c_str(), steps);
  if (cfg.moe) {
    std::printf("    hooks off, argmax only (%s)  %8.1f tok/s  %.3f ms/token  (MoE: no roofline, a step reads "
                "%d of %d experts)\n",
                graph ? "CUDA graph" : "no graph  ", 1 / dec, dec * 1e3, cfg.n_expert_used, cfg.n_expert);
  } else {
    std::printf("    hooks off, argmax only (%s)  %8.1f tok/s  %.3f ms/token  roofline %.1f%%\n",
                graph ? "CUDA graph" : "no graph  ", 1 / dec, dec * 1e3, roof * 100);
  }
  std::printf("    hooks off, logits copied to host     %8.1f tok/s  %.3f ms/token\n", 1 / dec_logits,
              dec_logits * 1e3);
  std::printf("    hooks off, no CUDA graph             %8.1f tok/s  %.3f ms/token\n", 1 / dec_nograph,
              dec_nograph * 1e3);
  std::printf("    hooks on (every checkpoint)          %8.1f tok/s  %.3f ms/token  overhead %.3fx, %.2f MiB/step\n",
              1 / dec_hooks, dec_hooks * 1e3, dec_hooks / dec, hooks_bytes / (1 << 20));
  std::printf("    hooks on, logits also returned       %8.1f tok/s  %.3f ms/token  overhead %.3fx (%.3fx against "
              "the logits copied)\n",
              1 / dec_hooks_logits, dec_hooks_logits * 1e3, dec_hooks_logits / dec, dec_hooks_logits / dec_logits);
  // Where the hook cost goes: the same run without the KV cache (whose recorded rows grow with the
  // position), and with the logits alone.
  DiscardingSink no_cache({"cache_k", "cache_v"});
  const double dec_no_cache = time_decode(*eng, steps, no_cache, false);
  DiscardingSink logits_only({"embd", "inp_", "attn", "Q", "K", "V", "cache", "kq", "kqv", "ffn", "l_out", "result_norm"});
  const double dec_logits_only = time_decode(*eng, steps, logits_only, false);
  std::printf("    hooks on, all but cache_k/cache_v    %8.1f tok/s  %.3f ms/token  overhead %.3fx, %.2f MiB/step\n",
              1 / dec_no_cache, dec_no_cache * 1e3, dec_no_cache / dec, double(no_cache.bytes) / steps / (1 << 20));
  std::printf("    hooks on, result_output only         %8.1f tok/s  %.3f ms/token  overhead %.3fx\n",
              1 / dec_logits_only, dec_logits_only * 1e3, dec_logits_only / dec);
  if (!cfg.moe)
    std::printf("    weights read per token %.1f MiB -> %.0f GB/s achieved\n", wb / (1 << 20), wb / dec / 1e9);
  std::fflush(stdout);
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "a");
    if (!f) throw diffrun::Error("cannot open " + json + " for writing");
    std::fprintf(f,
                 "{\"model\": \"%s\", \"precision\": \"%s\", \"tp\": %d, \"quantized_weights\": \"%s\", \"weight_bytes\": %.0f, "
                 "\"bandwidth\": %.0f, \"decode_tok_s\": %.2f, \"decode_roofline\": %.4f, \"decode_nograph_tok_s\": "
                 "%.2f, \"decode_hooks_tok_s\": %.2f, \"prefill32_tok_s\": %.1f, \"prefill512_tok_s\": %.1f, "
                 "\"moe\": %s}\n",
                 path.c_str(), precision.c_str(), tp, eng->facts().at("quantized_weights").c_str(), wb, bandwidth, 1 / dec,
                 roof, 1 / dec_nograph, 1 / dec_hooks, 32 / prefill_off[0], 512 / prefill_off[1],
                 cfg.moe ? "true" : "false");
    std::fclose(f);
  }
}

// One warm-up prefill of T tokens, then one inside the profiler's range (hooks off).
void profile_prefill(const std::string& path, const std::string& precision, int T) {
  auto file = diffrun::GgufFile::open(path);
  const diffrun::ModelConfig cfg = diffrun::config_from_gguf(*file);
  auto eng = diffrun::make_cuda_engine(*file, cfg, precision, T + 64);
  diffrun::NullSink none;
  const std::vector<int32_t> ids = prompt(T, cfg.n_vocab);
  eng->reset();
  eng->forward_argmax(0, ids, none);
  eng->reset();
  BENCH_CUDA(cudaDeviceSynchronize());
  BENCH_CUDA(cudaProfilerStart());
  eng->forward_argmax(0, ids, none);
  BENCH_CUDA(cudaDeviceSynchronize());
  BENCH_CUDA(cudaProfilerStop());
}

// A 32-token prefill and 4 warm-up decode steps, then `steps` decode steps inside the profiler's range:
// hooks off (argmax only), or with `hooks` every checkpoint recorded and the logits copied.
void profile_decode(const std::string& path, const std::string& precision, int steps, bool hooks) {
  auto file = diffrun::GgufFile::open(path);
  const diffrun::ModelConfig cfg = diffrun::config_from_gguf(*file);
  auto eng = diffrun::make_cuda_engine(*file, cfg, precision, 32 + 4 + steps + 64);
  diffrun::NullSink none;
  DiscardingSink every;
  eng->reset();
  int32_t next = eng->forward_argmax(0, prompt(32, cfg.n_vocab), none);
  int step = 1;
  std::vector<int32_t> tok(1);
  const auto decode = [&] {
    tok[0] = std::max(next, 0);
    if (hooks) {
      eng->forward(step, tok, every);
      next = eng->last_argmax();
    } else {
      next = eng->forward_argmax(step, tok, none);
    }
  };
  for (; step <= 4; ++step) decode();
  BENCH_CUDA(cudaDeviceSynchronize());
  BENCH_CUDA(cudaProfilerStart());
  for (int s = 0; s < steps; ++s, ++step) decode();
  BENCH_CUDA(cudaDeviceSynchronize());
  BENCH_CUDA(cudaProfilerStop());
}

// --cold-start T: seconds since the process started, and each part's own, one line each.
void cold_start(const std::string& path, int T, bool keep_context, bool warm_cublas) {
  const auto t_start = Clock::now();
  auto mark = [&, last = t_start](const char* what) mutable {
    const auto now = Clock::now();
    std::printf("  %7.3f s  %7.3f s  %s\n", std::chrono::duration<double>(now - t_start).count(),
                std::chrono::duration<double>(now - last).count(), what);
    std::fflush(stdout);
    last = now;
  };
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::printf("cold start, %d-token prefills, CUDA_MODULE_LOADING=%s\n       at      took\n", T,
              loading ? loading : "(unset)");
  auto file = diffrun::GgufFile::open(path);
  const diffrun::ModelConfig cfg = diffrun::config_from_gguf(*file);
  mark("model opened");
  diffrun::cuda_warm_up();
  mark("context (cudaFree(0))");
  if (warm_cublas) {
    // The main job's warm-up (cuda_warm_up_gemms), both precisions in turn: what of the first prefill is cuBLAS's.
    for (const char* precision : {"f32", "f16"}) diffrun::cuda_warm_up_gemms(cfg, precision, T, 0);
    mark("the GEMM warm-up, f32 and f16");
  }
  const std::vector<int32_t> ids = prompt(T, cfg.n_vocab);
  std::vector<std::unique_ptr<diffrun::CudaEngine>> engines;
  for (const char* precision : {"f32", "f16"}) {
    const std::string p = precision;
    engines.push_back(diffrun::make_cuda_engine(*file, cfg, p, T + 64));
    diffrun::CudaEngine& eng = *engines.back();
    mark((p + " engine loaded").c_str());
    diffrun::NullSink none;
    eng.forward_argmax(0, ids, none);
    mark((p + " first prefill, hooks off").c_str());
    for (const char* which : {" first prefill recorded", " warm prefill recorded"}) {
      DiscardingSink all;
      eng.reset();
      eng.forward_argmax(0, ids, all);
      mark((p + which).c_str());
    }
  }
  engines.clear();
  mark("engines released");
  if (!keep_context) {
    BENCH_CUDA(cudaDeviceReset());
    mark("cudaDeviceReset");
  }
  // The wall clock now, for the shell to subtract from its own after the process ended (the exit's cost).
  std::printf("  returning at unix time %.3f\n",
              std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string precision = "f16";
  int steps = 128;
  std::string json;
  int profile_T = 0;
  int tp = 1;
  int profile_decode_steps = 0;
  bool profile_hooks = false;
  int cold_T = 0;
  bool keep_context = false;
  bool warm_cublas = false;
  std::vector<std::string> models;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--precision" && i + 1 < argc) {
      precision = argv[++i];
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--tp" && i + 1 < argc) {
      tp = std::atoi(argv[++i]);
      if (tp < 1) {
        std::fprintf(stderr, "bench_cuda_engine: --tp takes a rank count >= 1, got '%s'\n", argv[i]);
        return 2;
      }
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--profile-prefill" && i + 1 < argc) {
      profile_T = std::atoi(argv[++i]);
      if (profile_T < 1) {
        std::fprintf(stderr, "bench_cuda_engine: --profile-prefill takes a token count >= 1, got '%s'\n", argv[i]);
        return 2;
      }
    } else if (a == "--profile-decode" && i + 1 < argc) {
      profile_decode_steps = std::atoi(argv[++i]);
      if (profile_decode_steps < 1) {
        std::fprintf(stderr, "bench_cuda_engine: --profile-decode takes a step count >= 1, got '%s'\n", argv[i]);
        return 2;
      }
    } else if (a == "--cold-start" && i + 1 < argc) {
      cold_T = std::atoi(argv[++i]);
      if (cold_T < 1) {
        std::fprintf(stderr, "bench_cuda_engine: --cold-start takes a token count >= 1, got '%s'\n", argv[i]);
        return 2;
      }
    } else if (a == "--keep-context") {
      keep_context = true;
    } else if (a == "--warm-cublas") {
      warm_cublas = true;
    } else if (a == "--profile-hooks") {
      profile_hooks = true;
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [--precision f16|f32] [--steps N] [--tp N] [--json FILE] MODEL.gguf [MODEL.gguf ...]\n", argv[0]);
      return 0;
    } else {
      models.push_back(a);
    }
  }
  if (models.empty() || steps < 1) {
    std::fprintf(stderr, "usage: %s [--precision f16|f32] [--steps N] [--json FILE] MODEL.gguf [MODEL.gguf ...]\n",
                 argv[0]);
    return 2;
  }
  try {
    std::string why;
    if (!diffrun::cuda_device_available(&why)) throw diffrun::Error("no CUDA device: " + why);
    if (cold_T > 0) {
      for (const std::string& m : models) cold_start(m, cold_T, keep_context, warm_cublas);
      return 0;
    }
    if (profile_T > 0) {
      for (const std::string& m : models) profile_prefill(m, precision, profile_T);
      return 0;
    }
    if (profile_decode_steps > 0) {
      for (const std::string& m : models) profile_decode(m, precision, profile_decode_steps, profile_hooks);
      return 0;
    }
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    const double bw = copy_bandwidth();
    std::printf("device %s; device-to-device copy bandwidth %.0f GB/s (read + write)\n", prop.name, bw / 1e9);
    for (const std::string& m : models) bench_model(m, precision, steps, bw, json, tp);
  } catch (const diffrun::Error& e) {
    std::fprintf(stderr, "bench_cuda_engine: %s\n", e.what());
    return 2;
  }
  return 0;
}
