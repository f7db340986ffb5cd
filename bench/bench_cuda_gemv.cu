// Benchmark of the dense one-token GEMV kernels (engine/ops/matmul.cu) on the shapes of a decode step: each shape
// under each setting of DIFFRUN_GEMV_WARPS_PER_ROW, timed as the decode graph runs them (a CUDA graph of
// launches one after another, with Programmatic Dependent Launch where the engine uses it). Prints figures; not a
// test.
//
//   bench_cuda_gemv [--precision f16|f32] [--launches N] [--variants V,V,...] [NAME=NxK[:swiglu] ...]
//
// Without shapes: the Llama-7B shape's GEMVs (K 4096, F 11008, vocabulary 32000), whole (TP 1) and as one rank of
// TP 2 holds them (q|k|v, gate|up and their heads split; Wo and Wdown split on their input). `:swiglu` runs the
// shape as the fused gate|up (N = 2F rows, the SwiGLU epilogue). Variants: `auto` (the engine's choice), or W[xB]
// (DIFFRUN_GEMV_WARPS_PER_ROW: W warps a row, B loads a round; 1 is the rows kernel).
//
// Each launch of a graph reads its own copy of the weights, with copies enough for 256 MB, so that no launch finds
// its matrix in L2 (as in a decode step, where each layer's matrices are read once). The figure is the median over
// 15 replays of the graph, divided by its launches: microseconds a GEMV, and the weight bytes over that time as a
// fraction of the copy bandwidth (the best of five device-to-device copies of 1 GiB, read and write counted).
//
// These are the kernels alone, one launch after another of the same kernel. They do not predict a decode step,
// where each GEMV follows a norm, attention or another GEMV and starts its weights' fetch under it: two warps a row
// measured 14-29% faster here on four of the 7B shape's matrices, and made its decode 1.2% slower at TP 1 and 7%
// at TP 2 (bench/NOTES.md). Check a setting there (DIFFRUN_GEMV_WARPS_PER_ROW with bench_cuda_engine) before
// keeping it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "bench/bench_cuda_util.cuh"
#include "engine/cuda_check.cuh"
#include "engine/device_matrix.cuh"
#include "engine/gemm.cuh"
#include "engine/ops/matmul.cuh"
#include "model/error.hpp"

namespace {


struct Shape {
  std::string name;
  int N = 0, K = 0;
  bool swiglu = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_cuda_gemv: %s\nusage: bench_cuda_gemv [--precision f16|f32] [--launches N] [--variants V,...] "
               "[NAME=NxK[:swiglu] ...]\n",
               why.c_str());
  std::exit(2);
}

Shape parse_shape(const std::string& s) {
  Shape sh;
  const size_t eq = s.find('='), x = s.find('x', eq == std::string::npos ? 0 : eq);
  if (eq == std::string::npos || x == std::string::npos) usage("shape '" + s + "': expected NAME=NxK[:swiglu]");
  sh.name = s.substr(0, eq);
  std::string k = s.substr(x + 1);
  if (k.ends_with(":swiglu")) {
    sh.swiglu = true;
    k.resize(k.size() - 7);
  }
  try {
    size_t used = 0;
    sh.N = std::stoi(s.substr(eq + 1, x - eq - 1));
    sh.K = std::stoi(k, &used);
    if (used != k.size()) throw std::invalid_argument(k);
  } catch (const std::exception&) {
    usage("shape '" + s + "': N and K must be integers");
  }
  if (sh.N < 2 || sh.K < 1 || (sh.swiglu && sh.N % 2)) usage("shape '" + s + "': N >= 2 (even with :swiglu), K >= 1");
  return sh;
}

std::vector<Shape> default_shapes() {
  return {{"tp1 q|k|v", 12288, 4096},          {"tp1 Wo", 4096, 4096},     {"tp1 gate|up", 22016, 4096, true},
          {"tp1 Wdown", 4096, 11008},          {"lm head", 32000, 4096},   {"tp2 q|k|v", 6144, 4096},
          {"tp2 Wo", 4096, 2048},              {"tp2 gate|up", 11008, 4096, true}, {"tp2 Wdown", 4096, 5504}};
}

using diffrun::bench_util::copy_bandwidth;

template <typename W>
struct Run {
  std::vector<W*> w;  // copies of the weights
  W* x = nullptr;
  W* act = nullptr;
  float* out = nullptr;
};

template <typename W>
__global__ void fill_kernel(W* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = W(float(h % 2001) / 1000.0f - 1.0f);  // [-1, 1] in steps of 1e-3
  }
}

template <typename W>
double time_variant(const Shape& sh, const Run<W>& r, int launches, const diffrun::engine::CublasHandle& cublas,
                    cudaStream_t stream) {
  using namespace diffrun::engine;
  auto launch = [&](int i) {
    const W* w = r.w[i % r.w.size()];
    if (sh.swiglu) {
      DeviceMatrix<W> m;
      m.dense = w;
      m.K = sh.K;
      m.rows = sh.N;
      matmul_gate_up_swiglu(r.out, r.out + sh.N / 2, r.act, r.x, m, sh.K, sh.N / 2, stream);
    } else {
      matmul(r.out, r.x, w, nullptr, 1, sh.K, sh.N, cublas, stream);
    }
  };
  for (int i = 0; i < 3; ++i) launch(i);  // modules loaded before the capture
  BENCH_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) launch(i);
  BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 17; ++i) {
    BENCH_CUDA(cudaEventRecord(e0, stream));
    BENCH_CUDA(cudaGraphLaunch(exec, stream));
    BENCH_CUDA(cudaEventRecord(e1, stream));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaGraphDestroy(graph));
  BENCH_CUDA(cudaEventDestroy(e0));
  BENCH_CUDA(cudaEventDestroy(e1));
  return ms[ms.size() / 2] * 1e3 / launches;  // microseconds a launch
}

template <typename W>
void run_all(const std::vector<Shape>& shapes, const std::vector<std::string>& variants, int launches,
             diffrun::engine::EnginePrecision precision) {
  const double bw = copy_bandwidth();
  std::printf("copy bandwidth %.0f GB/s; %d launches a graph; microseconds a GEMV (%% of the copy bandwidth)\n",
              bw / 1e9, launches);
  std::printf("%-14s %6s %6s", "shape", "N", "K");
  for (const std::string& v : variants) std::printf(" %13s", v.c_str());
  std::printf("\n");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  diffrun::engine::CublasHandle cublas(precision);
  for (const Shape& sh : shapes) {
    const size_t elems = size_t(sh.N) * sh.K, bytes = elems * sizeof(W);
    Run<W> r;
    const size_t copies = std::max<size_t>(2, (size_t(256) << 20) / bytes + 1);
    for (size_t c = 0; c < copies; ++c) {
      W* p = nullptr;
      BENCH_CUDA(cudaMalloc(&p, bytes));
      fill_kernel<<<1024, 256, 0, stream>>>(p, elems, uint32_t(c + 1));
      r.w.push_back(p);
    }
    BENCH_CUDA(cudaMalloc(&r.x, size_t(sh.K) * sizeof(W)));
    BENCH_CUDA(cudaMalloc(&r.act, size_t(sh.N) * sizeof(W)));
    BENCH_CUDA(cudaMalloc(&r.out, size_t(sh.N) * sizeof(float)));
    fill_kernel<<<64, 256, 0, stream>>>(r.x, size_t(sh.K), 7u);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::printf("%-14s %6d %6d", sh.name.c_str(), sh.N, sh.K);
    for (const std::string& v : variants) {
      setenv("DIFFRUN_GEMV_WARPS_PER_ROW", v.c_str(), 1);
      const double us = time_variant(sh, r, launches, cublas, stream);
      std::printf(" %6.2f (%3.0f%%)", us, 100.0 * double(bytes) / (us * 1e-6) / bw);
      std::fflush(stdout);
    }
    std::printf("\n");
    for (W* p : r.w) BENCH_CUDA(cudaFree(p));
    BENCH_CUDA(cudaFree(r.x));
    BENCH_CUDA(cudaFree(r.act));
    BENCH_CUDA(cudaFree(r.out));
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
  std::string precision = "f16";
  int launches = 64;
  std::vector<std::string> variants{"auto", "1", "2", "2x8", "4", "8"};
  std::vector<Shape> shapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--precision") {
      precision = value();
      if (precision != "f16" && precision != "f32") usage("--precision: f16 or f32");
    } else if (a == "--launches") {
      try {
        launches = std::stoi(value());
      } catch (const std::exception&) {
        usage("--launches: an integer");
      }
      if (launches < 1 || launches > 4096) usage("--launches: 1 to 4096");
    } else if (a == "--variants") {
      variants.clear();
      std::string v = value();
      for (size_t p = 0; p <= v.size();) {
        const size_t c = std::min(v.find(',', p), v.size());
        variants.push_back(v.substr(p, c - p));
        p = c + 1;
      }
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: bench_cuda_gemv [--precision f16|f32] [--launches N] [--variants V,...] "
                  "[NAME=NxK[:swiglu] ...]\n");
      return 0;
    } else {
      shapes.push_back(parse_shape(a));
    }
  }
  if (shapes.empty()) shapes = default_shapes();
  try {
    for (const std::string& v : variants) {  // the engine's own parse, before anything runs
      setenv("DIFFRUN_GEMV_WARPS_PER_ROW", v.c_str(), 1);
      (void)diffrun::engine::gemv_warps_per_row();
    }
    if (precision == "f16") run_all<__half>(shapes, variants, launches, diffrun::engine::EnginePrecision::f16);
    else run_all<float>(shapes, variants, launches, diffrun::engine::EnginePrecision::f32);
  } catch (const diffrun::InputError& e) {
    std::fprintf(stderr, "bench_cuda_gemv: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_gemv: %s\n", e.what());
    return 1;
  }
  return 0;
}
