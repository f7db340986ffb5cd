// `diffrun generate`: greedy generation with one backend, streaming the continuation to stdout.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/core.h>

#include "cli/command.hpp"
#include "cli/options.hpp"
#include "cli/run.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace diffrun::cli {
namespace {

struct GenerateOptions {
  std::string model;
  PromptOptions prompt;
  BackendOptions backend;
  int n_predict = 64;
};

// Length of the prefix of `text` that ends on a whole UTF-8 character (a token may end mid-character).
size_t complete_utf8_prefix(const std::string& text) {
  size_t i = text.size();
  for (int back = 0; back < 4 && i > 0; ++back) {
    const auto c = static_cast<unsigned char>(text[i - 1]);
    if (c < 0x80) return text.size();
    --i;
    if (c >= 0xC0) {
      const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
      return text.size() - i >= need ? text.size() : i;
    }
  }
  return text.size();
}

int run_generate(const GenerateOptions& o) {
  fmt::print(stderr, "diffrun generate: loading {}\n", o.model);
  const auto file = GgufFile::open(o.model);
  const ModelConfig cfg = load_config(*file);
  const auto tok = load_tokenizer(*file);
  const std::vector<int32_t> ids = prompt_tokens(*file, *tok, o.prompt);
  const int64_t needed = static_cast<int64_t>(ids.size()) + o.n_predict;
  if (needed > cfg.n_ctx) {
    throw InputError(fmt::format("the prompt ({} tokens) plus {} new tokens exceeds the model's context of {}",
                                 ids.size(), o.n_predict, cfg.n_ctx));
  }
  auto backend = make_backend(*file, cfg, o.backend, static_cast<int>(needed));
  fmt::print(stderr, "diffrun generate: {} {}, prompt {} tokens\n", backend->name(), backend->precision(),
             ids.size());

  NullSink none;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> logits = backend->forward(0, ids, none);
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> generated;
  size_t printed = 0;
  for (int i = 0; i < o.n_predict; ++i) {
    const int32_t next = greedy_token(*backend, logits);
    if (tok->is_eog(next)) break;
    generated.push_back(next);
    const std::string text = tok->decode(generated);
    const size_t stable = complete_utf8_prefix(text);
    if (stable > printed) {
      std::fwrite(text.data() + printed, 1, stable - printed, stdout);
      std::fflush(stdout);
      printed = stable;
    }
    if (i + 1 < o.n_predict) logits = backend->forward(i + 1, std::span<const int32_t>(&next, 1), none);
  }
  const std::string text = tok->decode(generated);
  if (text.size() > printed) std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
  std::fputs("\n", stdout);
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  fmt::print(stderr, "diffrun generate: prefill {} tokens in {:.2f} s, {} new tokens at {:.1f} tok/s\n", ids.size(),
             prefill_s, generated.size(), generated.empty() ? 0.0 : generated.size() / decode_s);
  return 0;
}

const CommandRegistrar reg("generate", "Greedy generation with one backend, streamed to stdout", [](CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  o->model = default_model_path();
  app.add_option("--model,-m", o->model, "GGUF model")->capture_default_str();
  o->prompt.add_options(app);
  o->backend.add_options(app);
  app.add_option("-n,--n-predict", o->n_predict, "Most new tokens to generate (stops earlier at end of generation)")
      ->capture_default_str()
      ->check(count_in(1));
  return [o] { return run_generate(*o); };
});

}  // namespace
}  // namespace diffrun::cli
