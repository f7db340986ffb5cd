// `diffrun compare ENGINE.h5 REFERENCE.h5`: the first divergence between two existing dumps from any writer.
#include <functional>
#include <memory>
#include <string>

#include "cli/command.hpp"
#include "cli/diff_report.hpp"
#include "cli/progress.hpp"
#include "cli/run.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace diffrun::cli {
namespace {

struct CompareCommand {
  std::string engine;
  std::string reference;
  std::string isolated;
  std::string model;  // decodes the token ids of the token table
  ReportOptions report;
};

const CommandRegistrar registrar{
    "compare", "Compare an engine dump (A) with a reference dump (B): first divergence, verdict, per-layer errors",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<CompareCommand>();
      sub.add_option("engine", o->engine, "Engine dump (side a)")->required();
      sub.add_option("reference", o->reference, "Reference dump (side b)")->required();
      sub.add_option("--isolated", o->isolated,
                     "The engine's isolation-replay dump (diffrun dump --replay REFERENCE): local error per checkpoint");
      sub.add_option("--model,-m", o->model, "The dumps' GGUF model: its tokenizer decodes the token ids in the report");
      o->report.add_options(sub);
      return [o] {
        Progress progress("diffrun compare");
        std::function<std::string(int32_t)> token_text;
        if (!o->model.empty()) {
          const auto file = GgufFile::open(o->model);
          std::shared_ptr<const Tokenizer> tok = load_tokenizer(*file);
          const int64_t n_vocab = tok->n_vocab();
          token_text = [tok, n_vocab](int32_t id) {
            if (id < 0 || id >= n_vocab) return std::string("(outside the vocabulary)");
            const int32_t one[1] = {id};
            return tok->decode(one);
          };
        }
        return compare_and_report(o->engine, o->reference, o->report, progress, token_text, o->isolated);
      };
    }};

}  // namespace
}  // namespace diffrun::cli
