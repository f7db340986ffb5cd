// Tokenizer encode throughput on English text, one core: median MB/s over several runs.
//
//   bench_tokenizer [MODEL.gguf] [TEXT_FILE]
// Defaults: the SmolLM2 model of `diffrun` and fixtures/vocab/corpus.txt (English prose), repeated to
// about 4 MB and encoded as one call. The tokenizer keeps no cache across calls or words, so repeating
// the text does not flatter the figure.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace {

std::string default_model() {
  if (const char* d = std::getenv("DIFFRUN_MODELS"); d && *d) return std::string(d) + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  const char* x = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string cache = (x && *x) ? std::string(x) : std::string(home ? home : ".") + "/.cache";
  return cache + "/diffrun/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : default_model();
  const std::string text_path = argc > 2 ? argv[2] : "fixtures/vocab/corpus.txt";
  try {
    std::ifstream in(text_path, std::ios::binary);
    if (!in) {
      fmt::print(stderr, "bench_tokenizer: cannot read {} (run from the repository root or pass a text file)\n",
                 text_path);
      return 2;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string unit = ss.str();
    if (unit.empty()) {
      fmt::print(stderr, "bench_tokenizer: {} is empty\n", text_path);
      return 2;
    }
    std::string text;
    while (text.size() < (4u << 20)) text += unit;

    auto file = diffrun::GgufFile::open(model);
    auto tok = diffrun::Tokenizer::from_gguf(*file);
    constexpr int runs = 7;
    std::vector<double> mbps;
    size_t n_tokens = 0;
    for (int r = 0; r < runs; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto ids = tok->encode(text, false, true);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      n_tokens = ids.size();
      mbps.push_back(static_cast<double>(text.size()) / 1e6 / s);
    }
    std::sort(mbps.begin(), mbps.end());
    fmt::print("model: {}\ntext: {} repeated to {:.2f} MB, {} tokens ({:.2f} bytes/token)\n", model, text_path,
               static_cast<double>(text.size()) / 1e6, n_tokens, static_cast<double>(text.size()) / n_tokens);
    fmt::print("encode: median {:.2f} MB/s over {} runs (min {:.2f}, max {:.2f}), one thread\n", mbps[runs / 2], runs,
               mbps.front(), mbps.back());
    return 0;
  } catch (const diffrun::Error& e) {
    fmt::print(stderr, "bench_tokenizer: {}\n", e.what());
    return 2;
  }
}
